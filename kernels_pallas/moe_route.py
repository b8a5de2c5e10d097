"""A decode step's MoE routing as one Pallas (Triton) kernel for NVIDIA GPUs.

XLA:GPU compiles the routing of a decode step (the softmax over the experts, the top-k, its
renormalisation, the pairs' ranks by expert and the experts' pair counts) into six to eight
kernels, each a launch per MoE layer, and at batch 1 a step's time is its launches more
than its bytes (issue 47). A decode step has few tokens (at most ``MAX_TOKENS``), so one
program holds all of them: their router logits ``[T, E]`` in registers, the top-k as k
rounds of a row maximum, and the order of the token-expert pairs by expert from two small
matmuls of the selection matrix (the pairs of earlier tokens on each expert, the pairs on
lower-numbered experts).

What it computes is ``reference.moe_route``'s: the MoE layer's ``route`` and
``sort_pairs`` (``omni_jax/models/layers/moe.py``), the token-expert pairs of tokens that
are not ``valid`` (bucket padding) sorted last and counted in no expert.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.paged_attention import next_pow2

__all__ = ["moe_route", "MAX_TOKENS"]

# The most tokens the kernel routes (one program: [T, E] logits in registers); decode steps.
MAX_TOKENS = 64


def _kernel(logits_ref, valid_ref, w_ref, pos_ref, sizes_ref, *, tokens, experts, top_k, renorm, logits_dtype):
    tp, ep = max(16, next_pow2(tokens)), max(16, next_pow2(experts))  # Triton tiles, dots >= 16
    t = jnp.arange(tp, dtype=jnp.int32)
    e = jnp.arange(ep, dtype=jnp.int32)
    row_ok, col_ok = t < tokens, e < experts
    at, mask = (t[:, None], e[None, :]), row_ok[:, None] & col_ok[None, :]
    if logits_ref.ndim == 2:
        x = plgpu.load(logits_ref.at[at], mask=mask, other=0.0).astype(jnp.float32)
    else:  # split-K partials: their sum, rounded as the router's own output would be
        x = sum(plgpu.load(logits_ref.at[(jnp.full((1, 1), i, jnp.int32), *at)], mask=mask, other=0.0)
                for i in range(logits_ref.shape[0]))
        x = x.astype(logits_dtype).astype(jnp.float32)
    x = jnp.where(col_ok[None, :], x, -jnp.inf)
    p = jnp.exp(x - jnp.max(x, axis=1)[:, None])
    p = p / jnp.sum(p, axis=1)[:, None]                       # softmax over the experts, fp32
    live = row_ok & (plgpu.load(valid_ref.at[t], mask=row_ok, other=0) != 0)

    weights, chosen = [], []
    sel = jnp.zeros((tp, ep), jnp.float32)                    # 1 where a live token chose an expert
    for _ in range(top_k):                                    # the largest; the lowest id among ties
        w = jnp.max(p, axis=1)
        i = jnp.min(jnp.where(p == w[:, None], e[None, :], ep), axis=1)
        hit = e[None, :] == i[:, None]
        p = jnp.where(hit, -1.0, p)
        sel = jnp.where(hit & live[:, None], 1.0, sel)
        weights.append(w)
        chosen.append(hit)
    if renorm:
        total = sum(weights)
        weights = [w / total for w in weights]

    # Pairs by (expert, token): before[t, e] = earlier live tokens on expert e, offset[e] =
    # pairs on lower-numbered experts (0/1 and counts up to T*k: exact in bf16 x bf16 -> fp32).
    sel16 = sel.astype(jnp.bfloat16)
    earlier = (t[None, :] < t[:, None]).astype(jnp.bfloat16)  # [tp, tp]
    before = plgpu.dot(earlier, sel16)                        # [tp, ep]
    lower = (e[:, None] < e[None, :]).astype(jnp.bfloat16)    # [ep, ep]
    offset = jnp.sum(plgpu.dot(sel16, lower), axis=0)         # [ep]
    n_live = jnp.sum(live.astype(jnp.int32))
    live_before = (jnp.sum(before, axis=1) / top_k).astype(jnp.int32)   # k pairs per live token
    for j, (w, hit) in enumerate(zip(weights, chosen)):
        pos = jnp.sum(jnp.where(hit, offset[None, :] + before, 0.0), axis=1).astype(jnp.int32)
        # A padding token's pairs follow every live pair, in pair order (token * k + slot).
        pos = jnp.where(live, pos, (n_live + t - live_before) * top_k + j)
        col = jnp.full((tp,), j, jnp.int32)
        plgpu.store(w_ref.at[t, col], w, mask=row_ok)
        plgpu.store(pos_ref.at[t, col], pos, mask=row_ok)
    plgpu.store(sizes_ref.at[e], jnp.sum(sel, axis=0).astype(jnp.int32), mask=col_ok)


@functools.partial(jax.jit, static_argnames=("top_k", "norm_topk_prob", "logits_dtype", "interpret", "num_warps"))
def moe_route(router_logits, valid, *, top_k: int, norm_topk_prob: bool, logits_dtype=jnp.float32,
              interpret: bool = False, num_warps: int = 4):
    """router_logits [T, E] (T <= MAX_TOKENS), valid [T] bool -> (weights [T, k] fp32, position
    [T, k] int32: the row of each token-expert pair in expert order, group_sizes [E] int32).

    router_logits may also be the router's split-K partial products [S, T, E] fp32
    (`skinny_matmul` with k_splits): the kernel sums them and rounds the sum to
    `logits_dtype` (the router's compute dtype), so that XLA's sum of them is no launch."""
    tokens, experts = router_logits.shape[-2:]
    if tokens > MAX_TOKENS or not 0 < top_k <= experts:
        raise ValueError(f"moe_route: {tokens} tokens (at most {MAX_TOKENS}), top_k {top_k} of {experts} experts")
    whole = lambda shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))  # noqa: E731
    out_shape = (jax.ShapeDtypeStruct((tokens, top_k), jnp.float32), jax.ShapeDtypeStruct((tokens, top_k), jnp.int32),
                 jax.ShapeDtypeStruct((experts,), jnp.int32))
    return pl.pallas_call(
        functools.partial(_kernel, tokens=tokens, experts=experts, top_k=top_k, renorm=norm_topk_prob,
                          logits_dtype=logits_dtype),
        grid=(1,),
        in_specs=[whole(router_logits.shape), whole((tokens,))],
        out_specs=tuple(whole(s.shape) for s in out_shape),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="moe_route",
    )(router_logits, valid.astype(jnp.int32))
