"""Deviceless ahead-of-time compilation for one GPU target, and what the compiler reports.

Runs only in the GPU compile environment (`.venv-gpu`, see `omni_jax.gpu`): importing it
registers JAX's CUDA plugin. `Compiler(target).compile(fn, args)` lowers and compiles a
jitted function for the target with XLA's dump on, then reads back:

* memory: argument / output / alias / temporary bytes (`compiled.memory_analysis()`);
* launches: the thunk sequence (one line per kernel launch, with grid, threads and
  shared memory per launch);
* for each Pallas kernel: shared memory (thunk sequence) and registers / spills
  (`ptxas -v` on the Triton PTX XLA dumped).

Nothing executes: no timing, no numerics. XLA skips autotuning without a device.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from jax.experimental import topologies
from jax.sharding import Mesh, SingleDeviceSharding

from ..models.layers.parallel import EP, TP
from .client import cuda_data_dir
from .targets import Target

# Pallas kernels are named after these prefixes (pallas_call name=...).
PALLAS_PREFIXES = ("paged_decode", "ragged_paged_prefill", "grouped_matmul")
# Thunks that only order or wrap others; every other thunk line is one launch.
_CONTROL_THUNKS = {"kSequential", "kWhile", "kConditional", "kWaitForStreams", "kCommandBuffer"}
_THUNK_RE = re.compile(r"^\s*\d+:\s+(k\w+)\s.*?\]\s+(\S+)(.*)$")
_LAUNCH_RE = re.compile(r"grid:\s*\[([\d, ]+)\]\s*threads:\s*\[([\d, ]+)\]\s*shared_memory:\s*(\d+)")


@dataclasses.dataclass
class KernelReport:
    """One Pallas kernel launch as compiled: launch shape and resource use."""

    name: str
    grid: tuple
    threads: tuple
    shared_memory: int
    registers: int = -1
    spill_stores: int = -1
    spill_loads: int = -1
    stack_frame: int = -1


@dataclasses.dataclass
class CompileReport:
    """What compiling one program for a target showed (or the error that stopped it)."""

    name: str
    ok: bool
    error: str = ""
    seconds: float = 0.0
    argument_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0
    temp_bytes: int = 0
    launches: int = 0
    kernels: list = dataclasses.field(default_factory=list)   # [KernelReport]
    info: dict = dataclasses.field(default_factory=dict)      # program-specific facts

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def parse_thunks(text: str) -> tuple[int, list[KernelReport]]:
    """(launch count, Pallas kernel launches) from a `*thunk_sequence.txt` dump."""
    launches, kernels = 0, []
    for line in text.splitlines():
        m = _THUNK_RE.match(line)
        if m is None or m.group(1) in _CONTROL_THUNKS:
            continue
        launches += 1
        name = m.group(2)
        g = _LAUNCH_RE.search(m.group(3))
        if g and name.startswith(PALLAS_PREFIXES):
            to_tuple = lambda s: tuple(int(x) for x in s.split(","))  # noqa: E731
            kernels.append(KernelReport(name, to_tuple(g.group(1)), to_tuple(g.group(2)), int(g.group(3))))
    return launches, kernels


def ptxas_usage(ptx_file: str, arch: str, ptxas: str) -> dict[str, dict]:
    """Per entry function of a PTX file: registers, spill stores/loads, stack frame bytes."""
    out = subprocess.run([ptxas, "-v", f"-arch={arch}", ptx_file, "-o", os.devnull],
                         capture_output=True, text=True, check=True).stderr
    usage, entry = {}, None
    for line in out.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            entry = m.group(1)
            usage[entry] = {}
        elif entry and "spill stores" in line:
            nums = [int(x) for x in re.findall(r"(\d+) bytes", line)]
            usage[entry].update(stack_frame=nums[0], spill_stores=nums[1], spill_loads=nums[2])
        elif entry and "Used" in line and "registers" in line:
            usage[entry]["registers"] = int(re.search(r"Used (\d+) registers", line).group(1))
    return usage


class Compiler:
    """Compiles jitted functions for one target, without the GPU."""

    def __init__(self, target: Target):
        self.target = target
        self.topology = topologies.get_topology_desc(platform="cuda", target_config=target.config_text,
                                                     topology="1x1x1")
        self.device = self.topology.devices[0]
        self.sharding = SingleDeviceSharding(self.device)
        self.mesh = target.abstract_mesh()
        self.ptxas = os.path.join(cuda_data_dir(), "bin", "ptxas")

    def stage_mesh(self, tensor_parallel_size: int, expert_parallel_size: int = 1) -> Mesh:
        """A stage's ("ep", "tp") mesh over TP * EP GPUs of this target in one host (the
        engine's layout, engine/sharding.py)."""
        n = tensor_parallel_size * expert_parallel_size
        topology = topologies.get_topology_desc(platform="cuda", target_config=self.target.config_text,
                                                topology=f"1x1x{n}")
        return Mesh(np.array(topology.devices).reshape(expert_parallel_size, tensor_parallel_size), (EP, TP))

    def sds(self, shape, dtype) -> jax.ShapeDtypeStruct:
        """An abstract argument placed on the target device."""
        return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=self.sharding)

    def place(self, tree):
        """Abstract arrays (anything with shape and dtype) of a pytree, placed on the target."""
        return jax.tree.map(lambda x: self.sds(x.shape, x.dtype), tree)

    def compile(self, name: str, jitted, *args, check_kernels: bool = True, mesh: Mesh | None = None,
                **kwargs) -> CompileReport:
        """Lower and compile `jitted(*args, **kwargs)`; errors become a failed report. `mesh`: the
        program runs over it (`stage_mesh`; its arguments carry their shardings)."""
        dump = tempfile.mkdtemp(prefix="omni_jax_aot_")
        t0 = time.perf_counter()
        try:
            with jax.sharding.use_abstract_mesh(self.mesh if mesh is None else mesh.abstract_mesh):
                lowered = jitted.lower(*args, **kwargs)
            compiled = lowered.compile(compiler_options={"xla_dump_to": dump})
        except Exception as e:  # the compiler's verdict is the result
            shutil.rmtree(dump, ignore_errors=True)
            return CompileReport(name, False, error=f"{type(e).__name__}: {e}".splitlines()[0][:500],
                                 seconds=time.perf_counter() - t0)
        seconds = time.perf_counter() - t0
        mem = compiled.memory_analysis()
        report = CompileReport(name, True, seconds=seconds, argument_bytes=mem.argument_size_in_bytes,
                               output_bytes=mem.output_size_in_bytes, alias_bytes=mem.alias_size_in_bytes,
                               temp_bytes=mem.temp_size_in_bytes)
        try:
            thunks = glob.glob(os.path.join(dump, "*thunk_sequence.txt"))
            # The program's own module is the last one compiled (earlier ones are helpers).
            text = Path(max(thunks, key=os.path.getmtime)).read_text() if thunks else ""
            report.launches, report.kernels = parse_thunks(text)
            if check_kernels and report.kernels:
                usage = {}
                for ptx in glob.glob(os.path.join(dump, "*.ptx")):
                    body = Path(ptx).read_text()
                    if any(f".entry {k.name}(" in body for k in report.kernels):
                        usage.update(ptxas_usage(ptx, self.target.arch, self.ptxas))
                for k in report.kernels:
                    for key, value in usage.get(k.name, {}).items():
                        setattr(k, key, value)
        finally:
            shutil.rmtree(dump, ignore_errors=True)
        return report
