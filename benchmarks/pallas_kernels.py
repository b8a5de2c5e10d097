"""Kernel benchmark: the Pallas kernels (paged attention, MoE grouped matmul) against XLA.

    python benchmarks/pallas_kernels.py            # GPU: timing tables
    python benchmarks/pallas_kernels.py --quick    # GPU: a few shapes only

On a GPU it times, at Qwen2.5-Omni-7B thinker shapes (28 q heads, 4 KV heads,
head dim 128, bf16), the decode kernel, the ragged prefill kernel, the KV
write and the XLA reference of each, and prints achieved HBM bandwidth
(bytes of K/V pages actually read plus q and output), its fraction of the
device's peak, and the kernel / XLA-reference speedup; also the decode kernel as
the engine calls it (the step's KV write and RoPE inside) against the XLA path
it replaces. Target: decode at
batch 64, 4k context, >= 70% of peak on H100 and >= 1.5x the reference.
It also times the MoE experts' grouped matmul at Qwen3-Omni-30B-A3B thinker shapes
(128 experts, 8 per token, hidden 2048, expert width 768): the Pallas kernel against the
blocked XLA loop (models/layers/moe.py), with the bandwidth of the routed experts' weights.
`norm_point` (the GPU check's) times the residual add + RMSNorm kernel against its reference.

Without a GPU it runs the kernels once in Pallas interpret mode on small
shapes as a smoke check and says clearly that no timing was taken.
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kernels_pallas import reference  # noqa: E402
from kernels_pallas.grouped_matmul import grouped_matmul, grouped_tuning  # noqa: E402
from kernels_pallas.rms_norm import rms_norm  # noqa: E402
from kernels_pallas.kv_update import write_kv_pages  # noqa: E402
from kernels_pallas.paged_attention import decode_tuning, paged_attention  # noqa: E402
from kernels_pallas.ragged_paged_attention import (  # noqa: E402
    prefill_tuning, ragged_paged_attention)

HQ, HKV, D = 28, 4, 128               # Qwen2.5-Omni-7B thinker
DTYPE = jnp.bfloat16
ITEM = 2                              # bytes per bf16 element

# Peak HBM bandwidth in bytes/s, matched against jax's device_kind, in order.
PEAKS = [
    (("H200",), "H200", 4.8e12),
    (("H100", "PCIE"), "H100 PCIe", 2.0e12),
    (("H100",), "H100 SXM", 3.35e12),
    (("A100", "80GB"), "A100 80GB", 2.0e12),
]

# (batch, context) for decode; block size 16 unless listed in BS_SHAPES.
DECODE_SHAPES = [(1, 512), (1, 4096), (1, 32768), (8, 4096), (8, 32768),
                 (32, 4096), (64, 512), (64, 4096), (64, 16384), (128, 4096),
                 (256, 512), (256, 2048), (256, 4096)]
QUICK_DECODE = [(1, 32768), (64, 4096), (256, 2048)]
BS_SHAPES = [(64, 4096), (1, 32768), (256, 2048)]
# Qwen3-Omni-30B-A3B thinker experts: (experts, per token, hidden, expert width); step sizes.
EXPERTS = (128, 8, 2048, 768)
EXPERT_TOKENS = [1, 8, 64, 512, 4096]
# (new tokens per sequence, cached tokens, sequences) for prefill.
PREFILL_SHAPES = [(2048, 0, 1), (512, 3584, 4), (256, 8192, 8)]


def device_peak(device):
    """(name, peak bytes/s or None) for a jax device."""
    kind = device.device_kind.upper()
    for keys, name, peak in PEAKS:
        if all(k in kind for k in keys):
            return name, peak
    return f"unknown ({device.device_kind})", None


def time_call(fn, *args, iters=20, reps=5):
    """Median seconds per call of a jitted fn over `reps` samples of `iters` calls each
    (compiles and runs once first; JAX dispatches asynchronously, so each sample ends with
    the device done)."""
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / iters)
    return statistics.median(samples)


def make_pool(key, num_seqs, context, bs, hkv=HKV, d=D):
    """K/V pages for num_seqs sequences of `context` tokens, blocks shuffled
    over the pool as in a long-running server; block 0 is the dummy."""
    width = -(-context // bs)
    num_blocks = 1 + num_seqs * width
    kk, kv, kp = jax.random.split(key, 3)
    shape = (num_blocks, bs, hkv, d)
    k = jax.random.normal(kk, shape, DTYPE)
    v = jax.random.normal(kv, shape, DTYPE)
    perm = 1 + jax.random.permutation(kp, num_blocks - 1)
    tables = perm.reshape(num_seqs, width).astype(jnp.int32)
    return k, v, tables


def kv_bytes(tokens):
    return tokens * HKV * D * 2 * ITEM            # K and V


def fmt_bw(nbytes, secs, peak):
    gbs = nbytes / secs / 1e9
    frac = f"{100 * nbytes / secs / peak:5.1f}%" if peak else "  n/a"
    return f"{gbs:8.1f} GB/s {frac}"


def bench_decode(shapes, block_sizes, peak, tuning=None):
    """Prints one row per (batch, context, block size); returns the rows."""
    rows = []
    print(f"\nDecode (q heads {HQ}, kv heads {HKV}, head dim {D}, bf16)")
    print(f"{'batch':>5} {'ctx':>6} {'bs':>3} | {'kernel ms':>9} "
          f"{'kernel HBM':>20} | {'xla ms':>8} {'xla HBM':>20} | speedup")
    for bs in block_sizes:
        for batch, ctx in shapes:
            r = decode_point(batch, ctx, (HQ, HKV, D), bs=bs, tuning=tuning)
            tk, tr, nbytes = r["kernel_s"], r["xla_s"], r["bytes"]
            print(f"{batch:5d} {ctx:6d} {bs:3d} | {tk * 1e3:9.3f} "
                  f"{fmt_bw(nbytes, tk, peak)} | {tr * 1e3:8.3f} "
                  f"{fmt_bw(nbytes, tr, peak)} | {tr / tk:5.2f}x"
                  f"{'' if r['rel_err'] < 2e-2 else '  MISMATCH %.3g' % r['rel_err']}")
            rows.append((batch, ctx, bs, tk, tr, nbytes))
    return rows

def bench_prefill(peak):
    print("\nRagged prefill (causal, TFLOP/s counts only unmasked products)")
    print(f"{'new':>5} {'cached':>6} {'seqs':>4} | {'kernel ms':>9} "
          f"{'TFLOP/s':>8} | {'xla ms':>8} | speedup")
    for new, cached, seqs in PREFILL_SHAPES:
        r = prefill_point(new, cached, seqs, (HQ, HKV, D))
        tk, tr = r["kernel_s"], r["xla_s"]
        print(f"{new:5d} {cached:6d} {seqs:4d} | {tk * 1e3:9.3f} "
              f"{r['flops'] / tk / 1e12:8.1f} | {tr * 1e3:8.3f} | {tr / tk:5.2f}x"
              f"{'' if r['rel_err'] < 2e-2 else '  MISMATCH %.3g' % r['rel_err']}")

def bench_decode_write(shapes, peak):
    """The decode kernel with the step's KV write, RoPE (and Qwen3's q/k norm), as the engine
    calls it, against the XLA path it replaces."""
    print("\nDecode with the KV write and RoPE (the engine's decode kernel), block size 16")
    print(f"{'batch':>5} {'ctx':>6} {'qk norm':>7} | {'kernel ms':>9} {'kernel HBM':>20} | {'xla ms':>8} | speedup")
    for batch, ctx in shapes:
        for norm in (False, True):
            r = decode_write_point(batch, ctx, (HQ, HKV, D), qk_norm=norm)
            tk, tr = r["kernel_s"], r["xla_s"]
            print(f"{batch:5d} {ctx:6d} {str(norm):>7} | {tk * 1e3:9.3f} {fmt_bw(r['bytes'], tk, peak)} | "
                  f"{tr * 1e3:8.3f} | {tr / tk:5.2f}x{'' if r['rel_err'] < 2e-2 else '  MISMATCH %.3g' % r['rel_err']}")


def bench_kv_write(peak):
    print("\nKV write (XLA scatter, donated pages)")
    for tokens in (256, 2048, 8192):
        r = kv_write_point(tokens, (HQ, HKV, D))
        print(f"  {tokens:5d} tokens: {r['kernel_s'] * 1e6:8.1f} us "
              f"{fmt_bw(r['bytes'], r['kernel_s'], peak)}{'' if r['max_err'] == 0 else '  WRONG PAGES'}")


def bench_experts(peak):
    """The gate/up grouped matmul of one MoE layer: Pallas kernel vs the blocked XLA loop."""
    e, k, h, i = EXPERTS
    print(f"\nMoE gate/up grouped matmul ({e} experts, {k} per token, [{2 * i}, {h}] each, bf16);"
          " HBM: the routed experts' weights")
    print(f"{'tokens':>6} {'experts hit':>11} | {'kernel ms':>9} {'kernel HBM':>20} | {'xla ms':>8} | speedup")
    for t in EXPERT_TOKENS:
        r = experts_point(t)
        tk, tr = r["kernel_s"], r["xla_s"]
        print(f"{t:6d} {r['experts_hit']:11d} | {tk * 1e3:9.3f} {fmt_bw(r['bytes'], tk, peak)} | {tr * 1e3:8.3f} | "
              f"{tr / tk:5.2f}x{'' if r['rel_err'] < 2e-2 else '  MISMATCH %.3g' % r['rel_err']}")

def copy_bandwidth(nbytes, iters=20, reps=5):
    """Bytes/s of a device-to-device copy of `nbytes` (read plus write): the HBM ceiling
    the kernels are held against, measured in the same run."""
    x = jax.random.normal(jax.random.key(11), (nbytes // ITEM,), DTYPE)
    secs = time_call(jax.jit(jnp.copy), x, iters=iters, reps=reps)
    return 2 * nbytes / secs


def _errors(out, ref):
    """(max abs error, relative L2 error ||out - ref|| / ||ref||) in float32; NaN when the
    reference is all zeros (random inputs never give that: something wrote nothing)."""
    out, ref = out.astype(jnp.float32), ref.astype(jnp.float32)
    norm = float(jnp.linalg.norm(ref))
    rel = float(jnp.linalg.norm(out - ref)) / norm if norm > 0 else float("nan")
    return float(jnp.max(jnp.abs(out - ref))), rel


def _timed_pair(kern, ref, args, iters, interpret):
    reps = 1 if interpret else 5
    tk = time_call(kern, *args, iters=iters, reps=reps)
    tr = time_call(ref, *args, iters=max(1, iters // 4), reps=reps)
    return tk, tr, _errors(kern(*args), ref(*args))


def decode_point(batch, ctx, heads, bs=16, interpret=False, iters=20, tuning=None):
    """Paged decode at (batch, context) for heads = (q heads, KV heads, head dim); `tuning`
    overrides the kernel's launch settings."""
    hq, hkv, d = heads
    k, v, tables = make_pool(jax.random.key(batch * 7919 + ctx), batch, ctx, bs, hkv, d)
    q = jax.random.normal(jax.random.key(ctx + 1), (batch, hq, d), DTYPE)
    lens = jnp.full((batch,), ctx, jnp.int32)
    kern = jax.jit(lambda *a: paged_attention(*a, interpret=interpret, **(tuning or {})))
    tk, tr, (err, rel) = _timed_pair(kern, jax.jit(reference.paged_attention), (q, k, v, tables, lens), iters,
                                     interpret)
    nbytes = batch * ctx * hkv * d * 2 * ITEM + 2 * q.size * ITEM + tables.size * 4
    return dict(kernel_s=tk, xla_s=tr, max_err=err, rel_err=rel, bytes=nbytes)


