"""Present per-expert checkpoint tensors as the fused expert tensors OmniJax modules load.

Qwen3-MoE checkpoints (Qwen3-Omni thinker and talker) store each expert separately::

    <block>.experts.<e>.gate_proj.weight   [I, H]
    <block>.experts.<e>.up_proj.weight     [I, H]
    <block>.experts.<e>.down_proj.weight   [H, I]

while transformers (in memory) and OmniJax's SparseMoeBlock hold them fused::

    <block>.experts.gate_up_proj   [E, 2I, H]   (gate rows first, then up)
    <block>.experts.down_proj      [E, H, I]

:func:`fuse_expert_keys` rewrites a key list, :func:`fused_expert_getter` wraps a
tensor getter, and :class:`FusedExperts` does both as a read-only mapping, so the
generic conversion (mapping.py ``map_hf_tensors`` / ``convert_tensors``, or
``load_hf_into``) runs unchanged over it. Fused tensors are stacked on demand,
one at a time (a real Qwen3-Omni thinker layer's gate_up_proj is 0.8 GB in bf16).
:func:`split_fused_experts` is the inverse.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Callable, Iterable

import numpy as np

from ...errors import CheckpointError

_EXPERT_KEY = re.compile(r"^(?P<block>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_PROJS = ("gate_proj", "up_proj", "down_proj")


def _scan(keys: Iterable[str]) -> tuple[list[str], dict[str, int]]:
    """Split keys into (other keys, {experts block prefix: number of experts}), checking completeness."""
    others: list[str] = []
    found: dict[str, dict[str, set[int]]] = {}
    for key in keys:
        m = _EXPERT_KEY.match(key)
        if m is None:
            others.append(key)
            continue
        found.setdefault(m["block"], {p: set() for p in _PROJS})[m["proj"]].add(int(m["e"]))
    counts = {}
    for block, per_proj in found.items():
        n = max(max(ids) for ids in per_proj.values() if ids) + 1
        for proj in _PROJS:
            missing = sorted(set(range(n)) - per_proj[proj])
            if missing:
                raise CheckpointError(
                    f"checkpoint is missing expert tensor {block}.{missing[0]}.{proj}.weight "
                    f"({len(missing)} {proj} tensor(s) of {block} missing in all)")
        counts[block] = n
    return others, counts


def fuse_expert_keys(keys: Iterable[str]) -> list[str]:
    """The key list with each block's per-expert keys replaced by its two fused keys."""
    others, counts = _scan(keys)
    fused = [f"{block}.{name}" for block in counts for name in ("gate_up_proj", "down_proj")]
    return others + fused


def fused_expert_getter(keys: Iterable[str], get_tensor: Callable[[str], np.ndarray]
                        ) -> Callable[[str], np.ndarray]:
    """A getter serving fused expert keys (stacked from `get_tensor`) and every other key as is."""
    _, counts = _scan(keys)

    def get(key: str) -> np.ndarray:
        block, _, name = key.rpartition(".")
        n = counts.get(block)
        if n is None or name not in ("gate_up_proj", "down_proj"):
            return get_tensor(key)
        if name == "down_proj":
            return np.stack([np.asarray(get_tensor(f"{block}.{e}.down_proj.weight")) for e in range(n)])
        return np.stack([np.concatenate([np.asarray(get_tensor(f"{block}.{e}.gate_proj.weight")),
                                         np.asarray(get_tensor(f"{block}.{e}.up_proj.weight"))], axis=0)
                         for e in range(n)])

    return get


class FusedExperts(Mapping):
    """Read-only view of a checkpoint (any mapping or object with keys()/get()) with fused experts."""

    def __init__(self, weights):
        keys = list(weights.keys())
        getter = weights.get if not isinstance(weights, Mapping) else weights.__getitem__
        self._keys = fuse_expert_keys(keys)
        self._key_set = set(self._keys)
        self._get = fused_expert_getter(keys, getter)

    def __getitem__(self, key: str) -> np.ndarray:
        if key not in self._key_set:
            raise KeyError(key)
        return self._get(key)

    def get(self, key, default=None):
        return self[key] if key in self._key_set else default

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key) -> bool:
        return key in self._key_set


def split_fused_experts(key: str, array: np.ndarray) -> dict[str, np.ndarray]:
    """Inverse of the fusion for one fused tensor: {per-expert key: tensor}."""
    block, _, name = key.rpartition(".")
    if name == "down_proj":
        return {f"{block}.{e}.down_proj.weight": array[e] for e in range(array.shape[0])}
    if name != "gate_up_proj":
        raise ValueError(f"{key!r} is not a fused expert key")
    inter = array.shape[1] // 2
    out = {}
    for e in range(array.shape[0]):
        out[f"{block}.{e}.gate_proj.weight"] = array[e, :inter]
        out[f"{block}.{e}.up_proj.weight"] = array[e, inter:]
    return out
