"""Normalisation layers shared by the Qwen-Omni models."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
    """Root-mean-square norm computed in fp32 (as transformers does), scaled by `weight`.

    The parameter is called `weight` (not `scale`) so that it maps 1:1 onto the
    Hugging Face checkpoint key.
    """

    def __init__(self, dim: int, eps: float = 1e-6, *, dtype=jnp.float32, param_dtype=jnp.float32):
        self.eps = eps
        self.dtype = dtype
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        in_dtype = x.dtype
        x32 = x.astype(jnp.float32)
        var = jnp.mean(x32 * x32, axis=-1, keepdims=True)
        x32 = x32 * jnp.reciprocal(jnp.sqrt(var + self.eps))
        return self.weight[...].astype(in_dtype) * x32.astype(in_dtype)
