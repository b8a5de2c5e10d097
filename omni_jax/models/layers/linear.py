"""The dense layer of every model: nnx.Linear whose matmul accumulates in fp32 and rounds once."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kernels_pallas.skinny_matmul import skinny_matmul, skinny_tuning

from . import parallel


def fp32_accumulating_dot_general(lhs, rhs, dimension_numbers, precision=None,
                                  preferred_element_type=None, **kwargs):
    """`lax.dot_general` that accumulates in fp32 and returns the operands' dtype (or the one asked).

    Why: for bf16 operands XLA:CPU asks its matmul library for bf16 x bf16 -> fp32 directly,
    but a bf16 -> bf16 dot is rewritten to convert both operands (the whole weight) to fp32
    on every call, about 2x slower. GPUs accumulate bf16 matmuls in fp32 anyway, so the
    numerics are those of a bf16 GEMM everywhere; for fp32 operands nothing changes.
    """
    dtype = preferred_element_type or jnp.result_type(lhs, rhs)
    dot = functools.partial(jax.lax.dot_general, precision=precision, preferred_element_type=jnp.float32,
                            **kwargs)
    if (lhs.dtype.itemsize == 2 and math.prod(lhs.shape[:-1]) == 1
            and dimension_numbers == (((lhs.ndim - 1,), (0,)), ((), ()))):
        # XLA:CPU makes a one-row matmul a vector-matrix product, which its bf16 path does
        # not take: it converts the whole weight to fp32 on every call (15x slower for the
        # engine benchmark's lm_head at batch 1). Two rows keep the matrix path.
        two = jnp.broadcast_to(lhs.reshape(1, -1), (2, lhs.shape[-1]))
        out = dot(two, rhs, (((1,), (0,)), ((), ())))[:1]
        return out.reshape(lhs.shape[:-1] + rhs.shape[1:]).astype(dtype)
    return dot(lhs, rhs, dimension_numbers).astype(dtype)


class Linear(nnx.Linear):
    """nnx.Linear with `fp32_accumulating_dot_general` (same parameters, same checkpoint keys);
    on a GPU whose launch settings say so, a few rows take the skinny kernel (`few_rows`)."""

    def __init__(self, in_features: int, out_features: int, **kwargs):
        kwargs.setdefault("dot_general", fp32_accumulating_dot_general)
        super().__init__(in_features, out_features, **kwargs)

    def __call__(self, x):
        if takes_skinny_kernel(x, self):
            return skinny_linears(x, self)
        return self.xla(x)

    def xla(self, x):
        """The layer as XLA's matmul, whatever the GPU's launch settings."""
        return super().__call__(x)


def takes_skinny_kernel(x: jnp.ndarray, *layers: Linear) -> bool:
    """Whether `layers` applied to `x` take the skinny kernel where the lowering is for a GPU:
    the target's row (``SKINNY_TUNING``) takes this many rows and outputs this wide (a narrow
    one, a router's, would be a few programs on a GPU of a hundred SMs), and no tensor
    parallelism splits the weights."""
    tune = skinny_tuning()
    rows = math.prod(x.shape[:-1])
    return (0 < rows <= tune["max_rows"] and sum(layer.out_features for layer in layers) >= tune["min_width"]
            and parallel.axis_size(parallel.TP) == 1)


def skinny_linears(x: jnp.ndarray, *layers: Linear) -> jnp.ndarray:
    """The layers' outputs side by side, [..., sum of their widths]: on a GPU one launch of the
    skinny kernel (`few_rows`); on CPU each layer as XLA's matmul, concatenated."""
    return jax.lax.platform_dependent(
        x, cpu=lambda x: jnp.concatenate([layer.xla(x) for layer in layers], axis=-1),
        default=lambda x: few_rows(x, *layers))


def few_rows(x: jnp.ndarray, *layers: Linear, interpret: bool = False) -> jnp.ndarray:
    """The layers' outputs side by side as one launch of the skinny kernel over their weights."""
    dtype = layers[0].dtype or x.dtype
    flat = x.reshape(-1, x.shape[-1]).astype(dtype)
    biases = [None if layer.bias is None else layer.bias[...] for layer in layers]
    y = skinny_matmul(flat, [layer.kernel[...].astype(dtype) for layer in layers], biases, out_dtype=dtype,
                      interpret=interpret)
    return y.reshape(x.shape[:-1] + (y.shape[-1],))


def parallel_linears(x: jnp.ndarray, *layers: Linear) -> list[jnp.ndarray]:
    """[layer(x) for layer in layers], on a GPU as one GEMM over their weights side by side:
    XLA:GPU fuses the concatenation into the GEMM, so the layers cost one launch and no weight
    copy (its own dot merging leaves weights this large apart: the MLP's gate and up). Apart
    on CPU, where the concatenation would copy the weights on every call, and under tensor
    parallelism, where each layer's columns are split over the shards. Where a GPU's few rows
    take the skinny kernel (`takes_skinny_kernel`), one launch of it over all the weights."""
    widths = [layer.out_features for layer in layers]
    if takes_skinny_kernel(x, *layers):
        return jnp.split(skinny_linears(x, *layers), np.cumsum(widths)[:-1], axis=-1)
    if len(layers) == 1 or parallel.axis_size(parallel.TP) > 1:
        return [layer(x) for layer in layers]

    def side_by_side(x):
        first = layers[0]
        w = jnp.concatenate([layer.kernel[...] for layer in layers], axis=1).astype(first.dtype or x.dtype)
        y = first.dot_general(x.astype(w.dtype), w, (((x.ndim - 1,), (0,)), ((), ())), precision=first.precision)
        if first.bias is not None:
            y = y + jnp.concatenate([layer.bias[...] for layer in layers]).astype(y.dtype)
        return jnp.split(y, np.cumsum(widths)[:-1], axis=-1)

    return jax.lax.platform_dependent(x, cpu=lambda x: [layer(x) for layer in layers], default=side_by_side)
