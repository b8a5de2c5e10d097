"""Tensor and expert parallelism inside one stage: the mesh the layers see while a step is traced.

A stage spanning several devices runs its jitted step over a `jax.sharding.Mesh` with axes
("ep", "tp") (engine/sharding.py builds it and places the parameters). Most of the step is
partitioned by XLA from the parameters' shardings; the two places that cannot be left to it
are written per shard with `shard_map`:

* paged attention (`Attention` in paged mode): the Pallas kernels have no partitioning rule,
  so kernel and XLA reference both run per shard over the "tp" axis, each shard on its own
  query heads and its own KV pages. The attention code is the same for every layout.
* MoE experts (`SparseMoeBlock`): each "ep" shard holds num_experts / EP experts, runs the
  token-expert pairs routed to them and the shards' outputs are summed.

The runner enters `use_mesh` around the step's body (a trace-time setting, like a static
argument); outside it, or with a mesh of one device, every layer runs exactly as before.

KV heads over the tensor axis: with num_kv_heads divisible by TP each shard holds
num_kv_heads / TP of them; with fewer KV heads than shards (e.g. 4 at TP 8) each KV head is
stored TP / num_kv_heads times, one copy per shard that needs it (vLLM's layout), so every
shard still holds exactly one KV head and its query heads' group.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from jax.sharding import Mesh

TP = "tp"  # tensor axis: attention heads, MLP intermediate, vocabulary
EP = "ep"  # expert axis: MoE experts

_MESH: Mesh | None = None


@contextlib.contextmanager
def use_mesh(mesh: Mesh | None) -> Iterator[None]:
    """Layers traced inside see `mesh` (None: single-device, nothing changes)."""
    global _MESH
    prev, _MESH = _MESH, mesh
    try:
        yield
    finally:
        _MESH = prev


def current_mesh() -> Mesh | None:
    """The stage's mesh while its step is traced, else None."""
    return _MESH


def axis_size(axis: str) -> int:
    """Shards along `axis` of the current mesh (1 without one)."""
    if _MESH is None or axis not in _MESH.axis_names:
        return 1
    return int(_MESH.shape[axis])


def kv_heads_stored(num_kv_heads: int, tp: int) -> int:
    """KV heads the paged cache holds at tensor parallel size `tp` (module docstring)."""
    if num_kv_heads % tp == 0:
        return num_kv_heads
    if tp % num_kv_heads == 0:
        return tp
    raise ValueError(f"tensor_parallel_size {tp} and num_kv_heads {num_kv_heads}: one must divide the other")
