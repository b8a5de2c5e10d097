"""Part `tuning` (on a GPU only when asked: `--only tuning`): the launch settings and XLA
options of the kernels a Qwen3-Omni-30B-A3B thinker's batch-1 decode step spends its time in,
swept at the real shapes, so that a few minutes of a GPU say which table row to change.

The step was 2.98 ms against a 1.49 ms roofline on an H200 (README, "Measured on a GPU"), its
kernels per layer: the MoE grouped matmuls 26.7 us (gate/up at 78% of the copy bandwidth,
down at 56%), the attention projections 17.5 us (XLA's GEMMs; q/k/v at 48%), paged decode
8.8 us, routing 5.8 us. Each point here is one kernel at one setting, timed alone, with its
share of the copy bandwidth measured in the same run; each sweep ends with its fastest point
and the setting the tables give today:

* paged decode: where each step's page ids come from (the split's table entries preloaded, or
  read in the page loop as before 2026-12-05: then Triton's pipeliner waits for every copy at
  the top of each step below 5 stages) with the stages each needs to keep pages in flight, and
  tokens per step; at batch 64 x 4096 (the 7B's heads: the kernel target's point) and for one
  530-token sequence with the 30B's heads (splits of the context too);
* the attention projections of one token (q/k/v side by side, as `parallel_linears` runs them,
  then o_proj): XLA as compiled today, XLA without its Triton GEMMs (cuBLAS), and the skinny
  matmul kernel (`kernels_pallas/skinny_matmul.py`, the weights as stored) at a few settings:
  where it wins, its row's `max_rows` sends a decode step's projections to it;
* the grouped matmul's block_n, block_k, warps and stages, for the gate/up and the down
  projection of one token's 8 experts as a decode step runs them (gate/up reading the token
  through the pairs' positions and returning SiLU(gate) * up), then the two against what they
  replaced on 2026-12-05 (XLA's scatter of the rows and SiLU between);
* one token's router and routing: the router's split-K partial products summed by the routing
  kernel (block_n, block_k, splits), against XLA's router GEMM before it (as before 2026-12-05);
* ragged prefill of one 2048-token prompt (the 7B's heads): its page ids read in the loop at 2
  stages (today's row: no prefetch) against preloaded at 3 and 4 stages, 4 and 8 warps.

In that order: what bears on the unmet targets most first.

On a CPU (`check.sh --cpu`) the kernels run in interpret mode at the tiny model's shapes, one
point per sweep: the code runs, the times mean nothing.
"""

from __future__ import annotations

import itertools
import os
import sys

from kernel_check import copy_peak
from sizes import ROOT, hf_config

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))



def _fits(point) -> bool:
    """A grouped (or skinny) matmul setting within Hopper's 232448 B of shared memory: Triton
    keeps stages - 1 tiles of the 16-row block and of the weights (what compiling for an H200
    asked for: bn128 bk256 s5, 294912 B, fails; every other point here compiles)."""
    bn, bk, _, stages = point
    return (16 + bn) * bk * 2 * (stages - 1) <= 232448


# (block_n, block_k, num_warps, num_stages) of the grouped matmul at one token (16-row blocks)
GROUPED_GRID = list(filter(_fits, itertools.product((32, 64, 128), (128, 256), (4,), (3, 5))))
# the skinny matmul (a projection's few rows): (block_n, block_k, num_warps, num_stages)
SKINNY_GRID = list(filter(_fits, itertools.product((16, 32, 64), (128, 256), (4,), (4, 5))))
# paged decode: (preload_table, num_stages) pairs: with the table preloaded 2 stages hold one
# step of pages, 3 two, 4 three; read in the loop, 5 stages are the first to hold two (PTX)
DECODE_PIPELINES = ((True, 2), (True, 3), (True, 4), (False, 3), (False, 5))
# ragged prefill: (preload_table, num_stages, num_warps)
PREFILL_GRID = ((False, 2, 4), (False, 2, 8), (True, 3, 4), (True, 3, 8), (True, 4, 8))
PREFILL_TOKENS = 2048
# (batch, context, family, tokens per step, k_splits; None: the kernel's heuristic). At batch 64
# the heuristic gives 4 splits (1024 programs): three preloaded programs fit an SM's shared memory
# (71.7 KB each), 396 at a time on 132 SMs, so 2.6 waves whose last is 59% full; 3 splits (1.94
# waves) and 6 (3.88) fill theirs. 32 tokens a step lost to 64 at every point of the H200 sweep.
DECODE_SHAPES = ((64, 4096, "qwen2_5_omni", (64,), (None, 3, 6)),
                 (1, 530, "qwen3_omni", (16, 32, 64), (None, 16)))
