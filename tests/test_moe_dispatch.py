"""MoE grouped-matmul dispatch: blocked vs ragged_dot vs the Pallas GPU kernel vs dense, and the
blocked path's cost."""

from __future__ import annotations

import contextlib
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kernels_pallas
from kernels_pallas.grouped_matmul import max_blocks
from omni_jax.gpu.targets import load_target
from omni_jax.models.layers.linear import Linear
from omni_jax.models.layers.moe import (
    COMPARE_ALL_MAX_PAIRS, MoEConfig, SparseMoeBlock, blocked_grouped_matmul, dense_moe_reference, grouped_matmul,
    moe_experts, ragged_dot_grouped_matmul, route)

pytestmark = pytest.mark.parity


def _routings(rng, p, g):
    """Group-size vectors over p rows and g groups, the corner cases included."""
    one = lambda e, n=p: np.eye(g, dtype=np.int64)[e] * n  # noqa: E731
    sparse = np.zeros(g, np.int64)
    sparse[rng.choice(g, size=min(3, g), replace=False)] = rng.multinomial(p, np.ones(min(3, g)) / min(3, g))
    return {
        "uniform": rng.multinomial(p, np.ones(g) / g),
        "skewed": rng.multinomial(p, rng.dirichlet(np.full(g, 0.3))),
        "empty_experts": sparse,                 # most experts get nothing
        "all_on_first": one(0),
        "all_on_last": one(g - 1),
        "all_on_middle": one(g // 2),
        "short": rng.multinomial(p - 5, np.ones(g) / g),  # 5 rows past sum(sizes): padding
        "none": np.zeros(g, np.int64),
    }


def _numpy_grouped(rows, w, sizes):
    out = np.zeros((rows.shape[0], w.shape[1]), np.float64)
    start = 0
    for e, n in enumerate(sizes):
        out[start:start + n] = rows[start:start + n].astype(np.float64) @ w[e].T.astype(np.float64)
        start += n
    return out


@pytest.mark.parametrize("p,g,k_in,n_out,block", [
    (37, 5, 16, 12, None),   # default block size
    (64, 8, 8, 24, 4),       # many small blocks
    (5, 16, 8, 8, None),     # fewer rows than experts (decode)
    (100, 3, 8, 8, 128),     # block larger than P: clamped
    (96, 6, 8, 8, 16),       # group boundaries on block boundaries
])
def test_impls_agree_over_random_routings(p, g, k_in, n_out, block):
    rng = np.random.default_rng(p * 1000 + g)
    rows = rng.standard_normal((p, k_in)).astype(np.float32)
    w = rng.standard_normal((g, n_out, k_in)).astype(np.float32)
    blocked = jax.jit(lambda r, w_, s: blocked_grouped_matmul(r, w_, s, block_rows=block))
    ragged = jax.jit(ragged_dot_grouped_matmul)
    default = jax.jit(grouped_matmul)
    for name, sizes in _routings(rng, p, g).items():
        s = jnp.asarray(sizes, jnp.int32)
        total = int(sizes.sum())
        ref = _numpy_grouped(rows, w, sizes)
        got_b = np.asarray(blocked(rows, w, s))
        got_r = np.asarray(ragged(rows, w, s))
        np.testing.assert_allclose(got_b[:total], ref[:total], atol=1e-5, rtol=1e-5, err_msg=name)
        np.testing.assert_allclose(got_b[:total], got_r[:total], atol=1e-5, rtol=1e-5, err_msg=name)
        assert np.all(got_b[total:] == 0), name  # rows of no group come out zero
        np.testing.assert_allclose(np.asarray(default(rows, w, s)), got_b, atol=1e-6, rtol=1e-6,
                                   err_msg=name)  # CPU default: blocked


@pytest.mark.kernels
@pytest.mark.parametrize("p,g,k_in,n_out,block,dtype", [
    (37, 5, 24, 40, None, jnp.float32),    # default row block; K and N not multiples of the tiles
    (5, 16, 16, 16, None, jnp.float32),    # fewer rows than experts (decode)
    (96, 6, 32, 48, 16, jnp.float32),      # group boundaries on block boundaries
    (64, 4, 32, 32, 32, jnp.bfloat16),
])
def test_pallas_kernel_matches_blocked_over_random_routings(p, g, k_in, n_out, block, dtype):
    """The GPU kernel (Pallas interpret mode, 16 x 16 tiles so every program loops over K and N
    splits into tiles) against the blocked path and numpy: same rows, zeros past the groups."""
    rng = np.random.default_rng(p * 100 + g)
    rows = jnp.asarray(rng.standard_normal((p, k_in)), dtype)
    w = jnp.asarray(rng.standard_normal((g, n_out, k_in)), dtype)
    kernel = jax.jit(lambda r, w_, s: kernels_pallas.grouped_matmul(
        r, w_, s, out_dtype=dtype, block_rows=block, block_n=16, block_k=16, interpret=True))
    blocked = jax.jit(lambda r, w_, s: blocked_grouped_matmul(r, w_, s, out_dtype=dtype))
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for name, sizes in _routings(rng, p, g).items():
        s = jnp.asarray(sizes, jnp.int32)
        total = int(sizes.sum())
        got = np.asarray(kernel(rows, w, s).astype(jnp.float32))
        ref = _numpy_grouped(np.asarray(rows.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)), sizes)
        np.testing.assert_allclose(got[:total], ref[:total], atol=tol * 10, rtol=tol, err_msg=name)
        np.testing.assert_allclose(got, np.asarray(blocked(rows, w, s).astype(jnp.float32)), atol=tol * 10,
                                   rtol=tol, err_msg=name)
        assert np.all(got[total:] == 0), name  # rows of no group come out zero
    with pytest.raises(ValueError, match="block_rows=8 must be a power of two >= 16"):
        kernels_pallas.grouped_matmul(rows, w, s, block_rows=8, interpret=True)
    # Interpret mode would promote; Triton's dot refuses two element types (found on an H200).
    with pytest.raises(ValueError, match="rows are bfloat16, the weights float32: give both one dtype"):
        kernels_pallas.grouped_matmul(rows.astype(jnp.bfloat16), w.astype(jnp.float32), s, interpret=True)
    assert kernels_pallas.grouped_matmul(rows[:0], w, s, interpret=True).shape == (0, n_out)


