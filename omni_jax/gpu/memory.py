"""Device memory of a stage on a target: weights, KV blocks, the share a stage may use.

Mirrors what a stage process does at load time (`engine.runner.resolve_num_blocks`): XLA
preallocates `memory_fraction` of the device for the stage's process; the weights take
their bytes; `kv_memory_fraction` of what is left becomes KV blocks, capped at what
`max_num_seqs` full-length sequences can use; the rest holds the steps' temporaries.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from ..config import StageConfig
from .targets import Target


def tree_bytes(tree) -> int:
    """Bytes of every array (or abstract array) in a pytree."""
    return int(sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)
                   if hasattr(x, "shape")))


@dataclasses.dataclass(frozen=True)
class StageMemory:
    """How one stage's share of a device divides (bytes)."""

    share: int              # memory_fraction of the device (the whole device if unset)
    params: int
    kv_budget: int          # kv_memory_fraction of share - params
    block_bytes: int        # one KV block, all layers, K and V (0: no KV cache)
    num_blocks: int         # blocks the engine would allocate (capped at what it can use)
    blocks_wanted: int      # max_num_seqs full-length sequences + the dummy block
    headroom: int           # share - params - KV: room for the steps' temporaries

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.block_bytes


def stage_memory(stage: StageConfig, target: Target, params: int, block_bytes: int) -> StageMemory:
    """The division of `stage`'s share of `target` (KV only for stages with a KV cache)."""
    share = int(target.device_memory_size * (stage.memory_fraction or 1.0))
    if not block_bytes:
        return StageMemory(share, params, 0, 0, 0, 0, share - params)
    wanted = stage.max_num_seqs * stage.blocks_per_seq + 1
    budget = int(max(share - params, 0) * (stage.kv_memory_fraction or 0.0))
    blocks = stage.num_blocks or min(budget // block_bytes, wanted)
    return StageMemory(share, params, budget, block_bytes, int(blocks), wanted,
                       share - params - int(blocks) * block_bytes)
