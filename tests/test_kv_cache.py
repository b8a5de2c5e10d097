"""Block pool, block tables and prefix caching of the host-side KV cache manager."""

from __future__ import annotations

import numpy as np
import pytest

from omni_jax.engine.hidden_cache import HiddenRowCache
from omni_jax.engine.protocol import Request
from omni_jax.engine.runner import DUMMY_BLOCK_ID, compute_slot_mapping
from omni_jax.engine.kv_cache import BlockPool, KVCacheManager, block_extra_keys, hash_block_tokens

pytestmark = pytest.mark.engine


def make_req(rid, tokens, **kw):
    return Request(rid, np.asarray(tokens, dtype=np.int32), **kw)


def admit(kv: KVCacheManager, req: Request, write: bool = True) -> int:
    """Admit a request as the scheduler does (hits + whole rest), optionally 'run' it. Returns hit tokens."""
    hits, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hits) is True
    req.num_computed_tokens = req.num_tokens
    if write:
        kv.cache_blocks(req, req.num_tokens)
    kv.check_invariants()
    return num_hit


def test_alloc_free_and_refcounts():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    assert kv.num_free_blocks == 9 and kv.num_usable_blocks == 9 and kv.usage == 0.0
    req = make_req("a", range(10))
    assert kv.allocate_slots(req, 10) is True
    table = kv.get_block_table("a")
    assert len(table) == 3 and DUMMY_BLOCK_ID not in table
    assert all(kv.block_pool.blocks[b].ref_cnt == 1 for b in table)
    assert kv.num_free_blocks == 6
    assert kv.usage == pytest.approx(3 / 9)
    kv.check_invariants()

    # Growing by decodes only takes a block at block boundaries.
    req.num_computed_tokens = 10
    req.append_output_token_ids(99)
    assert kv.allocate_slots(req, 1) is True and len(kv.get_block_table("a")) == 3
    req.num_computed_tokens = 11
    req.append_output_token_ids(98)
    assert kv.allocate_slots(req, 1) is True and len(kv.get_block_table("a")) == 3
    req.num_computed_tokens = 12
    req.append_output_token_ids(97)
    assert kv.allocate_slots(req, 1) is True and len(kv.get_block_table("a")) == 4
    assert kv.get_block_table("a")[:3] == table

    kv.free(req)
    kv.free(req)  # idempotent
    assert kv.get_block_table("a") == []
    assert kv.is_idle_and_leak_free()
    kv.check_invariants()


def test_dummy_block_never_allocated_and_failed_allocation_changes_nothing():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    reqs = [make_req(f"r{i}", [1, 2]) for i in range(5)]
    for r in reqs:
        assert kv.allocate_slots(r, 2) is True
    held = sorted(b for r in reqs for b in kv.get_block_table(r.request_id))
    assert held == [1, 2, 3, 4, 5]
    assert kv.num_free_blocks == 0

    extra = make_req("x", [1, 2, 3])
    assert kv.allocate_slots(extra, 3) is None
    assert kv.get_block_table("x") == [] and "x" not in kv.req_to_blocks
    kv.check_invariants()
    for r in reqs:
        kv.free(r)
    assert kv.is_idle_and_leak_free()
    with pytest.raises(ValueError, match="dummy block"):
        BlockPool(1)


def test_prefix_hit_only_full_blocks_and_last_token_recomputed():
    kv = KVCacheManager(num_blocks=20, block_size=4)
    a = make_req("a", range(10))  # blocks [0..3] [4..7] full, [8, 9] partial
    assert admit(kv, a) == 0
    assert len(kv.block_pool.cached_blocks) == 2

    # Same first 10 tokens and more: the two full blocks hit, the partial one does not.
    b = make_req("b", list(range(10)) + [50, 51])
    assert admit(kv, b) == 8
    assert kv.get_block_table("b")[:2] == kv.get_block_table("a")[:2]
    assert kv.get_block_table("b")[2] != kv.get_block_table("a")[2]
    for bid in kv.get_block_table("a")[:2]:
        assert kv.block_pool.blocks[bid].ref_cnt == 2

    # A prompt that is exactly the two cached blocks: the last block is recomputed (logits needed).
    c = make_req("c", range(8))
    hits, num_hit = kv.get_computed_blocks(c)
    assert num_hit == 4 and [h.block_id for h in hits] == kv.get_block_table("a")[:1]

    # One differing token in the first block kills every hit (chained hashes).
    d = make_req("d", [100] + list(range(1, 12)))
    assert kv.get_computed_blocks(d) == ([], 0)

    for r in (a, b):
        kv.free(r)
    kv.check_invariants()
    assert kv.is_idle_and_leak_free()
    # Freed cached blocks still hit.
    e = make_req("e", list(range(10)) + [7])
    assert admit(kv, e) == 8
    kv.free(e)
    assert kv.is_idle_and_leak_free()


