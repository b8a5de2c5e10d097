"""How a stage spans several devices: its mesh, and the one table placing its parameters.

A stage with tensor_parallel_size TP and expert_parallel_size EP runs over a
`jax.sharding.Mesh` of TP * EP local devices with axes ("ep", "tp"). Parameters are placed
by `PARAM_RULES`, keyed on their paths in the model state (first match wins; no match:
replicated); the paged KV cache by `kv_cache_sharding`. XLA partitions the step from these
placements; attention and the MoE experts run per shard (models/layers/parallel.py).

What is split, and why the rest is not:

* attention: q/k/v projections by output columns (heads), o_proj by input rows; k/v only
  when the KV heads divide over TP (else the small k/v projections stay replicated and
  the cache stores each KV head once per shard that needs it);
* MLPs (dense layers, the MoE's shared expert): gate/up by columns, down by rows;
* vocabulary: embedding rows and the output heads' (lm_head, codec_head) columns; the step
  gathers its logits rows, so the sampler sees whole rows and samples exactly as on one device;
* MoE experts: over "ep" (whole experts per shard); at EP 1 they are replicated over "tp":
  the fused gate_up layout ([E, 2I, H], gate rows then up rows) does not split into
  per-shard gate/up halves without re-laying out the checkpoint (a later step);
* encoders (audio_tower, visual) stay replicated: they run once per request in their own
  programs, are small next to the decoder, and their many small shapes would pay more in
  communication than they save; vocoders (oneshot stages) are one-device stages for the
  same reason. Small projections between stages (thinker_to_talker_proj, ...) and norms
  are replicated.

Device indices of the stage config are local positions in the process's devices, except in
a stage process on GPU, which sees only its devices (CUDA_VISIBLE_DEVICES, runtime/stage_worker.py)
at positions 0..n-1. A stage over several JAX processes takes the same positions in each
process, process 0's devices first (runtime/spmd.py).
"""

from __future__ import annotations

import os
import re
from typing import Callable, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ..models.layers.parallel import EP, TP, kv_heads_stored