@pytest.mark.kernels
@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter,dtype", [
    (1, 128, 8, 48, 40, jnp.float32),      # one token's 8 of 128 experts: 8 rows, one block
    (5, 8, 3, 40, 24, jnp.float32),        # K, N and I no tile divides; experts shared
    (40, 6, 2, 32, 16, jnp.float32),       # 80 pairs: several blocks of an expert, 2 chunks of pairs
    (3, 1, 1, 16, 16, jnp.float32),        # one expert
    (16, 16, 4, 32, 32, jnp.bfloat16),
])
def test_fused_decode_kernels_match_scatter_and_activation(tokens, experts, top_k, hidden, inter, dtype):
    """A decode step's experts on a GPU (`fused_expert_outputs`: the gate/up kernel reads the
    tokens through the pairs' positions and returns SiLU(gate) * up) in interpret mode against
    XLA's scatter, the blocked grouped matmuls and jax.nn.silu; padding tokens (pairs in no
    group) give zeros. The gate/up kernel alone also over several column tiles (block_n 32: 16
    of the gate's and 16 of the up's weight rows a program)."""
    from omni_jax.models.layers.moe import blocked_grouped_matmul, expert_outputs, fused_expert_outputs, sort_pairs

    rng = np.random.default_rng(tokens * 10 + experts)
    x = jnp.asarray(rng.standard_normal((tokens, hidden)), dtype)
    gate_up = jnp.asarray(rng.standard_normal((experts, 2 * inter, hidden)) * 0.3, dtype)
    down = jnp.asarray(rng.standard_normal((experts, hidden, inter)) * 0.3, dtype)
    chosen = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)])
    tol = 1e-4 if dtype == jnp.float32 else 3e-2
    for valid in (np.ones(tokens, bool), np.arange(tokens) < max(tokens - 2, 1)):
        flat = jnp.asarray(np.where(valid[:, None], chosen, experts).reshape(-1), jnp.int32)
        position, sizes = sort_pairs(flat, experts)
        want = np.asarray(expert_outputs(x, position, sizes, gate_up, down, k=top_k, act=jax.nn.silu,
                                          impl="blocked", block_rows=None), np.float32)
        got = np.asarray(fused_expert_outputs(x, position, sizes, gate_up, down, interpret=True,
                                               block_rows=None), np.float32)
        assert got.shape[0] >= tokens * top_k and got.shape[1] == hidden
        live = int(sizes.sum())
        assert np.abs(want[:live]).max() > 1.0  # outputs large enough that the tolerance means something
        np.testing.assert_allclose(got[:live], want[:live], atol=tol * 10, rtol=tol)
        assert np.all(got[live:] == 0)  # the padding tokens' pairs (and rows past the pairs)
        rows = jnp.zeros((max(tokens * top_k, 16), hidden), dtype).at[position].set(jnp.repeat(x, top_k, 0))
        h = blocked_grouped_matmul(rows, gate_up, sizes, out_dtype=dtype).astype(jnp.float32)
        tiles = kernels_pallas.grouped_matmul(x, gate_up, sizes, out_dtype=dtype, position=position, glu=True,
                                              block_n=32, block_k=16, interpret=True)
        np.testing.assert_allclose(np.asarray(tiles[:live], np.float32),
                                   np.asarray(jax.nn.silu(h[:, :inter]) * h[:, inter:])[:live], atol=tol * 10, rtol=tol)
    # The weights' halves, the glu tile and the pairs per token are checked.
    with pytest.raises(ValueError, match="glu: the weights' 9 rows are not a gate's and an up projection's"):
        kernels_pallas.grouped_matmul(jnp.zeros((16, 24), dtype), jnp.zeros((2, 9, 24), dtype),
                                      jnp.zeros(2, jnp.int32), glu=True, interpret=True)
    with pytest.raises(ValueError, match="glu: block_n=16 must be even and >= 32"):
        kernels_pallas.grouped_matmul(jnp.zeros((16, 24), dtype), jnp.zeros((2, 8, 24), dtype),
                                      jnp.zeros(2, jnp.int32), glu=True, block_n=16, interpret=True)
    with pytest.raises(ValueError, match="position has 7 pairs, not a whole number per token of 2"):
        kernels_pallas.grouped_matmul(jnp.zeros((2, 8), dtype), jnp.zeros((2, 8, 8), dtype),
                                      jnp.zeros(2, jnp.int32), position=jnp.arange(7), interpret=True)


