"""The captured hidden rows of cached KV blocks, so that requests returning hidden states take
prefix-cache hits too.

A speech reply's thinker sends the talker its hidden states at every prompt position. A
prefix-cache hit skips computing the cached blocks, and with them those rows, so without this
such a request computed its whole prompt, and every turn of a spoken conversation its whole
history. The engine records the rows of each full block under the block's hash (the KV's key:
rows, like KV, are a function of the prefix); a request that returns hidden states hits only
blocks whose rows are kept, and gets the hit's rows replayed as if it had computed them.

Rows live in host memory, least recently used dropped past a byte budget; a block whose rows
are gone is computed again, as a block whose KV is evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Sequence

import numpy as np

from omni_jax.engine.protocol import Request


class _OpenBlock:
    """One block's rows while a request is computing it: [block_size, H] per layer, and which are in."""

    __slots__ = ("rows", "filled")

    def __init__(self):
        self.rows: dict[int, np.ndarray] = {}
        self.filled: dict[int, np.ndarray] = {}

    def put(self, layer: int, at: int, rows: np.ndarray, block_size: int) -> None:
        if layer not in self.rows:
            self.rows[layer] = np.zeros((block_size, *rows.shape[1:]), rows.dtype)
            self.filled[layer] = np.zeros(block_size, bool)
        self.rows[layer][at:at + len(rows)] = rows
        self.filled[layer][at:at + len(rows)] = True

    def complete(self, layers: Iterable[int]) -> bool:
        return all(layer in self.filled and self.filled[layer].all() for layer in layers)


class HiddenRowCache:
    """Hidden rows of full KV blocks by block hash (see the module docstring)."""

    def __init__(self, block_size: int, layers: Sequence[int], max_bytes: int):
        self.block_size = block_size
        self.layers = tuple(layers)
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._blocks: OrderedDict[bytes, dict[int, np.ndarray]] = OrderedDict()  # LRU first
        self._open: dict[str, dict[int, _OpenBlock]] = {}  # request id -> block index -> rows so far

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def num_open_requests(self) -> int:
        """Requests with rows recorded for blocks not yet kept (0 when the engine is idle)."""
        return len(self._open)

    def record(self, request: Request, offset: int, hidden: dict[int, np.ndarray]) -> None:
        """Take a step's rows of `request` (layer -> rows from absolute position `offset`); each
        block whose rows are all in and whose hash the KV cache gave (`request.block_hashes`) is kept."""
        bs, hashes = self.block_size, request.block_hashes
        blocks = self._open.setdefault(request.request_id, {})
        for layer, rows in hidden.items():
            if layer not in self.layers:
                continue
            pos, end = offset, offset + len(rows)
            while pos < end:
                b = pos // bs
                stop = min(end, (b + 1) * bs)
                # A block already kept (the same prefix computed before) is not gathered again.
                if b in blocks or not (b < len(hashes) and hashes[b] in self._blocks):
                    blocks.setdefault(b, _OpenBlock()).put(layer, pos - b * bs, rows[pos - offset:stop - offset], bs)
                pos = stop
        for b in [b for b in blocks if b < len(hashes) and blocks[b].complete(self.layers)]:
            self._keep(hashes[b], blocks.pop(b).rows)

    def replay(self, block_hashes: Sequence[bytes]) -> dict[int, np.ndarray]:
        """The kept rows of these blocks, in order (layer -> [n * block_size, H]); KeyError if one is gone."""
        kept = [self._blocks[h] for h in block_hashes]
        for h in block_hashes:
            self._blocks.move_to_end(h)
        return {layer: np.concatenate([k[layer] for k in kept]) for layer in self.layers}

    def release(self, request_id: str) -> None:
        """Drop a request's rows of blocks not yet kept (it ended)."""
        self._open.pop(request_id, None)

    def clear(self) -> None:
        self._blocks.clear()
        self.nbytes = 0

    def _keep(self, block_hash: bytes, rows: dict[int, np.ndarray]) -> None:
        if block_hash in self._blocks:
            self._blocks.move_to_end(block_hash)
            return
        size = sum(r.nbytes for r in rows.values())
        if size > self.max_bytes:
            return
        self._blocks[block_hash] = rows
        self.nbytes += size
        while self.nbytes > self.max_bytes:
            _, dropped = self._blocks.popitem(last=False)
            self.nbytes -= sum(r.nbytes for r in dropped.values())
