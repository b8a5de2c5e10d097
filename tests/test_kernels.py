"""Paged-attention kernels in Pallas interpret mode against the XLA references,
and the references against a naive float64 numpy attention.

Every pool has NaN in the dummy block 0 and in the unused tail of each
sequence's last page, so a kernel that reads (or fails to mask) a slot past
a sequence's length produces NaN and fails.
"""
from __future__ import annotations

import functools
import importlib
import os
import re

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import page_dtype, reference, write_kv_pages
from kernels_pallas.kv_update import BF16_BITS
from kernels_pallas.paged_attention import paged_attention
from kernels_pallas.ragged_paged_attention import ragged_paged_attention

pytestmark = pytest.mark.kernels

F32, BF16 = jnp.float32, jnp.bfloat16
TOL = {F32: 1e-5, BF16: 2e-2}


# ---------------------------------------------------------------- fixtures


def make_cache(seed, kv_lens, hkv, d, bs, dtype, width=None, spare=3):
    """Random pages + block tables for sequences of the given KV lengths.

    Blocks are handed out in random order from 1..; block 0 and every slot
    past a sequence's length hold NaN. Returns (k_pages, v_pages, tables).
    """
    rng = np.random.default_rng(seed)
    need = [-(-n // bs) for n in kv_lens]
    width = width or max(max(need), 1)
    num_blocks = 1 + sum(need) + spare
    k = rng.standard_normal((num_blocks, bs, hkv, d)).astype(np.float32)
    v = rng.standard_normal((num_blocks, bs, hkv, d)).astype(np.float32)
    k[0] = v[0] = np.nan
    ids = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((len(kv_lens), width), np.int32)
    used = 0
    for s, (n, p) in enumerate(zip(kv_lens, need)):
        tables[s, :p] = ids[used:used + p]
        used += p
        if n % bs:
            k[tables[s, p - 1], n % bs:] = np.nan
            v[tables[s, p - 1], n % bs:] = np.nan
    return (jnp.asarray(k, dtype), jnp.asarray(v, dtype),
            jnp.asarray(tables))


def make_q(seed, rows, hq, d, dtype):
    rng = np.random.default_rng(seed + 1000)
    return jnp.asarray(rng.standard_normal((rows, hq, d)), dtype)


def dense_kv(pages, table, n):
    """[n, Hkv, D] float64 keys of one sequence, read page by page."""
    pages = np.asarray(pages.astype(F32), np.float64)
    bs = pages.shape[1]
    rows = [pages[b] for b in table[:-(-n // bs)]] or [pages[0, :0]]
    return np.concatenate(rows)[:n]


def naive_attention(q, k, v, scale):
    """q [Hq, D] at one position over k/v [L, Hkv, D], float64."""
    if len(k) == 0:
        return np.zeros_like(q)
    group = q.shape[0] // k.shape[1]
    kh = np.repeat(k, group, axis=1)                  # [L, Hq, D]
    vh = np.repeat(v, group, axis=1)
    logits = np.einsum("hd,lhd->hl", q, kh) * scale
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hl,lhd->hd", p, vh)


def naive_decode(q, k_pages, v_pages, tables, seq_lens, window=None):
    q = np.asarray(q.astype(F32), np.float64)
    tables = np.asarray(tables)
    out = np.zeros_like(q)
    for b, n in enumerate(np.asarray(seq_lens)):
        lo = 0 if window is None else max(0, n - window)
        k = dense_kv(k_pages, tables[b], n)[lo:]
        v = dense_kv(v_pages, tables[b], n)[lo:]
        out[b] = naive_attention(q[b], k, v, q.shape[-1] ** -0.5)
    return out


def naive_ragged(q, k_pages, v_pages, tables, kv_lens, cu, window=None):
    q = np.asarray(q.astype(F32), np.float64)
    tables, cu = np.asarray(tables), np.asarray(cu)
    out = np.zeros_like(q)
    for s, n in enumerate(np.asarray(kv_lens)):
        k = dense_kv(k_pages, tables[s], n)
        v = dense_kv(v_pages, tables[s], n)
        q_len = cu[s + 1] - cu[s]
        for i in range(q_len):
            pos = n - q_len + i
            lo = 0 if window is None else max(0, pos - window + 1)
            out[cu[s] + i] = naive_attention(q[cu[s] + i], k[lo:pos + 1],
                                             v[lo:pos + 1], q.shape[-1] ** -0.5)
    return out


def ragged_batch(bs):
    """(q_lens, kv_lens, total rows): chunks starting on and mid-block, a
    single-token (decode) chunk, a fresh prefill, padding sequences (q_len 0)
    and padding rows past cu_q_lens[S]."""
    q_lens = [5, 0, 1, 37, 20, 0]
    kv_lens = [21, 0, 2 * bs + 3, 37, 3 * bs + 9, 0]
    return q_lens, kv_lens, sum(q_lens) + 7


def cu_of(q_lens):
    return jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)


def assert_close(out, want, dtype):
    out = np.asarray(out.astype(F32))
    want = np.asarray(jnp.asarray(want).astype(F32))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, want, atol=TOL[dtype], rtol=0)


# Each GQA ratio (1, 4, 7), head dim, block size (16, 32, and the 64 we also
# ship) and dtype appears at least once; the Qwen2.5-Omni thinker group
# (28/4) is there in both dtypes.
CASES = [
    pytest.param(4, 4, 64, 16, F32, id="g1-d64-bs16-f32"),
    pytest.param(16, 4, 128, 32, F32, id="g4-d128-bs32-f32"),
    pytest.param(28, 4, 128, 16, F32, id="g7-d128-bs16-f32"),
    pytest.param(14, 2, 64, 32, BF16, id="g7-d64-bs32-bf16"),
    pytest.param(28, 4, 128, 16, BF16, id="g7-d128-bs16-bf16"),
    pytest.param(2, 2, 128, 32, BF16, id="g1-d128-bs32-bf16"),
    pytest.param(8, 2, 128, 64, BF16, id="g4-d128-bs64-bf16"),
]


# ----------------------------------------------------------- decode kernel


@pytest.mark.parametrize("hq,hkv,d,bs,dtype", CASES)
def test_decode_matches_reference(hq, hkv, d, bs, dtype):
    lens = [1, bs - 1, bs, bs + 1, 0, 3 * bs + 7]      # 0 = padded row
    k, v, tables = make_cache(0, lens, hkv, d, bs, dtype, width=6)
    q = make_q(0, len(lens), hq, d, dtype)
    seq_lens = jnp.asarray(lens, jnp.int32)
    out = paged_attention(q, k, v, tables, seq_lens, interpret=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    want = reference.paged_attention(q, k, v, tables, seq_lens)
    assert_close(out, want, dtype)
    assert not np.asarray(out[4].astype(F32)).any()    # padded row: zeros


@pytest.mark.parametrize("preload", [True, False], ids=["table-preloaded", "table-in-loop"])
@pytest.mark.parametrize("k_splits,ppb", [(1, 1), (2, 2), (3, 1)])
def test_decode_explicit_splits(k_splits, ppb, preload):
    """Uneven and single splits, one page per step, the split's page ids read before the page
    loop or in it (`preload_table`): same answer."""
    lens = [1, 17, 0, 50, 64, 33]
    k, v, tables = make_cache(1, lens, 2, 64, 16, F32, width=5)
    q = make_q(1, len(lens), 6, 64, F32)     # group 3 (padded to 16 rows)
    seq_lens = jnp.asarray(lens, jnp.int32)
    out = paged_attention(q, k, v, tables, seq_lens, interpret=True,
                          k_splits=k_splits, pages_per_compute_block=ppb, preload_table=preload)
    assert_close(out, reference.paged_attention(q, k, v, tables, seq_lens), F32)


def test_decode_walks_a_long_split_a_table_window_at_a_time(monkeypatch):
    """With the table preloaded, a split longer than MAX_TABLE_WINDOW pages reads its page ids
    a window at a time: one split over 13 pages in windows of 4, a sliding window starting
    mid-table: the same answers."""
    pa = importlib.import_module("kernels_pallas.paged_attention")   # the package exports the function
    monkeypatch.setattr(pa, "MAX_TABLE_WINDOW", 4)
    lens = [200, 9, 0]
    k, v, tables = make_cache(5, lens, 2, 32, 16, F32, width=13)
    q = make_q(5, len(lens), 6, 32, F32)
    seq_lens = jnp.asarray(lens, jnp.int32)
    for window in (None, 100):
        call = functools.partial(paged_attention, interpret=True, pages_per_compute_block=1, k_splits=1,
                                 preload_table=True, sliding_window=window)
        assert "paged_decode_bs16_ppb1_k1" in str(jax.make_jaxpr(call)(q, k, v, tables, seq_lens))
        want = reference.paged_attention(q, k, v, tables, seq_lens, sliding_window=window)
        assert_close(call(q, k, v, tables, seq_lens), want, F32)


@pytest.mark.parametrize("dtype,window,bs", [
    (F32, None, 32), (BF16, None, 16), (F32, 300, 32)])
def test_decode_long_context_split_k(dtype, window, bs):
    """Contexts >= 2048 with the default split-K (asserted to be engaged)."""
    lens = [2048 + 21, 0, 2048 + bs]
    k, v, tables = make_cache(2, lens, 4, 128, bs, dtype)
    q = make_q(2, len(lens), 28, 128, dtype)
    seq_lens = jnp.asarray(lens, jnp.int32)
    call = functools.partial(paged_attention, interpret=True,
                             sliding_window=window)
    # The kernel's name records its split count.
    jaxpr = str(jax.make_jaxpr(call)(q, k, v, tables, seq_lens))
    splits = {int(n) for n in re.findall(r"paged_decode_\w*_k(\d+)", jaxpr)}
    assert splits and min(splits) > 1, splits
    out = call(q, k, v, tables, seq_lens)
    want = reference.paged_attention(q, k, v, tables, seq_lens,
                                     sliding_window=window)
    assert_close(out, want, dtype)


@pytest.mark.parametrize("preload", [True, False], ids=["table-preloaded", "table-in-loop"])
@pytest.mark.parametrize("window", [1, 13, 40])
def test_decode_sliding_window(window, preload):
    lens = [1, 12, 16, 17, 0, 70]
    k, v, tables = make_cache(3, lens, 4, 64, 16, F32, width=6)
    q = make_q(3, len(lens), 16, 64, F32)
    seq_lens = jnp.asarray(lens, jnp.int32)
    out = paged_attention(q, k, v, tables, seq_lens, interpret=True,
                          sliding_window=window, k_splits=2,
                          pages_per_compute_block=1, preload_table=preload)
    want = reference.paged_attention(q, k, v, tables, seq_lens,
                                     sliding_window=window)
    assert_close(out, want, F32)


def _with_new_kv(seed, lens, hkv, d, bs, dtype):
    """make_cache's pages with the slot of each sequence's last position (the token a decode
    step brings) holding NaN, its slot, and that token's K/V."""
    k, v, tables = make_cache(seed, lens, hkv, d, bs, dtype, width=6)
    t = np.asarray(tables)
    slots = np.array([t[b, (n - 1) // bs] * bs + (n - 1) % bs if n else b % bs for b, n in enumerate(lens)],
                     np.int32)
    stale = np.asarray([n > 0 for n in lens])
    k, v = (p.reshape(-1, hkv, d).at[slots[stale]].set(jnp.nan).reshape(p.shape) for p in (k, v))
    rng = np.random.default_rng(seed + 7)
    k_new, v_new = (jnp.asarray(rng.standard_normal((len(lens), hkv, d)), dtype) for _ in "kv")
    return k, v, tables, jnp.asarray(slots), k_new, v_new


@pytest.mark.parametrize("hq,hkv,d,bs,dtype,k_splits,window,prepare", [
    pytest.param(28, 4, 128, 16, F32, None, None, "", id="g7-f32-split"),
    pytest.param(28, 4, 128, 16, BF16, 1, None, "rope", id="g7-bf16-one-split-rope"),
    pytest.param(16, 4, 64, 32, F32, 3, 13, "rope+norm", id="g4-f32-window-rope-norm"),
    pytest.param(16, 2, 128, 64, BF16, None, None, "rope+norm", id="g8-bf16-bs64-rope-norm"),
])
def test_decode_with_write_matches_write_then_decode(hq, hkv, d, bs, dtype, k_splits, window, prepare):
    """The decode kernel that also stores the step's K/V (one launch where the write took two
    to four per layer), and rotates and normalises q and k first when asked (Qwen2.5's RoPE,
    Qwen3's q/k norm: the fusions before it), against the XLA path (``prepare_qk``, the
    write, the reference decode): the same output and the same pages outside the dummy block
    (padded rows store nothing). The slots written hold NaN before, so attending to a page's
    stale row instead of the new K/V shows."""
    from kernels_pallas.paged_attention import paged_attention_with_write

    lens = [1, bs - 1, bs, bs + 1, 0, 3 * bs + 7]
    k, v, tables, slots, k_new, v_new = _with_new_kv(4, lens, hkv, d, bs, dtype)
    q = make_q(4, len(lens), hq, d, dtype)
    seq_lens = jnp.asarray(lens, jnp.int32)
    rng = np.random.default_rng(9)
    kw = dict(sliding_window=window)
    if "rope" in prepare:       # each sequence's angles, as rope_cos_sin makes them (both halves alike)
        angles = np.tile(rng.uniform(0, 2 * np.pi, (len(lens), d // 2)), 2)
        kw["rope"] = (jnp.asarray(np.cos(angles), dtype), jnp.asarray(np.sin(angles), dtype))
    if "norm" in prepare:
        kw["qk_norm"] = tuple(jnp.asarray(rng.uniform(0.5, 1.5, d), dtype) for _ in "qk")
        kw["norm_eps"] = 1e-6
    out, k2, v2 = paged_attention_with_write(q, k_new, v_new, k, v, slots, tables, seq_lens, interpret=True,
                                             k_splits=k_splits, pages_per_compute_block=1 if k_splits else None, **kw)
    want, k_want, v_want = reference.paged_attention_with_write(q, k_new, v_new, k, v, slots, tables, seq_lens, **kw)
    assert_close(out, want, dtype)
    assert not np.asarray(out[4].astype(F32)).any()    # padded row: zeros
    for got, ref in ((k2, k_want), (v2, v_want)):
        assert got.shape == ref.shape and got.dtype == ref.dtype
        # The kernel rotates and normalises in fp32 and rounds once (XLA: op by op in bf16).
        tol = TOL[dtype] if prepare else 0
        np.testing.assert_allclose(np.asarray(got.astype(F32))[1:], np.asarray(ref.astype(F32))[1:],
                                   atol=tol, rtol=tol)


# ----------------------------------------------------------- ragged kernel


@pytest.mark.parametrize("hq,hkv,d,bs,dtype", CASES)
def test_ragged_matches_reference(hq, hkv, d, bs, dtype):
    q_lens, kv_lens, rows = ragged_batch(bs)
    k, v, tables = make_cache(4, kv_lens, hkv, d, bs, dtype, width=5)
    q = make_q(4, rows, hq, d, dtype)
    args = (q, k, v, tables, jnp.asarray(kv_lens, jnp.int32), cu_of(q_lens))
    out = ragged_paged_attention(*args, interpret=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, reference.ragged_paged_attention(*args), dtype)
    assert not np.asarray(out[sum(q_lens):].astype(F32)).any()


@pytest.mark.parametrize("preload", [True, False], ids=["table-preloaded", "table-in-loop"])
@pytest.mark.parametrize("window,block_q,ppb", [
    (None, 1, 1), (7, None, None), (40, 4, 2)])
def test_ragged_tuning_and_window(window, block_q, ppb, preload):
    q_lens, kv_lens, rows = ragged_batch(16)
    k, v, tables = make_cache(5, kv_lens, 2, 64, 16, F32, width=5)
    q = make_q(5, rows, 6, 64, F32)                    # group 3 -> 4 rows
    args = (q, k, v, tables, jnp.asarray(kv_lens, jnp.int32), cu_of(q_lens))
    out = ragged_paged_attention(*args, interpret=True, block_q=block_q,
                                 pages_per_compute_block=ppb,
                                 sliding_window=window, preload_table=preload)
    want = reference.ragged_paged_attention(*args, sliding_window=window)
    assert_close(out, want, F32)


def test_ragged_walks_the_table_a_window_at_a_time(monkeypatch):
    """Prefill tiles with their page ids preloaded, read in windows of 2 (patched): a tile's
    KV range spans several, and sliding windows start mid-table."""
    pa = importlib.import_module("kernels_pallas.paged_attention")
    monkeypatch.setattr(pa, "MAX_TABLE_WINDOW", 2)
    q_lens, kv_lens, rows = ragged_batch(16)
    k, v, tables = make_cache(7, kv_lens, 2, 32, 16, F32, width=5)
    q = make_q(7, rows, 4, 32, F32)
    args = (q, k, v, tables, jnp.asarray(kv_lens, jnp.int32), cu_of(q_lens))
    for window in (None, 30):
        out = ragged_paged_attention(*args, interpret=True, pages_per_compute_block=1, preload_table=True,
                                     sliding_window=window)
        assert_close(out, reference.ragged_paged_attention(*args, sliding_window=window), F32)


def test_ragged_long_context():
    q_lens, kv_lens = [24, 3], [2048 + 40, 2048 + 2]
    k, v, tables = make_cache(6, kv_lens, 4, 128, 32, BF16)
    q = make_q(6, 32, 28, 128, BF16)
    args = (q, k, v, tables, jnp.asarray(kv_lens, jnp.int32), cu_of(q_lens))
    out = ragged_paged_attention(*args, interpret=True)
    assert_close(out, reference.ragged_paged_attention(*args), BF16)


def test_ragged_single_token_chunks_equal_decode():
    """Decode through the ragged path: one query row per sequence."""
    lens = [1, 15, 16, 17, 0, 40]
    k, v, tables = make_cache(7, lens, 4, 128, 16, F32)
    q = make_q(7, len(lens), 28, 128, F32)
    seq_lens = jnp.asarray(lens, jnp.int32)
    cu = cu_of([1 if n else 0 for n in lens])
    qr = jnp.concatenate([q[np.asarray(lens) > 0], jnp.zeros_like(q[:1])])
    ragged = ragged_paged_attention(qr, k, v, tables, seq_lens, cu,
                                    interpret=True)
    decode = paged_attention(q, k, v, tables, seq_lens, interpret=True)
    np.testing.assert_allclose(np.asarray(ragged[:-1]),
                               np.asarray(decode[np.asarray(lens) > 0]),
                               atol=1e-5, rtol=0)
    assert not np.asarray(ragged[-1]).any()


def test_ragged_rows_before_the_first_sequence_see_nothing():
    """cu_q_lens[0] > 0: the rows before it belong to no sequence (a mixed step's decode rows,
    see test_mixed_step_attends_decodes_and_chunks_in_one_call)."""
    q_lens, kv_lens, rows = ragged_batch(16)
    k, v, tables = make_cache(11, kv_lens, 4, 64, 16, F32, width=5)
    q = make_q(11, rows + 3, 8, 64, F32)
    cu = cu_of(q_lens) + 3
    args = (q, k, v, tables, jnp.asarray(kv_lens, jnp.int32), cu)
    want = naive_ragged(*args)
    for out in (ragged_paged_attention(*args, interpret=True), reference.ragged_paged_attention(*args)):
        assert_close(out, want, F32)
        assert not np.asarray(out[:3]).any()


@pytest.mark.parametrize("window", [None, 9])
def test_mixed_step_attends_decodes_and_chunks_in_one_call(window):
    """The attention layer's mixed step: `num_decodes` one-token sequences first (decode kernel),
    then prefill chunks (ragged kernel), equal to every sequence scored on its own."""
    from omni_jax.models.layers.attention import AttentionMetadata, paged_attention_step

    bs, hq, hkv, d = 16, 8, 2, 64
    q_lens = [1, 1, 1, 5, 37, 1, 0]          # three decodes, two chunks, a one-token chunk, padding
    kv_lens = [3 * bs + 2, 1, bs, 21, 37, 2 * bs + 5, 0]
    rows = sum(q_lens) + 6
    k, v, tables = make_cache(12, kv_lens, hkv, d, bs, F32, width=5)
    q = make_q(12, rows, hq, d, F32)
    cu = cu_of(q_lens)
    # New K/V go to the dummy block: the pages keep the keys the naive attention reads.
    meta = AttentionMetadata(mode="paged", backend="reference", slot_mapping=jnp.zeros(rows, jnp.int32),
                             block_tables=tables, kv_lens=jnp.asarray(kv_lens, jnp.int32), cu_q_lens=cu,
                             num_decodes=jnp.int32(3))
    zeros = jnp.zeros((rows, hkv, d), F32)
    scale = d ** -0.5
    out, _ = paged_attention_step(q, zeros, zeros, (k, v), meta, scale, sliding_window=window)
    k_real = k.at[0].set(jnp.nan)  # the step wrote into block 0; the naive attention never reads it
    want = naive_ragged(q, k_real, v.at[0].set(jnp.nan), tables, jnp.asarray(kv_lens), cu, window=window)
    assert_close(out, want, F32)
    assert not np.asarray(out[sum(q_lens):]).any()


# ------------------------------------------- references vs naive numpy


@pytest.mark.parametrize("hq,hkv,d,bs,window,step", [
    (4, 4, 64, 16, None, 512), (28, 4, 128, 16, None, 16),
    (12, 4, 64, 32, 5, 32), (16, 2, 128, 32, 40, 64)])
def test_reference_decode_vs_numpy(hq, hkv, d, bs, window, step):
    lens = [1, bs - 1, bs, bs + 1, 0, 3 * bs + 7]
    k, v, tables = make_cache(8, lens, hkv, d, bs, F32, width=6)
    q = make_q(8, len(lens), hq, d, F32)
    seq_lens = jnp.asarray(lens, jnp.int32)
    out = reference.paged_attention(q, k, v, tables, seq_lens,
                                    sliding_window=window, step_tokens=step)
    want = naive_decode(q, k, v, tables, seq_lens, window)
    assert_close(out, want, F32)


@pytest.mark.parametrize("hq,hkv,d,bs,window,chunk,step", [
    (4, 4, 64, 16, None, 128, 256), (28, 4, 128, 16, None, 16, 16),
    (12, 4, 64, 32, 9, 7, 64), (16, 2, 128, 32, 1, 64, 32)])
def test_reference_ragged_vs_numpy(hq, hkv, d, bs, window, chunk, step):
    q_lens, kv_lens, rows = ragged_batch(bs)
    k, v, tables = make_cache(9, kv_lens, hkv, d, bs, F32, width=5)
    q = make_q(9, rows, hq, d, F32)
    args = (q, k, v, tables, jnp.asarray(kv_lens, jnp.int32), cu_of(q_lens))
    out = reference.ragged_paged_attention(*args, sliding_window=window,
                                           token_chunk=chunk,
                                           step_tokens=step)
    want = naive_ragged(*args, window=window)
    assert_close(out, want, F32)


def test_reference_bf16_vs_numpy():
    lens = [5, 0, 40]
    k, v, tables = make_cache(10, lens, 4, 128, 16, BF16)
    q = make_q(10, len(lens), 28, 128, BF16)
    seq_lens = jnp.asarray(lens, jnp.int32)
    out = reference.paged_attention(q, k, v, tables, seq_lens)
    assert out.dtype == BF16
    assert_close(out, naive_decode(q, k, v, tables, seq_lens), BF16)


@pytest.mark.parametrize("op", ["decode", "ragged", "write"])
def test_reference_bf16_cache_is_never_copied_whole(op):
    """XLA:CPU gathers and scatters bf16 by converting the operand to fp32, and a bitcast
    of bf16 pages to their bits copies them: on the pages, that is the whole cache, per
    layer and step (bf16 decode ran 15x slower than fp32). The engine stores a bf16 cache
    for this backend as its bits (`page_dtype`); then no compiled op holds a temporary
    as large as the cache, and the write aliases it."""
    nb, bs, hkv, d, hq, t = 997, 16, 2, 64, 4, 8
    assert page_dtype(BF16, "reference") == BF16_BITS and page_dtype(BF16, "pallas") == BF16
    pages = jax.ShapeDtypeStruct((nb, bs, hkv, d), BF16_BITS)
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    if op == "decode":
        fn, args = reference.paged_attention, (jax.ShapeDtypeStruct((t, hq, d), BF16), pages, pages,
                                               i32((t, 12)), i32((t,)))
    elif op == "ragged":
        fn, args = reference.ragged_paged_attention, (jax.ShapeDtypeStruct((64, hq, d), BF16), pages, pages,
                                                      i32((t, 12)), i32((t,)), i32((t + 1,)))
    else:
        new = jax.ShapeDtypeStruct((t, hkv, d), BF16)
        fn, args = jax.jit(write_kv_pages, donate_argnums=(0, 1)), (pages, pages, new, new, i32((t,)))
    memory = fn.trace(*args).lower().compile().memory_analysis()
    cache_bytes = nb * bs * hkv * d * 2
    assert memory.temp_size_in_bytes < cache_bytes / 4
    if op == "write":
        assert memory.alias_size_in_bytes == 2 * cache_bytes


@pytest.mark.parametrize("op", ["decode", "ragged"])
def test_reference_reads_bf16_bits_pages_as_bf16(op):
    """The same attention from a bf16 cache and from its bits, bit for bit."""
    lens = [5, 0, 40]
    k, v, tables = make_cache(10, lens, 4, 128, 16, BF16)
    bits = [jax.lax.bitcast_convert_type(x, BF16_BITS) for x in (k, v)]
    kv_lens = jnp.asarray(lens, jnp.int32)
    if op == "decode":
        q = make_q(10, len(lens), 28, 128, BF16)
        run = lambda k, v: reference.paged_attention(q, k, v, tables, kv_lens)
    else:
        q = make_q(11, 45, 28, 128, BF16)
        cu = jnp.asarray([0, 5, 5, 45], jnp.int32)
        run = lambda k, v: reference.ragged_paged_attention(q, k, v, tables, kv_lens, cu)
    np.testing.assert_array_equal(np.asarray(run(*bits), np.float32), np.asarray(run(k, v), np.float32))


# ----------------------------------------------------------------- kv write


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_write_kv_pages_slots_padding_and_roundtrip(dtype):
    nb, bs, hkv, d = 6, 16, 2, 64
    rng = np.random.default_rng(11)
    k0 = jnp.asarray(rng.standard_normal((nb, bs, hkv, d)), dtype)
    v0 = jnp.asarray(rng.standard_normal((nb, bs, hkv, d)), dtype)
    # Sequence A: positions 14..18 in blocks [3, 5]; sequence B: 0..1 in
    # block 2; two padding tokens to the dummy block (slot 0) and one -1.
    slots = np.array([3 * bs + 14, 3 * bs + 15, 5 * bs, 5 * bs + 1,
                      5 * bs + 2, 2 * bs, 2 * bs + 1, 0, 0, -1], np.int32)
    t = len(slots)
    kn = jnp.asarray(rng.standard_normal((t, hkv, d)), dtype)
    vn = jnp.asarray(rng.standard_normal((t, hkv, d)), dtype)
    k1, v1 = jax.jit(write_kv_pages)(k0, v0, kn, vn, jnp.asarray(slots))

    want_k = np.asarray(k0).reshape(nb * bs, hkv, d).copy()
    want_v = np.asarray(v0).reshape(nb * bs, hkv, d).copy()
    real = slots[:7]
    want_k[real], want_v[real] = np.asarray(kn)[:7], np.asarray(vn)[:7]
    got_k = np.asarray(k1).reshape(nb * bs, hkv, d)
    got_v = np.asarray(v1).reshape(nb * bs, hkv, d)
    # Everything outside the dummy block is exact; the -1 token wrote nothing.
    np.testing.assert_array_equal(got_k[bs:], want_k[bs:])
    np.testing.assert_array_equal(got_v[bs:], want_v[bs:])
    np.testing.assert_array_equal(got_k[1:bs], want_k[1:bs])
    # Round trip: A's block table [4, 3, 5] reads positions 30..34 back.
    np.testing.assert_array_equal(dense_kv(k1, np.array([4, 3, 5]), 35)[30:],
                                  np.asarray(kn)[:5])


def test_write_kv_pages_into_bf16_bits_pages():
    """Writing into a bf16 cache stored as its bits stores exactly the bf16 write's bits."""
    nb, bs, hkv, d = 6, 16, 2, 64
    rng = np.random.default_rng(12)
    k0 = jnp.asarray(rng.standard_normal((nb, bs, hkv, d)), BF16)
    kn = jnp.asarray(rng.standard_normal((5, hkv, d)), F32)  # cast to bf16 by the write
    slots = jnp.asarray([3 * bs + 2, 5 * bs, 0, -1, 2 * bs + 15], jnp.int32)
    as_bits = functools.partial(jax.lax.bitcast_convert_type, new_dtype=BF16_BITS)
    want, _ = jax.jit(write_kv_pages)(k0, k0, kn, kn, slots)
    got, _ = jax.jit(write_kv_pages)(as_bits(k0), as_bits(k0), kn, kn, slots)
    assert got.dtype == BF16_BITS
    np.testing.assert_array_equal(np.asarray(got), np.asarray(as_bits(want)))


def test_write_kv_pages_in_place_under_donation():
    nb, bs, hkv, d = 4, 16, 2, 64
    k = jnp.ones((nb, bs, hkv, d), BF16)
    v = jnp.ones((nb, bs, hkv, d), BF16)
    kn = jnp.full((3, hkv, d), 2.0, F32)               # cast to the pages'
    slots = jnp.asarray([17, 18, 0], jnp.int32)
    step = jax.jit(write_kv_pages, donate_argnums=(0, 1))
    ptr = k.unsafe_buffer_pointer()
    k2, v2 = step(k, v, kn, kn, slots)
    assert k.is_deleted() and v.is_deleted()
    assert k2.unsafe_buffer_pointer() == ptr
    assert k2.dtype == BF16 and float(k2[1, 1, 0, 0]) == 2.0
    assert float(k2[1, 3, 0, 0]) == 1.0


# ---------------------------------------------------------------- decode merge, RMSNorm


@pytest.mark.parametrize("splits,rows", [(2, 16), (16, 16), (32, 32)])
def test_decode_merge_kernel_matches_xla_merge(splits, rows):
    """The split partials' log-sum-exp merge as one kernel (interpret mode) against the XLA
    merge it replaced, with empty splits (l == 0, the padding to a power of two) and a
    sequence that saw no key at all (its output: zeros)."""
    from kernels_pallas.paged_attention import M_INIT, merge_splits, merge_splits_kernel

    rng = np.random.default_rng(splits)
    b, h, d = 3, 2, 32
    acc = rng.standard_normal((splits, b, h, rows, d)).astype(np.float32)
    m = (rng.standard_normal((splits, b, h, rows)) * 4).astype(np.float32)
    l = rng.uniform(0.5, 3, (splits, b, h, rows)).astype(np.float32)
    empty = np.zeros((splits, b, 1, 1), bool)
    empty[splits // 2:] = True                      # the padded splits: nothing seen
    empty[:, 1] = True                              # sequence 1: no key in any split
    m, l = np.where(empty, M_INIT, m), np.where(empty, 0.0, l)
    acc = np.where(empty[..., None], 0.0, acc)
    group = rows // 2 - 1                             # GQA padding rows past it
    out = merge_splits_kernel(jnp.asarray(acc), jnp.asarray(m), jnp.asarray(l), group, F32, interpret=True)
    want = merge_splits(jnp.asarray(acc), jnp.asarray(m), jnp.asarray(l))[:, :, :group].reshape(b, h * group, d)
    assert out.shape == (b, h * group, d)
    assert_close(out, want, F32)
    assert not np.asarray(out[1]).any()


@pytest.mark.parametrize("splits", [2, 16])
def test_decode_merge_reads_only_the_splits_holding_tokens(splits):
    """With the sequences' lengths the merge reads only the splits that hold some of their
    tokens (a sequence's pages spread over the splits in whole compute blocks: `used_splits`):
    the decode kernel stores nothing for the others, so whatever they hold (NaN here) must
    not reach the output; a sequence of no tokens (padding) reads none and gives zeros."""
    from kernels_pallas.paged_attention import merge_splits, merge_splits_kernel, used_splits

    rng = np.random.default_rng(splits + 1)
    b, h, rows, d, bs = 4, 2, 16, 32, 16
    acc = rng.standard_normal((splits, b, h, rows, d)).astype(np.float32)
    m = (rng.standard_normal((splits, b, h, rows)) * 4).astype(np.float32)
    l = rng.uniform(0.5, 3, (splits, b, h, rows)).astype(np.float32)
    # One page; a page a split; one page more than splits (two a split: half of them, a chunk's
    # tail at 16); none.
    seq_lens = np.array([1, bs * splits, bs * (splits + 1), 0])
    used = np.array([int(used_splits(jnp.int32(n), splits, 1, bs)) for n in seq_lens])
    assert list(used) == [1, splits, splits // 2 + 1, 0]
    unwritten = np.arange(splits)[:, None] >= used[None, :]           # [K, B]
    garbage = lambda x: np.where(unwritten.reshape(unwritten.shape + (1,) * (x.ndim - 2)), np.nan, x)  # noqa: E731
    out = merge_splits_kernel(*(jnp.asarray(garbage(x)) for x in (acc, m, l)), rows, F32,
                              seq_lens=jnp.asarray(seq_lens, jnp.int32), pages_per_block=1, block_size=bs,
                              interpret=True)
    assert out.shape == (b, h * rows, d) and not np.isnan(np.asarray(out)).any()
    for i in range(b):
        k = int(used[i])
        if k == 0:
            assert not np.asarray(out[i]).any()
            continue
        want = merge_splits(*(jnp.asarray(x[:k, i]) for x in (acc, m, l))).reshape(h * rows, d)
        assert_close(out[i], want, F32)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("hidden", [96, 128])       # 96: the row padded to 128, its tail masked
@pytest.mark.parametrize("with_delta", [False, True])
def test_rms_norm_kernel_matches_reference(dtype, hidden, with_delta):
    """The one-launch RMSNorm (and the residual add before it) in interpret mode against
    ``reference.rms_norm``, the norm of every other backend."""
    import kernels_pallas

    rng = np.random.default_rng(hidden)
    x, delta = (jnp.asarray(rng.standard_normal((5, hidden)) * 3, dtype) for _ in range(2))
    w = jnp.asarray(rng.standard_normal(hidden), dtype)
    delta = delta if with_delta else None
    out = kernels_pallas.rms_norm(x, w, delta, eps=1e-6, interpret=True)
    want = reference.rms_norm(x, w, delta, eps=1e-6)
    if with_delta:
        (out, summed), (want, want_sum) = out, want
        np.testing.assert_array_equal(np.asarray(summed.astype(F32)), np.asarray(want_sum.astype(F32)))
    assert out.dtype == dtype and out.shape == x.shape
    # bf16: the fp32 statistics round differently (a padded sum / H against a mean, 1 / sqrt
    # against reciprocal(sqrt)), so the bf16 row may round one ulp the other way, and the
    # weight's bf16 product one more: two ulps, relative.
    np.testing.assert_allclose(np.asarray(out.astype(F32)), np.asarray(want.astype(F32)),
                               rtol=0 if dtype == F32 else 2 ** -6, atol=TOL[F32])
    with pytest.raises(ValueError, match="rms_norm"):
        kernels_pallas.rms_norm(x, w[:-1], eps=1e-6, interpret=True)
