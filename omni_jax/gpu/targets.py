"""GPU targets for deviceless compilation: XLA GPU target configs kept in `targets/`.

Each `*.txtpb` is a `stream_executor.GpuTargetConfigProto` (text format) that XLA
compiles against instead of a real device. `Target` reads the few facts the checks and
the plan need from it (shared memory, registers, bandwidth, memory size).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from jax.sharding import AbstractDevice, AbstractMesh, AxisType

TARGETS_DIR = Path(__file__).resolve().parent / "targets"
# Short names accepted on the command line -> config file stem.
FILES = {"h100": "h100_sxm", "a100": "a100_sxm_80", "h200": "h200_sxm"}


@dataclasses.dataclass(frozen=True)
class Target:
    """One GPU model as XLA sees it when compiling without the device."""

    name: str                    # "h100" | "a100" | "h200"
    config_text: str             # the GpuTargetConfigProto text XLA compiles for
    device_kind: str             # device_description_str, what jax reports as device_kind
    compute_capability: int      # 90, 80
    core_count: int              # SMs
    shared_memory_per_block_optin: int
    registers_per_block_limit: int
    memory_bandwidth: int        # bytes / s
    device_memory_size: int      # bytes

    def abstract_mesh(self) -> AbstractMesh:
        """A one-device mesh of this GPU, to lower or compile under (`jax.sharding.use_abstract_mesh`):
        Pallas and the kernels' tuning tables ask it which GPU the program is for (from JAX 0.11
        on, the Triton backend refuses to lower without a GPU or such a mesh). Its axis is
        Auto, as the engine's meshes are (under the default axis types JAX 0.12 asks ragged_dot
        for explicit output shardings)."""
        return AbstractMesh((1,), ("x",), axis_types=(AxisType.Auto,), abstract_device=AbstractDevice(
            device_kind=self.device_kind, num_cores=None, platform="cuda"))

    @property
    def arch(self) -> str:
        """ptxas architecture ("sm_90a" for Hopper, as XLA emits; "sm_80" for Ampere)."""
        cc = self.compute_capability
        return f"sm_{cc}a" if cc >= 90 else f"sm_{cc}"


def _field(text: str, name: str, cast=int):
    m = re.search(rf"^\s*{name}:\s*(\S+)\s*$", text, re.M)
    if m is None:
        raise ValueError(f"target config lacks {name}")
    return cast(m.group(1).strip('"'))


def _capability(text: str) -> int:
    m = re.search(r"cuda_compute_capability\s*\{([^}]*)\}", text)
    if m is None:
        raise ValueError("target config lacks cuda_compute_capability")
    major = re.search(r"major:\s*(\d+)", m.group(1))
    minor = re.search(r"minor:\s*(\d+)", m.group(1))
    return int(major.group(1)) * 10 + (int(minor.group(1)) if minor else 0)


def load_target(name: str) -> Target:
    """The target called `name` ("h100" or "a100")."""
    if name not in FILES:
        raise ValueError(f"unknown GPU target {name!r}; known: {sorted(FILES)}")
    text = (TARGETS_DIR / f"{FILES[name]}.txtpb").read_text()
    kind = re.search(r'^device_description_str:\s*"([^"]+)"', text, re.M)
    return Target(
        name=name, config_text=text, device_kind=kind.group(1) if kind else name,
        compute_capability=_capability(text), core_count=_field(text, "core_count"),
        shared_memory_per_block_optin=_field(text, "shared_memory_per_block_optin"),
        registers_per_block_limit=_field(text, "registers_per_block_limit"),
        memory_bandwidth=_field(text, "memory_bandwidth"),
        device_memory_size=_field(text, "device_memory_size"))


def all_targets() -> list[Target]:
    """Every target kept in the repository."""
    return [load_target(n) for n in FILES]
