"""Decode attention over a paged KV cache: a Pallas kernel for NVIDIA GPUs.

Backend: Pallas' Triton lowering (``plgpu.CompilerParams``), not Mosaic GPU.

* Triton runs on Ampere and Hopper (A100, H100, H200); Mosaic GPU is
  Hopper-only.
* Paged attention reads K/V pages through a block table, i.e. gathers rows
  at data-dependent addresses. Triton loads take a tensor of pointers, so a
  gather of ``pages_per_compute_block`` pages is a single masked load.
  Mosaic GPU wants TMA/wgmma-friendly tiles (128-element multiples, 64-row
  warpgroup tiles) that do not match 16-token pages or a 7-head GQA group.
* Interpret mode of Triton-style kernels runs in seconds on CPU, Mosaic GPU
  interpret needs minutes and an abstract H100 mesh, which would blow the
  test budget. CUDA lowering of both is checked on CPU.
* The Triton backend is deprecated from JAX 0.11 on (it still works in 0.12);
  the XLA reference (``kernels_pallas.reference``) remains the fallback.

Algorithm (flash-decoding): one program per (sequence, KV head, split). The
query heads sharing a KV head (GQA group, padded to a power of two and to at
least 16 rows, the smallest Triton ``dot`` tile) form the rows of a small
matmul against ``pages_per_compute_block`` pages of K at a time, with an
online softmax in fp32. Long contexts are split over ``k_splits`` programs
per head, whose partial results a second kernel merges by log-sum-exp. The split
count is static (from the table's width); each sequence spreads its own pages over
all of them (``split_pages``), so a short context in a long table keeps every
program busy, and only the splits holding its tokens store partials, the only ones
the merge reads. A program
reads its split's page ids before the page loop (``preload_table``). The page
loop runs only over the pages a sequence uses (its bounds come from
``seq_len`` and the sliding window), and loads past ``seq_len`` are masked,
so padded rows (``seq_len == 0``) read nothing and return zeros.

A decode step calls ``paged_attention_with_write``: the same kernel also takes the
step's K/V (with q, as one array), normalises and rotates q and k first when asked
(Qwen3's q/k norm, RoPE), and the split holding the new position stores its K/V into
the pools (aliased: in place). That key joins the softmax after the page loop, from
the inputs, so no load has to wait for the store. XLA ran those as four to eight
launches per layer besides the kernel (issue 47).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.tuning import pick, target_capability

__all__ = ["paged_attention", "paged_attention_with_write", "DECODE_TUNING", "decode_tuning"]

LOG2E = math.log2(math.e)
# The m (running max) initial value: finite, so a row that has seen only
# masked (-inf) logits keeps exp2(m_old - m_new) == 1 instead of nan.
M_INIT = -1e30

# Launch settings per compute capability (most conservative row first), from compiling
# at the real models' shapes (bf16, head_dim 128, 16 query rows) for each target; the
# gpu_compile tests check every configuration the engine can pick. Seen there: 256 KV
# tokens per step with 4 warps spill on both GPUs (255 registers), with 8 warps they
# do not; 512 tokens with 3 stages needs 282752 B of shared memory (H100 allows 232448).
# ``tokens_per_step`` is pages_per_compute_block * block_size; ``programs`` is what the
# split heuristic aims for (4 waves over the SMs; it was 512 for every GPU).
# ``preload_table``: a program reads its split's block-table entries before the page loop
# (a window of MAX_TABLE_WINDOW at a time) and takes each step's page ids from those
# registers. Read inside the loop (False), the ids are a load that the K/V loads' addresses
# depend on, and Triton's pipeliner then waits for every copy in flight at the top of each
# step and issues the next step's loads after computing (``cp.async.wait_group 0`` in the
# PTX for an H200, at 2, 3 and 4 stages): a program never loads its next pages while it
# computes on these. Read before the loop, at 3 stages the next step's pages are in flight
# while it computes (``wait_group 2``), for 71.7 KB of shared memory at 64 tokens a step
# instead of 38.9.
DECODE_TUNING = {
    # A100 (108 SMs, 166912 B shared memory per block): two programs per SM with the table
    # preloaded (71.7 KB, 128 registers); four with the ids read in the loop (38.9 KB).
    80: dict(tokens_per_step=64, num_warps=4, num_stages=3, programs=432, preload_table=True),
    # H100 / H200 (132 SMs, 232448 B): timed on an H200 (2026-12-04; the sweep is in the README):
    # 64 tokens per step with 4 warps, and enough programs (1024) that a batch of 64 at a 4k
    # context splits evenly in four (528 gave three splits and an empty fourth). One sequence
    # of 530 tokens (the 30B's heads): 12.2 us against 17.8 with 128 tokens, 8 warps and 528;
    # batch 64 x 4096: 0.244 ms against 0.265 (53% of the copy bandwidth). 128 tokens with 8
    # warps was 73.8 KB, 128 registers. Those timings had the table read in the loop; the
    # preloaded table is compiled here (no spills) but not yet timed: `--only tuning` sweeps both.
    90: dict(tokens_per_step=64, num_warps=4, num_stages=3, programs=1024, preload_table=True),
}
# The most table entries a program holds at a time (one register each, spread over its
# threads): a longer split walks its pages a window at a time, the pipeline refilled at
# each (128 pages of 16 tokens are 32 steps of 64). Splitting more finely instead would
# write a partial result per split, empty ones included (the width is the model's length).
MAX_TABLE_WINDOW = 128


def decode_tuning(capability: int | None = None) -> dict:
    """The decode kernel's launch settings for a GPU (default: the one being compiled for)."""
    return pick(DECODE_TUNING, target_capability() if capability is None else capability)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def check_paged_shapes(q_heads, head_dim, k_pages, v_pages):
    """Validates the page pool against Triton's power-of-two tile rule."""
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages {k_pages.shape} != v_pages {v_pages.shape}")
    _, block_size, hkv, d = k_pages.shape
    if d != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) != of pages ({d})")
    if q_heads % hkv:
        raise ValueError(f"num q heads {q_heads} not a multiple of kv heads {hkv}")
    # Triton tiles are powers of two, and a dot needs K >= 16.
    if d != next_pow2(d) or d < 16:
        raise ValueError(f"head_dim={d} must be a power of two >= 16")
    if block_size != next_pow2(block_size):
        raise ValueError(f"block_size={block_size} must be a power of two")
    return block_size, hkv, d