# Fewer warps a program, at today's tokens a step and splits, with the table preloaded: the row max
# and sum of a 4-warp program's 16 x 64 scores cross its warps through shared memory, 10 barriers
# a step in the SASS for an H200 (2 warps: 8; 1 warp: 2), and the instructions a 64-token step
# issues over all its warps fall with them (4 warps 1,556, 2 warps 1,452, 1 warp 1,368; 230
# registers at 1 warp, 192 at 2, no spills). (warps, pipelines) beside the 4-warp sweep above.
DECODE_FEWER_WARPS = ((2, ((True, 3), (True, 4))), (1, ((True, 3), (True, 4))))
NO_TRITON_GEMM = {"xla_gpu_enable_triton_gemm": False}
REL_TOL = 2e-2  # bf16 operands, as the kernels part


def run(size, rep, results_dir) -> None:
    import pallas_kernels as kb
    from omni_jax.gpu.programs import text_config

    texts = {f: text_config(f, "thinker", hf_config(f, size)) for f in ("qwen2_5_omni", "qwen3_omni")}
    peak = copy_peak(size, rep)
    if peak is None:
        return
    interp, iters = size.interpret, size.kernel_iters
    grid = (lambda points: points[:1]) if interp else (lambda points: points)
    sweep = Sweep(rep, peak, kb, interp, iters)
    for shape in DECODE_SHAPES:
        _decode(sweep, texts, shape, grid, kb)
    _projections(sweep, texts["qwen3_omni"], grid, kb)
    _experts(sweep, texts["qwen3_omni"], grid, kb)
    _routing(sweep, texts["qwen3_omni"], grid, kb)
    _prefill(sweep, texts["qwen2_5_omni"], grid, kb)


class Sweep:
    """Times points of one sweep, records each (microseconds, share of the copy bandwidth,
    error against the sweep's reference), then the fastest of the right ones and the current
    setting's."""

    def __init__(self, rep, peak, kb, interpret, iters):
        self.rep, self.peak, self.kb, self.interpret, self.iters = rep, peak, kb, interpret, iters

    def run(self, name: str, nbytes: int, points: dict, want, current: str | None = None) -> None:
        """`points`: label -> (function, args); `want`: the reference output every point must
        give (within REL_TOL); `current`: the label of today's setting."""
        times = {}
        for label, (fn, args) in points.items():
            try:
                secs = self.kb.time_call(fn, *args, iters=self.iters, reps=1 if self.interpret else 5)
                _, rel = self.kb._errors(fn(*args), want)
            except Exception as e:  # noqa: BLE001 - a setting past the GPU's limits fails to compile
                self.rep.add(f"{name} {label}", "failed", note=f"{type(e).__name__}: {str(e)[:160]}")
                continue
            wrong = not rel <= REL_TOL  # NaN is wrong
            self.rep.add(f"{name} {label}", secs * 1e6, "us", self._share(nbytes, secs) + f", rel err {rel:.2g}"
                         + (f" FAIL: over {REL_TOL}" if wrong else ""))
            if not wrong:
                times[label] = secs
        if not times:
            return
        best = min(times, key=times.get)
        note = self._share(nbytes, times[best])
        if current in times:
            note += f"; today's setting ({current}): {times[current] * 1e6:.3g} us, {times[current] / times[best]:.2f}x"
        self.rep.add(f"{name} fastest: {best}", times[best] * 1e6, "us", note)

    def _share(self, nbytes: int, secs: float) -> str:
        return f"{nbytes / secs / 1e9:.4g} GB/s = {100 * nbytes / secs / self.peak:.3g}% of copy"


