"""The dense layer of every model: nnx.Linear whose matmul accumulates in fp32 and rounds once."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def fp32_accumulating_dot_general(lhs, rhs, dimension_numbers, precision=None,
                                  preferred_element_type=None, **kwargs):
    """`lax.dot_general` that accumulates in fp32 and returns the operands' dtype (or the one asked).

    Why: for bf16 operands XLA:CPU asks its matmul library for bf16 x bf16 -> fp32 directly,
    but a bf16 -> bf16 dot is rewritten to convert both operands (the whole weight) to fp32
    on every call, about 2x slower. GPUs accumulate bf16 matmuls in fp32 anyway, so the
    numerics are those of a bf16 GEMM everywhere; for fp32 operands nothing changes.
    """
    out = jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                              preferred_element_type=jnp.float32, **kwargs)
    return out.astype(preferred_element_type or jnp.result_type(lhs, rhs))


class Linear(nnx.Linear):
    """nnx.Linear with `fp32_accumulating_dot_general` (same parameters, same checkpoint keys)."""

    def __init__(self, in_features: int, out_features: int, **kwargs):
        kwargs.setdefault("dot_general", fp32_accumulating_dot_general)
        super().__init__(in_features, out_features, **kwargs)
