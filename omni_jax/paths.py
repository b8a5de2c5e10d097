"""Where OmniJax keeps files between runs: `$OMNI_JAX_CACHE`, else `~/.cache/omni-jax` (the
tiny demo checkpoint, JAX's compilation cache, the vLLM peer's virtualenv). Standard library
only: a stage process reads it before JAX is imported."""

from __future__ import annotations

import os


def cache_root() -> str:
    return os.environ.get("OMNI_JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "omni-jax")
