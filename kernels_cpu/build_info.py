"""What the compiled CPU kernels depend on, in one place for the two sides that need it:
`setup.py`, which compiles `paged_attention.cc` when OmniJax is installed, and `library.py`,
which refuses a library that no longer matches this source or this CPU.

Standard library only: setup.py loads this file by path, before the package can be imported.
"""
from __future__ import annotations

import hashlib
import platform
from pathlib import Path

SOURCE = Path(__file__).with_name("paged_attention.cc")
# Tuned for the CPU it is installed on, as source installs of vLLM CPU and llama.cpp are.
FLAGS = ("-O3", "-march=native", "-std=c++17", "-fopenmp-simd", "-fno-math-errno")
# The extension's module name; it is a plain shared library, loaded with ctypes.
MODULE = "kernels_cpu._paged_attention"


def _cpu_signature() -> str:
    # -march=native code is only valid on a CPU with the same features.
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), platform.processor())
    except OSError:
        return platform.processor()


def build_key() -> str:
    """A hash of the source, the flags and this CPU's features; the library embeds the one it
    was built with (`OmniJaxBuildKey()`)."""
    parts = [SOURCE.read_bytes(), " ".join(FLAGS).encode(), _cpu_signature().encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