def _experts(sweep, text, grid, kb) -> None:
    """The MoE layer's experts for one token, as a decode step runs them on a GPU: the two
    grouped matmuls at each setting (gate/up reading the token through the pairs' positions and
    returning SiLU(gate) * up, then down), then the pair of them at today's settings
    against the XLA ops they replaced (the rows scattered into expert order, the SiLU between)."""
    import jax
    import jax.numpy as jnp

    from kernels_pallas.grouped_matmul import MIN_BLOCK_ROWS, block_settings, grouped_matmul, grouped_tuning
    from omni_jax.models.layers.moe import blocked_grouped_matmul, expert_outputs, fused_expert_outputs, sort_pairs

    e, per_token, h, width = text.num_experts, text.num_experts_per_tok, text.hidden_size, text.moe_intermediate_size
    chosen = jax.random.choice(jax.random.key(1), e, (per_token,), replace=False)
    position, sizes = sort_pairs(chosen.astype(jnp.int32), e)
    x = jax.random.normal(jax.random.key(3), (1, h), kb.DTYPE)
    gate_up = jax.random.normal(jax.random.key(2), (e, 2 * width, h), kb.DTYPE) / h ** 0.5
    down = jax.random.normal(jax.random.key(4), (e, h, width), kb.DTYPE) / width ** 0.5
    # References: the token's rows scattered into expert order, XLA's blocked loop, jax.nn.silu.
    rows = jnp.zeros((max(per_token, MIN_BLOCK_ROWS), h), kb.DTYPE).at[position].set(jnp.repeat(x, per_token, 0))
    up_rows = blocked_grouped_matmul(rows, gate_up, sizes, out_dtype=kb.DTYPE)
    act = (jax.nn.silu(up_rows[:, :width].astype(jnp.float32)) * up_rows[:, width:]).astype(kb.DTYPE)
    want = blocked_grouped_matmul(act, down, sizes)
    tune = grouped_tuning()
    now = block_settings(tune, MIN_BLOCK_ROWS)
    current = f"bn{tune['block_n']} bk{now['block_k']} w{now['num_warps']} s{now['num_stages']}"
    for name, operands, expect, fixed in (
            ("gate/up + SiLU x up, tokens gathered", (x, gate_up, sizes, position), act,
             dict(out_dtype=kb.DTYPE, glu=True)),
            ("down", (act, down, sizes), want, {})):
        n, k = operands[1].shape[1:]
        points = {}
        for bn, bk, warps, stages in grid(GROUPED_GRID):
            kw = dict(fixed, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, interpret=sweep.interpret)
            fn = jax.jit(lambda a, w, s_, *pos, kw=kw: grouped_matmul(a, w, s_, position=pos[0] if pos else None, **kw))
            points[f"bn{bn} bk{bk} w{warps} s{stages}"] = (fn, operands)
        # The routed experts' weights, the pairs' rows in and out.
        nbytes = (per_token * n * k + per_token * (operands[0].shape[1] + expect.shape[1])) * kb.ITEM
        sweep.run(f"moe {name} 1 token {n}x{k}", nbytes, points, expect, current)
    # The pair at today's settings against what they replaced (scatter + gate/up + SiLU + down).
    args = (x, position, sizes, gate_up, down)
    nbytes = per_token * 3 * h * width * kb.ITEM
    points = {"2 kernels": (jax.jit(lambda *a: fused_expert_outputs(*a, interpret=sweep.interpret)), args),
              "XLA scatter + SiLU between": (jax.jit(lambda *a: expert_outputs(
                  *a, k=per_token, act=jax.nn.silu, impl="blocked" if sweep.interpret else "pallas",
                  block_rows=None)), args)}
    sweep.run("moe experts 1 token (gate/up and down)", nbytes, points, want, "2 kernels")
    del gate_up, down