def pages_per_step(pages_per_compute_block, block_size, tokens_per_step=64):
    """Pages per KV step: default ``tokens_per_step``; a power of two, >= 16 tokens."""
    ppb = pages_per_compute_block or max(1, tokens_per_step // block_size)
    if ppb != next_pow2(ppb) or ppb * block_size < 16:
        raise ValueError(f"pages_per_compute_block={ppb} must be a power of "
                         f"two with >= 16 tokens per step (block {block_size})")
    return ppb


def dot_precision(dtype):
    """fp32 inputs: IEEE fp32 dots (Triton would use TF32 by default)."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def softmax_scale_log2(sm_scale, head_dim):
    """Softmax scale with log2(e) folded in, so the kernels can use exp2."""
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    return scale * LOG2E


def online_softmax_step(q, k, v, mask, carry, scale_log2, precision):
    """One flash-attention update of (acc [M, D], m [M], l [M]), in fp32.

    q [M, D], k/v [N, D], mask [M, N] (True = attend). Logits are in log2
    units. Masked keys get -inf and contribute exactly zero.
    """
    acc, m, l = carry
    s = plgpu.dot(q, k, trans_b=True, precision=precision) * scale_log2
    s = jnp.where(mask, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    pv = plgpu.dot(p.astype(v.dtype), v, precision=precision)
    return acc * alpha[:, None] + pv, m_new, l


def normalize(acc, l):
    """acc / l, with zeros where no key was seen (l == 0)."""
    return jnp.where(l[:, None] > 0, acc / jnp.where(l > 0, l, 1.0)[:, None],
                     0.0)


def load_pages(pages_ref, page_ids, valid):
    """Masked gather of pages -> [len(page_ids) * block_size, D].

    ``valid`` [P, block_size] says which token rows to read; the others are
    not loaded (no memory traffic) and read as 0, so stale or garbage data in
    unused slots can never turn into nan via 0 * inf.
    """
    p, bs, d = page_ids.shape[0], pages_ref.shape[1], pages_ref.shape[2]
    mask = jnp.broadcast_to(valid[:, :, None], (p, bs, d))
    # Index every axis with an array (not page_ids + slices): interpret mode
    # only discharges all-slice or all-array indexers; Triton takes both.
    idx = (page_ids[:, None, None],
           jnp.arange(bs, dtype=jnp.int32)[None, :, None],
           jnp.arange(d, dtype=jnp.int32)[None, None, :])
    x = plgpu.load(pages_ref.at[idx], mask=mask, other=0.0)
    return x.reshape(p * bs, d)


def page_loop(read_ids, start, n_iter, pages_per_block, table_window, max_pages, step, carry):
    """``carry = step(page0, page_ids, carry)`` over `n_iter` compute blocks of `pages_per_block`
    pages from page `start` (`page_ids` [pages_per_block]: the block table's entries from
    page0); ``read_ids(first, n)`` reads n entries of the program's table row from page `first`.

    With `table_window` 0 each step reads its own entries, in the loop; else the entries are
    read `table_window` at a time ahead of the steps that use them (see DECODE_TUNING's
    preload_table; the table must hold `table_window` entries past the last page walked).
    `max_pages`: the most pages a program walks (static), so that one window is not a loop."""
    if not table_window:
        def body(i, carry):
            page0 = start + i * pages_per_block
            return step(page0, read_ids(page0, pages_per_block), carry)

        return lax.fori_loop(0, n_iter, body, carry)
    offs = jnp.arange(pages_per_block, dtype=jnp.int32)
    window = jnp.arange(table_window, dtype=jnp.int32)
    steps = table_window // pages_per_block

    def run_window(w, carry):
        base = start + w * table_window
        ids = read_ids(base, table_window)

        def body(i, carry):
            # Triton has no gather from registers: a select and a sum pick the step's ids.
            at = (i * pages_per_block + offs)[:, None] == window[None, :]
            return step(base + i * pages_per_block, jnp.sum(jnp.where(at, ids[None, :], 0), axis=1), carry)

        return lax.fori_loop(0, jnp.minimum(steps, n_iter - w * steps), body, carry)

    if max_pages <= table_window:   # one window holds every page
        return run_window(0, carry)
    return lax.fori_loop(0, pl.cdiv(n_iter, steps), run_window, carry)


def table_window_of(preload: bool, pages_per_block: int, max_pages: int) -> int:
    """`page_loop`'s window: 0 (ids read in the loop) unless `preload`; else a power of two (a
    Triton tile), at least a compute block, at most MAX_TABLE_WINDOW unless a block is more."""
    return max(pages_per_block, min(next_pow2(max_pages), MAX_TABLE_WINDOW)) if preload else 0


def split_pages(seq_len, splits: int, pages_per_block: int, block_size: int):
    """Pages each of a sequence's `splits` splits walks (traced): its own pages spread over all of
    them in whole compute blocks, at least one, so that a short context in a long table still
    has every split's program at work (each split a slice of the table's width left all but the
    first few idle: at batch 1 on an H100, a 530-token context in 5 of 256 splits, two steps
    each; now 9 splits of one step)."""
    blocks = pl.cdiv(pl.cdiv(seq_len, block_size), pages_per_block)
    return jnp.maximum(pl.cdiv(blocks, splits), 1) * pages_per_block


def used_splits(seq_len, splits: int, pages_per_block: int, block_size: int):
    """How many of a sequence's splits hold some of its tokens (`split_pages`); 0 for none."""
    return pl.cdiv(pl.cdiv(seq_len, block_size), split_pages(seq_len, splits, pages_per_block, block_size))


