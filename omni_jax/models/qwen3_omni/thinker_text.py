"""The Qwen3-Omni thinker's text decoder: Qwen3-MoE with interleaved M-RoPE and DeepStack.

Per layer (names as transformers' ``Qwen3OmniMoeThinkerTextDecoderLayer``):
``input_layernorm`` -> ``self_attn`` (q/k/v/o_proj without bias, per-head ``q_norm`` /
``k_norm`` RMSNorm before RoPE) -> residual -> ``post_attention_layernorm`` -> ``mlp``
-> residual. ``mlp`` is the sparse MoE block (omni_jax/models/layers/moe.py) on every
layer of the real model; layers listed in ``mlp_only_layers`` or skipped by
``decoder_sparse_step`` get a dense SwiGLU of ``intermediate_size`` (as transformers).

M-RoPE is always interleaved here, whatever the config's ``interleaved`` flags say,
because transformers' Qwen3-Omni rotary embedding interleaves unconditionally.

DeepStack: Qwen3-Omni adds vision-encoder features from intermediate ViT layers to
the hidden states after decoder layers 0..n-1 at the visual token positions; see
:meth:`Qwen3TextDecoder.__call__`.

On-disk keys live under ``thinker.model.`` (the thinker's ``lm_head`` is
``thinker.lm_head``); experts are per-expert on disk and must go through
conversion/moe.py to reach the fused ``mlp.experts.gate_up_proj`` / ``down_proj``.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax.numpy as jnp
from flax import nnx

from ..layers.attention import AttentionConfig, AttentionMetadata
from ..layers.decoder import DecoderLayer
from ..layers.moe import MoEConfig, SparseMoeBlock
from ..layers.norms import RMSNorm
from ..layers.rope import inv_frequencies, mrope_band_rows, rope_cos_sin


@dataclasses.dataclass(frozen=True)
class Qwen3TextConfig:
    """Sizes of a Qwen3-MoE text decoder; `from_hf` reads a transformers text config dict.

    Also describes the talker's decoder (`shared_expert_intermediate_size` > 0); note
    that transformers gives every talker layer the MoE block whatever
    `mlp_only_layers` says, so a talker built from this should pass
    `dataclasses.replace(cfg, mlp_only_layers=(), decoder_sparse_step=1)`.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int = 0            # dense layers only
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    mrope_section: tuple[int, ...] | None = None
    attention_bias: bool = False
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768

    @classmethod
    def from_hf(cls, d: dict) -> "Qwen3TextConfig":
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise ValueError(f"unsupported rope_type {rope.get('rope_type')!r}")
        section = rope.get("mrope_section")
        head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
        return cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            num_layers=d["num_hidden_layers"], num_heads=d["num_attention_heads"],
            num_kv_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
            head_dim=head_dim,
            moe_intermediate_size=d["moe_intermediate_size"],
            num_experts=d.get("num_experts", d.get("num_local_experts", 0)),
            num_experts_per_tok=d["num_experts_per_tok"],
            intermediate_size=d.get("intermediate_size") or 0,
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            shared_expert_intermediate_size=d.get("shared_expert_intermediate_size") or 0,
            decoder_sparse_step=d.get("decoder_sparse_step") or 1,
            mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 1_000_000.0))),
            mrope_section=tuple(section) if section else None,
            attention_bias=bool(d.get("attention_bias", False)),
            hidden_act=d.get("hidden_act", "silu"),
            max_position_embeddings=d.get("max_position_embeddings", 32768),
        )

    def is_moe_layer(self, i: int) -> bool:
        """transformers' rule for which layers get the sparse MoE block."""
        return (i not in self.mlp_only_layers and self.num_experts > 0
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def attention(self) -> AttentionConfig:
        return AttentionConfig(self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim,
                               qkv_bias=self.attention_bias, o_bias=self.attention_bias,
                               qk_norm=True, rms_norm_eps=self.rms_norm_eps)

    @property
    def moe(self) -> MoEConfig:
        return MoEConfig(self.hidden_size, self.moe_intermediate_size, self.num_experts,
                         self.num_experts_per_tok, self.norm_topk_prob,
                         self.shared_expert_intermediate_size, self.hidden_act)


class Qwen3DecoderLayer(DecoderLayer):
    """Pre-norm attention (q/k norm) + MoE (or dense) feed-forward, names as in transformers."""

    def __init__(self, cfg: Qwen3TextConfig, layer_idx: int, *, dtype=jnp.float32,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        mlp = SparseMoeBlock(cfg.moe, dtype=dtype, param_dtype=param_dtype, rngs=rngs) \
            if cfg.is_moe_layer(layer_idx) else None
        super().__init__(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs, mlp=mlp)

    def _feed_forward(self, h, meta):
        # Bucket padding is routed to no expert: MoE work stays proportional to real tokens.
        if isinstance(self.mlp, SparseMoeBlock):
            return self.mlp(h, meta.valid_tokens(h.shape[0]))
        return self.mlp(h)


class Qwen3TextDecoder(nnx.Module):
    """embed_tokens -> layers -> norm over a packed token batch [T] (same contract as TextDecoder)."""

    def __init__(self, cfg: Qwen3TextConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        self.dtype = dtype
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype,
                                      param_dtype=param_dtype, rngs=rngs)
        self.layers = nnx.List([Qwen3DecoderLayer(cfg, i, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
                                for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)

    def embed(self, token_ids: jnp.ndarray) -> jnp.ndarray:
        """Token ids [T] -> embeddings [T, hidden]."""
        return jnp.take(self.embed_tokens.embedding[...], token_ids, axis=0).astype(self.dtype)

    def __call__(self, inputs_embeds, positions, meta: AttentionMetadata, kv_caches=None,
                 capture_layers: Sequence[int] = (), deepstack=None):
        """Run the stack. positions: [3, T] (T/H/W rows of M-RoPE) or [T].

        deepstack: None, or ``(mask [T] bool, features [n, T, hidden])``: after decoder
        layer i < n, ``features[i]`` is added to the hidden states of the tokens where
        ``mask`` is true (the visual placeholder tokens); rows where it is false are
        ignored, so the caller may fill them with anything (e.g. a clipped gather).
        This is transformers' ``deepstack_visual_embeds`` / ``visual_pos_masks``,
        scattered to token positions so the step keeps static shapes. Pass None for
        decode steps and for chunks without visual tokens.

        Returns (normed hidden [T, hidden], kv_caches list or None, {index: hidden [T, hidden]})
        with transformers' ``hidden_states`` indexing: 0 is the input embeddings, i the
        output of layer i-1 (before that layer's DeepStack addition, as transformers
        records it), num_layers the final normed output.
        """
        cfg = self.cfg
        # Trace-time constants: kept off the module so they are not mistaken for state.
        inv_freq = inv_frequencies(cfg.head_dim, cfg.rope_theta)
        band_rows = mrope_band_rows(cfg.mrope_section, cfg.head_dim // 2, interleaved=True)
        cos, sin = rope_cos_sin(positions, inv_freq, band_rows, dtype=inputs_embeds.dtype)
        x = inputs_embeds
        captured = {0: x} if 0 in capture_layers else {}
        new_caches = [] if kv_caches is not None else None
        for i, layer in enumerate(self.layers):
            x, cache = layer(x, cos, sin, meta, None if kv_caches is None else kv_caches[i])
            if new_caches is not None:
                new_caches.append(cache)
            if i + 1 < cfg.num_layers and i + 1 in capture_layers:
                captured[i + 1] = x
            if deepstack is not None and i < deepstack[1].shape[0]:
                mask, features = deepstack
                x = x + jnp.where(mask[:, None], features[i].astype(x.dtype), 0).astype(x.dtype)
        x = self.norm(x, meta.backend)
        if cfg.num_layers in capture_layers:
            captured[cfg.num_layers] = x
        return x, new_caches, captured
