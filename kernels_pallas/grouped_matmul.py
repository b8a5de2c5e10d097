"""Grouped matmul for mixture-of-experts layers: a Pallas kernel for NVIDIA GPUs.

``rows [P, K]`` sorted by group (expert), ``weights [G, N, K]`` (a group's weights as
[out, in], the layout the MoE layer stores), ``group_sizes [G]``: row r is multiplied by
the weights of the group whose run of rows holds it. Backend: Pallas' Triton lowering
(see ``paged_attention``'s docstring for why not Mosaic GPU).

Algorithm: each group's run of rows is cut into blocks of ``block_rows`` (the last block
of a run is partial), planned by each program from a cumsum of the per-group block counts
(``plan_block``: no host sync, no launch of its own). One program per (row block, tile of
N columns) loads its group's weight tiles in place, through pointers into the whole table,
and runs a K loop of ``[block_rows, block_k] x [block_k, block_n]`` dots in fp32. The
programs of the static grid past the used blocks zero the rows of no group. So a step
reads each routed group's weights once per row block, never copies them, and is one
launch, where a loop of per-block XLA matmuls would copy each block's weights out of the
table first (a ``dynamic-slice`` XLA:GPU does not fuse into a GEMM) and launch several
kernels per block, one block after another.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.paged_attention import dot_precision, next_pow2
from kernels_pallas.tuning import pick, target_capability

__all__ = ["grouped_matmul", "blocked_plan", "plan_block", "max_blocks", "MIN_BLOCK_ROWS", "default_block_rows",
           "GROUPED_TUNING", "grouped_tuning", "block_settings"]

# Launch settings per compute capability (most conservative row first), from compiling
# at the real Qwen3-Omni MoE shapes for each target; tests/test_gpu_compile.py checks
# every row block size the engine can pick. ``by_rows`` maps the largest row block a
# setting serves to its K step, warps and stages (the fp32 accumulator is block_rows x
# block_n). Seen: 16-row blocks (decode) with 4 warps, 36 KB of shared memory, 64-72
# registers; 128-row blocks (prefill) with 8 warps, 64 KB (A100) / 96 KB (H100), 100-132
# registers, where 4 warps sit at ptxas's 255-register cap on A100 (202 on H100); no spills.
# Hopper's 16-row blocks (a decode step of a few tokens) take K steps of 128 over 5 stages:
# timed on an H200 (2026-12-04) at one token (8 of 128 experts, [1536, 2048] each), 16.0 us,
# 78% of the copy bandwidth, against 26.0 us (48%) with 64 over 3; the sweep's other points
# are in the README. Larger blocks keep the settings compiled for both targets (untimed).
GROUPED_TUNING = {
    80: dict(block_n=128, by_rows=((32, dict(block_k=64, num_warps=4, num_stages=3)),
                                   (128, dict(block_k=64, num_warps=8, num_stages=3)))),
    90: dict(block_n=128, by_rows=((16, dict(block_k=128, num_warps=4, num_stages=5)),
                                   (32, dict(block_k=64, num_warps=4, num_stages=3)),
                                   (128, dict(block_k=64, num_warps=8, num_stages=3)))),
}


def grouped_tuning(capability: int | None = None) -> dict:
    """The kernel's launch settings for a GPU (default: the one being compiled for)."""
    return pick(GROUPED_TUNING, target_capability() if capability is None else capability)


def block_settings(tune: dict, block_rows: int) -> dict:
    """block_k, num_warps and num_stages of a tuning row for blocks of `block_rows` rows."""
    return next((s for top, s in tune["by_rows"] if block_rows <= top), tune["by_rows"][-1][1])


