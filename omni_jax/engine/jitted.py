"""The jitted programs one object runs, by name (`Jitted`).

Every object that compiles programs (the runner's steps, the sampler, media encoders,
vocoder synthesizers) keeps them in one `Jitted` namespace and calls them through it, so
that what it compiles is declared in one place: warm-up compiles them, and the GPU tier
(`omni_jax.gpu.programs`) records each call a warm-up makes (`record`) to compile the same
program at real size for a GPU it does not have.
"""

from __future__ import annotations

import types
from typing import Callable


# Compiler options of the programs whose matmuls go to cuBLAS instead of XLA's Triton GEMM, which
# finds no tile for some of them ("Couldn't find output tile sizes", deviceless compiles): a bf16
# [patches, 1280] one of Qwen2.5's vision encoder on A100, an f32 [640, 32] one of the tiny
# Qwen2.5's audio encoder and an f32 [2600, 1024] one of Qwen3-Omni's code2wav (8 windows of
# 325 frames) on H100. The encoders and the fp32 vocoders use them; other backends ignore them.
NO_TRITON_GEMM = {"xla_gpu_enable_triton_gemm": False}


class Jitted(types.SimpleNamespace):
    """Named jitted functions: `jitted.step(...)` calls the program named "step"."""

    def record(self, wrap: Callable[[str, Callable], Callable]) -> None:
        """Route every program through `wrap(name, fn)`, which returns what is called instead."""
        for name, fn in list(vars(self).items()):
            setattr(self, name, wrap(name, fn))
