"""Compiles the C++ CPU attention kernels (`kernels_cpu/paged_attention.cc`) with the package,
through setuptools' `build_ext` and the host's compiler (Python's, or $CC / $CXX). Everything
else about the package is in pyproject.toml.

The extension is optional: without a working compiler the install still succeeds and the
engine falls back to the XLA reference attention, with a warning that says why.
"""
import importlib.util
import os
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

_spec = importlib.util.spec_from_file_location(
    "build_info", Path(__file__).parent / "kernels_cpu" / "build_info.py")
build_info = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build_info)


class BuildKernels(build_ext):
    """Adds what only the build environment knows: where jaxlib keeps the XLA FFI headers."""

    def build_extension(self, ext):
        import jax  # a build requirement (pyproject.toml)

        ext.include_dirs.append(jax.ffi.include_dir())
        super().build_extension(ext)


setup(
    ext_modules=[Extension(
        build_info.MODULE,
        sources=[os.path.relpath(build_info.SOURCE, Path(__file__).parent)],  # setuptools wants it relative
        language="c++",
        extra_compile_args=list(build_info.FLAGS),
        define_macros=[("OMNI_JAX_BUILD_KEY", f'"{build_info.build_key()}"')],
        optional=True,
    )],
    cmdclass={"build_ext": BuildKernels},
)