def head_rows(rows, group):
    """[R] query head of each row of this program's GQA group in [B, Hq, D]: rows 0..group-1
    are KV head h's query heads h * group..; the rows padding the group to a Triton tile
    repeat the last one (same address, same value: no mask, see `store_heads`)."""
    r = jnp.arange(rows, dtype=jnp.int32)
    return pl.program_id(1) * group + jnp.minimum(r, group - 1)


def load_rows(ref, heads, *, rope=None, norm=None, eps=0.0):
    """Rows `heads` [R] of this program's sequence in ref [B, H, D] -> [R, D]. `norm`: a
    ref [D] of RMSNorm weights (Qwen3's q/k norm), `rope`: (cos, sin) [D] of the sequence's
    position; when given, the rows are normalised then rotated (rotate-half) as the layer
    would before attending, in fp32, so that no fusion of them precedes the kernel."""
    d = ref.shape[-1]
    col = jnp.arange(d, dtype=jnp.int32)
    at = lambda c: (jnp.full((heads.shape[0], 1), pl.program_id(0), jnp.int32),  # noqa: E731
                    heads[:, None], c[None, :])
    x = plgpu.load(ref.at[at(col)])
    if rope is None and norm is None:
        return x
    dtype, half = x.dtype, d // 2
    swap = (col + half) % d                  # rotate-half reads each row with its halves swapped
    x, xs = x.astype(jnp.float32), plgpu.load(ref.at[at(swap)]).astype(jnp.float32)
    if norm is not None:                     # xs is x permuted: the same mean square
        r = lax.rsqrt(jnp.mean(x * x, axis=1, keepdims=True) + eps)
        x = x * r * plgpu.load(norm.at[(col,)]).astype(jnp.float32)[None, :]
        xs = xs * r * plgpu.load(norm.at[(swap,)]).astype(jnp.float32)[None, :]
    if rope is not None:
        cos, sin = (c.astype(jnp.float32)[None, :] for c in rope)
        x = x * cos + jnp.where(col < half, -1.0, 1.0)[None, :] * xs * sin
    return x.astype(dtype)


