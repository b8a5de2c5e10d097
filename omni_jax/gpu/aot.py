"""Deviceless ahead-of-time compilation for one GPU target, and what the compiler reports.

Runs only in the GPU compile environment (`.venv-gpu`, see `omni_jax.gpu`): importing it
registers JAX's CUDA plugin. `Compiler(target).compile(fn, args)` lowers and compiles a
jitted function for the target with XLA's dump on, then reads back:

* memory: argument / output / alias / temporary bytes (`compiled.memory_analysis()`);
* launches: the thunk sequence after XLA's thunk passes (one line per kernel launch, with
  grid, threads and shared memory), and which of them run inside command buffers (CUDA
  graphs: one graph launch replays them) and which the host launches one by one
  (`Launches`);
* for each Pallas kernel: shared memory (thunk sequence) and registers / spills
  (`ptxas -v` on the Triton PTX XLA dumped);
* bytes: what the program's kernels move, from the optimized HLO (`hlo_bytes`), the
  Pallas kernels' tables (KV pool, expert weights) apart.

Nothing executes: no timing, no numerics. XLA skips autotuning without a device.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
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
from jax.sharding import Mesh, make_single_device_sharding

from ..models.layers.parallel import EP, TP
from .client import cuda_data_dir
from .hlo_bytes import program_bytes
from .targets import Target

# Pallas kernels are named after these prefixes (pallas_call name=...).
PALLAS_PREFIXES = ("paged_decode", "decode_merge", "ragged_paged_prefill", "grouped_matmul", "skinny_matmul", "rms_norm", "add_rms_norm")
# Thunks that only order or wrap others; every other thunk line is one launch.
_CONTROL_THUNKS = {"kSequential", "kWhile", "kConditional", "kWaitForStreams", "kCommandBuffer"}
_THUNK_RE = re.compile(r"^(\s*)\d+:\s+(k\w+)\s[^\]]*\]\s*(.*)$")
# A kernel thunk's name and launch, as XLA prints them: "NAME grid: [..] threads: [..]
# shared_memory: N bytes", and from jax 0.12.1 on "kernel=NAME, profile_annotation=..., launch
# dimensions=blocks: {..}, threads/block: {..}, cluster_dim=..., shmem_bytes=N, ...".
_LAUNCH_RES = (
    re.compile(r"^(\S+)\s+grid:\s*\[([\d, ]+)\]\s*threads:\s*\[([\d, ]+)\]\s*shared_memory:\s*(\d+)"),
    re.compile(r"^kernel=([^,\s]+),.*?blocks:\s*\{([\d, ]+)\},\s*threads/block:\s*\{([\d, ]+)\}.*?shmem_bytes=(\d+)"),
)


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
    launches: int = 0            # kernel launches per run, loop bodies counted once
    graphed_launches: int = 0    # of them inside command buffers
    command_buffers: int = 0
    outside_launches: list = dataclasses.field(default_factory=list)  # the others: ["kKind name"]
    host_loops: int = 0          # while / conditional thunks the host drives
    bytes_accessed: int = 0      # HBM bytes the kernels move, the Pallas tables aside (hlo_bytes)
    table_bytes: dict = dataclasses.field(default_factory=dict)  # {kernel: whole tables left out}
    partial_bytes: dict = dataclasses.field(default_factory=dict)  # {split decode kernel: all splits' partials}
    kernels: list = dataclasses.field(default_factory=list)   # [KernelReport]
    info: dict = dataclasses.field(default_factory=dict)      # program-specific facts

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Launches:
    """A program's kernel launches as its thunk sequence lists them (each counted once: a
    loop body's launches are per iteration)."""

    total: int = 0
    graphed: int = 0                    # inside a command buffer (a CUDA graph node)
    command_buffers: int = 0            # graphs launched per run (each one host launch)
    outside: list = dataclasses.field(default_factory=list)   # ["kKind name"] the host launches alone
    loops: int = 0                      # while / conditional thunks outside graphs (a host sync each)