def _routing(sweep, text, grid, kb) -> None:
    """One token's router and routing: the router's split-K partial products (the skinny kernel,
    a K tile a program, or a few) summed by the routing kernel, against XLA's router GEMM (split
    over K, summed, sliced) before the routing kernel, as before 2026-12-05."""
    import jax
    import jax.numpy as jnp

    from kernels_pallas.moe_route import moe_route
    from kernels_pallas.skinny_matmul import skinny_matmul, skinny_tuning
    from omni_jax.models.layers.linear import fp32_accumulating_dot_general

    h, e = text.hidden_size, text.num_experts
    kw = dict(top_k=text.num_experts_per_tok, norm_topk_prob=True, interpret=sweep.interpret)
    x = jax.random.normal(jax.random.key(13), (1, h), kb.DTYPE)
    w = jax.random.normal(jax.random.key(14), (h, e), kb.DTYPE) / h ** 0.5
    valid = jnp.ones((1,), bool)

    def xla(x, w, valid):
        logits = fp32_accumulating_dot_general(x, w, (((1,), (0,)), ((), ()))).astype(kb.DTYPE)
        return moe_route(logits, valid, **kw)[0]

    points = {"XLA router": (jax.jit(xla), (x, w, valid))}
    for bn, bk, splits in grid(list(itertools.product((32, 128), (128, 256), (4, 8, 16)))):
        fn = jax.jit(lambda x, w, valid, c=(bn, bk, splits): moe_route(
            skinny_matmul(x, [w], k_splits=c[2], block_n=c[0], block_k=c[1], interpret=sweep.interpret),
            valid, logits_dtype=kb.DTYPE, **kw)[0])
        points[f"partials bn{bn} bk{bk} {splits} splits"] = (fn, (x, w, valid))
    tune = skinny_tuning()   # the model's: a K tile a program (`moe.router_partials`)
    today = f"partials bn{tune['block_n']} bk{tune['block_k']} {-(-h // tune['block_k'])} splits"
    sweep.run(f"moe routing 1 token ({h} x {e} router)", w.size * kb.ITEM, points, jax.jit(xla)(x, w, valid), today)


def _projections(sweep, text, grid, kb) -> None:
    """One token through the attention's projections: XLA as compiled today and without its
    Triton GEMMs, and the skinny kernel (the weights as stored, [in, out], q/k/v side by side)."""
    import jax
    import jax.numpy as jnp

    from kernels_pallas.skinny_matmul import skinny_matmul
    from omni_jax.models.layers.linear import fp32_accumulating_dot_general

    h, d = text.hidden_size, text.head_dim
    widths = (text.num_heads * d, text.num_kv_heads * d, text.num_kv_heads * d)
    for name, (k, outs) in (("q/k/v", (h, widths)), ("o_proj", (text.num_heads * d, (h,)))):
        n = sum(outs)
        x = jax.random.normal(jax.random.key(4), (1, k), kb.DTYPE)
        kernels = [jax.random.normal(jax.random.key(5 + i), (k, o), kb.DTYPE) for i, o in enumerate(outs)]

        def side_by_side(x, *ws):  # parallel_linears' GPU path: the concatenation fused into the GEMM
            w = jnp.concatenate(ws, axis=1) if len(ws) > 1 else ws[0]
            return fp32_accumulating_dot_general(x, w, (((1,), (0,)), ((), ())))

        xla = jax.jit(side_by_side)
        args = (x, *kernels)
        points = {"XLA": (xla, args),
                  "XLA, no Triton GEMM": (xla.lower(*args).compile(compiler_options=NO_TRITON_GEMM), args)}
        for bn, bk, warps, stages in grid(SKINNY_GRID):
            fn = jax.jit(lambda x, *ws, c=(bn, bk, warps, stages): skinny_matmul(
                x, ws, block_n=c[0], block_k=c[1], num_warps=c[2], num_stages=c[3], interpret=sweep.interpret))
            points[f"skinny bn{bn} bk{bk} w{warps} s{stages}"] = (fn, args)
        sweep.run(f"{name} 1 token {k}x{n}", (k * n + k + n) * kb.ITEM, points, xla(*args), "XLA")
        del kernels