@pytest.mark.parametrize("tokens,experts,top_k,renorm,dtype", [
    (1, 128, 8, True, jnp.float32),        # Qwen3-Omni thinker, batch 1
    (64, 128, 8, True, jnp.bfloat16),      # ... the largest decode bucket
    (5, 128, 6, False, jnp.bfloat16),      # the talker's routing
    (24, 32, 4, True, jnp.float32),
    (3, 8, 2, False, jnp.float32),
])
def test_route_kernel_matches_route_and_sort(tokens, experts, top_k, renorm, dtype):
    """A decode step's MoE routing as one kernel (interpret mode) against the XLA path
    (`route` + `sort_pairs`): the same weights, experts in the same order (ties to the lowest
    id: some rows repeat a logit), the pairs of padding tokens last, the same group sizes."""
    from kernels_pallas import reference
    from kernels_pallas.moe_route import moe_route

    rng = np.random.default_rng(tokens)
    logits = rng.standard_normal((tokens, experts)) * 2
    logits[0, [3, 5]] = logits[0].max() + 1.0                  # a tie at the top
    logits = jnp.asarray(logits, dtype)
    valid = jnp.asarray(rng.random(tokens) < 0.7).at[0].set(True)
    weights, position, sizes = moe_route(logits, valid, top_k=top_k, norm_topk_prob=renorm, interpret=True)
    want_w, want_e = route(logits, top_k, renorm)
    np.testing.assert_allclose(np.asarray(weights), np.asarray(want_w), rtol=1e-5, atol=1e-6)
    want_pos, want_sizes = reference.rank_pairs(jnp.where(valid[:, None], want_e, experts).reshape(-1), experts)
    np.testing.assert_array_equal(np.asarray(position).reshape(-1), np.asarray(want_pos))
    np.testing.assert_array_equal(np.asarray(sizes), np.asarray(want_sizes))
    assert int(sizes.sum()) == top_k * int(valid.sum())
    with pytest.raises(ValueError, match="at most 64"):
        moe_route(jnp.zeros((65, experts), dtype), jnp.ones(65, bool), top_k=top_k, norm_topk_prob=renorm,
                  interpret=True)


