"""RMSNorm, and the residual add before it, as one Pallas (Triton) kernel for NVIDIA GPUs.

XLA:GPU makes a decoder's ``norm(x + h)`` three kernels (the add, the sum of squares, the
scaling), each a launch; a decode step runs two per layer, and at batch 1 a step's time
is its launches more than its bytes (issue 47). One program per token row loads the row
once (the hidden size padded to a power of two, the tail masked), adds, reduces in fp32
and writes the normalised row and, with an addend, the sum.

The arithmetic is ``reference.rms_norm``'s, the backend of every other platform: the sum
in the input dtype, the mean of squares and the scaling in fp32, the weight applied in
the input dtype.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.paged_attention import next_pow2

__all__ = ["rms_norm"]


def _kernel(*refs, eps, dim, width, with_delta):
    if with_delta:
        x_ref, d_ref, w_ref, o_ref, s_ref = refs
    else:
        (x_ref, w_ref, o_ref), d_ref, s_ref = refs, None, None
    row = jnp.full((width,), pl.program_id(0), jnp.int32)
    cols = jnp.arange(width, dtype=jnp.int32)
    ok = cols < dim
    at = lambda ref: ref.at[row, cols]  # noqa: E731  (array indexers on every axis: interpret mode)
    x = plgpu.load(at(x_ref), mask=ok, other=0.0)
    if with_delta:
        x = x + plgpu.load(at(d_ref), mask=ok, other=0.0)
        plgpu.store(at(s_ref), x, mask=ok)
    x32 = x.astype(jnp.float32)
    var = jnp.sum(x32 * x32) / dim
    y = (x32 * (1.0 / jnp.sqrt(var + eps))).astype(x.dtype)
    w = plgpu.load(w_ref.at[cols], mask=ok, other=0.0).astype(x.dtype)
    plgpu.store(at(o_ref), w * y, mask=ok)


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "num_warps"))
def rms_norm(x, weight, delta=None, *, eps: float, interpret: bool = False, num_warps: int = 4):
    """x [T, H] (+ delta [T, H]) -> normed [T, H] (and x + delta when delta is given), in x's dtype."""
    t, dim = x.shape
    if weight.shape != (dim,) or (delta is not None and delta.shape != x.shape):
        raise ValueError(f"rms_norm: x {x.shape}, weight {weight.shape}, delta "
                         f"{None if delta is None else delta.shape}")
    with_delta = delta is not None
    whole = lambda shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))  # noqa: E731
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    args = (x, delta, weight) if with_delta else (x, weight)
    res = pl.pallas_call(
        functools.partial(_kernel, eps=float(eps), dim=dim, width=next_pow2(dim), with_delta=with_delta),
        grid=(t,),
        in_specs=[whole(a.shape) for a in args],
        out_specs=(whole(x.shape), whole(x.shape)) if with_delta else whole(x.shape),
        out_shape=(out, out) if with_delta else out,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="add_rms_norm" if with_delta else "rms_norm",
    )(*args)
    return res
