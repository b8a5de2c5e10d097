"""The skinny matmul kernel (a decode step's few rows against dense [in, out] weights) in Pallas
interpret mode against XLA, its bad inputs, and where the models' projections take it: lowered
for CUDA with a launch-settings row that turns it on, and with one that turns it off."""
from __future__ import annotations

import math
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kernels_pallas.skinny_matmul import SKINNY_TUNING, skinny_matmul
from omni_jax.gpu.targets import load_target
from omni_jax.models.layers.linear import Linear, few_rows, parallel_linears, takes_skinny_kernel
from omni_jax.models.layers.mlp import GatedMLP

TRITON_CALL = "__gpu$xla.gpu.triton"


def _arrays(rows, k, widths, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
    ws = [jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype) for n in widths]
    bs = [jnp.asarray(rng.standard_normal((n,)), dtype) for n in widths]
    return x, ws, bs


def _want(x, ws, bs):
    hi = jax.lax.Precision.HIGHEST
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    return jnp.concatenate([jnp.dot(f32(x), f32(w), precision=hi) + (0 if b is None else f32(b))
                            for w, b in zip(ws, bs)], axis=1)


@pytest.mark.parametrize("rows", [1, 3, 16, 20])
def test_weights_side_by_side_with_biases(rows):
    """Three weights of widths no tile divides (q/k/v-like), a K that is not a whole number of
    steps, rows below, at and past one block of 16: the columns side by side, bias added."""
    x, ws, bs = _arrays(rows, 72, (40, 24, 24))
    got = skinny_matmul(x, ws, [bs[0], None, bs[2]], block_n=16, block_k=32, interpret=True)
    want = _want(x, ws, [bs[0], None, bs[2]])
    assert got.shape == (rows, 88) and got.dtype == jnp.float32
    assert float(jnp.max(jnp.abs(got - want))) <= 1e-4


def test_one_weight_at_the_tuning_rows_settings():
    x, ws, _ = _arrays(2, 256, (96,))
    got = skinny_matmul(x, ws, interpret=True)   # the CPU takes the most conservative row
    assert float(jnp.max(jnp.abs(got - _want(x, ws, [None])))) <= 1e-4


def test_bf16_rounds_once():
    """bf16 operands accumulate in fp32 and round once: within a bf16 step of the fp32 result."""
    x, ws, bs = _arrays(4, 512, (64, 32), jnp.bfloat16)
    got = skinny_matmul(x, ws, bs, block_n=32, block_k=128, interpret=True)
    want = _want(x, ws, bs)
    assert got.dtype == jnp.bfloat16
    assert float(jnp.max(jnp.abs(got.astype(jnp.float32) - want) / (jnp.abs(want) + 1))) <= 1e-2
    f32 = skinny_matmul(x, ws, bs, out_dtype=jnp.float32, block_n=32, block_k=128, interpret=True)
    assert float(jnp.max(jnp.abs(f32 - want))) <= 1e-3


@pytest.mark.parametrize("splits", [2, 3, 4])
def test_split_k_partials_sum_to_the_product(splits):
    """k_splits: fp32 partial products [S, M, N], each over whole block_k tiles (4 splits of 72
    columns in 16-column tiles take 32 each: the last has none and is zero), the bias in the
    first only; their sum is the product."""
    x, ws, bs = _arrays(3, 72, (40, 24))
    got = skinny_matmul(x.astype(jnp.bfloat16), [w.astype(jnp.bfloat16) for w in ws], [bs[0].astype(jnp.bfloat16),
                        None], k_splits=splits, block_n=16, block_k=16, interpret=True)
    assert got.shape == (splits, 3, 64) and got.dtype == jnp.float32
    bf = lambda a: a.astype(jnp.bfloat16)  # noqa: E731
    want = _want(bf(x), [bf(w) for w in ws], [bf(bs[0]), None])
    assert float(jnp.max(jnp.abs(got.sum(0) - want))) <= 1e-4
    per_split = 16 * math.ceil(math.ceil(72 / splits) / 16)
    for i in range(splits):   # each split is its own columns' product (and the first, the bias)
        cols = slice(i * per_split, min((i + 1) * per_split, 72))
        part = _want(bf(x)[:, cols], [bf(w)[cols] for w in ws], [bf(bs[0]) if i == 0 else None, None])
        assert float(jnp.max(jnp.abs(got[i] - part))) <= 1e-4, i
    if splits == 4:
        assert not jnp.any(got[3])


@pytest.mark.parametrize("bad, message", [
    (lambda x, ws, bs: skinny_matmul(x, [ws[0][:-1]]), "x has 32 columns"),
    (lambda x, ws, bs: skinny_matmul(x, [ws[0].astype(jnp.bfloat16)]), "give both one dtype"),
    (lambda x, ws, bs: skinny_matmul(x, ws, [bs[0]]), "one bias (or None) per weight"),
    (lambda x, ws, bs: skinny_matmul(x, ws, [bs[1], bs[0]]), "a bias is (16,)"),
    (lambda x, ws, bs: skinny_matmul(x, ws, block_n=24), "powers of two >= 16"),
    (lambda x, ws, bs: skinny_matmul(x, ws, block_k=8), "powers of two >= 16"),
    (lambda x, ws, bs: skinny_matmul(x, ws, k_splits=0), "k_splits=0: give a count >= 1"),
    (lambda x, ws, bs: skinny_matmul(x, ws, out_dtype=jnp.bfloat16, k_splits=2), "partials of more than one are fp32"),
])
def test_bad_inputs_say_what_is_wrong(bad, message):
    x, ws, bs = _arrays(2, 32, (48, 16))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        bad(x, ws, bs)