def prefill_point(new, cached, seqs, heads, bs=16, interpret=False, iters=5):
    """Ragged prefill of `seqs` sequences of `new` tokens after `cached` ones."""
    hq, hkv, d = heads
    ctx = new + cached
    k, v, tables = make_pool(jax.random.key(ctx + seqs), seqs, ctx, bs, hkv, d)
    q = jax.random.normal(jax.random.key(ctx + 2), (new * seqs, hq, d), DTYPE)
    kv_lens = jnp.full((seqs,), ctx, jnp.int32)
    cu = jnp.arange(seqs + 1, dtype=jnp.int32) * new
    kern = jax.jit(lambda *a: ragged_paged_attention(*a, interpret=interpret))
    tk, tr, (err, rel) = _timed_pair(kern, jax.jit(reference.ragged_paged_attention),
                                     (q, k, v, tables, kv_lens, cu), iters, interpret)
    pairs = seqs * (new * cached + new * (new + 1) / 2)
    nbytes = seqs * ctx * hkv * d * 2 * ITEM + 2 * q.size * ITEM
    return dict(kernel_s=tk, xla_s=tr, max_err=err, rel_err=rel, bytes=nbytes, flops=4 * pairs * hq * d)


def decode_write_point(batch, ctx, heads, bs=16, qk_norm=False, interpret=False, iters=20):
    """The decode kernel as the engine's decode steps call it (``paged_attention_with_write``):
    this step's K/V stored at position ctx - 1 of each sequence, q and k rotated (and
    RMS-normed per head with ``qk_norm``, Qwen3), then attention over ctx tokens, against the
    XLA path (``reference.prepare_qk``, the scatter, the reference attention). Both update
    donated pools in place, threaded from call to call as the engine threads its KV cache.
    The error covers the output and the rows written (read back from the pools)."""
    from kernels_pallas.paged_attention import paged_attention_with_write

    hq, hkv, d = heads
    k, v, tables = make_pool(jax.random.key(batch * 7919 + ctx + 1), batch, ctx, bs, hkv, d)
    keys = jax.random.split(jax.random.key(ctx + 5), 6)
    q = jax.random.normal(keys[0], (batch, hq, d), DTYPE)
    kn, vn = (jax.random.normal(kk, (batch, hkv, d), DTYPE) for kk in keys[1:3])
    angle = jax.random.uniform(keys[3], (batch, d // 2), jnp.float32, 0, 2 * np.pi)
    rope = (jnp.tile(jnp.cos(angle), 2).astype(DTYPE), jnp.tile(jnp.sin(angle), 2).astype(DTYPE))
    norm = tuple(1 + 0.1 * jax.random.normal(kk, (d,), DTYPE) for kk in keys[4:6]) if qk_norm else None
    lens = jnp.full((batch,), ctx, jnp.int32)
    slots = (tables[:, (ctx - 1) // bs] * bs + (ctx - 1) % bs).astype(jnp.int32)

    def jitted(fn):   # the pools donated; every array an argument (closed over, it would be a constant)
        step = jax.jit(lambda kp, vp, *rest: fn(*rest[:3], kp, vp, *rest[3:6], rope=rest[6], qk_norm=rest[7]),
                       donate_argnums=(0, 1))
        return lambda kp, vp: step(kp, vp, q, kn, vn, slots, tables, lens, rope, norm)

    kern = jitted(functools.partial(paged_attention_with_write, interpret=interpret))
    ref = jitted(reference.paged_attention_with_write)

    def written(out, kp, vp):   # the output and the rows the step stored, per sequence
        return jnp.concatenate([a.reshape(batch, -1) for a in (out, kp.reshape(-1, hkv, d)[slots],
                                                                vp.reshape(-1, hkv, d)[slots])], 1)

    # The pools are donated: the reference gets its own copy of the kernel's, taken before the
    # kernel's first call, so both store the same rows into the same pages.
    copies = jnp.copy(k), jnp.copy(v)
    got, want = kern(k, v), ref(*copies)
    err, rel = _errors(written(*got), written(*want))
    reps = 1 if interpret else 5
    tk = _time_threaded(kern, got[1:], iters, reps)
    tr = _time_threaded(ref, want[1:], max(1, iters // 4), reps)
    nbytes = batch * ctx * hkv * d * 2 * ITEM + (2 * q.size + 4 * kn.size) * ITEM + tables.size * 4
    return dict(kernel_s=tk, xla_s=tr, max_err=err, rel_err=rel, bytes=nbytes)


def _time_threaded(fn, pools, iters, reps):
    """Median seconds per call of fn(*pools) -> (..., *pools), each call taking the pools the
    one before returned (they are donated, as the engine's steps donate the KV cache)."""
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            results = fn(*pools)
            pools = results[-len(pools):]
        jax.block_until_ready(results)
        samples.append((time.perf_counter() - t0) / iters)
    return statistics.median(samples)


def kv_write_point(tokens, heads, bs=16, pool_tokens=64 * 1024, iters=20, interpret=False):
    """The KV write (an XLA scatter, no kernel: kv_update.py says why) of `tokens` new tokens
    into a donated page pool; its error is the largest difference between the pages read back
    at the slots and the new values (exactly 0 when right)."""
    _, hkv, d = heads
    k, v, _ = make_pool(jax.random.key(3), 1, pool_tokens, bs, hkv, d)
    kn = jax.random.normal(jax.random.key(4), (tokens, hkv, d), DTYPE)
    vn = jax.random.normal(jax.random.key(5), (tokens, hkv, d), DTYPE)
    slots = (bs + jax.random.permutation(jax.random.key(6), (k.shape[0] - 1) * bs)[:tokens]).astype(jnp.int32)
    jitted = jax.jit(write_kv_pages, donate_argnums=(0, 1))
    step = lambda kp, vp: jitted(kp, vp, kn, vn, slots)  # noqa: E731
    k, v = step(k, v)
    err = max(float(jnp.max(jnp.abs(k.reshape(-1, hkv, d)[slots].astype(jnp.float32) - kn.astype(jnp.float32)))),
              float(jnp.max(jnp.abs(v.reshape(-1, hkv, d)[slots].astype(jnp.float32) - vn.astype(jnp.float32)))))
    secs = _time_threaded(step, (k, v), iters, 1 if interpret else 5)
    return dict(kernel_s=secs, max_err=err, rel_err=0.0 if err == 0 else float("nan"),
                bytes=2 * 2 * tokens * hkv * d * ITEM + tokens * 4)


def experts_point(tokens, experts=EXPERTS, interpret=False, iters=20):
    """A MoE layer's gate/up grouped matmul for `tokens` tokens routed to `per_token` random
    experts each, as the layer runs it: a decode step's kernel reads the tokens through the
    pairs' positions, a prefill's the rows put in expert order. The Pallas kernel against the
    blocked XLA loop on the rows in expert order (models/layers/moe.py)."""
    from omni_jax.models.layers.moe import COMPARE_ALL_MAX_PAIRS, blocked_grouped_matmul, sort_pairs

    e, k, h, i = experts
    w = jax.random.normal(jax.random.key(6), (e, 2 * i, h), DTYPE) / h ** 0.5  # a Python float keeps bf16
    chosen = jax.vmap(lambda key: jax.random.choice(key, e, (k,), replace=False))(
        jax.random.split(jax.random.key(tokens), tokens))
    position, sizes = sort_pairs(chosen.reshape(-1).astype(jnp.int32), e)
    x = jax.random.normal(jax.random.key(7 + tokens), (tokens, h), DTYPE)
    rows = jnp.zeros((max(tokens * k, 16), h), DTYPE).at[position].set(jnp.repeat(x, k, axis=0))
    ref = jax.jit(lambda r, w_, s, *_: blocked_grouped_matmul(r, w_, s, out_dtype=DTYPE))
    if tokens * k <= COMPARE_ALL_MAX_PAIRS:
        kern = jax.jit(lambda r, w_, s, x_, p: grouped_matmul(x_, w_, s, out_dtype=DTYPE, position=p,
                                                              interpret=interpret))
    else:
        kern = jax.jit(lambda r, w_, s, *_: grouped_matmul(r, w_, s, out_dtype=DTYPE, interpret=interpret))
    tk, tr, (err, rel) = _timed_pair(kern, ref, (rows, w, sizes, x, position), iters, interpret)
    hit = int(jnp.count_nonzero(sizes))
    nbytes = hit * 2 * i * h * ITEM + x.size * ITEM + tokens * k * 2 * i * ITEM
    return dict(kernel_s=tk, xla_s=tr, max_err=err, rel_err=rel, bytes=nbytes, experts_hit=hit,
                flops=2 * tokens * k * 2 * i * h)


def route_point(tokens, experts=EXPERTS, interpret=False, iters=20):
    """A decode step's MoE routing of `tokens` tokens (softmax, top-k, renormalised, the pairs'
    order by expert): the one-launch Pallas kernel against its XLA reference (six to eight
    kernels on a GPU). Its error covers the weights; the order must match exactly (else NaN)."""
    from kernels_pallas.moe_route import moe_route

    e, k, _, _ = experts
    logits = jax.random.normal(jax.random.key(12 + tokens), (tokens, e), DTYPE)
    valid = jnp.ones((tokens,), bool)
    kern = jax.jit(lambda a, b: moe_route(a, b, top_k=k, norm_topk_prob=True, interpret=interpret))
    ref = jax.jit(lambda a, b: reference.moe_route(a, b, top_k=k, norm_topk_prob=True))
    tk, tr, _ = _timed_pair(lambda *a: kern(*a)[0], lambda *a: ref(*a)[0], (logits, valid), iters, interpret)
    got, want = kern(logits, valid), ref(logits, valid)
    err, rel = _errors(got[0], want[0])
    same_order = bool(jnp.array_equal(got[1], want[1]) and jnp.array_equal(got[2], want[2]))
    return dict(kernel_s=tk, xla_s=tr, max_err=err, rel_err=rel if same_order else float("nan"),
                bytes=logits.size * ITEM + tokens * k * 8 + e * 4)


def norm_point(tokens, hidden, interpret=False, iters=20):
    """The residual add + RMSNorm of `tokens` rows (a decoder's post-attention norm): the
    one-launch Pallas kernel against its XLA reference (three kernels on a GPU)."""
    x, h = (jax.random.normal(jax.random.key(8 + i), (tokens, hidden), DTYPE) for i in range(2))
    w = jax.random.normal(jax.random.key(10), (hidden,), DTYPE)
    kern = jax.jit(lambda a, b, c: rms_norm(a, c, b, eps=1e-6, interpret=interpret)[0])
    ref = jax.jit(lambda a, b, c: reference.rms_norm(a, c, b, eps=1e-6)[0])
    tk, tr, (err, rel) = _timed_pair(kern, ref, (x, h, w), iters, interpret)
    return dict(kernel_s=tk, xla_s=tr, max_err=err, rel_err=rel, bytes=(3 * x.size + hidden) * ITEM)


def report_target(rows, peak):
    hits = [r for r in rows if r[:3] == (64, 4096, 16)]
    if not hits:
        return
    _, _, _, tk, tr, nbytes = hits[0]
    frac = nbytes / tk / peak if peak else None
    ok = frac is not None and frac >= 0.7 and tr / tk >= 1.5
    frac_s = f"{100 * frac:.1f}% of peak" if frac else "peak unknown"
    print(f"\nTarget (decode, batch 64, 4k context): {frac_s}, "
          f"{tr / tk:.2f}x XLA reference -> {'MET' if ok else 'NOT MET'} "
          "(want >= 70% and >= 1.5x)")


def smoke_check():
    """Interpret-mode run on tiny shapes, compared with the reference."""
    print("No GPU found: running the kernels once in Pallas interpret mode on "
          "small shapes as a smoke check.\nNO TIMING WAS TAKEN; run this "
          "script on an NVIDIA GPU for the benchmark.")
    rng = np.random.default_rng(0)
    bs, lens = 16, [1, 15, 30, 0]         # <= 2 pages each
    k = jnp.asarray(rng.standard_normal((12, bs, HKV, D)), DTYPE)
    v = jnp.asarray(rng.standard_normal((12, bs, HKV, D)), DTYPE)
    tables = jnp.asarray(1 + rng.permutation(11)[:8].reshape(4, 2), jnp.int32)
    tables = tables.at[0, 1].set(0).at[3].set(0)
    seq_lens = jnp.asarray(lens, jnp.int32)
    q = jnp.asarray(rng.standard_normal((4, HQ, D)), DTYPE)
    out = paged_attention(q, k, v, tables, seq_lens, interpret=True)
    want = reference.paged_attention(q, k, v, tables, seq_lens)
    err_d = float(jnp.max(jnp.abs(out.astype(jnp.float32) - want)))
    cu = jnp.asarray([0, 1, 5, 12, 12], jnp.int32)
    qr = jnp.asarray(rng.standard_normal((16, HQ, D)), DTYPE)
    out = ragged_paged_attention(qr, k, v, tables, seq_lens, cu,
                                 interpret=True)
    want = reference.ragged_paged_attention(qr, k, v, tables, seq_lens, cu)
    err_r = float(jnp.max(jnp.abs(out.astype(jnp.float32) - want)))
    sizes = jnp.asarray([5, 0, 17, 9], jnp.int32)      # 31 rows of 32: one of no expert
    rows = jnp.asarray(rng.standard_normal((32, 64)), DTYPE)
    w = jnp.asarray(rng.standard_normal((4, 48, 64)), DTYPE)
    from omni_jax.models.layers.moe import blocked_grouped_matmul

    out = grouped_matmul(rows, w, sizes, interpret=True)
    err_g = float(jnp.max(jnp.abs(out - blocked_grouped_matmul(rows, w, sizes))))
    ok = err_d < 2e-2 and err_r < 2e-2 and err_g < 2e-2
    print(f"decode max abs err {err_d:.2e}, ragged max abs err {err_r:.2e}, grouped matmul max abs "
          f"err {err_g:.2e}: {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="a few decode shapes, block size 16 only")
    args = parser.parse_args(argv)
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        return smoke_check()
    name, peak = device_peak(gpus[0])
    print(f"Device: {gpus[0].device_kind} -> peak HBM "
          f"{f'{peak / 1e12:.2f} TB/s ({name})' if peak else name}; "
          f"a 2 GiB device-to-device copy measures {copy_bandwidth(2 << 30) / 1e12:.2f} TB/s")
    # The launch settings the engine uses on this GPU (the kernels' per-target tables,
    # checked by the gpu_compile tests); the GPU check's tuning part
    # (benchmarks/gpu/tuning.py) times the alternatives.
    print(f"Tuning: decode {decode_tuning()}, prefill {prefill_tuning()}, experts {grouped_tuning()}")
    rows = bench_decode(QUICK_DECODE if args.quick else DECODE_SHAPES, [16],
                        peak)
    if not args.quick:
        rows += bench_decode(BS_SHAPES, [32, 64], peak)
        bench_decode_write(QUICK_DECODE, peak)
        bench_prefill(peak)
        bench_kv_write(peak)
        bench_experts(peak)
    report_target(rows, peak)
    return 0


if __name__ == "__main__":
    sys.exit(main())