def parse_thunks(text: str) -> tuple[Launches, list[KernelReport]]:
    """(launches, Pallas kernel launches) from a `*thunk_sequence_after_thunk_passes.txt` dump.

    Nesting is by indentation: a thunk is graphed when a `kCommandBuffer` above it holds it."""
    launches, kernels = Launches(), []
    parents: list[tuple[int, str]] = []   # (indent, kind) of the open control thunks
    for line in text.splitlines():
        m = _THUNK_RE.match(line)
        if m is None:
            continue
        indent, kind, rest = len(m.group(1)), m.group(2), m.group(3)
        g = next((g for g in (r.match(rest) for r in _LAUNCH_RES) if g), None)
        name = g.group(1) if g else (rest.split() or [""])[0]
        while parents and parents[-1][0] >= indent:
            parents.pop()
        graphed = any(k == "kCommandBuffer" for _, k in parents)
        if kind in _CONTROL_THUNKS:
            parents.append((indent, kind))
            if kind == "kCommandBuffer" and not graphed:
                launches.command_buffers += 1
            elif kind in ("kWhile", "kConditional") and not graphed:
                launches.loops += 1
            continue
        launches.total += 1
        if graphed:
            launches.graphed += 1
        else:
            launches.outside.append(f"{kind} {name}")
        if g and name.startswith(PALLAS_PREFIXES):
            to_tuple = lambda s: tuple(int(x) for x in s.split(","))  # noqa: E731
            kernels.append(KernelReport(name, to_tuple(g.group(2)), to_tuple(g.group(3)), int(g.group(4))))
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


def kernel_usage(ptx_files, names, arch: str, ptxas: str, seen: dict[str, dict]) -> dict[str, dict]:
    """`ptxas_usage` of the PTX files that hold an entry of `names`. `seen`: the usage already
    read, by the file's content (the same kernel is in many programs: the H100 tier's 290 files
    are 210 distinct ones, read in 12 s once each)."""
    usage = {}
    for ptx in ptx_files:
        body = Path(ptx).read_text()
        if any(f".entry {name}(" in body for name in names):
            key = hashlib.sha256(f"{arch}\n{body}".encode()).hexdigest()
            if key not in seen:
                seen[key] = ptxas_usage(ptx, arch, ptxas)
            usage.update(seen[key])
    return usage


class Compiler:
    """Compiles jitted functions for one target, without the GPU."""

    def __init__(self, target: Target):
        self.target = target
        self.topology = topologies.get_topology_desc(platform="cuda", target_config=target.config_text,
                                                     topology="1x1x1")
        self.device = self.topology.devices[0]
        self.sharding = make_single_device_sharding(self.device)
        self.mesh = target.abstract_mesh()
        self.ptxas = os.path.join(cuda_data_dir(), "bin", "ptxas")
        self._ptx_usage: dict[str, dict] = {}  # kernel_usage's, by PTX content

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
            # The emitter regex: XLA dumps the kernels' PTX (ptxas_usage) only when it matches
            # "ptx" since jax 0.11 (dumped anyway before).
            compiled = lowered.compile(compiler_options={"xla_dump_to": dump, "xla_dump_emitter_re": "ptx"})
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
            # After the thunk passes: what runs, command buffers included (a program of one
            # kernel has no passes, and only the plain sequence).
            thunks = (glob.glob(os.path.join(dump, "*thunk_sequence_after_thunk_passes.txt"))
                      or glob.glob(os.path.join(dump, "*thunk_sequence.txt")))
            # The program's own module is the last one compiled (earlier ones are helpers).
            text = Path(max(thunks, key=os.path.getmtime)).read_text() if thunks else ""
            launches, report.kernels = parse_thunks(text)
            report.launches, report.graphed_launches = launches.total, launches.graphed
            report.command_buffers, report.outside_launches = launches.command_buffers, launches.outside
            report.host_loops = launches.loops
            hlo = glob.glob(os.path.join(dump, "*gpu_after_optimizations.txt"))
            if hlo:
                moved = program_bytes(Path(max(hlo, key=os.path.getmtime)).read_text())
                report.bytes_accessed, report.table_bytes = moved["bytes"], moved["tables"]
                report.partial_bytes = moved["partials"]
            if check_kernels and report.kernels:
                usage = kernel_usage(glob.glob(os.path.join(dump, "*.ptx")), [k.name for k in report.kernels],
                                     self.target.arch, self.ptxas, self._ptx_usage)
                for k in report.kernels:
                    for key, value in usage.get(k.name, {}).items():
                        setattr(k, key, value)
        finally:
            shutil.rmtree(dump, ignore_errors=True)
        return report