def _linears(*widths, bias=True, k=64):
    rngs = nnx.Rngs(0)
    layers = [Linear(k, n, use_bias=bias, rngs=rngs) for n in widths]
    for layer in layers:   # nonzero biases, so that a dropped one shows
        if bias:
            layer.bias[...] = jax.random.normal(jax.random.key(n := layer.out_features), (n,))
    return layers


@pytest.mark.parametrize("shape", [(3, 64), (2, 1, 64)])
def test_few_rows_equals_the_layers(shape):
    """The models' GPU path (`few_rows`) gives each Linear's output, side by side, for [T, in] and
    [B, T, in]."""
    layers = _linears(48, 16, 16)
    x = jax.random.normal(jax.random.key(1), shape)
    got = few_rows(x, *layers, interpret=True)
    want = jnp.concatenate([layer(x) for layer in layers], axis=-1)
    assert got.shape == want.shape == shape[:-1] + (80,)
    assert float(jnp.max(jnp.abs(got - want))) <= 1e-4


@pytest.fixture
def skinny_on(monkeypatch):
    """The A100 row (also the CPU's) taking steps of up to 16 rows and outputs of 32 columns."""
    monkeypatch.setitem(SKINNY_TUNING, 80, dict(SKINNY_TUNING[80], max_rows=16, min_width=32))


def test_which_calls_take_the_kernel(skinny_on):
    q, k, v = _linears(48, 16, 16)
    one, many = jnp.zeros((1, 64)), jnp.zeros((17, 64))
    assert takes_skinny_kernel(one, q, k, v) and takes_skinny_kernel(jnp.zeros((2, 8, 64)), q)
    assert not takes_skinny_kernel(many, q), "more rows than the row takes"
    assert not takes_skinny_kernel(one, k), "an output too narrow for the GPU's SMs"
    assert not takes_skinny_kernel(jnp.zeros((0, 64)), q)


def test_a_row_turned_off_keeps_xla(monkeypatch):
    monkeypatch.setitem(SKINNY_TUNING, 80, dict(SKINNY_TUNING[80], max_rows=0, min_width=32))
    assert not takes_skinny_kernel(jnp.zeros((1, 64)), *_linears(4096))


def _lower_cuda(fn, *args):
    # A100: the CPU's row, and the GPU the lowering tests lower for (tests/test_lowering.py)
    with jax.sharding.use_abstract_mesh(load_target("a100").abstract_mesh()):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _mlp():
    return GatedMLP(64, 128, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("rows, kernels", [(1, 2), (16, 2), (17, 0)])
def test_a_gated_mlp_lowers_to_two_kernels_for_few_rows(skinny_on, rows, kernels):
    """Lowered for CUDA with the row on: gate/up one launch over both weights, down one; past
    the row's rows, XLA's GEMMs. On CPU the same module keeps its XLA path."""
    mlp = _mlp()
    graph, state = nnx.split(mlp)
    x = jax.ShapeDtypeStruct((rows, 64), jnp.bfloat16)
    text = _lower_cuda(lambda s, x: nnx.merge(graph, s)(x), state, x)
    assert text.count(f"@{TRITON_CALL}(") == kernels
    xv = jax.random.normal(jax.random.key(2), (rows, 64), jnp.bfloat16)
    assert TRITON_CALL not in jax.jit(lambda s, x: nnx.merge(graph, s)(x)).lower(state, xv).as_text()


def test_attention_takes_its_projections_as_heads(skinny_on):
    """With the row on, attention slices q, k and v as heads of the projections' one output (the
    CPU lowers that output as each layer's, concatenated): the same result as with it off."""
    from omni_jax.models.layers.attention import Attention, AttentionConfig, AttentionMetadata

    cfg = AttentionConfig(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True)
    attn = Attention(cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(3), (5, 64))
    cos, sin = jnp.ones((5, 16)), jnp.zeros((5, 16))
    meta = AttentionMetadata.dense(5)
    assert takes_skinny_kernel(x, attn.q_proj, attn.k_proj, attn.v_proj)
    got, _ = attn(x, cos, sin, meta)
    SKINNY_TUNING[80] = dict(SKINNY_TUNING[80], max_rows=0)   # the fixture restores it
    want, _ = attn(x, cos, sin, meta)
    assert float(jnp.max(jnp.abs(got - want))) <= 1e-5


def test_parallel_linears_lower_to_one_kernel(skinny_on):
    layers = _linears(48, 16, 16)
    x = jax.ShapeDtypeStruct((1, 64), jnp.float32)
    assert _lower_cuda(lambda x: parallel_linears(x, *layers), x).count(f"@{TRITON_CALL}(") == 1


def test_a_row_turned_off_lowers_no_kernel(monkeypatch):
    monkeypatch.setitem(SKINNY_TUNING, 80, dict(SKINNY_TUNING[80], max_rows=0, min_width=32))
    mlp = _mlp()
    graph, state = nnx.split(mlp)
    text = _lower_cuda(lambda s, x: nnx.merge(graph, s)(x), state, jax.ShapeDtypeStruct((1, 64), jnp.bfloat16))
    assert TRITON_CALL not in text