def test_extra_keys_keep_different_media_apart():
    kv = KVCacheManager(num_blocks=30, block_size=4)
    tokens = [5, 5, 5, 5, 5, 5, 5, 5, 9, 9, 1]  # 8 image placeholder tokens, then text
    img_a = make_req("a", tokens, mm_hashes=[(0, 8, "img-A")])
    assert admit(kv, img_a) == 0
    img_b = make_req("b", tokens, mm_hashes=[(0, 8, "img-B")])
    assert admit(kv, img_b) == 0  # same ids, other picture: no sharing
    assert set(kv.get_block_table("a")).isdisjoint(kv.get_block_table("b"))
    img_a2 = make_req("a2", tokens, mm_hashes=[(0, 8, "img-A")])
    assert admit(kv, img_a2) == 8
    # The media's place matters, not only its content.
    shifted = make_req("s", tokens, mm_hashes=[(4, 4, "img-A")])
    assert kv.get_computed_blocks(shifted)[1] == 0
    no_media = make_req("n", tokens)
    assert kv.get_computed_blocks(no_media)[1] == 0

    # Media only in the second block: the first block is still shared.
    late = make_req("l1", tokens, mm_hashes=[(4, 4, "img-C")])
    admit(kv, late)
    late2 = make_req("l2", tokens, mm_hashes=[(4, 4, "img-D")])
    assert kv.get_computed_blocks(late2)[1] == 4

    req = make_req("k", range(12), mm_hashes=[(2, 3, b"h1"), (6, 1, 7)], cache_salt="s")
    assert block_extra_keys(req, 0, 4) == (("salt", "s"), ("mm", 2, 3, b"h1"))
    assert block_extra_keys(req, 4, 8) == (("mm", -2, 3, b"h1"), ("mm", 2, 1, 7))
    assert block_extra_keys(req, 8, 12) == ()
    for r in (img_a, img_b, img_a2, late):
        kv.free(r)
    assert kv.is_idle_and_leak_free()


def test_prompt_embeds_and_cache_salt():
    kv = KVCacheManager(num_blocks=30, block_size=4)
    e1 = make_req("e1", range(9), has_prompt_embeds=True)
    assert admit(kv, e1) == 0 and not kv.block_pool.cached_blocks  # never cached: ids don't define KV
    e2 = make_req("e2", range(9), has_prompt_embeds=True)
    assert kv.get_computed_blocks(e2)[1] == 0
    s1 = make_req("s1", range(9), has_prompt_embeds=True, cache_salt="emb-1")
    admit(kv, s1)
    assert kv.get_computed_blocks(make_req("s2", range(9), cache_salt="emb-2"))[1] == 0
    assert kv.get_computed_blocks(make_req("s3", range(9), has_prompt_embeds=True, cache_salt="emb-1"))[1] == 8
    for r in (e1, s1):
        kv.free(r)
    assert kv.is_idle_and_leak_free()


