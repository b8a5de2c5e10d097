"""Normalisation layers shared by the Qwen-Omni models."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

import kernels_pallas
from kernels_pallas import reference


def rms_norm(x, weight, delta=None, *, eps: float, backend: str = "reference"):
    """``reference.rms_norm`` over x's last axis; on the "pallas" backend (GPU) the one-launch
    kernel (``kernels_pallas.rms_norm``), on the rows of x flattened to 2-D."""
    if backend != "pallas":
        return reference.rms_norm(x, weight, delta, eps=eps)
    flat = lambda a: a.reshape(-1, a.shape[-1])  # noqa: E731
    out = kernels_pallas.rms_norm(flat(x), weight, None if delta is None else flat(delta), eps=eps)
    return out.reshape(x.shape) if delta is None else tuple(o.reshape(x.shape) for o in out)


class RMSNorm(nnx.Module):
    """Root-mean-square norm computed in fp32 (as transformers does), scaled by `weight`.

    The parameter is called `weight` (not `scale`) so that it maps 1:1 onto the
    Hugging Face checkpoint key. `backend`: the attention backend's name (the GPU's
    "pallas" normalises in one kernel launch).
    """

    def __init__(self, dim: int, eps: float = 1e-6, *, dtype=jnp.float32, param_dtype=jnp.float32):
        self.eps = eps
        self.dtype = dtype
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))

    def __call__(self, x: jnp.ndarray, backend: str = "reference") -> jnp.ndarray:
        return rms_norm(x, self.weight[...], eps=self.eps, backend=backend)

    def add(self, x: jnp.ndarray, delta: jnp.ndarray, backend: str = "reference"):
        """The residual add and the norm of its sum: (normed, x + delta)."""
        return rms_norm(x, self.weight[...], delta, eps=self.eps, backend=backend)
