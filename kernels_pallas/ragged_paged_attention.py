"""Causal attention for a packed batch of prefill chunks over paged K/V.

Pallas Triton kernel (backend choice: see ``paged_attention``'s docstring).

The query rows of all sequences are packed into ``q [T, Hq, D]``. The grid
is static: ``T // block_q + S`` query tiles (an upper bound on
``sum_s ceil(q_len_s / block_q)``) times the KV heads. A tiny XLA prologue
maps each tile to its sequence, first row and KV range; tiles past the last
sequence do nothing. Each tile holds ``block_q`` tokens times the (padded to a
power of two) GQA group as the rows of one matmul, so the K/V pages of a KV
head are read once per tile for all the query heads that share them.

The KV loop covers only the positions the tile's rows can see (from the
sliding-window start of its first row to its last row's position), with a
causal mask per row; chunks may start mid-block. Its page ids come as the decode
kernel's do (``paged_attention.page_loop``). No split-K here: prefill
tiles already fill the GPU, and decode has its own kernel. A single-token
chunk works too (one valid row in its tile).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.paged_attention import (
    M_INIT, check_paged_shapes, dot_precision, load_pages, next_pow2, normalize, online_softmax_step,
    page_loop, pages_per_step, softmax_scale_log2, table_window_of)
from kernels_pallas.tuning import pick, target_capability

__all__ = ["ragged_paged_attention", "PREFILL_TUNING", "prefill_tuning"]

# Launch settings per compute capability (most conservative row first), from compiling
# at the real models' shapes for each target (tests/test_gpu_compile.py checks every row
# the engine can pick). ``rows`` is the tile's matmul height (block_q tokens x the GQA
# group padded to a power of two); ``tokens_per_step`` the KV tokens per loop step.
# ``preload_table`` as the decode kernel's (paged_attention.DECODE_TUNING): with the page ids
# read in the loop, the PTX for an H200 waits for every copy at the top of each step at 2, 3
# and 4 stages alike, so 2 stages (no prefetch) cost the least shared memory. Preloaded ids
# need 3 stages to prefetch, and the H100 tile's shared memory then allows one program per
# SM instead of two: off until an H200 times it (`check.sh --only tuning`).
PREFILL_TUNING = {
    # A100: with 4 warps the 64-row tile sits at ptxas's 255-register cap (128 rows
    # spill); 8 warps keep it at 159 registers, 57 KB of shared memory.
    80: dict(rows=64, tokens_per_step=64, num_warps=8, num_stages=2, preload_table=False),
    # H100: 64 rows x 64 KV tokens, 4 warps: 211 registers, 82 KB (128 rows with
    # 4 warps spill here too).
    90: dict(rows=64, tokens_per_step=64, num_warps=4, num_stages=2, preload_table=False),
}


def prefill_tuning(capability: int | None = None) -> dict:
    """The prefill kernel's launch settings for a GPU (default: the one being compiled for)."""
    return pick(PREFILL_TUNING, target_capability() if capability is None else capability)


def _ragged_kernel(seq_ref, q_start_ref, q_end_ref, pos_off_ref, kv_lo_ref,
                   kv_hi_ref, table_ref, q_ref, k_ref, v_ref, o_ref, *,
                   block_q, scale_log2, pages_per_block, table_window, max_pages, sliding_window,
                   precision):
    block_size = k_ref.shape[1]
    seq = seq_ref[()]
    q_start = q_start_ref[()]
    pos_off = pos_off_ref[()]
    kv_lo = kv_lo_ref[()]
    kv_hi = kv_hi_ref[()]

    q = q_ref[pl.ds(q_start, block_q)]                   # [bq, Gp, D]
    _, group_rows, d = q.shape
    rows = block_q * group_rows
    q = q.reshape(rows, d)
    row_pos = (q_start + jnp.arange(rows, dtype=jnp.int32) // group_rows
               + pos_off)                                  # absolute position

    # page0 stays a multiple of pages_per_block: table reads stay in range.
    start = kv_lo // block_size // pages_per_block * pages_per_block
    n_iter = pl.cdiv(jnp.maximum(pl.cdiv(kv_hi, block_size) - start, 0),
                     pages_per_block)
    block_k = pages_per_block * block_size
    offs = jnp.arange(pages_per_block, dtype=jnp.int32)
    in_page = jnp.arange(block_size, dtype=jnp.int32)
    flat = jnp.arange(block_k, dtype=jnp.int32)

    def step(page0, page_ids, carry):
        tok = (page0 + offs)[:, None] * block_size + in_page[None, :]
        valid = (tok >= kv_lo) & (tok < kv_hi)
        k = load_pages(k_ref, page_ids, valid)
        v = load_pages(v_ref, page_ids, valid)
        kpos = (page0 * block_size + flat)[None, :]
        mask = (kpos >= kv_lo) & (kpos < kv_hi) & (kpos <= row_pos[:, None])
        if sliding_window is not None:
            mask &= kpos > row_pos[:, None] - sliding_window
        return online_softmax_step(q, k, v, mask, carry, scale_log2, precision)

    carry = (jnp.zeros((rows, d), jnp.float32),
             jnp.full((rows,), M_INIT, jnp.float32),
             jnp.zeros((rows,), jnp.float32))
    acc, _, l = page_loop(lambda first, n: table_ref[seq, pl.ds(first, n)], start, n_iter, pages_per_block,
                          table_window, max_pages, step, carry)

    out = normalize(acc, l).astype(o_ref.dtype).reshape(block_q, group_rows, d)
    tok_ok = q_start + jnp.arange(block_q, dtype=jnp.int32) < q_end_ref[()]
    mask = jnp.broadcast_to(tok_ok[:, None, None], out.shape)
    plgpu.store(o_ref.at[pl.ds(q_start, block_q)], out, mask=mask)