def test_lru_eviction_order():
    kv = KVCacheManager(num_blocks=8, block_size=4)  # 7 usable
    reqs = {name: make_req(name, [i * 10 + k for k in range(8)]) for i, name in enumerate("ABC")}
    for r in reqs.values():
        admit(kv, r)  # 2 full cached blocks each: 6 of 7 blocks
    tables = {n: kv.get_block_table(n) for n in reqs}
    for n in "ABC":
        kv.free(reqs[n])
    assert kv.num_free_blocks == 7 and len(kv.block_pool.cached_blocks) == 6
    # Never-cached block first, then A's (freed first; its tail block before its head), B's, C's.
    order = list(kv.block_pool.free_queue)
    assert order[1:] == tables["A"][::-1] + tables["B"][::-1] + tables["C"][::-1]

    # A hit revives B's head block; freeing it again makes it the most recently used.
    b2 = make_req("B2", list(reqs["B"].prompt_token_ids))
    assert admit(kv, b2) == 4
    kv.free(b2)
    assert list(kv.block_pool.free_queue)[-1] == tables["B"][0]

    # Three fresh blocks: the uncached one, then A's two: A is evicted, B and C still hit.
    filler = make_req("F", range(100, 112))
    assert kv.allocate_slots(filler, 12) is True
    kv.check_invariants()
    assert kv.get_computed_blocks(make_req("A?", reqs["A"].prompt_token_ids))[1] == 0
    assert kv.get_computed_blocks(make_req("B?", reqs["B"].prompt_token_ids))[1] == 4
    assert kv.get_computed_blocks(make_req("C?", reqs["C"].prompt_token_ids))[1] == 4
    # Next to go: B's tail block (B's head was revived, so it moved behind C's blocks).
    f2 = make_req("F2", range(200, 204))
    assert kv.allocate_slots(f2, 4) is True
    assert kv.get_block_table("F2") == [tables["B"][1]]
    assert kv.get_computed_blocks(make_req("B?", reqs["B"].prompt_token_ids))[1] == 4
    assert list(kv.block_pool.free_queue) == tables["C"][::-1] + [tables["B"][0]]
    kv.free(filler)
    kv.free(f2)
    assert kv.is_idle_and_leak_free()


def test_hit_rate_stats_and_reset():
    kv = KVCacheManager(num_blocks=20, block_size=4)
    a = make_req("a", range(10))
    admit(kv, a)
    b = make_req("b", list(range(10)) + [1, 2])
    admit(kv, b)
    stats = kv.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 22, 8)
    assert stats.hit_rate == pytest.approx(8 / 22)
    # A failed allocation is not a query.
    big = make_req("big", range(300, 400))
    hits, n = kv.get_computed_blocks(big)
    assert kv.allocate_slots(big, 100 - n, hits) is None
    assert kv.prefix_cache_stats.queries == 22
    assert kv.reset_stats().hits == 8 and kv.prefix_cache_stats.queries == 0

    assert kv.reset_prefix_cache() is False  # blocks in use
    kv.free(a)
    kv.free(b)
    assert kv.reset_prefix_cache() is True
    assert not kv.block_pool.cached_blocks
    assert kv.get_computed_blocks(make_req("c", range(10)))[1] == 0
    assert kv.is_idle_and_leak_free()

    off = KVCacheManager(num_blocks=20, block_size=4, enable_prefix_caching=False)
    admit(off, make_req("a", range(10)))
    assert off.get_computed_blocks(make_req("b", range(10))) == ([], 0)
    assert not off.block_pool.cached_blocks and off.prefix_cache_stats.queries == 0


def test_block_hashes_incremental_and_deterministic():
    kv = KVCacheManager(num_blocks=20, block_size=4)
    req = make_req("a", range(6))
    kv.get_computed_blocks(req)
    assert len(req.block_hashes) == 1
    first = req.block_hashes[0]
    req.append_output_token_ids([6, 7, 8])
    kv.get_computed_blocks(req)
    assert len(req.block_hashes) == 2 and req.block_hashes[0] is first

    fresh = make_req("b", range(9))
    kv.get_computed_blocks(fresh)
    assert fresh.block_hashes == req.block_hashes

    toks = np.arange(4, dtype=np.int32)
    h = hash_block_tokens(None, toks)
    assert h == hash_block_tokens(None, toks.astype(np.int64)) and len(h) == 32
    assert hash_block_tokens(h, toks) != h
    assert hash_block_tokens(None, toks, (("mm", 0, "x"),)) != h
    # A fixed value: the hash must not depend on the process (no salted hash()).
    assert h.hex() == "758bcc93cadcc1f71674cf648a9c290fc9d583da123748fdab3434c1ac3af11c"