def max_blocks(num_rows: int, num_groups: int, block_rows: int) -> int:
    """Static bound on used blocks: sum_g ceil(s_g/B) <= (P + G*(B-1)) // B, and <= P."""
    return max(1, min(num_rows, (num_rows + num_groups * (block_rows - 1)) // block_rows))


def blocked_plan(group_sizes: jnp.ndarray, num_rows: int, block_rows: int, num_blocks: int | None = None):
    """Per-block (group, first row, end row) arrays [num_blocks, default max_blocks], the
    used-block count and the rows that belong to a group (sum of the sizes).

    Block j belongs to group g_j with cum_blocks[g_j - 1] <= j < cum_blocks[g_j]; it
    covers rows [start_j, end_j) of the sorted rows, end_j - start_j <= block_rows.
    Entries past the used count are junk and never read.
    """
    n = num_blocks or max_blocks(num_rows, group_sizes.shape[0], block_rows)
    return plan_block(group_sizes, jnp.arange(n, dtype=jnp.int32), block_rows)


def plan_block(group_sizes: jnp.ndarray, j, block_rows: int):
    """``blocked_plan`` for block index j (a scalar, or an array of them): (group, start, end,
    used, total). Only cumsums, sums and selects, so that the kernel computes its own block
    in each program (the plan as XLA ops was eight kernels per MoE layer, a launch each) and
    XLA the whole plan for the CPU path, from the same lines."""
    sizes = group_sizes.astype(jnp.int32)
    g = sizes.shape[0]
    blocks = (sizes + block_rows - 1) // block_rows
    cum_blocks = jnp.cumsum(blocks)
    row_end = jnp.cumsum(sizes)
    j = jnp.asarray(j, jnp.int32)
    ids = jnp.arange(g, dtype=jnp.int32)
    # Block j's group: the groups whose blocks all end at or before j (compared all at once;
    # searchsorted's binary search is a while loop XLA:GPU drives from the host).
    group = jnp.minimum(jnp.sum((cum_blocks <= j[..., None]).astype(jnp.int32), axis=-1), g - 1)
    if group.ndim:   # XLA: a gather
        at = lambda v: jnp.take(v, group)  # noqa: E731
    else:            # one program: a select (a Triton program cannot index a vector it holds)
        at = lambda v: jnp.sum(jnp.where(ids == group, v, 0))  # noqa: E731
    ends = at(row_end)
    start = ends - at(sizes) + (j - (at(cum_blocks) - at(blocks))) * block_rows
    return group, start, jnp.minimum(start + block_rows, ends), jnp.sum(blocks), jnp.sum(sizes)


# Rows of the smallest block: the smallest M of a Triton dot.
MIN_BLOCK_ROWS = 16


def default_block_rows(num_rows: int, num_groups: int, smallest: int = MIN_BLOCK_ROWS) -> int:
    """Row-block size: ~ the mean group size, a power of two in [smallest, 128] (16, the
    smallest Triton dot, for this kernel). Big enough that a block is a real matmul, small
    enough that the <= 1 partial block per group (G*(B-1) padded rows at worst) stays
    small next to the P routed rows."""
    mean = -(-num_rows // max(num_groups, 1))
    return min(128, max(smallest, next_pow2(mean)))


def _silu_gated(gate, up):
    """SiLU(gate) * up in fp32 (Triton has no lowering of ``lax.logistic``, jax.nn.silu's)."""
    g = gate.astype(jnp.float32)
    return g / (1.0 + jnp.exp(-g)) * up.astype(jnp.float32)


def _tokens_of_rows(pos_ref, r, num_pairs: int, top_k: int, chunk: int = 64):
    """The token of each sorted row in r: row r holds pair p with position[p] == r (the
    positions are a permutation of the pairs), and pair p is token p // top_k's. The pairs
    compared with the block's rows `chunk` at a time ([block_rows, chunk] in registers: all
    of a decode step's 512 at once spilled)."""
    chunk = min(chunk, next_pow2(num_pairs))

    def body(i, tok):
        pairs = i * chunk + jnp.arange(chunk, dtype=jnp.int32)
        pos = plgpu.load(pos_ref.at[pairs], mask=pairs < num_pairs, other=-1)
        return tok + jnp.sum(jnp.where(pos[None, :] == r[:, None], pairs[None, :] // top_k, 0), axis=1)

    return lax.fori_loop(0, pl.cdiv(num_pairs, chunk), body, jnp.zeros(r.shape, jnp.int32))


def _kernel(sizes_ref, *refs, block_rows, block_n, block_k, num_rows, k_dim, top_k, gathered, glu, precision):
    pos_ref, rows_ref, w_ref, out_ref = refs if gathered else (None, *refs)
    j, n = pl.program_id(0), pl.program_id(1)
    n_dim = out_ref.shape[1]   # with glu the weights hold the gate's rows, then the up's
    cols = block_n // 2 if glu else block_n  # a program's weight rows: block_n, both halves
    group, start, end, used, total = plan_block(sizes_ref[...], j, block_rows)
    c = n * cols + jnp.arange(cols, dtype=jnp.int32)
    col_ok = c < n_dim

    def block(lo, hi):
        # A block that would run past the last row is shifted back inside (rows >= block_rows,
        # see grouped_matmul) and masked to its own rows: every row index is real and distinct,
        # so a masked-off row never writes over another block's (as in interpret mode, which
        # stores masked rows back as they were read).
        first = jnp.minimum(lo, num_rows - block_rows)
        r = first + jnp.arange(block_rows, dtype=jnp.int32)
        return r, (r >= lo) & (r < hi)

    @pl.when(j < used)
    def _():
        r, row_ok = block(start, end)
        # The rows this block reads: its sorted rows, or the tokens they hold (gathered).
        src = _tokens_of_rows(pos_ref, r, pos_ref.shape[0], top_k) if gathered else r
        # Index every axis with an array: interpret mode discharges only all-array (or
        # all-slice) indexers; Triton takes both.
        gi = jnp.full((1, 1), group, jnp.int32)

        def body(i, accs):
            kk = i * block_k + jnp.arange(block_k, dtype=jnp.int32)
            k_ok = kk < k_dim
            a = plgpu.load(rows_ref.at[src[:, None], kk[None, :]], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w_ok = col_ok[:, None] & k_ok[None, :]
            # Each accumulator's weight rows: columns c (with glu, then the up projection's, n_dim on).
            return tuple(acc + plgpu.dot(a, plgpu.load(w_ref.at[gi, (h * n_dim + c)[:, None], kk[None, :]],
                                                       mask=w_ok, other=0.0), trans_b=True, precision=precision)
                         for h, acc in enumerate(accs))

        zeros = jnp.zeros((block_rows, cols), jnp.float32)
        accs = lax.fori_loop(0, pl.cdiv(k_dim, block_k), body, (zeros, zeros) if glu else (zeros,))
        # glu: each product rounded to the output dtype first, as the gate/up output is without it.
        out = _silu_gated(*(acc.astype(out_ref.dtype) for acc in accs)) if glu else accs[0]
        plgpu.store(out_ref.at[r[:, None], c[None, :]], out.astype(out_ref.dtype),
                    mask=row_ok[:, None] & col_ok[None, :])

    # The programs past the used blocks write the zeros of the rows of no group, a block each
    # (a zero-filled output aliased in would be one more [P, N] buffer per call, which XLA
    # materialises for every layer of a step at once).
    @pl.when(j >= used)
    def _():
        r, row_ok = block(total + (j - used) * block_rows, num_rows)
        plgpu.store(out_ref.at[r[:, None], c[None, :]], jnp.zeros((block_rows, cols), out_ref.dtype),
                    mask=row_ok[:, None] & col_ok[None, :])


@functools.partial(jax.jit, static_argnames=("out_dtype", "glu", "block_rows", "block_n", "block_k", "num_warps",
                                             "num_stages", "interpret"))
def grouped_matmul(rows, weights, group_sizes, out_dtype=jnp.float32, *, position=None, glu=False, block_rows=None,
                   block_n=None, block_k=None, num_warps=None, num_stages=None, interpret=False):
    """rows [P, K] sorted by group; weights [G, N, K]; group_sizes [G] int -> [P, N] in out_dtype.

    Rows past sum(group_sizes) belong to no group and come out zero. Products accumulate
    in fp32 (IEEE fp32 dots for fp32 inputs). Two inputs a MoE decode step takes as they are,
    each saving XLA a launch or two before the kernel:

    * ``position`` [P] (or [T, k]) int: rows are the tokens [T, K] instead, and sorted row
      position[p] holds token p // k (k = P / T pairs a token; the positions a permutation of
      the P pairs, as the MoE routing gives them). The output has max(P, block_rows) rows.
    * ``glu``: the weights [G, 2N, K] hold a gate projection's rows, then an up projection's;
      the kernel returns SiLU(gate) * up [P, N] (each product rounded to out_dtype, then fp32),
      a program's ``block_n`` weight rows half of each. The activation taken as it loads the
      down projection's rows instead computed it again in every program of a row block, on
      every warp (1,546 instructions a warp a K step in the SASS for an H200, against 142).

    Tuning: ``block_rows`` (a power of two >= 16; default ~ the mean group size), ``block_n``,
    ``block_k``, Triton ``num_warps`` and ``num_stages``; unset ones come from
    ``GROUPED_TUNING`` for the GPU being compiled for.
    """
    t, width = rows.shape
    g, n_dim, k_dim = weights.shape
    if width != k_dim:
        raise ValueError(f"rows have {width} columns, the weights contract {k_dim}")
    if glu and n_dim % 2:
        raise ValueError(f"glu: the weights' {n_dim} rows are not a gate's and an up projection's of one width")
    if group_sizes.shape != (g,):
        raise ValueError(f"group_sizes {group_sizes.shape} != ({g},)")
    if rows.dtype != weights.dtype:  # Triton's dot takes one element type (interpret mode would promote)
        raise ValueError(f"rows are {rows.dtype}, the weights {weights.dtype}: give both one dtype")
    p = t if position is None else position.size
    if position is not None and (t == 0 or p % t):
        raise ValueError(f"position has {p} pairs, not a whole number per token of {t}")
    n_out = n_dim // 2 if glu else n_dim
    if p == 0:
        return jnp.zeros((0, n_out), out_dtype)
    tune = grouped_tuning()
    bm = block_rows or default_block_rows(p, g)
    if bm != next_pow2(bm) or bm < MIN_BLOCK_ROWS:
        raise ValueError(f"block_rows={bm} must be a power of two >= {MIN_BLOCK_ROWS}")
    at = block_settings(tune, bm)
    bn, bk = block_n or tune["block_n"], block_k or at["block_k"]
    if glu and (bn < 32 or bn % 2):  # half for each projection, and a Triton dot is >= 16 wide
        raise ValueError(f"glu: block_n={bn} must be even and >= 32")
    warps = num_warps or at["num_warps"]
    # At least a block's worth of sorted rows: gathered rows are that many, plain ones padded.
    p_in = max(p, bm)
    if position is None and p < bm:
        rows = jnp.pad(rows, ((0, bm - p), (0, 0)))
    operands = [group_sizes.astype(jnp.int32)]
    if position is not None:
        operands.append(position.reshape(-1).astype(jnp.int32))
    operands += [rows, weights]
    # Grid: the plan's blocks, then enough for the rows of no group (at most all of them).
    nb = max_blocks(p, g, bm) + pl.cdiv(p_in, bm)
    kernel = functools.partial(_kernel, block_rows=bm, block_n=bn, block_k=bk, num_rows=p_in, k_dim=k_dim,
                               top_k=max(p // t, 1), gathered=position is not None, glu=glu,
                               precision=dot_precision(rows.dtype))
    whole = lambda shape: pl.BlockSpec(shape, lambda j, n: (0,) * len(shape))  # noqa: E731
    out = pl.pallas_call(
        kernel,
        grid=(nb, pl.cdiv(n_out, bn // 2 if glu else bn)),
        in_specs=[whole(x.shape) for x in operands],
        out_specs=whole((p_in, n_out)),
        out_shape=jax.ShapeDtypeStruct((p_in, n_out), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=num_stages or at["num_stages"]),
        interpret=interpret,
        name=f"grouped_matmul_bm{bm}_bn{bn}_bk{bk}" + ("_gather" if position is not None else "")
        + ("_glu" if glu else ""),
    )(*operands)
    return out if position is not None or p_in == p else out[:p]