def store_heads(o_ref, o, group):
    """Rows 0..group-1 of this program's o [R, D] (its KV head's query heads; the rest pad the
    GQA group to a Triton tile) to query heads h * group.. of sequence b in o_ref [B, Hq, D], so
    that no slice of a padded output follows (a launch per layer). The pad rows store row
    group-1 again, its address and its value: no mask, as interpret mode stores a masked row
    back as it read it, which would race with the real write of that row."""
    rows, d = o.shape
    r = jnp.arange(rows, dtype=jnp.int32)
    last = jnp.sum(jnp.where(r[:, None] == group - 1, o, jnp.zeros_like(o)), axis=0)
    o = jnp.where(r[:, None] < group, o, last[None, :].astype(o.dtype))
    idx = (jnp.full((rows, 1), pl.program_id(0), jnp.int32), head_rows(rows, group)[:, None],
           jnp.arange(d, dtype=jnp.int32)[None, :])
    plgpu.store(o_ref.at[idx], o)


def _decode_kernel(seq_len_ref, table_ref, q_ref, *refs,
                   scale_log2, pages_per_block, pages_per_split, splits, table_window,
                   sliding_window, precision, group, rows, write, rope, qk_norm, eps):
    # With the write: where this step's K/V go, and what q and k take before attending (the
    # pools stay the last operands: hlo_bytes).
    if write:
        slot_ref, *refs = refs
    cos_ref = sin_ref = q_norm = k_norm = None
    if rope:
        cos_ref, sin_ref, *refs = refs
    if qk_norm:
        q_norm, k_norm, *refs = refs
    k_ref, v_ref, *out_refs = refs
    block_size, d = k_ref.shape[1], k_ref.shape[2]
    split = pl.program_id(2)
    seq_len = seq_len_ref[()]
    angle = (cos_ref[...], sin_ref[...]) if rope else None
    q = load_rows(q_ref, head_rows(rows, group), rope=angle, norm=q_norm, eps=eps)    # [R, D]
    if write:   # this step's K/V of (sequence, KV head) follow the query heads
        hkv = q_ref.shape[1] // (group + 2)                   # q_ref: [B, Hq + 2 * Hkv, D]
        kv_head = jnp.full((1,), pl.program_id(1), jnp.int32)
        k_new = load_rows(q_ref, group * hkv + kv_head, rope=angle, norm=k_norm, eps=eps)   # [1, D]
        v_new = load_rows(q_ref, (group + 1) * hkv + kv_head)

    lo_tok = 0 if sliding_window is None else jnp.maximum(
        seq_len - sliding_window, 0)
    # This sequence's pages spread over the splits (at most pages_per_split each: the table's
    # width over them, the static bound the table window and padding are sized for).
    my_pages = split_pages(seq_len, splits, pages_per_block, block_size)
    split_start = split * my_pages
    split_end = jnp.minimum(split_start + my_pages,
                            pl.cdiv(seq_len, block_size))
    # Start at the compute block holding the window's first page; keeping
    # page0 a multiple of pages_per_block keeps every table read in range.
    first = jnp.maximum(lo_tok // block_size - split_start, 0)
    start = split_start + first // pages_per_block * pages_per_block
    n_iter = pl.cdiv(jnp.maximum(split_end - start, 0), pages_per_block)

    offs = jnp.arange(pages_per_block, dtype=jnp.int32)
    in_page = jnp.arange(block_size, dtype=jnp.int32)

    # With the write, the new token's key is not read from its page (the store below need
    # not land before the load): it joins the softmax after the loop, from the inputs.
    last = seq_len - 1 if write else seq_len

    def step(page0, page_ids, carry):
        tok = (page0 + offs)[:, None] * block_size + in_page[None, :]
        valid = (tok < split_end * block_size) & (tok >= lo_tok)
        valid &= tok < last
        k = load_pages(k_ref, page_ids, valid)
        v = load_pages(v_ref, page_ids, valid)
        mask = jnp.broadcast_to(valid.reshape(1, -1), (rows, k.shape[0]))
        return online_softmax_step(q, k, v, mask, carry, scale_log2, precision)

    carry = (jnp.zeros((rows, d), jnp.float32),
             jnp.full((rows,), M_INIT, jnp.float32),
             jnp.zeros((rows,), jnp.float32))
    acc, m, l = page_loop(lambda first, n: table_ref[pl.ds(first, n)], start, n_iter, pages_per_block,
                          table_window, pages_per_split, step, carry)

    if write:
        *out_refs, ko_ref, vo_ref = out_refs
        # The split holding the new position (padded rows, seq_len 0, have none).
        mine = (seq_len > 0) & (last // (my_pages * block_size) == split)
        s_new = jnp.sum(q.astype(jnp.float32) * k_new.astype(jnp.float32), axis=1) * scale_log2
        s_new = jnp.where(mine, s_new, -jnp.inf)                        # [R]
        m_new = jnp.maximum(m, s_new)
        alpha, p = jnp.exp2(m - m_new), jnp.exp2(s_new - m_new)
        acc = acc * alpha[:, None] + p[:, None] * v_new.astype(jnp.float32)
        m, l = m_new, l * alpha + p

        @pl.when(mine)
        def _():
            slot = slot_ref[()]
            idx = (jnp.full((1, d), slot // block_size, jnp.int32), jnp.full((1, d), slot % block_size, jnp.int32),
                   jnp.arange(d, dtype=jnp.int32)[None, :])
            plgpu.store(ko_ref.at[idx], k_new.astype(ko_ref.dtype))
            plgpu.store(vo_ref.at[idx], v_new.astype(vo_ref.dtype))

    if len(out_refs) == 1:           # single split: final output directly
        (o_ref,) = out_refs
        store_heads(o_ref, normalize(acc, l).astype(o_ref.dtype), group)
    else:                            # partial results for the LSE merge
        o_ref, m_ref, l_ref = out_refs

        # Only a split that holds some of the sequence's tokens: the merge reads no other
        # (a short context in a long table leaves most splits empty, their partials bytes
        # written and read for nothing).
        @pl.when(split < used_splits(seq_len, splits, pages_per_block, block_size))
        def _():
            o_ref[...] = acc
            m_ref[...] = m
            l_ref[...] = l


def default_k_splits(batch, kv_heads, num_compute_blocks, programs=512):
    """Splits so that batch * kv_heads * splits reaches ``programs`` (a few waves
    over the GPU), keeping at least two compute blocks per split of the table's width
    (a shorter sequence spreads its own over them: ``split_pages``)."""
    want = pl.cdiv(programs, batch * kv_heads)
    return max(1, min(want, num_compute_blocks // 2))


def _merge_kernel(*refs, chunk, group, paged):
    """One (sequence, KV head): the log-sum-exp merge of its splits' partials, `chunk`
    splits at a time (an online merge: the running max moves as chunks come in). With
    `paged` = (pages_per_block, block_size), only the splits that hold some of the sequence's
    tokens (`used_splits`): the decode kernel stores nothing for the others, so theirs are
    never read (masked in the last chunk)."""
    seq_len_ref, acc_ref, m_ref, l_ref, o_ref = refs if paged else (None, *refs)
    splits, rows, d = acc_ref.shape
    used = splits if seq_len_ref is None else used_splits(seq_len_ref[()], splits, *paged)

    def body(i, carry):
        acc, m, l = carry
        part = pl.ds(i * chunk, chunk)
        live = i * chunk + jnp.arange(chunk, dtype=jnp.int32) < used
        m_c = jnp.where(live[:, None], m_ref[part, :], M_INIT)
        l_c = jnp.where(live[:, None], l_ref[part, :], 0.0)
        acc_c = jnp.where(live[:, None, None], acc_ref[part, :, :], 0.0)
        m_new = jnp.maximum(m, jnp.max(m_c, axis=0))
        alpha = jnp.exp2(m - m_new)
        w = jnp.exp2(m_c - m_new[None, :])                   # [chunk, rows]
        l = l * alpha + jnp.sum(w * l_c, axis=0)
        acc = acc * alpha[:, None] + jnp.sum(w[:, :, None] * acc_c, axis=0)
        return acc, m_new, l

    carry = (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), M_INIT, jnp.float32),
             jnp.zeros((rows,), jnp.float32))
    acc, _, l = lax.fori_loop(0, pl.cdiv(used, chunk), body, carry)
    store_heads(o_ref, normalize(acc, l).astype(o_ref.dtype), group)


def merge_splits_kernel(acc, m, l, group, out_dtype, *, seq_lens=None, pages_per_block=None, block_size=None,
                        interpret=False, num_warps=8):
    """``merge_splits`` as one launch (XLA makes three reductions of it and a convert, a
    launch each, per layer of a decode step): partials acc [K, B, H, R, D], m and l
    [K, B, H, R] (K a power of two; splits with l == 0 add nothing; rows past `group` are
    GQA padding) -> [B, H * group, D], query head h * group + r from row r of KV head h.
    With `seq_lens` [B] and the decode kernel's `pages_per_block` and `block_size`: only the
    splits that hold some of each sequence's tokens are read (`used_splits`; the others may
    hold anything). 8 warps: with 4, jax 0.12.1's Triton and CUDA 13's ptxas spill (48 registers,
    8 bytes of stack, Qwen3's thinker at batch 64 on an H200); with 2 or 8 nothing does."""
    splits, batch, heads, rows, d = acc.shape
    chunk = min(splits, 8)
    part = lambda *tail: pl.BlockSpec((splits, None, None) + tail,  # noqa: E731
                                      lambda b, h: (0, b, h) + (0,) * len(tail))
    in_specs, args = [part(rows, d), part(rows), part(rows)], [acc, m, l]
    paged = None
    if seq_lens is not None:
        paged = (pages_per_block, block_size)
        in_specs.insert(0, pl.BlockSpec((None,), lambda b, h: (b,)))
        args.insert(0, seq_lens.astype(jnp.int32))
    return pl.pallas_call(
        functools.partial(_merge_kernel, chunk=chunk, group=group, paged=paged),
        grid=(batch, heads),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((batch, heads * group, d), lambda b, h: (0, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((batch, heads * group, d), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=f"decode_merge_k{splits}",
    )(*args)


def merge_splits(acc, m, l):
    """Log-sum-exp merge of split partials [K, ...] -> normalized output (the XLA reference
    of ``merge_splits_kernel``)."""
    m_max = jnp.max(m, axis=0)
    w = jnp.exp2(m - m_max[None])                           # [K, ...]
    denom = jnp.sum(w * l, axis=0)
    num = jnp.sum(w[..., None] * acc, axis=0)
    safe = jnp.where(denom > 0, denom, 1.0)[..., None]
    return jnp.where(denom[..., None] > 0, num / safe, 0.0)


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "interpret",
                     "pages_per_compute_block", "k_splits", "num_warps",
                     "num_stages", "preload_table"))
def paged_attention(q, k_pages, v_pages, block_tables, seq_lens, *,
                    sm_scale=None, sliding_window=None, interpret=False,
                    pages_per_compute_block=None, k_splits=None,
                    num_warps=None, num_stages=None, preload_table=None):
    """Decode attention: one query token per sequence over paged K/V.

    q: [B, Hq, D] (the token at position seq_lens[b] - 1); k_pages/v_pages:
    [num_blocks, block_size, Hkv, D] (block 0 = dummy); block_tables: int32
    [B, max_blocks] padded with 0; seq_lens: int32 [B], 0 for padded rows
    (output zeros). ``sliding_window=w`` attends to the last w positions.
    Tuning: ``pages_per_compute_block`` (default: the table's tokens per step),
    ``k_splits`` (default: see ``default_k_splits``), Triton ``num_warps``
    and ``num_stages``, ``preload_table``; unset ones come from ``DECODE_TUNING``
    for the GPU being compiled for. Returns [B, Hq, D] in q's dtype.
    """
    return _decode(q, k_pages, v_pages, block_tables, seq_lens, None, sm_scale=sm_scale,
                   sliding_window=sliding_window, interpret=interpret,
                   pages_per_compute_block=pages_per_compute_block, k_splits=k_splits,
                   num_warps=num_warps, num_stages=num_stages, preload_table=preload_table)


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "norm_eps", "interpret",
                     "pages_per_compute_block", "k_splits", "num_warps",
                     "num_stages", "preload_table"))
def paged_attention_with_write(q, k_new, v_new, k_pages, v_pages, slot_mapping, block_tables,
                               seq_lens, *, rope=None, qk_norm=None, norm_eps=1e-6, sm_scale=None,
                               sliding_window=None, interpret=False, pages_per_compute_block=None,
                               k_splits=None, num_warps=None, num_stages=None, preload_table=None):
    """``write_kv_pages`` of this step's K/V, then ``paged_attention``, in one launch (the KV
    write is two to four launches per layer otherwise). k_new/v_new: [B, Hkv, D], stored at
    slot_mapping[b], which must be the slot of position seq_lens[b] - 1 through
    block_tables[b] (as the engine's decode steps make it); rows with seq_len 0 store
    nothing. The pages are updated in place (aliased). Returns (out, k_pages, v_pages).

    What the layer does to q and k before attending, done here instead (the fusions that do
    it are launches of their own): ``qk_norm`` = (q weight, k weight) [D], a per-head
    RMSNorm (eps ``norm_eps``), then ``rope`` = (cos, sin) [B, D], the rotary embedding of
    each sequence's position (rotate-half); ``reference.prepare_qk`` is their reference."""
    return _decode(q, k_pages, v_pages, block_tables, seq_lens, (slot_mapping, k_new, v_new, rope, qk_norm),
                   sm_scale=sm_scale, sliding_window=sliding_window, interpret=interpret, eps=norm_eps,
                   pages_per_compute_block=pages_per_compute_block, k_splits=k_splits,
                   num_warps=num_warps, num_stages=num_stages, preload_table=preload_table)


def _decode(q, k_pages, v_pages, block_tables, seq_lens, new_kv, *, sm_scale, sliding_window,
            interpret, pages_per_compute_block, k_splits, num_warps, num_stages, preload_table, eps=0.0):
    tune = decode_tuning()
    num_warps = num_warps or tune["num_warps"]
    num_stages = num_stages or tune["num_stages"]
    preload = tune["preload_table"] if preload_table is None else preload_table
    batch, hq, head_dim = q.shape
    block_size, hkv, d = check_paged_shapes(hq, head_dim, k_pages, v_pages)
    num_blocks = k_pages.shape[0]
    group = hq // hkv
    # >= 16 rows: the smallest M of a Triton dot; power of two: Triton tiles.
    rows = max(16, next_pow2(group))

    ppb = pages_per_step(pages_per_compute_block, block_size, tune["tokens_per_step"])
    width = block_tables.shape[1]
    num_compute_blocks = pl.cdiv(width, ppb)
    splits = k_splits or default_k_splits(batch, hkv, num_compute_blocks, tune["programs"])
    splits = max(1, min(splits, num_compute_blocks))
    pages_per_split = pl.cdiv(num_compute_blocks, splits) * ppb
    splits = pl.cdiv(width, pages_per_split)     # drop splits with no pages
    if splits > 1:   # a power of two for the merge kernel's tiles; the extra splits read nothing
        splits = next_pow2(splits)
    table_window = table_window_of(preload, ppb, pages_per_split)
    # Pad the table so every compute block (and the last window of the last split) reads in
    # range (entries -> dummy).
    pad = splits * pages_per_split + table_window - width
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, pad)))

    write = new_kv is not None
    slot_mapping, k_new, v_new, rope, qk_norm = new_kv if write else (None,) * 5
    kernel = functools.partial(
        _decode_kernel, scale_log2=softmax_scale_log2(sm_scale, d),
        pages_per_block=ppb, pages_per_split=pages_per_split, splits=splits, table_window=table_window,
        sliding_window=sliding_window, precision=dot_precision(q.dtype), group=group, rows=rows,
        write=write, rope=rope is not None, qk_norm=qk_norm is not None, eps=eps)
    page_spec = pl.BlockSpec((num_blocks, block_size, None, d),
                             lambda b, h, s: (0, 0, h, 0))
    per_seq = pl.BlockSpec((None,), lambda b, h, s: (b,))
    heads = q
    if write:   # one array, so that the projections' epilogue before the kernel is one fusion
        heads = jnp.concatenate([q, k_new, v_new], axis=1)
    in_specs = [
        per_seq,                                                      # seq_len
        pl.BlockSpec((None, tables.shape[1]), lambda b, h, s: (b, 0)),  # table
        pl.BlockSpec(heads.shape, lambda b, h, s: (0, 0, 0)),         # q (k, v), rows gathered
    ]
    args = [seq_lens.astype(jnp.int32), tables, heads]
    if write:
        in_specs.append(per_seq)                                      # slot
        args.append(slot_mapping.astype(jnp.int32))
    if rope is not None:                                              # cos, sin [B, D]
        in_specs += [pl.BlockSpec((None, d), lambda b, h, s: (b, 0))] * 2
        args += list(rope)
    if qk_norm is not None:                                           # weights [D]
        in_specs += [pl.BlockSpec((d,), lambda b, h, s: (0,))] * 2
        args += list(qk_norm)
    in_specs += [page_spec, page_spec]
    args += [k_pages, v_pages]
    if splits == 1:
        out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
        out_specs = [pl.BlockSpec(q.shape, lambda b, h, s: (0, 0, 0))]
    else:
        part = (splits, batch, hkv, rows)
        out_shape = [jax.ShapeDtypeStruct(part + (d,), jnp.float32),
                     jax.ShapeDtypeStruct(part, jnp.float32),
                     jax.ShapeDtypeStruct(part, jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, None, rows, d),
                                  lambda b, h, s: (s, b, h, 0, 0)),
                     pl.BlockSpec((None, None, None, rows),
                                  lambda b, h, s: (s, b, h, 0)),
                     pl.BlockSpec((None, None, None, rows),
                                  lambda b, h, s: (s, b, h, 0))]
    aliases = {}
    if write:
        aliases = {len(args) - 2: len(out_shape), len(args) - 1: len(out_shape) + 1}
        out_shape += [jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                      jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)]
        out_specs += [page_spec, page_spec]
    out = pl.pallas_call(
        kernel,
        grid=(batch, hkv, splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps,
                                             num_stages=num_stages),
        interpret=interpret,
        name=f"paged_decode_bs{block_size}_ppb{ppb}_k{splits}" + ("_write" if write else ""),
    )(*args)

    attn = out[0] if splits == 1 else merge_splits_kernel(*out[:3], group, q.dtype, seq_lens=seq_lens,
                                                          pages_per_block=ppb, block_size=block_size,
                                                          interpret=interpret)
    return (attn, *out[-2:]) if write else attn