def stage_devices(indices: Sequence[int] | None, count: int) -> list:
    """The jax devices of a stage, `count` in all: `indices` (None: the first) in each JAX
    process's own devices, process by process (a stage over several processes, runtime/spmd.py);
    see the module docstring."""
    num_processes = jax.process_count()
    if count % num_processes:
        raise ValueError(f"{count} devices do not divide over {num_processes} processes")
    if indices is None:
        indices = range(count // num_processes)
    indices = list(indices)
    per_process = [[d for d in jax.devices() if d.process_index == p] for p in range(num_processes)]
    local = per_process[jax.process_index()]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if jax.default_backend() == "gpu" and visible == ",".join(map(str, indices)):
        indices = list(range(len(indices)))
    missing = [i for i in indices if i >= len(local)]
    if missing:
        raise ValueError(f"devices {indices}: this process has only {len(local)} devices "
                         f"({local[0].platform}); no device {missing[0]}")
    return [devices[i] for devices in per_process for i in indices]


def build_mesh(devices: Sequence[int] | None, tensor_parallel_size: int, expert_parallel_size: int) -> Mesh | None:
    """The stage's ("ep", "tp") mesh, or None for a one-device stage (no mesh, as before).
    `devices`: each process's local indices (see stage_devices)."""
    n = tensor_parallel_size * expert_parallel_size
    if n == 1:
        return None
    per_process = n // jax.process_count()
    if devices is not None and len(devices) != per_process:
        raise ValueError(f"devices {list(devices)} must be tensor_parallel_size * expert_parallel_size"
                         f"{' / processes' if jax.process_count() > 1 else ''} = {per_process}")
    grid = np.array(stage_devices(devices, n), dtype=object).reshape(expert_parallel_size, tensor_parallel_size)
    return Mesh(grid, (EP, TP))


# ------------------------------------------------------------------ parameter rules
# A rule maps (shape, num_kv_heads, tp) to the axis each dimension splits over (None: whole).
Rule = Callable[[tuple, int, int], tuple]

_columns: Rule = lambda shape, kv, tp: (None,) * (len(shape) - 1) + (TP,)   # kernel [in, out], bias [out]
_rows: Rule = lambda shape, kv, tp: (TP,) + (None,) * (len(shape) - 1)      # kernel [in, out]: split in
_kv_columns: Rule = lambda shape, kv, tp: _columns(shape, kv, tp) if kv % tp == 0 else (None,) * len(shape)
_experts: Rule = lambda shape, kv, tp: (EP,) + (None,) * (len(shape) - 1)   # [E, out, in]
_replicated: Rule = lambda shape, kv, tp: (None,) * len(shape)

PARAM_RULES: tuple[tuple[str, Rule], ...] = (
    (r"(^|/)(audio_tower|visual)/", _replicated),
    (r"self_attn/q_proj/(kernel|bias)$", _columns),
    (r"self_attn/[kv]_proj/(kernel|bias)$", _kv_columns),
    (r"self_attn/o_proj/kernel$", _rows),
    (r"(gate_proj|up_proj)/(kernel|bias)$", _columns),
    (r"down_proj/kernel$", _rows),
    (r"experts/(gate_up_proj|down_proj)$", _experts),
    (r"(embed_tokens|codec_embedding)(/\d+)?/embedding$", _rows),
    (r"(lm_head|codec_head)(/\d+)?/kernel$", _columns),
)


def param_spec(path: str, shape: tuple, mesh: Mesh, num_kv_heads: int) -> P:
    """The PartitionSpec of one parameter (first matching rule; none: replicated).

    A dimension that does not divide over its axis is an error naming the parameter:
    the stage's tensor_parallel_size (or expert_parallel_size) does not fit the model.
    """
    tp = int(mesh.shape[TP])
    axes = _replicated(shape, num_kv_heads, tp)
    for pattern, rule in PARAM_RULES:
        if re.search(pattern, path):
            axes = rule(shape, num_kv_heads, tp)
            break
    for dim, axis in zip(shape, axes):
        if axis is not None and dim % mesh.shape[axis]:
            field = "tensor_parallel_size" if axis == TP else "expert_parallel_size"
            raise ValueError(f"{field} {mesh.shape[axis]} does not divide parameter {path} {tuple(shape)} "
                             f"(its {'experts' if axis == EP else 'heads / width'} are split over it)")
    return P(*axes)


def state_path(keypath) -> str:
    """'model/layers/0/self_attn/q_proj/kernel' from a state leaf's key path."""
    keys = [getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in keypath]
    if keys and keys[-1] == "value":  # the array inside an nnx Variable
        keys = keys[:-1]
    return "/".join(map(str, keys))


def param_sharding(mesh: Mesh, num_kv_heads: int) -> Callable[[str, tuple], NamedSharding]:
    """Where each parameter goes on `mesh`: (path 'model/layers/0/...', shape) -> NamedSharding by
    PARAM_RULES. load_checkpoint restores each array straight into it (no whole model on one
    device) and shard_params places an already-loaded state with it."""
    return lambda path, shape: NamedSharding(mesh, param_spec(path, shape, mesh, num_kv_heads))


def shard_params(state: nnx.State, mesh: Mesh, num_kv_heads: int) -> nnx.State:
    """The model state placed on the mesh by PARAM_RULES. Arrays already placed so (restored by
    load_checkpoint onto this mesh) are kept as they are: device_put with their own sharding
    copies nothing, and Mesh objects are interned (same devices and axes: the same mesh)."""
    where = param_sharding(mesh, num_kv_heads)

    def place(keypath, x):
        return jax.device_put(x, where(state_path(keypath), x.shape))

    return jax.tree_util.tree_map_with_path(place, state)


def check_kv_heads(mesh: Mesh, num_kv_heads: int) -> None:
    """The KV heads divide over the tensor axis, or it over them (query heads: checked where
    attention is traced, layers/attention.py)."""
    tp = int(mesh.shape[TP])
    try:
        kv_heads_stored(num_kv_heads, tp)
    except ValueError:
        raise ValueError(f"tensor_parallel_size {tp} and the stage's {num_kv_heads} KV heads: one must "
                         f"divide the other") from None


def kv_cache_sharding(mesh: Mesh) -> NamedSharding:
    """Pages [num_blocks, block_size, kv_heads, head_dim] split over their KV heads."""
    return NamedSharding(mesh, P(None, None, TP, None))


def replicated(mesh: Mesh) -> NamedSharding:
    """The same whole array on every device of the stage."""
    return NamedSharding(mesh, P())


def committed_device(state) -> jax.sharding.Sharding | None:
    """The one device a one-device stage's parameters were committed to by its caller
    (`jax.device_put(params, device)`), or None when they are uncommitted (on the default device).

    JAX compiles a program again for the same shapes when an input's committedness changes, and a
    step's outputs are committed wherever one input was: the runner commits every step input there
    too, so warm-up compiles the programs serving runs."""
    devices = set().union(*(leaf.sharding.device_set for leaf in jax.tree.leaves(state)
                            if isinstance(leaf, jax.Array) and leaf.committed))
    if not devices:
        return None
    if len(devices) > 1:
        raise ValueError(f"the stage's parameters are committed to {len(devices)} devices, but the stage runs on "
                         "one: put them on one device, or give the stage its devices and a parallel size")
    return jax.sharding.make_single_device_sharding(devices.pop())