@pytest.mark.kernels
@pytest.mark.parametrize("tokens,experts,top_k,hidden", [
    (1, 128, 8, 300),     # one token: 3 splits of the K tiles (the CPU row's 128), the last partial
    (24, 32, 4, 256),
    (3, 8, 2, 40),        # one K tile: no split, the logits themselves
])
def test_router_partials_into_the_route_kernel(tokens, experts, top_k, hidden):
    """A decode step's router on a GPU (`router_partials`: the gate's split-K partial products,
    summed and rounded to the router's dtype by the routing kernel) in interpret mode against
    XLA's bf16 router and `reference.moe_route`: the same experts in the same order, the same
    weights; the padding tokens' pairs last."""
    from kernels_pallas import reference
    from kernels_pallas.moe_route import moe_route
    from omni_jax.models.layers.moe import router_partials

    gate = Linear(hidden, experts, use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                  rngs=nnx.Rngs(tokens))
    rng = np.random.default_rng(hidden)
    x = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.bfloat16)
    valid = jnp.asarray(rng.random(tokens) < 0.7).at[0].set(True)
    partials = router_partials(x, gate, interpret=True)
    splits = -(-hidden // 128)
    assert partials.shape == ((splits,) if splits > 1 else ()) + (tokens, experts)
    kw = dict(top_k=top_k, norm_topk_prob=True)
    got = moe_route(partials, valid, logits_dtype=jnp.bfloat16, interpret=True, **kw)
    want = reference.moe_route(gate(x), valid, **kw)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-6)
    for g, w in zip(got[1:], want[1:]):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


# A decode step's pairs (ranked, scattered into expert order) and a prefill's (sorted, gathered).
@pytest.mark.parametrize("tokens", [29, COMPARE_ALL_MAX_PAIRS // 3 + 11])
def test_moe_experts_impls_match_dense_reference(tokens):
    cfg = MoEConfig(hidden_size=32, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=3)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((tokens, cfg.hidden_size)), jnp.float32)
    gate_w = jnp.asarray(rng.standard_normal((cfg.num_experts, cfg.hidden_size)), jnp.float32)
    gate_up = jnp.asarray(rng.standard_normal((8, 32, 32)) * 0.3, jnp.float32)
    down = jnp.asarray(rng.standard_normal((8, 32, 16)) * 0.3, jnp.float32)
    weights, experts = route(x @ gate_w.T, 3, True)
    dense = np.asarray(dense_moe_reference(x, gate_w, gate_up, down, 3, True))
    outs = {impl: np.asarray(jax.jit(lambda *a, impl=impl: moe_experts(*a, impl=impl))(
        x, weights, experts, gate_up, down)) for impl in ("blocked", "ragged_dot")}
    outs["default"] = np.asarray(moe_experts(x, weights, experts, gate_up, down))
    assert np.abs(dense).max() > 1.0  # non-trivial outputs, so 1e-5 means something
    for impl, out in outs.items():
        np.testing.assert_allclose(out, dense, atol=1e-5, rtol=1e-5, err_msg=impl)
    np.testing.assert_allclose(outs["blocked"], outs["ragged_dot"], atol=1e-5, rtol=1e-5)
    # All tokens on one expert (the pathological load) and padding tokens.
    one = jnp.zeros_like(experts).at[:, 0].set(5).at[:, 1].set(6).at[:, 2].set(7)
    real = tokens * 2 // 3
    valid = jnp.arange(tokens) < real
    a = moe_experts(x, weights, one, gate_up, down, valid=valid, impl="blocked")
    b = moe_experts(x, weights, one, gate_up, down, valid=valid, impl="ragged_dot")
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
    assert np.all(np.asarray(a[real:]) == 0)


def test_block_default_path_equals_dense_reference():
    cfg = MoEConfig(hidden_size=24, moe_intermediate_size=8, num_experts=6, num_experts_per_tok=2)
    block = SparseMoeBlock(cfg, rngs=nnx.Rngs(1))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((13, 24)) * 10, jnp.float32)
    out = jax.jit(lambda m, v: m(v))(block, x)
    dense = dense_moe_reference(x, block.gate.kernel[...].T, block.experts.gate_up_proj[...],
                                block.experts.down_proj[...], 2, True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(dense), atol=1e-6, rtol=1e-5)


