"""The models' dense layer (layers.linear.Linear): nnx.Linear's results, fp32 accumulation,
and bf16 matmuls that XLA:CPU runs without converting the weight to fp32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from omni_jax.models.layers.linear import Linear

pytestmark = pytest.mark.parity

IN, OUT = 256, 4096
SHAPES = [(1, IN), (IN,), (2, 1, IN), (5, IN)]


def _pair(dtype, bias):
    kw = dict(use_bias=bias, dtype=dtype, param_dtype=dtype)
    ours, theirs = Linear(IN, OUT, rngs=nnx.Rngs(0), **kw), nnx.Linear(IN, OUT, rngs=nnx.Rngs(0), **kw)
    if bias:  # a nonzero bias, so that adding it is tested too
        b = jax.random.normal(jax.random.PRNGKey(2), (OUT,), dtype)
        ours.bias[...], theirs.bias[...] = b, b
    return ours, theirs


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fp32_equals_nnx_linear_bit_for_bit(shape):
    ours, theirs = _pair(jnp.float32, bias=True)
    x = jax.random.normal(jax.random.PRNGKey(1), shape, jnp.float32)
    got = jax.jit(lambda x: ours(x))(x)
    assert got.dtype == jnp.float32 and got.shape == shape[:-1] + (OUT,)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(lambda x: theirs(x))(x)))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_bf16_accumulates_in_fp32_and_rounds_once(shape):
    """Every output is the float64 product rounded to bf16 (within one bf16 step: the
    accumulation order is the library's), for one row and for several."""
    ours, _ = _pair(jnp.bfloat16, bias=True)
    x = jax.random.normal(jax.random.PRNGKey(1), shape, jnp.bfloat16)
    got = jax.jit(lambda x: ours(x))(x)
    assert got.dtype == jnp.bfloat16 and got.shape == shape[:-1] + (OUT,)
    w = np.asarray(ours.kernel[...], np.float64)
    # The bias is added to the bf16-rounded product, as nnx.Linear does.
    prod = np.asarray(jnp.asarray(np.asarray(x, np.float64) @ w, jnp.bfloat16), np.float64)
    want = prod + np.asarray(ours.bias[...], np.float64)
    err = np.abs(np.asarray(got, np.float64) - want)
    assert (err <= 2.0 ** -7 * np.maximum(np.abs(want), 1.0)).all(), err.max()


@pytest.mark.parametrize("rows", [1, 8])
def test_bf16_matmul_never_converts_the_weight(rows):
    """XLA:CPU converts a bf16 weight to fp32 on every call for a bf16 -> bf16 dot, and for
    any one-row dot: the compiled layer holds no temporary as large as the weight."""
    ours, _ = _pair(jnp.bfloat16, bias=False)
    x = jax.ShapeDtypeStruct((rows, IN), jnp.bfloat16)
    graph, state = nnx.split(ours)
    fn = jax.jit(lambda state, x: nnx.merge(graph, state)(x))
    memory = fn.trace(state, x).lower().compile().memory_analysis()
    assert memory.temp_size_in_bytes < IN * OUT * 2 / 4
