"""MoE block benchmark: blocked grouped matmul vs ragged_dot vs every-expert dense reference.

    python benchmarks/moe.py                   # H=512, I=256, E=32, k=4, T in {16, 256, 2048}
    python benchmarks/moe.py --tokens 256 --reps 5
    python benchmarks/moe.py --block-rows 16 32 64 128   # also sweep the blocked row-block size

Times, in one run and on the same weights and inputs, the sparse MoE block
(router + top-k + sorted dispatch + two grouped matmuls + un-permute) with

* ``blocked``: omni_jax.models.layers.moe's while loop over used row blocks
  (work ~ routed rows: T*k rows + at most one partial block per hit expert),
* ``ragged_dot``: ``jax.lax.ragged_dot_general`` (on CPU, JAX lowers it to a
  zero-masked batch over all E experts: E x the routed FLOPs),
* ``dense``: every token through every expert, combined with the routing weights
  (``dense_moe_reference``: E/k x the routed FLOPs),

and prints best-of-N wall times, the ratios against ``blocked``, the routed
GFLOP/s, the blocks the blocked loop executed against its bound ceil(T*k/B) + E,
and the max abs difference of each output against ``blocked``. The shapes are a
scaled-down Qwen3-Omni MoE layer so it runs on a CPU; on a GPU it runs as is
(GPU timings of ``ragged_dot`` depend on whether XLA picks a grouped-GEMM backend).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from kernels_pallas.grouped_matmul import default_block_rows  # noqa: E402
from omni_jax.models.layers.moe import (  # noqa: E402
    MoEConfig, SparseMoeBlock, blocked_grouped_matmul, dense_moe_reference, moe_experts, route)


def _time(fn, args, reps: int, budget_s: float) -> float:
    """Best-of-reps seconds of fn(*args) after one compile+warm-up call; stops early past budget_s.

    The minimum, not the median: the CPU this runs on in CI is shared, and other
    load only ever adds time.
    """
    jax.block_until_ready(fn(*args))
    times = []
    t_end = time.perf_counter() + budget_s
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
        if time.perf_counter() > t_end and len(times) >= 2:
            break
    return min(times)


def _fns(cfg: MoEConfig, block_rows: int | None):
    """Jitted (name -> fn(x, gate_w, gate_up, down)) for the three dispatches."""
    k = cfg.num_experts_per_tok

    def sparse(impl):
        def f(x, gate_w, gate_up, down):
            weights, experts = route(x @ gate_w.T, k, cfg.norm_topk_prob)
            return moe_experts(x, weights, experts, gate_up, down, impl=impl, block_rows=block_rows)
        return jax.jit(f)

    dense = jax.jit(lambda x, gate_w, gate_up, down: dense_moe_reference(
        x, gate_w, gate_up, down, k, cfg.norm_topk_prob))
    return {"blocked": sparse("blocked"), "ragged_dot": sparse("ragged_dot"), "dense": dense}


def _blocks_executed(cfg, x, gate_w, gate_up, block_rows):
    """(blocks the blocked gate_up matmul ran, block size) for this routing."""
    t, k, e = x.shape[0], cfg.num_experts_per_tok, cfg.num_experts
    _, experts = route(x @ gate_w.T, k, cfg.norm_topk_prob)
    flat = experts.reshape(-1)
    sizes = jnp.zeros((e,), jnp.int32).at[flat].add(1)
    rows = jnp.take(x, jnp.argsort(flat, stable=True) // k, axis=0)
    b = min(block_rows or default_block_rows(t * k, e, smallest=8), t * k)
    _, count = jax.jit(lambda r, w, g: blocked_grouped_matmul(r, w, g, block_rows=b, count_blocks=True))(
        rows, gate_up, sizes)
    return int(count), b


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--inter", type=int, default=256)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 256, 2048])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=10.0, help="per (shape, impl) timing budget")
    ap.add_argument("--block-rows", type=int, nargs="*", default=[],
                    help="extra blocked row-block sizes to time (default size always timed)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["ragged_dot", "dense"])
    args = ap.parse_args(argv)

    cfg = MoEConfig(hidden_size=args.hidden, moe_intermediate_size=args.inter, num_experts=args.experts,
                    num_experts_per_tok=args.top_k)
    block = SparseMoeBlock(cfg, rngs=nnx.Rngs(0))
    # Larger-than-init router weights so routing is uneven, as in a trained model.
    gate_w = block.gate.kernel[...].T * 20.0
    gate_up, down = block.experts.gate_up_proj[...], block.experts.down_proj[...]
    h, i, e, k = args.hidden, args.inter, args.experts, args.top_k
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), fp32, "
          f"H={h} I={i} E={e} k={k}")
    print(f"{'T':>6} {'impl':>14} {'ms':>10} {'x blocked':>10} {'routed GF/s':>12} {'max|diff|':>10}  notes")
    for t in args.tokens:
        x = jnp.asarray(np.random.default_rng(t).standard_normal((t, h)), jnp.float32)
        routed_flops = 2 * t * k * 3 * h * i
        variants = [("blocked", None)] + [(f"blocked B={b}", b) for b in args.block_rows]
        variants += [(name, None) for name in ("ragged_dot", "dense") if name not in args.skip]
        results = {}
        base_out = None
        for label, b in variants:
            impl = "blocked" if label.startswith("blocked") else label
            fn = _fns(cfg, b)[impl]
            secs = _time(fn, (x, gate_w, gate_up, down), args.reps, args.budget_s)
            out = fn(x, gate_w, gate_up, down)
            if base_out is None:
                base_out = out
            results[label] = secs
            diff = float(jnp.max(jnp.abs(out - base_out)))
            note = ""
            if impl == "blocked":
                n, bb = _blocks_executed(cfg, x, gate_w, gate_up, b)
                bound = -(-t * k // bb) + e
                note = f"B={bb}: {n} blocks run (bound ceil(T*k/B)+E = {bound})"
            elif impl == "ragged_dot":
                note = f"{e}x routed FLOPs if lowered dense-masked"
            else:
                note = f"{e / k:g}x routed FLOPs"
            print(f"{t:>6} {label:>14} {secs * 1e3:>10.2f} {secs / results['blocked']:>10.2f} "
                  f"{routed_flops / secs / 1e9:>12.2f} {diff:>10.2e}  {note}", flush=True)


if __name__ == "__main__":
    main()