def test_jit_compiles_once_for_any_routing():
    traces = []

    def f(r, w, s):
        traces.append(1)  # Python side effect: runs once per trace
        return blocked_grouped_matmul(r, w, s, block_rows=8)

    fj = jax.jit(f)
    rng = np.random.default_rng(2)
    rows = jnp.asarray(rng.standard_normal((40, 8)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((6, 4, 8)), jnp.float32)
    for sizes in _routings(rng, 40, 6).values():
        jax.block_until_ready(fj(rows, w, jnp.asarray(sizes, jnp.int32)))
    assert len(traces) == 1
    # Abstract shapes are enough to lower: nothing depends on the group sizes' values.
    lowered = jax.jit(lambda r, w_, s: grouped_matmul(r, w_, s, impl="blocked")).lower(
        jax.ShapeDtypeStruct((40, 8), jnp.float32), jax.ShapeDtypeStruct((6, 4, 8), jnp.float32),
        jax.ShapeDtypeStruct((6,), jnp.int32))
    assert "stablehlo.while" in lowered.as_text()


@pytest.mark.parametrize("p,g,block", [(64, 8, 8), (200, 32, 16), (12, 64, 8), (256, 4, 128)])
def test_blocks_executed_proportional_to_routed_rows(p, g, block):
    rng = np.random.default_rng(p + g)
    rows = jnp.zeros((p, 4), jnp.float32)
    w = jnp.zeros((g, 4, 4), jnp.float32)
    count_fn = jax.jit(lambda r, w_, s: blocked_grouped_matmul(r, w_, s, block_rows=block, count_blocks=True)[1])
    b = min(block, p)
    bound = math.ceil(p / b) + g
    assert max_blocks(p, g, b) <= bound
    for name, sizes in _routings(rng, p, g).items():
        n = int(count_fn(rows, w, jnp.asarray(sizes, jnp.int32)))
        # Exactly one loop iteration per (partial) block of each expert's rows, none for empty experts.
        assert n == sum(math.ceil(s / b) for s in sizes), name
        assert n <= min(bound, max_blocks(p, g, b)), name
        hit = int(np.count_nonzero(sizes))
        assert n * b <= sizes.sum() + hit * (b - 1), name  # padded rows: < 1 block per hit expert
        if name.startswith("all_on"):
            assert n == math.ceil(p / b)


def _flops(fn, p, g, k_in, n_out):
    args = (jax.ShapeDtypeStruct((p, k_in), jnp.float32), jax.ShapeDtypeStruct((g, n_out, k_in), jnp.float32),
            jax.ShapeDtypeStruct((g,), jnp.int32))
    compiled = jax.jit(fn).lower(*args).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return cost["flops"], compiled.as_text()


def test_hlo_cost_scales_with_routed_rows_not_experts():
    """XLA's HloCostAnalysis counts a while body once (the trip count is dynamic), so the
    blocked program reports ~ one block's matmul, 2*B*K*N, whatever E is; the total is that
    times the executed blocks (test above), <= (ceil(P/B) + E) blocks. ragged_dot's CPU lowering
    reports its dense-over-experts cost, ~2*E*P*K*N: the reason the blocked path exists."""
    p, k_in, n_out, b = 256, 64, 64, 16
    block_flops = 2 * b * k_in * n_out
    routed_flops = 2 * p * k_in * n_out
    blocked = lambda r, w, s: blocked_grouped_matmul(r, w, s, block_rows=b)  # noqa: E731
    for g in (4, 64):
        f_blocked, text = _flops(blocked, p, g, k_in, n_out)
        assert block_flops <= f_blocked <= 1.25 * block_flops, (g, f_blocked)
        assert "while" in text
        # No dense-over-experts temporary: every f32 buffer is smaller than an [E, P, min(K, N)] one.
        sizes = [math.prod(int(d) for d in m.split(",")) for m in re.findall(r"f32\[([0-9,]+)\]", text)]
        assert max(sizes) < g * p * min(k_in, n_out)
        total_bound = f_blocked * (math.ceil(p / b) + g)
        assert total_bound <= 1.25 * 2 * (p + g * b) * k_in * n_out
        f_ragged, _ = _flops(ragged_dot_grouped_matmul, p, g, k_in, n_out)
        if g == 64:
            # CPU ragged_dot: E x the routed work; blocked's worst case is far below it.
            assert f_ragged >= 0.9 * g * routed_flops
            assert total_bound < f_ragged / 4


@pytest.mark.lowering
def test_default_impl_per_lowering_platform():
    cfg = MoEConfig(hidden_size=32, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2)
    block = SparseMoeBlock(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    graph, state = nnx.split(block)
    x = jax.ShapeDtypeStruct((64, 32), jnp.bfloat16)

    def text(fn, platform, gpu=None):
        # `gpu`: a GPU's mesh, for Pallas: from JAX 0.11 on, its Triton backend lowers only for a named GPU.
        with jax.sharding.use_abstract_mesh(gpu) if gpu else contextlib.nullcontext():
            return jax.jit(fn).trace(state, x).lower(lowering_platforms=(platform,)).as_text()

    # GPU: the Pallas kernel, one launch per grouped matmul (gate/up, down); CPU: the blocked loop.
    cuda = text(lambda s, v: nnx.merge(graph, s)(v), "cuda", load_target("a100").abstract_mesh())
    assert "ragged_dot" not in cuda
    assert len(re.findall(r'custom_call @__gpu\$xla\.gpu\.triton.*?name = "grouped_matmul', cuda)) == 2, cuda
    # A decode step's 128 pairs: the gate/up kernel reads the tokens itself and applies the
    # activation (no scatter of the rows into expert order, no separate SiLU).
    assert re.search(r'name = "grouped_matmul_bm\d+_bn\d+_bk\d+_gather_glu"', cuda), cuda
    assert re.search(r'name = "grouped_matmul_bm\d+_bn\d+_bk\d+"', cuda), cuda
    assert "stablehlo.scatter" not in cuda and "call @silu" not in cuda
    # The router: the skinny kernel's partial products, summed by the routing kernel (no XLA GEMM).
    assert len(re.findall(r'custom_call @__gpu\$xla\.gpu\.triton.*?name = "skinny_matmul', cuda)) == 1, cuda
    assert cuda.count("stablehlo.dot_general") == 1  # the weighted combine's, not the router's
    # A decode step's routing (64 tokens): one kernel on a GPU, XLA's ops elsewhere.
    assert len(re.findall(r'custom_call @__gpu\$xla\.gpu\.triton.*?name = "moe_route', cuda)) == 1, cuda
    cpu = text(lambda s, v: nnx.merge(graph, s)(v), "cpu")
    assert "grouped_matmul" not in cpu and "moe_route" not in cpu
    assert "stablehlo.scatter" in cpu and "call @silu" in cpu and cpu.count("stablehlo.dot_general") >= 3
    # The ragged_dot path stays available on request.
    def forced(s, v):
        m = nnx.merge(graph, s)
        w, e = route(m.gate(v), 2, True)
        return moe_experts(v, w, e, m.experts.gate_up_proj[...], m.experts.down_proj[...], impl="ragged_dot")
    assert "ragged_dot" in text(forced, "cuda")
