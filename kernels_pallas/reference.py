"""Pure-JAX (XLA) references for the paged-attention kernels.

These functions have the same signatures as the Pallas kernels and are the
attention backend of the serving engine on CPU (tests, demo), so they are
vectorised and jit-friendly: static shapes, no Python loops over sequences.
Products accumulate in fp32 and the softmax runs in fp32; outputs are cast
back to q's dtype.

Conventions shared with the kernels:

* pages are ``[num_blocks, block_size, num_kv_heads, head_dim]``; block 0 is a
  reserved dummy block, block tables are padded with 0; here they may also be
  uint16 pages holding bf16 bits, as the engine stores a bf16 cache for this
  backend (``kv_update.page_dtype``);
* a query at absolute position ``p`` attends to key positions ``0..p``, or,
  with ``sliding_window=w``, to ``max(0, p - w + 1)..p`` (exactly ``w``
  tokens including itself);
* a query that sees no key (padded rows, ``seq_len == 0``) returns zeros.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

# The production KV write already is plain XLA (a scatter), so the reference
# is the same function; see kv_update.py for why no kernel is used.
from kernels_pallas.kv_update import page_values, write_kv_pages

__all__ = ["paged_attention", "paged_attention_with_write", "ragged_paged_attention", "write_kv_pages",
           "write_then", "prepare_qk", "apply_rope", "rms_norm", "route_top_k", "rank_pairs", "expert_counts",
           "moe_route"]

# HIGHEST: fp32 inputs get true fp32 products on GPU too (XLA would use TF32
# otherwise); for bf16 inputs it changes nothing.
_PRECISION = lax.Precision.HIGHEST


def _scale(sm_scale, head_dim):
    return 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)


def _block_diagonal(q):
    """[N, Hkv, G, D] -> [N, Hkv*G, Hkv*D], zero outside each head's own D columns.

    Scoring these rows against keys laid out [L, Hkv*D] (the page layout, as is)
    gives every head its own scores in one plain matmul per unit. The Hkv-fold
    extra products are cheaper on CPU than the transposes that a per-head
    batched matmul needs.
    """
    n, hkv, g, d = q.shape
    eye = jnp.eye(hkv, dtype=bool)
    return jnp.where(eye[None, :, None, :, None], q[:, :, :, None, :],
                     jnp.zeros((), q.dtype)).reshape(n, hkv * g, hkv * d)


def _gather_pages(pages, blocks):
    """`pages[blocks]` as values (`BF16_BITS` pages are gathered as bits, then read as bf16)."""
    return page_values(pages[blocks])


def _attend(q, k_pages, v_pages, tables, pos, sliding_window, sm_scale,
            span, units):
    """Attention of N query rows, each over its own block-table row.

    q [N, Hkv, G, D]; tables int32 [N, W]; pos int32 [N]: the row's absolute
    position (it sees keys ``lo..pos``, lo from the window; -1 sees nothing).
    Each row's pages are cut into units of ``span`` consecutive pages, the
    units of all rows are laid end to end (row 0's, then row 1's, ...), and
    each loop step takes ``units`` of them, whichever rows they belong to.
    Each step's partial softmax is merged into its rows' running (max, sum,
    acc) by scatter. So the cost is the pages actually needed (rounded up to
    the span): not the table width, and not the longest row times the batch.
    Returns fp32 [N, Hkv, G, D].
    """
    n, hkv, g, d = q.shape
    bs = k_pages.shape[1]
    width = tables.shape[1]
    keys = span * bs
    lo = jnp.zeros_like(pos)
    if sliding_window is not None:
        lo = jnp.maximum(pos - sliding_window + 1, 0)
    first = lo // bs
    count = jnp.where(pos >= 0, (pos // bs - first + span) // span, 0)
    end = jnp.cumsum(count)                       # row r owns units [end[r] - count[r], end[r])
    start = end - count
    total = end[-1]
    qbd = _block_diagonal(q)
    eye = jnp.eye(hkv, dtype=bool)

    def body(j, carry):
        acc, m, l = carry
        u = units
        idx = j * u + jnp.arange(u, dtype=jnp.int32)
        live = idx < total
        # compare_all: one [U, N] compare, instead of a binary-search loop.
        row = jnp.minimum(jnp.searchsorted(end, idx, side="right", method="compare_all"),
                          n - 1).astype(jnp.int32)
        page = (first[row] + (idx - start[row]) * span)[:, None] + jnp.arange(span, dtype=jnp.int32)
        blocks = jnp.take_along_axis(tables[row], jnp.clip(page, 0, width - 1), axis=1)
        blocks = jnp.where(live[:, None], blocks, 0)
        k = _gather_pages(k_pages, blocks).reshape(u, keys, hkv * d)
        v = _gather_pages(v_pages, blocks).reshape(u, keys, hkv * d)
        kpos = (page[:, :, None] * bs + jnp.arange(bs, dtype=jnp.int32)).reshape(u, keys)
        mask = live[:, None] & (kpos <= pos[row][:, None]) & (kpos >= lo[row][:, None])
        s = jnp.einsum("uqe,uke->uqk", qbd[row], k, precision=_PRECISION,
                       preferred_element_type=jnp.float32).reshape(u, hkv, g, keys) * sm_scale
        s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
        m_unit = jnp.max(s, axis=-1)               # [U, Hkv, G]
        # A unit with nothing visible keeps m = -inf; shift by 0 instead, so
        # no exp(-inf - -inf) = nan appears.
        p = jnp.exp(s - jnp.where(jnp.isfinite(m_unit), m_unit, 0.0)[..., None])
        # Unused slots (dummy block, stale tail of a last page) may hold any
        # bits; zero them so 0 * nan cannot reach the output.
        v = jnp.where(mask[:, :, None], v, jnp.zeros((), v.dtype))
        # Probabilities in v's dtype with fp32 accumulation, as in the
        # kernels and any fast GPU attention: also a fair XLA baseline.
        pv = jnp.einsum("uqk,uke->uqe", p.astype(v.dtype).reshape(u, hkv * g, keys), v,
                        precision=_PRECISION, preferred_element_type=jnp.float32)
        # Each head keeps its own D columns of the product.
        pv = jnp.sum(jnp.where(eye[None, :, None, :, None], pv.reshape(u, hkv, g, hkv, d), 0.0), axis=3)
        # Merge the units into their rows (a row may span several units of
        # this step; scatters combine duplicates).
        m_new = m.at[row].max(m_unit)
        shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        alpha = jnp.exp(m - shift)
        w = jnp.exp(m_unit - shift[row])
        acc = acc * alpha[..., None] + jnp.zeros_like(acc).at[row].add(pv * w[..., None])
        l = l * alpha + jnp.zeros_like(l).at[row].add(jnp.sum(p, axis=-1) * w)
        return acc, m_new, l

    carry = (jnp.zeros((n, hkv, g, d), jnp.float32),
             jnp.full((n, hkv, g), -jnp.inf, jnp.float32),
             jnp.zeros((n, hkv, g), jnp.float32))
    acc, _, l = lax.fori_loop(0, (total + units - 1) // units, body, carry)
    safe = jnp.where(l > 0, l, 1.0)[..., None]
    return jnp.where(l[..., None] > 0, acc / safe, 0.0)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window",
                                             "step_tokens"))
def paged_attention(q, k_pages, v_pages, block_tables, seq_lens, *,
                    sm_scale=None, sliding_window=None, interpret=False,
                    step_tokens=None, **tuning):
    """Decode attention over paged K/V (XLA reference of the Pallas kernel).

    q: [B, Hq, D], the token at position ``seq_lens[b] - 1`` of each sequence.
    k_pages/v_pages: [num_blocks, block_size, Hkv, D]. block_tables: int32
    [B, max_blocks]. seq_lens: int32 [B] (0 for padded rows -> zeros).
    ``step_tokens``: keys per online-softmax step, over all rows together
    (default: 8 pages per row of the batch, 8 to 128 pages: measured on CPU).
    ``interpret`` and other tuning kwargs are accepted for signature parity
    and ignored. Returns [B, Hq, D] in q's dtype.
    """
    del interpret, tuning
    b, hq, d = q.shape
    bs, hkv = k_pages.shape[1], k_pages.shape[2]
    if step_tokens is None:
        pages = min(128, max(8, 8 * b))
    else:
        pages = max(1, step_tokens // bs)
    # Two pages per unit: one matmul then covers 2 * block_size keys (measured on CPU).
    span = min(2, pages)
    out = _attend(q.reshape(b, hkv, hq // hkv, d), k_pages, v_pages,
                  block_tables.astype(jnp.int32),
                  seq_lens.astype(jnp.int32) - 1, sliding_window,
                  _scale(sm_scale, d), span, max(1, pages // span))
    return out.reshape(b, hq, d).astype(q.dtype)


def apply_rope(x, cos, sin):
    """Rotate x [T, heads, D] by cos/sin [T, D] (rotate-half: the Qwen decoders' rotary embedding)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def prepare_qk(q, k, rope=None, qk_norm=None, norm_eps=1e-6):
    """q [T, Hq, D] and k [T, Hkv, D] as a decoder layer attends with them: every head
    RMS-normed when ``qk_norm`` = (q weight, k weight) [D] is given (Qwen3), then rotated by
    ``rope`` = (cos, sin) [T, D] when given (what the Pallas decode kernel does in-kernel)."""
    if qk_norm is not None:
        q, k = rms_norm(q, qk_norm[0], eps=norm_eps), rms_norm(k, qk_norm[1], eps=norm_eps)
    if rope is not None:
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    return q, k


def write_then(paged_attention):
    """``paged_attention_with_write`` for a backend without a kernel that does it all:
    ``prepare_qk``, ``write_kv_pages`` of the step's K/V, then ``paged_attention``."""

    def paged_attention_with_write(q, k_new, v_new, k_pages, v_pages, slot_mapping, block_tables,
                                   seq_lens, *, rope=None, qk_norm=None, norm_eps=1e-6, **kwargs):
        q, k_new = prepare_qk(q, k_new, rope, qk_norm, norm_eps)
        k_pages, v_pages = write_kv_pages(k_pages, v_pages, k_new, v_new, slot_mapping)
        return paged_attention(q, k_pages, v_pages, block_tables, seq_lens, **kwargs), k_pages, v_pages

    return paged_attention_with_write


paged_attention_with_write = write_then(paged_attention)


def _attend_block(q, k_pages, v_pages, tables, seq, pos, seq_lo, seq_hi,
                  sliding_window, sm_scale, step_tokens):
    """Attention of a block of C packed query rows spanning sequences seq_lo..seq_hi.

    q [C, Hkv, G, D]; seq/pos int32 [C] (pos -1: padding). For each sequence
    in the block the keys are gathered once, through that sequence's table row,
    and scored against all C rows as one matmul; rows of other sequences are
    masked. Rows of one sequence are contiguous, so a block of a long prefill
    chunk costs one pass over its keys. Returns fp32 [C, Hkv, G, D].
    """
    c, hkv, g, d = q.shape
    bs = k_pages.shape[1]
    pages = max(1, min(step_tokens // bs, tables.shape[1]))
    tables = jnp.pad(tables, ((0, 0), (0, -tables.shape[1] % pages)))
    step = pages * bs
    lo = jnp.zeros_like(pos)
    if sliding_window is not None:
        lo = jnp.maximum(pos - sliding_window + 1, 0)

    def per_seq(s_idx, carry):
        mine = (seq == s_idx) & (pos >= 0)
        top = jnp.max(jnp.where(mine, pos, -1))
        bottom = jnp.min(jnp.where(mine, lo, jnp.iinfo(jnp.int32).max))
        row = tables[s_idx]

        def per_step(j, carry):
            acc, m, l = carry
            cols = lax.dynamic_slice_in_dim(row, j * pages, pages)
            k = _gather_pages(k_pages, cols).reshape(step, hkv, d)
            v = _gather_pages(v_pages, cols).reshape(step, hkv, d)
            kpos = j * step + jnp.arange(step, dtype=jnp.int32)
            mask = (mine[:, None] & (kpos[None, :] <= pos[:, None])
                    & (kpos[None, :] >= lo[:, None]))          # [C, step]
            sc = jnp.einsum("ckgd,lkd->ckgl", q, k, precision=_PRECISION,
                            preferred_element_type=jnp.float32) * sm_scale
            sc = jnp.where(mask[:, None, None, :], sc, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
            shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            alpha = jnp.exp(m - shift)
            p = jnp.exp(sc - shift[..., None])
            # Slots past a sequence's end may hold any bits: never let 0 * nan in.
            kv_ok = kpos <= top
            v = jnp.where(kv_ok[:, None, None], v, jnp.zeros((), v.dtype))
            pv = jnp.einsum("ckgl,lkd->ckgd", p.astype(v.dtype), v,
                            precision=_PRECISION,
                            preferred_element_type=jnp.float32)
            return (acc * alpha[..., None] + pv, m_new,
                    l * alpha + jnp.sum(p, axis=-1))

        first = jnp.where(top >= 0, bottom // step, 0)
        last = jnp.where(top >= 0, top // step + 1, 0)
        return lax.fori_loop(first, last, per_step, carry)

    carry = (jnp.zeros((c, hkv, g, d), jnp.float32),
             jnp.full((c, hkv, g), -jnp.inf, jnp.float32),
             jnp.zeros((c, hkv, g), jnp.float32))
    acc, _, l = lax.fori_loop(seq_lo, seq_hi + 1, per_seq, carry)
    safe = jnp.where(l > 0, l, 1.0)[..., None]
    return jnp.where(l[..., None] > 0, acc / safe, 0.0)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window",
                                             "token_chunk", "step_tokens"))
def ragged_paged_attention(q, k_pages, v_pages, block_tables, kv_lens,
                           cu_q_lens, *, sm_scale=None, sliding_window=None,
                           interpret=False, token_chunk=64, step_tokens=64,
                           **tuning):
    """Causal attention for a packed batch of prefill chunks (XLA reference).

    q: [T, Hq, D] packed query rows; sequence s owns rows
    ``cu_q_lens[s]:cu_q_lens[s+1]`` and ``kv_lens[s]`` = cached + new tokens
    (new K/V already in the pages). Row i of sequence s sits at absolute
    position ``kv_lens[s] - q_len_s + i``. Rows before ``cu_q_lens[0]`` or
    at or past ``cu_q_lens[S]`` return zeros. Rows are processed
    ``token_chunk`` at a time; within a block, each sequence present gathers
    its pages once (``step_tokens`` keys per step) and scores all the block's
    rows in one matmul, so cost is (sequences per block) x block x context.
    The defaults were the fastest on CPU for both short and long chunks (small
    key steps waste less of the causal triangle). Many one-row sequences in a
    step are better served by :func:`paged_attention` (the attention layer
    sends a mixed step's decodes there). Returns [T, Hq, D] in q's dtype.
    """
    del interpret, tuning
    t, hq, d = q.shape
    s = kv_lens.shape[0]
    hkv = k_pages.shape[2]
    g = hq // hkv
    cu = cu_q_lens.astype(jnp.int32)
    kv_lens = kv_lens.astype(jnp.int32)
    rows = jnp.arange(t, dtype=jnp.int32)
    # Row -> sequence: the last s with cu[s] <= row. Rows outside cu[0]..cu[S]
    # get an index clamped into range and position -1 (they see nothing).
    seq = jnp.clip(jnp.searchsorted(cu, rows, side="right") - 1, 0, s - 1)
    pos = kv_lens[seq] - (cu[seq + 1] - cu[seq]) + (rows - cu[seq])
    pos = jnp.where((rows >= cu[0]) & (rows < cu[s]), pos, -1)

    chunk = max(1, min(int(token_chunk), t))
    pad = -t % chunk
    n = (t + pad) // chunk
    qp = jnp.pad(q.reshape(t, hkv, g, d), ((0, pad), (0, 0), (0, 0), (0, 0)))
    seqp = jnp.pad(seq, (0, pad), constant_values=s - 1).reshape(n, chunk)
    posp = jnp.pad(pos, (0, pad), constant_values=-1).reshape(n, chunk)
    tables = block_tables.astype(jnp.int32)
    scale = _scale(sm_scale, d)

    def one_block(args):
        qc, sc, pc = args
        valid = pc >= 0
        lo_s = jnp.min(jnp.where(valid, sc, s))
        hi_s = jnp.max(jnp.where(valid, sc, -1))
        return _attend_block(qc, k_pages, v_pages, tables, sc, pc, lo_s, hi_s,
                             sliding_window, scale, step_tokens)

    out = lax.map(one_block, (qp.reshape(n, chunk, hkv, g, d), seqp, posp))
    return out.reshape(t + pad, hq, d)[:t].astype(q.dtype)


def rms_norm(x, weight, delta=None, *, eps: float):
    """RMSNorm over the last axis (fp32 statistics, as transformers), of x + delta when an
    addend is given: normed, or (normed, x + delta). The Pallas kernel's reference
    (``rms_norm.py``) and the norm of every backend but the GPU's."""
    if delta is not None:
        x = x + delta
    x32 = x.astype(jnp.float32)
    var = jnp.mean(x32 * x32, axis=-1, keepdims=True)
    y = weight.astype(x.dtype) * (x32 * jnp.reciprocal(jnp.sqrt(var + eps))).astype(x.dtype)
    return y if delta is None else (y, x)


def route_top_k(router_logits, top_k: int, norm_topk_prob: bool):
    """MoE routing (transformers' Qwen3-MoE router): softmax in fp32 over all experts, the
    top k (the lowest id among ties), renormalised over the k when ``norm_topk_prob``:
    logits [T, E] -> (weights [T, k] fp32, experts [T, k] int32)."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def rank_pairs(flat_experts, num_experts: int):
    """Stable order of token-expert pairs by expert, by comparing every pair with every other:
    (position [P]: pair p's row in expert order, group_sizes [E]); ids >= E (pairs of no
    expert) sort last and are counted nowhere. For a decode step's few pairs."""
    p = flat_experts.shape[0]
    e = flat_experts.astype(jnp.int32)
    idx = jnp.arange(p, dtype=jnp.int32)
    before = (e[None, :] < e[:, None]) | ((e[None, :] == e[:, None]) & (idx[None, :] < idx[:, None]))
    # Counted apart from the ranks: one reduction of both came out a kernel less but a copy
    # more on a GPU (the custom call takes the sizes as a buffer of their own).
    return jnp.sum(before, axis=1, dtype=jnp.int32), expert_counts(e, num_experts)


def expert_counts(flat_experts, num_experts: int):
    """[E] int32: the pairs routed to each expert (ids >= E are counted nowhere)."""
    return jnp.sum(flat_experts[None, :] == jnp.arange(num_experts, dtype=jnp.int32)[:, None], axis=1,
                   dtype=jnp.int32)


def moe_route(router_logits, valid, *, top_k: int, norm_topk_prob: bool, **tuning):
    """The Pallas ``moe_route``'s reference: ``route_top_k``, then ``rank_pairs`` of the
    pairs with those of invalid tokens (bucket padding) given to no expert: (weights [T, k],
    position [T, k], group_sizes [E])."""
    del tuning
    t, num_experts = router_logits.shape
    weights, experts = route_top_k(router_logits, top_k, norm_topk_prob)
    experts = jnp.where(valid[:, None], experts, num_experts)
    position, group_sizes = rank_pairs(experts.reshape(-1), num_experts)
    return weights, position.reshape(t, top_k), group_sizes
