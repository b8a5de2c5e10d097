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


class Jitted(types.SimpleNamespace):
    """Named jitted functions: `jitted.step(...)` calls the program named "step"."""

    def record(self, wrap: Callable[[str, Callable], Callable]) -> None:
        """Route every program through `wrap(name, fn)`, which returns what is called instead."""
        for name, fn in list(vars(self).items()):
            setattr(self, name, wrap(name, fn))
