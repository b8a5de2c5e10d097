"""CPU attention benchmark: the C++ kernels (kernels_cpu, the engine's CPU backend) against
the XLA reference they replaced (kernels_pallas.reference), timed in the same run.

    python benchmarks/cpu_attention.py            # both dtypes, both shape sets
    python benchmarks/cpu_attention.py --quick    # fewer repetitions

Shapes: the engine benchmark's model (8 q heads, 4 KV heads, head dim 64; decode at batch 64
over its prompt lengths, prefill as 4 chunks of 256) and the Qwen2.5-Omni-7B thinker's
attention (28 q heads, 4 KV heads, head dim 128) at a smaller batch. Pages are stored as the
engine stores them on CPU (bf16 as its bits). Prints milliseconds per call, the kernel's
K/V bytes read per second (decode) or arithmetic rate (prefill), and reference / kernel. Run it on a quiet machine; it prints the load.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import kernels_cpu  # noqa: E402
from kernels_pallas import page_dtype, reference  # noqa: E402

BLOCK = 16
SHAPES = {  # name: (q heads, KV heads, head dim, decode batch)
    "engine benchmark model": (8, 4, 64, 64),
    "Qwen2.5-Omni-7B thinker": (28, 4, 128, 16),
}


def pool(rng, lens, hkv, d, dtype):
    """K/V pages holding sequences of the given lengths in shuffled blocks, and their tables."""
    need = [-(-n // BLOCK) for n in lens]
    blocks = 1 + sum(need)
    k = rng.standard_normal((blocks, BLOCK, hkv, d)).astype(np.float32)
    v = rng.standard_normal((blocks, BLOCK, hkv, d)).astype(np.float32)
    ids, used = rng.permutation(np.arange(1, blocks)), 0
    tables = np.zeros((len(lens), max(need)), np.int32)
    for i, n in enumerate(need):
        tables[i, :n] = ids[used:used + n]
        used += n
    store = page_dtype(dtype, "cpu")
    k, v = (jax.lax.bitcast_convert_type(jnp.asarray(x, dtype), store) if store != dtype else
            jnp.asarray(x, dtype) for x in (k, v))
    return k, v, jnp.asarray(tables)


def timed(fn, args, reps):
    fn(*args).block_until_ready()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def compare(title, calls, args, work, reps):
    ref_fn, cpu_fn = (jax.jit(c) for c in calls)
    ref, cpu = [], []
    for _ in range(3):  # interleaved, so that load changes hit both alike
        ref.append(timed(ref_fn, args, reps))
        cpu.append(timed(cpu_fn, args, reps))
    r, c = statistics.median(ref), statistics.median(cpu)
    amount, unit = work
    print(f"  {title:<34} reference {r * 1e3:8.2f} ms   kernels_cpu {c * 1e3:7.2f} ms "
          f"({amount / c / 1e9:5.1f} {unit})   {r / c:5.2f}x", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = ap.parse_args(argv)
    reps = 3 if args.quick else 10
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}; jax {jax.__version__}")
    for name, (hq, hkv, d, batch) in SHAPES.items():
        for dtype in (jnp.float32, jnp.bfloat16):
            print(f"{name}: {hq} q heads, {hkv} KV heads, head dim {d}, {jnp.dtype(dtype).name}")
            rng = np.random.default_rng(0)
            item = jnp.dtype(dtype).itemsize
            # Decode: the engine benchmark's prompt lengths (19-477) plus half its new tokens.
            lens = rng.integers(19, 478, batch) + 48
            k, v, tables = pool(rng, lens, hkv, d, dtype)
            q = jnp.asarray(rng.standard_normal((batch, hq, d)), dtype)
            kv_read = 2 * int(lens.sum()) * hkv * d * item  # decode is bound by reading the pages
            compare(f"decode, batch {batch}, mean ctx {lens.mean():.0f}",
                    (reference.paged_attention, kernels_cpu.paged_attention),
                    (q, k, v, tables, jnp.asarray(lens, jnp.int32)), (kv_read, "GB/s"), reps)
            # Prefill: 4 chunks of 256 rows, two of them after a cached prefix.
            q_lens, kv_lens = np.array([256] * 4), np.array([256, 512, 300, 400])
            k, v, tables = pool(rng, kv_lens, hkv, d, dtype)
            q = jnp.asarray(rng.standard_normal((int(q_lens.sum()), hq, d)), dtype)
            cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
            # Prefill is bound by arithmetic: 4 flops per (row, head, visible key, head dim).
            seen = sum(n - m + i + 1 for m, n in zip(q_lens, kv_lens) for i in range(m))
            compare("prefill, 4 chunks of 256",
                    (reference.ragged_paged_attention, kernels_cpu.ragged_paged_attention),
                    (q, k, v, tables, jnp.asarray(kv_lens, jnp.int32), cu), (4 * seen * hq * d, "GFLOP/s"),
                    reps)


if __name__ == "__main__":
    main()
