"""Sparse mixture-of-experts feed-forward block (Qwen3-MoE: Qwen3-Omni thinker and talker).

Routing (as transformers' ``Qwen3OmniMoe*TopKRouter``): router logits = ``gate(x)``,
softmax in fp32 over all experts, top-k, optionally renormalised over the k
(``norm_topk_prob``; true for both real Qwen3-Omni decoders), cast to the compute
dtype. The talker adds a shared expert scaled by ``sigmoid(shared_expert_gate(x))``.

Expert weights are stored fused, exactly as transformers holds them in memory:

* ``experts.gate_up_proj`` ``[E, 2I, H]`` (rows 0..I-1 the gate projection, I..2I-1 up),
* ``experts.down_proj`` ``[E, H, I]``,

i.e. [expert, out, in]. The grouped matmuls contract the last axis of the weights
(``ragged_dot_general`` with rhs contracting dim 2), so no transposed copy is ever
made; the checkpoint's per-expert ``experts.{e}.{gate,up,down}_proj.weight`` tensors
become these by stacking (conversion/moe.py), and an HF module's ``state_dict()``
loads as is. (``jax.lax.ragged_dot``'s canonical rhs is [G, in, out]; XLA picks the
physical layout either way, and JAX's Hopper grouped-matmul kernel
``jax.experimental.pallas.ops.gpu.ragged_dot_mgpu.ragged_dot`` takes this
orientation with ``transpose_rhs=True``.)

Dispatch (:func:`moe_experts`), for T tokens, k experts per token, P = T*k
token-expert pairs:

1. sort the P pairs by expert (``sort_pairs``: a decode step's few pairs ranked by
   comparing every pair with every other, one reduction; a prefill's many by ``argsort``),
   put the token rows in expert order ``[P, H]`` (at least a kernel block of rows; a decode
   step scatters them, a prefill gathers them: `sorted_experts`),
   count the pairs per expert;
2. two grouped matmuls over the sorted rows (:func:`grouped_matmul` with the
   per-expert group sizes): ``[P, H] x [E, 2I, H] -> [P, 2I]``, SiLU-gate,
   ``[P, I] x [E, H, I] -> [P, H]``;
3. gather each token's k rows back from their sorted positions and sum them weighted by
   the routing weights (no atomics, deterministic).

A decode step on a GPU (SiLU experts) skips the rows of step 1 and the SiLU of step 2:
the gate/up kernel reads each sorted row's token through the pairs' positions and returns
SiLU(gate) * up (`fused_expert_outputs`).

On a GPU each of these is a kernel launch per MoE layer of a step, and a decode step's
time is its launches more than its bytes (issue 47): what they compile to is in the
README ("Launches per decode step").

Grouped matmul implementations (``impl``; the default is chosen per lowering
platform with ``lax.platform_dependent``, see ``DEFAULT_IMPL``):

* ``"pallas"`` (GPU): ``kernels_pallas.grouped_matmul``, one Pallas (Triton) launch per
  grouped matmul: each program takes one row block of one expert (the plan below) and
  one tile of output columns, and reads that expert's weight tiles in place.
* ``"blocked"`` (CPU): each expert's run of sorted rows is cut into blocks
  of ``B`` rows (the last block of a group is partial; the plan is built on device
  from a cumsum of the per-expert block counts, no host sync: ``blocked_plan``, shared
  with the GPU kernel), and a while loop
  with a *dynamic* trip count = the number of used blocks runs one
  ``[B, in] x [in, out]`` matmul per block against that block's expert weights
  (a dynamic slice of the weight table, never a gathered ``[n_blocks, out, in]``
  copy) and writes the block's rows back under a mask. Used blocks
  ``sum_e ceil(s_e / B) <= ceil(P / B) + E'`` (E' = experts that got a row), so
  FLOPs = used_blocks * 2*B*in*out <= 2*(P + E'*(B-1))*in*out: proportional to the
  routed rows plus at most one partial block per hit expert. Weights are read
  once per used block (once per hit expert when its group fits one block).
  The block size defaults to ~ the mean group size (``default_block_rows``,
  8..128), so a decode step (P a few times E or less: 1-3 rows per hit expert)
  pays up to B/(rows per expert) x the routed FLOPs in padding, which is harmless
  there (weight reads dominate) and vanishes relative to P for prefill. Blocks run
  one after another (no cross-block parallelism) and, as a while loop, forward only
  (no reverse-mode AD): an inference path. Not for GPUs: compiled for one (omni_jax/gpu),
  each block copies its expert's weights out of the table before the matmul (XLA:GPU
  does not fuse the dynamic slice into the GEMM: a temporary of one expert's weights)
  and runs as several small kernels, block after block.
* ``"ragged_dot"`` (TPU): ``jax.lax.ragged_dot_general``, meant to be a real grouped
  GEMM where the backend has one (TPU; not verified here, no TPU). JAX's own CPU
  lowering expands it into a zero-masked ``[E, P, in]`` batch (E times the FLOPs of
  the routed work and an ``E*P*in`` temporary), and XLA:GPU by default rewrites
  the ``chlo.ragged_dot`` it emits the same way unless a grouped-GEMM backend takes it.

Measured (benchmarks/moe.py, 2-core shared CPU, fp32, H=512 I=256 E=32 k=4, whole
block incl. routing, best of 5): T=16: blocked 6.6 ms, ragged_dot 70 ms (10.5x),
dense every-expert 42 ms (6.3x); T=256: 28 / 317 (11x) / 112 ms (4x); T=2048:
117 / 2261 (19x) / 1078 ms (9x).

Cost of the block (routed work, blocked or a real grouped GEMM): FLOPs ~
2 * P * 3 * H * I = 2 * T * k * 3 * H * I (+ blocked's partial-block padding, at
most E*(B-1) rows; + 2*T*H*E for the router; + 2*T*3*H*I_shared for a shared
expert). Memory traffic: the weights of the experts that receive a token (at most
min(E, P) of them, 3*H*I elements each; with P a few times E nearly every expert
is hit, so a large decode batch reads the whole expert table once per step), plus
O(P*(H + 2I)) activations for the gathered rows and intermediates.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

import kernels_pallas
from kernels_pallas import reference
from kernels_pallas.grouped_matmul import MIN_BLOCK_ROWS, blocked_plan, default_block_rows
from kernels_pallas.moe_route import MAX_TOKENS as ROUTE_KERNEL_MAX_TOKENS
from kernels_pallas.skinny_matmul import skinny_matmul, skinny_tuning

from . import parallel
from .linear import Linear
from .mlp import ACTIVATIONS, GatedMLP

# lhs [P, in] (rows ragged by expert) x rhs [E, out, in] (contract in) -> [P, out].
_GROUPED_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0],
)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Sizes of one sparse MoE block; shared_expert_intermediate_size 0 means no shared expert."""

    hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    hidden_act: str = "silu"