def test_duplicate_content_in_flight_stays_unshared():
    kv = KVCacheManager(num_blocks=20, block_size=4)
    a, b = make_req("a", range(9)), make_req("b", range(9))
    for r in (a, b):  # both admitted before either ran: no hit, both compute the same blocks
        hits, n = kv.get_computed_blocks(r)
        assert n == 0 and kv.allocate_slots(r, 9, hits)
    for r in (a, b):
        kv.cache_blocks(r, 9)
    kv.check_invariants()
    assert len(kv.block_pool.cached_blocks) == 2
    kv.free(a)
    kv.free(b)
    kv.check_invariants()
    assert kv.is_idle_and_leak_free()


def test_block_table_array_and_slot_mapping():
    kv = KVCacheManager(num_blocks=20, block_size=4)
    a, b = make_req("a", range(6)), make_req("b", range(9))
    kv.allocate_slots(a, 6)
    kv.allocate_slots(b, 9)
    table = kv.get_block_table_array(["a", "b"], width=4)
    assert table.dtype == np.int32 and table.shape == (2, 4)
    assert list(table[0]) == kv.get_block_table("a") + [0, 0]
    with pytest.raises(ValueError):
        kv.get_block_table_array(["b"], width=2)

    req_idx = np.array([0, 0, 1, 1, -1])
    pos = np.array([0, 5, 4, 8, 3])
    slots = compute_slot_mapping(table, req_idx, pos, 4)
    ta, tb = kv.get_block_table("a"), kv.get_block_table("b")
    assert list(slots) == [ta[0] * 4, ta[1] * 4 + 1, tb[1] * 4, tb[2] * 4, 3]


def test_check_invariants_catches_corruption():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_req("a", range(6))
    kv.allocate_slots(a, 6)
    kv.block_pool.blocks[kv.get_block_table("a")[0]].ref_cnt += 1
    with pytest.raises(AssertionError, match="ref_cnt"):
        kv.check_invariants()


def test_hidden_rows_gate_the_hits_of_requests_that_return_them():
    """A request that returns hidden states hits only blocks whose rows the HiddenRowCache keeps;
    rows arrive in pieces across blocks, are kept once a block is whole and hashed, replay in
    order, and the least recently used go past the byte budget."""
    rows = HiddenRowCache(block_size=4, layers=(0, 2), max_bytes=3 * 2 * 4 * 8 * 4)  # 3 blocks of 2 layers
    kv = KVCacheManager(num_blocks=16, block_size=4, hidden_rows=rows)
    first = make_req("a", range(13), captures_hidden=True)
    assert admit(kv, first) == 0
    h = np.arange(13 * 8, dtype=np.float32).reshape(13, 8)
    rows.record(first, 0, {0: h[:6], 2: -h[:6]})  # block 0 whole, block 1 half
    assert len(rows) == 1 and first.block_hashes[0] in rows and rows.num_open_requests == 1
    rows.record(first, 6, {0: h[6:13], 2: -h[6:12]})  # layer 2 short of position 12: block 3 stays open
    assert len(rows) == 3 and rows.nbytes == 3 * 2 * 4 * 8 * 4
    rows.release("a")
    assert rows.num_open_requests == 0
    kv.free(first)

    again = make_req("b", list(range(13)) + [99], captures_hidden=True)
    assert admit(kv, again, write=False) == 12
    replayed = rows.replay(again.block_hashes[:3])
    assert np.array_equal(replayed[0], h[:12]) and np.array_equal(replayed[2], -h[:12])
    kv.free(again)
    # A request that returns no hidden states is not limited by the rows kept.
    assert admit(kv, make_req("c", range(13)), write=False) == 12

    # Past the budget the least recently used block goes: block 0 (blocks 1, 2 were just replayed
    # after it): a hit now stops before it.
    other = make_req("d", range(100, 105), captures_hidden=True)
    admit(kv, other)
    rows.record(other, 0, {0: h[:4], 2: h[:4]})
    assert len(rows) == 3 and first.block_hashes[0] not in rows and other.block_hashes[0] in rows
    assert admit(kv, make_req("e", range(13), captures_hidden=True), write=False) == 0
    # Without a cache of rows such a request takes no hit at all.
    plain = KVCacheManager(num_blocks=16, block_size=4)
    admit(plain, make_req("f", range(13)))
    assert admit(plain, make_req("g", range(13), captures_hidden=True), write=False) == 0
