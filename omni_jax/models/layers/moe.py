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

1. sort the P pairs by expert (``argsort`` of P int32 keys: O(P log P), negligible),
   gather the token rows into expert order ``[P, H]``, count the pairs per expert;
2. two grouped matmuls over the sorted rows (``ragged_dot`` with the per-expert
   group sizes): ``[P, H] x [E, 2I, H] -> [P, 2I]``, SiLU-gate, ``[P, I] x [E, H, I] -> [P, H]``;
3. un-permute and sum each token's k rows weighted by its routing weights (the
   scatter-add, written as a gather + k-term sum: no atomics, deterministic).

Cost: FLOPs ~ 2 * P * 3 * H * I = 2 * T * k * 3 * H * I (+ 2*T*H*E for the router,
+ 2*T*3*H*I_shared for a shared expert). Memory traffic: the weights of the experts
that receive a token (at most min(E, P) of them, 3*H*I elements each; with P a few
times E nearly every expert is hit, so a large decode batch reads the whole expert
table once per step), plus O(P*(H + 2I)) activations for the gathered rows and
intermediates. Those figures hold only where ``ragged_dot`` lowers to a real grouped
matmul (TPU; a grouped-GEMM kernel on GPU). JAX's own CPU lowering of ``ragged_dot``
expands the rows into a zero-masked ``[E, P, H]`` batch (E times the FLOPs and an
``E*P*H`` temporary), and XLA:GPU by default rewrites the ``chlo.ragged_dot`` this
emits the same way unless a grouped-GEMM backend (cuDNN ragged-dot fusion, behind
an XLA flag) takes it, per XLA's own description; not measured here (no GPU).
Fine for the tiny test models, not for a 128-expert prefill: :func:`grouped_matmul`
is the one place to plug a grouped-GEMM kernel in.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

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


def grouped_matmul(rows: jnp.ndarray, weights: jnp.ndarray, group_sizes: jnp.ndarray,
                   out_dtype=jnp.float32) -> jnp.ndarray:
    """rows [P, in], sorted by group; weights [G, out, in]; group_sizes [G] -> [P, out].

    Row r uses the weights of the group whose cumulative range holds r; rows past
    sum(group_sizes) belong to no group and must be ignored by the caller.
    """
    return jax.lax.ragged_dot_general(
        rows, weights, group_sizes.astype(jnp.int32), _GROUPED_DIMS,
        preferred_element_type=out_dtype)


def route(router_logits: jnp.ndarray, top_k: int, norm_topk_prob: bool):
    """Softmax (fp32) top-k routing: logits [T, E] -> (weights [T, k] fp32, experts [T, k] int32)."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def moe_experts(x, routing_weights, experts, gate_up_proj, down_proj, act=jax.nn.silu, valid=None):
    """Sorted grouped-matmul dispatch (module docstring): x [T, H] -> [T, H] in x's dtype.

    routing_weights [T, k], experts [T, k] int; gate_up_proj [E, 2I, H]; down_proj [E, H, I];
    valid [T] bool or None: invalid tokens (bucket padding) are routed to no expert, so
    a grouped-GEMM kernel skips them, and their output is zero.
    """
    t, k = experts.shape
    num_experts = gate_up_proj.shape[0]
    inter = down_proj.shape[-1]
    flat_experts = experts.reshape(-1)
    if valid is not None:
        # Expert id E sorts after every real expert and is counted in no group.
        flat_experts = jnp.where(jnp.repeat(valid, k), flat_experts, num_experts)
    order = jnp.argsort(flat_experts, stable=True)
    group_sizes = jnp.zeros((num_experts,), jnp.int32).at[flat_experts].add(1, mode="drop")
    rows = jnp.take(x, order // k, axis=0)

    # Intermediate in the compute dtype (as transformers); the down projection in fp32
    # so the k-way weighted sum below adds unrounded expert outputs.
    h = grouped_matmul(rows, gate_up_proj.astype(x.dtype), group_sizes, out_dtype=x.dtype)
    h = act(h[:, :inter]) * h[:, inter:]
    y = grouped_matmul(h, down_proj.astype(x.dtype), group_sizes)  # [P, H] fp32

    # Pair p = token * k + slot sits at sorted position inverse[p].
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype),
                                                  unique_indices=True)
    y = jnp.take(y, inverse, axis=0).reshape(t, k, -1)
    out = jnp.einsum("tk,tkh->th", routing_weights.astype(x.dtype).astype(jnp.float32), y)
    if valid is not None:
        out = jnp.where(valid[:, None], out, 0.0)
    return out.astype(x.dtype)


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
        self.gate = nnx.Linear(cfg.hidden_size, cfg.num_experts, use_bias=False, **kw)
        self.experts = MoEExperts(cfg, param_dtype=param_dtype, rngs=rngs)
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size,
                                          act=cfg.hidden_act, **kw)
            self.shared_expert_gate = nnx.Linear(cfg.hidden_size, 1, use_bias=False, **kw)

    def __call__(self, x: jnp.ndarray, valid: jnp.ndarray | None = None) -> jnp.ndarray:
        """x [T, H] -> [T, H]; valid [T] bool (optional) marks real tokens (see moe_experts)."""
        cfg = self.cfg
        x = x.astype(self.dtype)
        weights, experts = route(self.gate(x), cfg.num_experts_per_tok, cfg.norm_topk_prob)
        out = moe_experts(x, weights, experts, self.experts.gate_up_proj[...],
                          self.experts.down_proj[...], ACTIVATIONS[cfg.hidden_act], valid)
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