# Grouped-matmul implementation per lowering platform (module docstring); anything
# not listed uses "blocked" (ROCm: the Triton kernel is compiled and checked for CUDA only).
DEFAULT_IMPL = {"cpu": "blocked", "cuda": "pallas", "rocm": "blocked", "tpu": "ragged_dot"}
IMPLS = ("blocked", "ragged_dot", "pallas")


def blocked_grouped_matmul(rows, weights, group_sizes, out_dtype=jnp.float32, block_rows=None,
                           count_blocks=False):
    """Grouped matmul doing (used blocks) x block_rows x in x out work (module docstring).

    Same contract as :func:`grouped_matmul`; rows past sum(group_sizes) come out zero.
    count_blocks=True also returns the number of loop iterations actually executed
    (a debug/cost check: it equals the plan's used-block count).
    """
    p, n_out = rows.shape[0], weights.shape[1]
    if p == 0:
        out = jnp.zeros((0, n_out), out_dtype)
        return (out, jnp.zeros((), jnp.int32)) if count_blocks else out
    b = min(block_rows or default_block_rows(p, weights.shape[0], smallest=8), p)
    expert, start, end, used, _ = blocked_plan(group_sizes, p, b)
    offs = jnp.arange(b, dtype=jnp.int32)

    def body(j, carry):
        out, count = carry
        lo, hi = start[j], end[j]
        # dynamic_slice clamps a block that would run past row P back inside; shift
        # the mask with it so only rows [lo, hi) are written.
        first = jnp.minimum(lo, p - b)
        blk = jax.lax.dynamic_slice_in_dim(rows, first, b, axis=0)
        w = jax.lax.dynamic_index_in_dim(weights, expert[j], axis=0, keepdims=False)  # [out, in]
        # fp32 accumulation, as in layers.linear (XLA:CPU's fast bf16 matmul produces fp32)
        res = jax.lax.dot_general(blk, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        idx = first + offs
        mask = ((idx >= lo) & (idx < hi))[:, None]
        cur = jax.lax.dynamic_slice_in_dim(out, first, b, axis=0)
        out = jax.lax.dynamic_update_slice_in_dim(out, jnp.where(mask, res.astype(out_dtype), cur),
                                                  first, axis=0)
        return out, count + 1

    init = (jnp.zeros((p, n_out), out_dtype), jnp.zeros((), jnp.int32))
    # Dynamic upper bound: a while loop whose trip count is the used-block count.
    out, count = jax.lax.fori_loop(0, used, body, init)
    return (out, count) if count_blocks else out


def ragged_dot_grouped_matmul(rows, weights, group_sizes, out_dtype=jnp.float32):
    """:func:`grouped_matmul` through ``jax.lax.ragged_dot_general`` (a grouped GEMM on TPU only)."""
    return jax.lax.ragged_dot_general(
        rows, weights, group_sizes.astype(jnp.int32), _GROUPED_DIMS,
        preferred_element_type=jnp.float32).astype(out_dtype)


def grouped_matmul(rows: jnp.ndarray, weights: jnp.ndarray, group_sizes: jnp.ndarray,
                   out_dtype=jnp.float32, *, impl: str | None = None,
                   block_rows: int | None = None) -> jnp.ndarray:
    """rows [P, in], sorted by group; weights [G, out, in]; group_sizes [G] -> [P, out].

    Row r uses the weights of the group whose cumulative range holds r; rows past
    sum(group_sizes) belong to no group and must be ignored by the caller.
    impl: "blocked" | "ragged_dot" | "pallas" (the GPU kernel) | None (per lowering platform,
    ``DEFAULT_IMPL``).
    """
    blocked = functools.partial(blocked_grouped_matmul, out_dtype=out_dtype, block_rows=block_rows)
    ragged = functools.partial(ragged_dot_grouped_matmul, out_dtype=out_dtype)
    pallas = functools.partial(kernels_pallas.grouped_matmul, out_dtype=out_dtype, block_rows=block_rows)
    fns = {"blocked": blocked, "ragged_dot": ragged, "pallas": pallas}
    if impl is not None:
        if impl not in fns:
            raise ValueError(f"unknown grouped matmul impl {impl!r}; expected one of {IMPLS}")
        return fns[impl](rows, weights, group_sizes)
    # Chosen at lowering time, so an AOT lowering for another platform gets that
    # platform's implementation (only the selected branch is compiled).
    return jax.lax.platform_dependent(rows, weights, group_sizes, default=blocked,
                                      **{plat: fns[name] for plat, name in DEFAULT_IMPL.items()})


# Softmax (fp32) top-k routing: logits [T, E] -> (weights [T, k] fp32, experts [T, k] int32).
# The softmax over all E experts stays (though renormalised over the k it equals the softmax
# of the top k logits): on a GPU it also sums the router matmul's split-K partials, which a
# top-k of the logits needs done apart (two launches more per layer).
route = reference.route_top_k

# Pairs up to which sort_pairs ranks by comparing every pair with every other (P x P, one
# fused reduction: decode steps), above which it sorts (prefill).
COMPARE_ALL_MAX_PAIRS = 1024


def sort_pairs(flat_experts, num_experts: int):
    """Stable sort of token-expert pairs by expert, as (position [P], group_sizes [E]):
    pair p goes to row position[p] of the expert-ordered rows; group_sizes counts the pairs
    of each expert (ids >= E belong to no group and sort last).

    Decode steps (P <= COMPARE_ALL_MAX_PAIRS) rank each pair by counting the pairs before it
    (`reference.rank_pairs`: two fused reductions, where a sort and the scatters that invert
    it are several kernels each, a step's launches on a GPU)."""
    p = flat_experts.shape[0]
    e = flat_experts.astype(jnp.int32)
    if p <= COMPARE_ALL_MAX_PAIRS:
        return reference.rank_pairs(e, num_experts)
    order = jnp.argsort(e, stable=True)
    position = jnp.zeros_like(order).at[order].set(jnp.arange(p, dtype=order.dtype), unique_indices=True)
    return position.astype(jnp.int32), reference.expert_counts(e, num_experts)


def route_sorted(x, gate: Linear, valid, top_k: int, norm_topk_prob: bool):
    """The router `gate` on x [T, H], then `route` and `sort_pairs` at once: (weights [T, k],
    position [T * k], group_sizes [E]), the pairs of invalid tokens (valid [T] bool) in no
    group. A decode step's few tokens (at most ROUTE_KERNEL_MAX_TOKENS) on a GPU: two kernels,
    the router's split-K partial products (`router_partials`) and the routing kernel
    (`kernels_pallas.moe_route`), which sums them; XLA makes the router three launches (its
    GEMM split over K, the sum, a slice) and the routing six or more. Elsewhere XLA's router
    and `reference.moe_route`, the same."""
    t, num_experts = x.shape[0], gate.out_features
    if t > ROUTE_KERNEL_MAX_TOKENS:
        weights, experts = route(gate(x), top_k, norm_topk_prob)
        position, group_sizes = sort_pairs(jnp.where(valid[:, None], experts, num_experts).reshape(-1), num_experts)
        return weights, position, group_sizes
    kw = dict(top_k=top_k, norm_topk_prob=norm_topk_prob)

    def on_gpu(x, valid):
        if parallel.axis_size(parallel.TP) > 1:  # the skinny kernel takes whole weights only
            return kernels_pallas.moe_route(gate(x), valid, **kw)
        return kernels_pallas.moe_route(router_partials(x, gate), valid, logits_dtype=gate.dtype or x.dtype, **kw)

    weights, position, group_sizes = jax.lax.platform_dependent(
        x, valid, cuda=on_gpu, default=lambda x, valid: reference.moe_route(gate(x), valid, **kw))
    return weights, position.reshape(-1), group_sizes


def router_partials(x, gate: Linear, *, interpret: bool = False):
    """The router's logits for a decode step's few rows as split-K partial products [S, T, E]
    fp32 (`skinny_matmul`): a program per K tile and column tile, since a router's weights are
    too narrow for a program per column tile alone to keep a GPU's SMs busy."""
    dtype = gate.dtype or x.dtype
    block_k = skinny_tuning()["block_k"]
    return skinny_matmul(x.astype(dtype), [gate.kernel[...].astype(dtype)], k_splits=-(-x.shape[1] // block_k),
                         block_k=block_k, interpret=interpret)


def moe_experts(x, routing_weights, experts, gate_up_proj, down_proj, act=jax.nn.silu, valid=None,
                *, impl: str | None = None, block_rows: int | None = None):
    """Sorted grouped-matmul dispatch (module docstring): x [T, H] -> [T, H] in x's dtype.

    routing_weights [T, k], experts [T, k] int; gate_up_proj [E, 2I, H]; down_proj [E, H, I];
    valid [T] bool or None: invalid tokens (bucket padding) are routed to no expert, so
    a grouped-GEMM kernel skips them, and their output is zero.
    impl, block_rows: grouped-matmul implementation and blocked row-block size
    (:func:`grouped_matmul`); None = per platform / :func:`default_block_rows`.
    """
    k = experts.shape[1]
    flat_experts = experts.reshape(-1)
    if valid is not None:
        # Expert id E sorts after every real expert and is counted in no group.
        flat_experts = jnp.where(jnp.repeat(valid, k), flat_experts, gate_up_proj.shape[0])
    position, group_sizes = sort_pairs(flat_experts, gate_up_proj.shape[0])
    return sorted_experts(x, routing_weights, position, group_sizes, gate_up_proj, down_proj, act, valid,
                          impl=impl, block_rows=block_rows)


def sorted_experts(x, routing_weights, position, group_sizes, gate_up_proj, down_proj, act=jax.nn.silu,
                   valid=None, *, impl: str | None = None, block_rows: int | None = None):
    """`moe_experts` of pairs already ordered by expert (`sort_pairs`, `route_sorted`):
    position [T * k], group_sizes [E]."""
    t, k = routing_weights.shape
    gate_up, down = gate_up_proj.astype(x.dtype), down_proj.astype(x.dtype)
    args = (x, position, group_sizes, gate_up, down)
    unfused = functools.partial(expert_outputs, k=k, act=act, impl=impl, block_rows=block_rows)
    if t * k <= COMPARE_ALL_MAX_PAIRS and impl is None and act is jax.nn.silu:
        # A decode step on a GPU: the kernels take the tokens and the gate/up output as they
        # are (`fused_expert_outputs`); elsewhere XLA puts them in order.
        fused = functools.partial(fused_expert_outputs, block_rows=block_rows)
        y = jax.lax.platform_dependent(*args, cuda=fused, default=unfused)
    else:
        y = unfused(*args)
    y = jnp.take(y, position, axis=0).reshape(t, k, -1)
    out = jnp.einsum("tk,tkh->th", routing_weights.astype(x.dtype).astype(jnp.float32), y)
    if valid is not None:
        out = jnp.where(valid[:, None], out, 0.0)
    return out.astype(x.dtype)


def expert_outputs(x, position, group_sizes, gate_up, down, *, k, act, impl, block_rows):
    """Each token-expert pair's expert output [>= P, H] fp32, in expert order: the tokens'
    rows put in that order, then two grouped matmuls with the activation between them."""
    t = x.shape[0]
    inter = down.shape[-1]
    # Pair p = token * k + slot goes to row position[p] of the expert-ordered rows; at least
    # a kernel block's worth of them (the rows past the pairs belong to no group), so that
    # the grouped matmuls take them as they are (a pad before each is one launch more).
    n_rows = max(t * k, MIN_BLOCK_ROWS)
    if t * k <= COMPARE_ALL_MAX_PAIRS:
        # A decode step's few rows: one scatter launch into zeros.
        rows = jnp.zeros((n_rows, x.shape[1]), x.dtype).at[position].set(
            jnp.repeat(x, k, axis=0), unique_indices=True)
    else:
        # A prefill gathers each row's token instead: the zeros a scatter fills depend on
        # nothing, and XLA:GPU fuses every layer's into one kernel at the start of the step,
        # all alive at once ([P, H] per layer: 5.4 GB of Qwen3-Omni's 4096-token prefill).
        token = jnp.zeros(n_rows, jnp.int32).at[position].set(
            jnp.arange(t * k, dtype=jnp.int32) // k, unique_indices=True)
        rows = jnp.take(x, token, axis=0)
    # Intermediate in the compute dtype (as transformers); the down projection in fp32
    # so the k-way weighted sum after it adds unrounded expert outputs.
    h = grouped_matmul(rows, gate_up, group_sizes, out_dtype=x.dtype, impl=impl, block_rows=block_rows)
    h = act(h[:, :inter]) * h[:, inter:]
    return grouped_matmul(h, down, group_sizes, impl=impl, block_rows=block_rows)


def fused_expert_outputs(x, position, group_sizes, gate_up, down, *, block_rows=None, interpret=False):
    """`expert_outputs` in two kernel launches (a decode step with SiLU experts on a GPU):
    the gate/up kernel reads each sorted row's token itself and returns SiLU(gate) * up (the
    scatter, its zeros and the activation were three launches of their own a layer)."""
    kw = dict(block_rows=block_rows, interpret=interpret)
    h = kernels_pallas.grouped_matmul(x, gate_up, group_sizes, out_dtype=x.dtype, position=position, glu=True, **kw)
    return kernels_pallas.grouped_matmul(h, down, group_sizes, **kw)


def expert_parallel_moe(x, routing_weights, experts, gate_up_proj, down_proj, act=jax.nn.silu, valid=None):
    """:func:`moe_experts` with the experts split over the mesh's "ep" axis (layers/parallel.py).

    Each shard holds a contiguous run of num_experts / EP experts and the tokens (replicated);
    it runs only the pairs routed to its experts (the others get the out-of-range expert id,
    which no group counts, so they cost nothing and come out zero), and the shards' partial
    outputs are summed. Without an expert axis this is moe_experts itself.
    """
    if parallel.axis_size(parallel.EP) == 1:
        return moe_experts(x, routing_weights, experts, gate_up_proj, down_proj, act, valid)

    def local(x, routing_weights, experts, gate_up_proj, down_proj, valid):
        n = gate_up_proj.shape[0]
        mine = experts - jax.lax.axis_index(parallel.EP) * n
        mine = jnp.where((mine >= 0) & (mine < n), mine, n)
        out = moe_experts(x, routing_weights, mine, gate_up_proj, down_proj, act, valid)
        return jax.lax.psum(out, parallel.EP)

    if valid is None:
        valid = jnp.ones(x.shape[0], bool)
    rep, split = P(), P(parallel.EP)
    return jax.shard_map(local, mesh=parallel.current_mesh(), in_specs=(rep, rep, rep, split, split, rep),
                         out_specs=rep, check_vma=False)(x, routing_weights, experts, gate_up_proj,
                                                         down_proj, valid)


class MoEExperts(nnx.Module):
    """The fused expert weights, named and laid out as transformers' ``*Experts`` modules."""

    def __init__(self, cfg: MoEConfig, *, param_dtype=jnp.float32, rngs: nnx.Rngs):
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        init = jax.nn.initializers.normal(0.02)
        self.gate_up_proj = nnx.Param(init(rngs.params(), (e, 2 * i, h), param_dtype))
        self.down_proj = nnx.Param(init(rngs.params(), (e, h, i), param_dtype))


class SparseMoeBlock(nnx.Module):
    """Router ``gate`` + fused ``experts`` (+ sigmoid-gated ``shared_expert``), names as in HF.

    Mirrors ``Qwen3OmniMoeThinkerTextSparseMoeBlock`` (no shared expert) and
    ``Qwen3OmniMoeTalkerTextSparseMoeBlock`` (``shared_expert`` + ``shared_expert_gate``).
    """

    def __init__(self, cfg: MoEConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        self.dtype = dtype
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, use_bias=False, **kw)
        self.experts = MoEExperts(cfg, param_dtype=param_dtype, rngs=rngs)
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size,
                                          act=cfg.hidden_act, **kw)
            self.shared_expert_gate = Linear(cfg.hidden_size, 1, use_bias=False, **kw)

    def __call__(self, x: jnp.ndarray, valid: jnp.ndarray | None = None) -> jnp.ndarray:
        """x [T, H] -> [T, H]; valid [T] bool (optional) marks real tokens (see moe_experts)."""
        cfg = self.cfg
        x = x.astype(self.dtype)
        act = ACTIVATIONS[cfg.hidden_act]
        gate_up, down = self.experts.gate_up_proj[...], self.experts.down_proj[...]
        if parallel.axis_size(parallel.EP) == 1:
            valid = jnp.ones(x.shape[0], bool) if valid is None else valid
            weights, position, sizes = route_sorted(x, self.gate, valid, cfg.num_experts_per_tok, cfg.norm_topk_prob)
            out = sorted_experts(x, weights, position, sizes, gate_up, down, act, valid)
        else:
            weights, experts = route(self.gate(x), cfg.num_experts_per_tok, cfg.norm_topk_prob)
            out = expert_parallel_moe(x, weights, experts, gate_up, down, act, valid)
        if cfg.shared_expert_intermediate_size:
            out = out + jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def dense_moe_reference(x, gate_w, gate_up_proj, down_proj, top_k, norm_topk_prob,
                        act=jax.nn.silu):
    """Every expert on every token, combined with the routing weights (tests only: E x the work).

    gate_w [E, H] is the router weight in HF layout; other weights as in SparseMoeBlock.
    """
    weights, experts = route(x @ gate_w.T, top_k, norm_topk_prob)
    dense_w = jnp.zeros((x.shape[0], gate_w.shape[0]), jnp.float32)
    dense_w = dense_w.at[jnp.arange(x.shape[0])[:, None], experts].set(weights)
    inter = down_proj.shape[-1]
    h = jnp.einsum("th,eoh->teo", x, gate_up_proj)
    h = act(h[..., :inter]) * h[..., inter:]
    y = jnp.einsum("tei,ehi->teh", h, down_proj)
    return jnp.einsum("te,teh->th", dense_w, y)
