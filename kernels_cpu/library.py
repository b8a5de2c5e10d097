"""Loads the compiled CPU kernels into XLA, or says why they cannot be used.

`setup.py` compiles `paged_attention.cc` into the extension `kernels_cpu._paged_attention` when
OmniJax is installed (`pip install -e .`, as `.ci/setup` does). It is a plain shared library:
ctypes loads it and its handlers are registered with XLA:CPU as FFI targets. A library built
from another source or for another CPU (see `build_info`) is refused, not run.
"""
from __future__ import annotations

import ctypes
import functools
import importlib.machinery
from pathlib import Path

import jax

from kernels_cpu import build_info

# The handlers the library exports, by the names XLA knows them under.
TARGETS = {"omni_jax_paged_attention": "OmniJaxPagedAttention",
           "omni_jax_ragged_paged_attention": "OmniJaxRaggedPagedAttention"}
_REINSTALL = "reinstall OmniJax to compile it for this machine: pip install -v -e ."


class KernelBuildError(RuntimeError):
    """The CPU kernels are not built here, are stale, or cannot be loaded."""


def library_path() -> Path | None:
    """The compiled extension, if the install built one."""
    stem = Path(__file__).with_name(build_info.MODULE.rpartition(".")[2])
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        if (path := stem.with_name(stem.name + suffix)).exists():
            return path
    return None


@functools.cache
def register() -> None:
    """Loads the library and registers its handlers with XLA:CPU (once per process)."""
    path = library_path()
    if path is None:
        raise KernelBuildError(f"{build_info.SOURCE.name} was not compiled when OmniJax was installed "
                               f"(no C++ compiler then?); {_REINSTALL}")
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise KernelBuildError(f"loading the CPU kernels failed: {exc}; {_REINSTALL}") from exc
    lib.OmniJaxBuildKey.restype = ctypes.c_char_p
    if (built := lib.OmniJaxBuildKey().decode()) != (want := build_info.build_key()):
        raise KernelBuildError(f"{path.name} was built from another {build_info.SOURCE.name} or for "
                               f"another CPU (build key {built}, here {want}); {_REINSTALL}")
    for target, symbol in TARGETS.items():
        try:
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
        except jax.errors.JaxRuntimeError as exc:  # e.g. built against a newer jaxlib's FFI headers
            raise KernelBuildError(f"XLA (jaxlib {jax.lib.__version__}) refused {path.name}: {exc}; "
                                   f"{_REINSTALL}") from exc


@functools.cache
def unavailable_reason() -> str | None:
    """None when the kernels work here; else why not (the engine then uses the XLA reference)."""
    try:
        register()
    except KernelBuildError as exc:
        return str(exc)
    return None

