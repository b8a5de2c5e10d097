"""The KV cache blocks a stage's scheduler hands out: which block ids each request owns.

The device holds K/V pages `[num_blocks, block_size, ...]`; the host only decides which
block ids each request owns (`KVCacheManager`, over a `BlockPool`). Block 0 is the dummy
block (padding slots write into it), so it is never handed out. A full block whose KV is
written gets a chained hash (parent hash, its token ids, extra keys such as media content
hashes); when its last user frees it, it keeps the hash and joins the free queue, from which
it is either revived by a prefix-cache hit or evicted (least recently freed first) when a
fresh block is needed.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Optional

import numpy as np

from omni_jax.engine.protocol import Request
from omni_jax.engine.runner import DUMMY_BLOCK_ID, cdiv

if TYPE_CHECKING:
    from omni_jax.engine.hidden_cache import HiddenRowCache

_ROOT_HASH = b"omni-jax-prefix-cache-v1"


# -- block hashing ------------------------------------------------------------------------------
def _key_bytes(key: Any) -> bytes:
    # Tagged and length-prefixed so that different keys never encode to the same bytes.
    if isinstance(key, (bytes, bytearray)):
        tag, raw = b"b", bytes(key)
    elif isinstance(key, str):
        tag, raw = b"s", key.encode()
    elif isinstance(key, (int, np.integer)):
        tag, raw = b"i", str(int(key)).encode()
    elif isinstance(key, tuple):
        tag, raw = b"t", b"".join(_key_bytes(k) for k in key)
    else:
        raise TypeError(f"unsupported prefix-cache extra key type {type(key).__name__}")
    return tag + len(raw).to_bytes(8, "little") + raw


def hash_block_tokens(parent_hash: Optional[bytes], token_ids: np.ndarray, extra_keys: tuple = ()) -> bytes:
    """Chained hash of one full block: blake2b(parent hash, int32 token bytes, extra keys).

    Deterministic across processes (unlike Python's salted `hash()`).
    """
    h = hashlib.blake2b(digest_size=32)
    h.update(_ROOT_HASH if parent_hash is None else parent_hash)
    h.update(np.ascontiguousarray(token_ids, dtype="<i4").tobytes())
    for key in extra_keys:
        h.update(_key_bytes(key))
    return h.digest()


def block_extra_keys(request: Request, start: int, end: int) -> tuple:
    """Extra hash keys of the block covering token positions [start, end) of `request`.

    Every media placeholder range overlapping the block contributes its content hash, its
    offset relative to the block and its length; the first block carries the cache salt.
    """
    keys: list[Any] = []
    if start == 0 and request.cache_salt is not None:
        keys.append(("salt", request.cache_salt))
    for offset, length, content_hash in request.mm_hashes:
        if offset >= end:
            break  # sorted by offset
        if offset + length > start:
            keys.append(("mm", offset - start, length, content_hash))
    return tuple(keys)


# -- block pool ---------------------------------------------------------------------------------
class KVCacheBlock:
    """One KV block: id, number of requests using it, and its prefix-cache hash if full and cached."""

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Optional[bytes] = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hash={h})"


class BlockPool:
    """All KV blocks: ref counts, the free queue (LRU eviction order) and the hash -> block table.

    The free queue holds every block with ref count 0. Its head is taken first: blocks that
    carry no cached content are put at the head, cached blocks at the tail, so cached
    prefixes are evicted last and in the order they were freed.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the dummy block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # OrderedDict as an O(1) LRU list that also supports removal from the middle (cache hits).
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self.cached_blocks: dict[bytes, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (cached-but-unused blocks included)."""
        return len(self.free_queue)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def get_cached_block(self, block_hash: bytes) -> Optional[KVCacheBlock]:
        return self.cached_blocks.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on (cache-hit) blocks, pulling unused ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Hand out `n` blocks from the head of the free queue, evicting their cached content."""
        if n > len(self.free_queue):
            raise ValueError(f"cannot allocate {n} blocks: only {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; give `blocks` in the order they should be evicted."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"block {block.block_id} freed more often than allocated")
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = None
                if block.block_hash is None:
                    self.free_queue.move_to_end(block.block_id, last=False)

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> bool:
        """Register a full, written block under its hash; False if another block holds that hash."""
        if block_hash in self.cached_blocks:
            return False
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only when no block is in use (else False), as in-use blocks
        may be shared through their hash."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()
        return True


# -- manager ------------------------------------------------------------------------------------
@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups, counted in tokens at each admission of a request."""

    requests: int = 0
    queries: int = 0  # prompt (+ output, if resumed) tokens looked up
    hits: int = 0  # of which found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Per-request block tables over a `BlockPool`, with prefix caching (vLLM v1 style API)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hidden_rows: "Optional[HiddenRowCache]" = None) -> None:
        """`hidden_rows`: the blocks whose hidden rows are kept (engine/hidden_cache.py): a request
        that captures hidden states hits only those (none without it)."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.hidden_rows = hidden_rows
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # The same tables as plain id lists, grown incrementally: copying one is a memcpy.
        self.req_to_block_ids: dict[str, list[int]] = {}
        # How many leading blocks of each request are already registered in the hash table.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    # -- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks available for allocation (unused cached blocks count as free)."""
        return self.block_pool.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        """All blocks except the dummy block."""
        return self.num_blocks - 1

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    @property
    def max_num_tokens(self) -> int:
        """Most tokens one request's KV can ever hold (the whole pool)."""
        return self.num_usable_blocks * self.block_size

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def get_block_table(self, request_id: str) -> list[int]:
        """Block ids of a request in position order (empty if it holds none)."""
        ids = self.req_to_block_ids.get(request_id)
        return list(ids) if ids else []

    def num_held_blocks(self, request_id: str) -> int:
        return len(self.req_to_block_ids.get(request_id, ()))

    def get_block_table_array(self, request_ids: Iterable[str], width: int) -> np.ndarray:
        """int32 `[len(request_ids), width]` block tables, padded with the dummy block id."""
        ids = list(request_ids)
        table = np.full((len(ids), width), DUMMY_BLOCK_ID, dtype=np.int32)
        for row, rid in enumerate(ids):
            blocks = self.get_block_table(rid)
            if len(blocks) > width:
                raise ValueError(f"request {rid!r} holds {len(blocks)} blocks, more than the table width {width}")
            table[row, : len(blocks)] = blocks
        return table

    # -- prefix caching ------------------------------------------------------------------------
    def _block_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """The request's chained block hashes up to `num_blocks`, extending its cached list."""
        hashes = request.block_hashes
        if len(hashes) < num_blocks:
            bs = self.block_size
            if num_blocks * bs > request.num_tokens:
                raise ValueError(f"request {request.request_id!r} has no full block #{num_blocks - 1}")
            tokens = request.all_token_ids
            parent = hashes[-1] if hashes else None
            for i in range(len(hashes), num_blocks):
                start = i * bs
                extra = block_extra_keys(request, start, start + bs)
                parent = hash_block_tokens(parent, tokens[start : start + bs], extra)
                hashes.append(parent)
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request's full blocks: (blocks, number of tokens).

        Never the whole request: its last token is always left to compute, so there are logits.
        """
        if not (self.enable_prefix_caching and request.reads_prefix_cache):
            return [], 0
        rows = self.hidden_rows if request.captures_hidden else None
        if request.captures_hidden and rows is None:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, max_hit_blocks)
        hits: list[KVCacheBlock] = []
        for block_hash in hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None or (rows is not None and block_hash not in rows):
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks that are full of written KV (call after the step ran)."""
        start = self.num_cached_blocks.get(request.request_id)
        # Most steps fill no block: that test first, it is every decode's cost.
        if start is None or num_computed_tokens // self.block_size <= start:
            return
        if not (self.enable_prefix_caching and request.use_prefix_cache):
            return
        blocks = self.req_to_blocks[request.request_id]
        num_full = min(num_computed_tokens // self.block_size, len(blocks))
        if num_full <= start:
            return
        hashes = self._block_hashes(request, num_full)
        for i in range(start, num_full):
            if blocks[i].block_hash is None:
                # A duplicate (same content computed twice in one step) stays unregistered.
                self.block_pool.cache_block(blocks[i], hashes[i])
        self.num_cached_blocks[request.request_id] = num_full

    # -- allocation ----------------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Optional[list[KVCacheBlock]] = None,
    ) -> Optional[bool]:
        """Make room for `num_new_tokens` after the request's computed tokens.

        `new_computed_blocks` (from `get_computed_blocks`, only at admission) are prefix-cache
        hits prepended to the request's block table. Returns True, or None (and changes
        nothing) if the pool has too few free blocks.
        """
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid)
        # Fast path, most decode steps: the new tokens fit the blocks already held.
        if (not new_computed_blocks and blocks
                and request.num_computed_tokens + num_new_tokens <= len(blocks) * self.block_size):
            return True
        new_computed_blocks = new_computed_blocks or []
        if new_computed_blocks and blocks:
            raise ValueError(f"request {rid!r}: prefix-cache hits can only be added at admission")
        num_held = len(blocks) if blocks else 0
        num_tokens = request.num_computed_tokens + len(new_computed_blocks) * self.block_size + num_new_tokens
        num_new_blocks = max(0, self.num_blocks_for(num_tokens) - num_held - len(new_computed_blocks))
        # Hits that sit unused in the free queue leave it when touched, so they use free space too.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + num_revived > self.block_pool.num_free_blocks:
            return None

        if blocks is None:
            blocks = self.req_to_blocks[rid] = []
            self.req_to_block_ids[rid] = []
            self.num_cached_blocks[rid] = len(new_computed_blocks)
            if self.enable_prefix_caching and request.use_prefix_cache:
                stats = self.prefix_cache_stats
                stats.requests += 1
                stats.queries += request.num_tokens
                stats.hits += len(new_computed_blocks) * self.block_size
        # Touch the hits before taking new blocks, so eviction cannot pick a hit.
        self.block_pool.touch(new_computed_blocks)
        added = new_computed_blocks + self.block_pool.get_new_blocks(num_new_blocks)
        blocks.extend(added)
        self.req_to_block_ids[rid].extend(b.block_id for b in added)
        return True

    def free(self, request: Request) -> None:
        """Release the request's blocks (idempotent). Its tail blocks are evicted first."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        self.req_to_block_ids.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        """Drop all cached prefixes (and their kept hidden rows); False (nothing done) while any
        block is in use."""
        done = self.block_pool.reset_prefix_cache()
        if done and self.hidden_rows is not None:
            self.hidden_rows.clear()
        return done

    def reset_stats(self) -> PrefixCacheStats:
        """Return the prefix-cache stats so far and start counting afresh."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    # -- checks --------------------------------------------------------------------------------
    def is_idle_and_leak_free(self) -> bool:
        """True when no request holds a block and every usable block is free (or cached-free)."""
        return not self.req_to_blocks and self.num_free_blocks == self.num_usable_blocks

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (for tests and debugging)."""
        pool = self.block_pool
        users = np.zeros(self.num_blocks, dtype=np.int64)
        for rid, blocks in self.req_to_blocks.items():
            ids = [b.block_id for b in blocks]
            if DUMMY_BLOCK_ID in ids:
                raise AssertionError(f"request {rid!r} holds the dummy block")
            if len(set(ids)) != len(ids):
                raise AssertionError(f"request {rid!r} holds a block twice: {ids}")
            np.add.at(users, ids, 1)
            if ids != self.req_to_block_ids.get(rid):
                raise AssertionError(f"request {rid!r}: block id list out of sync with its blocks")
        ref = np.array([b.ref_cnt for b in pool.blocks], dtype=np.int64)
        if ref[DUMMY_BLOCK_ID] != 0 or DUMMY_BLOCK_ID in pool.free_queue:
            raise AssertionError("the dummy block was handed out or queued")
        bad = np.nonzero(ref != users)[0]
        if bad.size:
            b = int(bad[0])
            raise AssertionError(f"block {b}: ref_cnt {ref[b]} but {users[b]} requests hold it")
        free = set(pool.free_queue)
        expect_free = {int(i) + 1 for i in np.nonzero(ref[1:] == 0)[0]}
        if free != expect_free:
            raise AssertionError(f"free queue {sorted(free)} != blocks with ref 0 {sorted(expect_free)}")
        for block in pool.blocks:
            if block.ref_cnt > 1 and block.block_hash is None:
                raise AssertionError(f"block {block.block_id} is shared ({block.ref_cnt}) without a prefix hash")
        for block_hash, block in pool.cached_blocks.items():
            if block.block_hash != block_hash:
                raise AssertionError(f"hash table entry of block {block.block_id} does not match its hash")
        for rid, n in self.num_cached_blocks.items():
            if n > len(self.req_to_blocks[rid]):
                raise AssertionError(f"request {rid!r}: {n} cached blocks > blocks held")