def _decode(sweep, texts, shape, grid, kb) -> None:
    """Paged decode of `batch` sequences of `context` tokens with a thinker's heads."""
    import jax
    import jax.numpy as jnp

    from kernels_pallas import reference
    from kernels_pallas.paged_attention import decode_tuning, paged_attention

    batch, ctx, family, tokens, splits = shape
    text, bs = texts[family], 16
    hq, hkv, d = text.num_heads, text.num_kv_heads, text.head_dim
    if sweep.interpret:
        batch, ctx = min(batch, 2), min(ctx, 4 * bs)
    k, v, tables = kb.make_pool(jax.random.key(9), batch, ctx, bs, hkv, d)
    q = jax.random.normal(jax.random.key(10), (batch, hq, d), kb.DTYPE)
    lens = jnp.full((batch,), ctx, jnp.int32)
    label = lambda t, pre, st, sp, w: (f"t{t} {'preloaded' if pre else 'in-loop'} s{st} splits {sp or 'auto'}"  # noqa: E731
                                       + ("" if w == 4 else f" w{w}"))
    tune = decode_tuning()
    current = label(tune["tokens_per_step"], tune["preload_table"], tune["num_stages"], None, tune["num_warps"])
    settings = [(t, pipeline, sp, 4) for t, pipeline, sp in itertools.product(tokens, DECODE_PIPELINES, splits)]
    settings += [(tune["tokens_per_step"], pipeline, None, w) for w, pipelines in DECODE_FEWER_WARPS
                 for pipeline in pipelines]
    points = {}
    for t, (pre, stages), sp, w in grid(settings):
        fn = jax.jit(lambda *a, c=(t // bs, stages, sp, pre, w): paged_attention(
            *a, pages_per_compute_block=c[0], num_warps=c[4], num_stages=c[1], k_splits=c[2], preload_table=c[3],
            interpret=sweep.interpret))
        points[label(t, pre, stages, sp, w)] = (fn, (q, k, v, tables, lens))
    nbytes = batch * ctx * hkv * d * 2 * kb.ITEM + 2 * q.size * kb.ITEM
    want = reference.paged_attention(q, k, v, tables, lens)
    sweep.run(f"paged decode {batch} x {ctx} ({family} heads)", nbytes, points, want, current)


def _prefill(sweep, text, grid, kb) -> None:
    """Ragged prefill of one fresh prompt with the 7B's heads."""
    import jax
    import jax.numpy as jnp

    from kernels_pallas import reference
    from kernels_pallas.ragged_paged_attention import prefill_tuning, ragged_paged_attention

    hq, hkv, d, bs = text.num_heads, text.num_kv_heads, text.head_dim, 16
    tokens = 32 if sweep.interpret else PREFILL_TOKENS
    k, v, tables = kb.make_pool(jax.random.key(11), 1, tokens, bs, hkv, d)
    q = jax.random.normal(jax.random.key(12), (tokens, hq, d), kb.DTYPE)
    args = (q, k, v, tables, jnp.full((1,), tokens, jnp.int32), jnp.asarray([0, tokens], jnp.int32))
    label = lambda pre, st, w: f"{'preloaded' if pre else 'in-loop'} s{st} w{w}"  # noqa: E731
    tune = prefill_tuning()
    points = {}
    for pre, stages, warps in grid(list(PREFILL_GRID)):
        fn = jax.jit(lambda *a, c=(pre, stages, warps): ragged_paged_attention(
            *a, preload_table=c[0], num_stages=c[1], num_warps=c[2], interpret=sweep.interpret))
        points[label(pre, stages, warps)] = (fn, args)
    nbytes = tokens * hkv * d * 2 * kb.ITEM + 2 * q.size * kb.ITEM
    want = reference.ragged_paged_attention(*args)
    sweep.run(f"ragged prefill 1 x {tokens} (qwen2_5_omni heads)", nbytes, points, want,
              label(tune["preload_table"], tune["num_stages"], tune["num_warps"]))