def _tile_schedule(cu_q_lens, kv_lens, num_tiles, block_q, sliding_window):
    """Per-tile (seq, q_start, q_end, pos_offset, kv_lo, kv_hi), int32 [P]."""
    s = kv_lens.shape[0]
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    tiles = (q_lens + block_q - 1) // block_q
    ends = jnp.cumsum(tiles)
    p = jnp.arange(num_tiles, dtype=jnp.int32)
    # First s with ends[s] > p: zero-length sequences are skipped naturally.
    seq = jnp.clip(jnp.searchsorted(ends, p, side="right"), 0, s - 1)
    active = p < ends[-1]
    q_start = cu_q_lens[seq] + (p - (ends[seq] - tiles[seq])) * block_q
    q_end = cu_q_lens[seq + 1]
    pos_off = kv_lens[seq] - q_lens[seq] - cu_q_lens[seq]
    kv_hi = jnp.minimum(q_start + block_q, q_end) + pos_off
    kv_lo = jnp.zeros_like(kv_hi)
    if sliding_window is not None:
        kv_lo = jnp.maximum(q_start + pos_off - sliding_window + 1, 0)
    zero = jnp.zeros_like(p)
    sched = (seq, q_start, q_end, pos_off, kv_lo, kv_hi)
    return tuple(jnp.where(active, x, zero).astype(jnp.int32) for x in sched)


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "interpret", "block_q",
                     "pages_per_compute_block", "num_warps", "num_stages", "preload_table"))
def ragged_paged_attention(q, k_pages, v_pages, block_tables, kv_lens,
                           cu_q_lens, *, sm_scale=None, sliding_window=None,
                           interpret=False, block_q=None,
                           pages_per_compute_block=None, num_warps=None,
                           num_stages=None, preload_table=None):
    """Causal attention of packed prefill chunks against paged K/V.

    q: [T, Hq, D]; sequence s owns rows cu_q_lens[s]:cu_q_lens[s+1]
    (int32 [S+1]); kv_lens: int32 [S] = cached + new tokens, whose K/V are
    already in the pages; block_tables: int32 [S, max_blocks]. Row i of
    sequence s is at position kv_lens[s] - q_len_s + i and attends to
    positions <= its own (the last ``sliding_window`` of them if set). Rows
    before cu_q_lens[0] or past cu_q_lens[S] return zeros. Tuning: ``block_q``
    query tokens per tile (default: the table's rows / padded group), ``pages_per_compute_block``
    (default: the table's KV tokens per step), Triton ``num_warps``/``num_stages``,
    ``preload_table``; unset ones come from ``PREFILL_TUNING`` for the GPU being compiled for.
    Returns [T, Hq, D] in q's dtype.
    """
    tune = prefill_tuning()
    num_warps = num_warps or tune["num_warps"]
    num_stages = num_stages or tune["num_stages"]
    preload = tune["preload_table"] if preload_table is None else preload_table
    t, hq, head_dim = q.shape
    block_size, hkv, d = check_paged_shapes(hq, head_dim, k_pages, v_pages)
    num_blocks = k_pages.shape[0]
    num_seqs = kv_lens.shape[0]
    group = hq // hkv
    group_rows = next_pow2(group)
    # >= 16 rows per tile: the smallest M of a Triton dot.
    bq = block_q or max(1, tune["rows"] // group_rows)
    bq = max(next_pow2(bq), pl.cdiv(16, group_rows))
    ppb = pages_per_step(pages_per_compute_block, block_size, tune["tokens_per_step"])

    cu = cu_q_lens.astype(jnp.int32)
    kv_lens = kv_lens.astype(jnp.int32)
    num_tiles = t // bq + num_seqs
    sched = _tile_schedule(cu, kv_lens, num_tiles, bq, sliding_window)
    width = block_tables.shape[1]
    max_pages = width + -width % ppb
    table_window = table_window_of(preload, ppb, max_pages)
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, max_pages - width + table_window)))
    # Pad rows by one tile so a tile starting near T never reads or writes
    # out of bounds, and the group to a power of two.
    qg = jnp.pad(q.reshape(t, hkv, group, d),
                 ((0, bq), (0, 0), (0, group_rows - group), (0, 0)))

    kernel = functools.partial(
        _ragged_kernel, block_q=bq,
        scale_log2=softmax_scale_log2(sm_scale, d), pages_per_block=ppb, table_window=table_window,
        max_pages=max_pages, sliding_window=sliding_window, precision=dot_precision(q.dtype))
    scalar = pl.BlockSpec((None,), lambda p, h: (p,))
    page_spec = pl.BlockSpec((num_blocks, block_size, None, d),
                             lambda p, h: (0, 0, h, 0))
    rows_spec = pl.BlockSpec((t + bq, None, group_rows, d),
                             lambda p, h: (0, h, 0, 0))
    out = pl.pallas_call(
        kernel,
        grid=(num_tiles, hkv),
        in_specs=[scalar] * 6 + [
            pl.BlockSpec(tables.shape, lambda p, h: (0, 0)),
            rows_spec, page_spec, page_spec],
        out_specs=rows_spec,
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps,
                                             num_stages=num_stages),
        interpret=interpret,
        name=f"ragged_paged_prefill_bs{block_size}_bq{bq}_ppb{ppb}",
    )(*sched, tables, qg, k_pages, v_pages)

    # Rows no tile wrote (outside cu_q_lens[0]..cu_q_lens[S]) are uninitialized on GPU.
    out = out[:t, :, :group].reshape(t, hq, d)
    rows = jnp.arange(t, dtype=jnp.int32)
    written = (rows >= cu[0]) & (rows < cu[num_seqs])
    return jnp.where(written[:, None, None], out, jnp.zeros_like(out))
