"""Compiles the C++ CPU kernels (paged_attention.cc) once per machine and loads them into XLA.

The library is built with the host's C++ compiler (`$CXX`, else `c++`) against the XLA FFI
headers that ship with jaxlib, tuned for this CPU (`-march=native`). It is kept under the
package (`_build/`, or a per-user temporary directory where that is read-only) with a name
that hashes everything it depends on: the source, the flags, jaxlib's version and the CPU.
`.ci/setup` builds it at install time (`build()`); otherwise the first engine that uses it
does (a few seconds). Several processes may build at once: each writes its own file and
renames it into place.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import jaxlib

log = logging.getLogger("omni_jax.kernels_cpu")

SOURCE = Path(__file__).with_name("paged_attention.cc")
FLAGS = ("-O3", "-march=native", "-std=c++17", "-fopenmp-simd", "-fno-math-errno", "-fPIC",
         "-shared")
# The handlers the library exports, by the names XLA knows them under.
TARGETS = {"omni_jax_paged_attention": "OmniJaxPagedAttention",
           "omni_jax_ragged_paged_attention": "OmniJaxRaggedPagedAttention"}


class KernelBuildError(RuntimeError):
    """The CPU kernels could not be compiled or loaded (no compiler, a compile error)."""


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise KernelBuildError("no C++ compiler found (set $CXX or install g++)")
    return cxx


def _cpu_signature() -> str:
    # -march=native code is only valid on a CPU with the same features.
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), platform.processor())
    except OSError:
        return platform.processor()


def library_path() -> Path:
    key = hashlib.sha256(b"\0".join([
        SOURCE.read_bytes(), " ".join(FLAGS).encode(), jaxlib.__version__.encode(),
        _cpu_signature().encode()])).hexdigest()[:16]
    name = f"paged_attention-{key}.so"
    here = Path(__file__).parent / "_build"
    try:
        here.mkdir(exist_ok=True)
        if os.access(here, os.W_OK) or (here / name).exists():
            return here / name
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"omni-jax-kernels-{os.getuid()}" / name


def build() -> Path:
    """The compiled library's path, compiling it first if this machine has none yet."""
    path = library_path()
    if path.exists():
        return path
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    cxx = _compiler()
    log.warning("compiling the CPU attention kernels with %s (once per machine) ...", cxx)
    start = time.perf_counter()
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    cmd = [cxx, *FLAGS, "-I", jax.ffi.include_dir(), str(SOURCE), "-o", tmp]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        os.unlink(tmp)
        raise KernelBuildError(f"compiling {SOURCE.name} failed:\n{' '.join(cmd)}\n{proc.stderr[-4000:]}")
    os.replace(tmp, path)
    log.warning("compiled the CPU attention kernels in %.1f s: %s", time.perf_counter() - start, path)
    # Builds of other sources or machines are stale here (a process that loaded one keeps it).
    for old in path.parent.glob("paged_attention-*.so"):
        if old != path:
            old.unlink(missing_ok=True)
    return path


@functools.cache
def register() -> None:
    """Builds (if needed) and loads the library, and registers its handlers with XLA:CPU."""
    try:
        lib = ctypes.CDLL(str(build()))
    except OSError as exc:
        raise KernelBuildError(f"loading the CPU kernels failed: {exc}") from exc
    for target, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")


@functools.cache
def unavailable_reason() -> str | None:
    """None when the kernels work here; else why not (the engine then uses the XLA reference)."""
    try:
        register()
    except KernelBuildError as exc:
        return str(exc)
    return None
