"""Which GPU a kernel is being compiled for, so it can take its launch settings from a table.

Each kernel module keeps a small table of tunables per compute capability, chosen from
what compiling for that GPU showed (shared memory within the limit, no register spills;
see `tests/test_gpu_compile.py`). The lookup runs at trace time:

* on a GPU, from the device's compute capability;
* in a deviceless compile (`omni_jax.gpu`), from the abstract mesh's device kind,
  which is how Pallas itself learns the target there;
* otherwise (CPU, interpret mode, lowering tests) None: the tables' most conservative
  row (the one with the smallest shared memory limit).
"""
from __future__ import annotations

import jax

__all__ = ["target_capability", "pick"]

# Device kinds (as jax reports them) of the GPUs the tables know, by compute capability.
_KINDS = ((90, ("H100", "H200", "H800", "GH200")), (80, ("A100", "A800")))


def capability_of_kind(device_kind: str) -> int | None:
    """Compute capability (90, 80) of a device kind string, None if unknown."""
    for cc, names in _KINDS:
        if any(n in device_kind for n in names):
            return cc
    return None


def target_capability() -> int | None:
    """Compute capability of the GPU being compiled for, None if there is none."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    if device is not None and device.platform in ("cuda", "gpu"):
        return capability_of_kind(device.device_kind)
    try:
        gpu = jax.local_devices(backend="gpu")[0]
    except RuntimeError:  # no GPU backend in this process
        return None
    cc = getattr(gpu, "compute_capability", None)
    return int(str(cc).replace(".", "")) if cc else capability_of_kind(gpu.device_kind)


def pick(table: dict, capability: int | None) -> dict:
    """The table row for a capability: exact, else the newest row not above it, else the
    first row (tables list their most conservative row first)."""
    if capability in table:
        return table[capability]
    below = [cc for cc in table if capability is not None and cc <= capability]
    return table[max(below)] if below else next(iter(table.values()))
