"""A Qwen-style pre-norm decoder stack (embed -> layers -> final norm).

Used by the Qwen2.5-Omni thinker text model and talker. Hidden states of chosen
layers can be captured on the way (HF `hidden_states` indexing: 0 is the input
embeddings, i the output of layer i-1, num_layers the output after the final norm).

Why the layers are a Python loop (unrolled in the compiled step) and not a `lax.scan` over
stacked weights, here and in the Qwen3-Omni decoders: a scan compiles a real-size step 4-10x
faster (Qwen3-Omni's 48-layer thinker decode step for A100: 28 s -> 2 s), but with this XLA
(JAX 0.10.2) each iteration copies its layer's weights out of the stack before the GEMMs read
them (temporaries the size of one layer's weights, 1.2 GiB there): two more passes over the
weights in a step whose cost is reading them once. XLA's dynamic-slice fusion, which would let
the GEMMs read the stack in place, fails to compile (`xla_gpu_enable_dynamic_slice_fusion`:
"BufferAllocation::Slice not assigned"). Measured by compiling for the GPU targets (omni_jax/gpu).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax.numpy as jnp
from flax import nnx

from .attention import Attention, AttentionConfig, AttentionMetadata
from .mlp import GatedMLP
from .norms import RMSNorm
from .rope import inv_frequencies, mrope_band_rows, rope_cos_sin


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Sizes of a Qwen2-style decoder; `from_hf` reads a transformers text config dict."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False
    qkv_bias: bool = True
    qk_norm: bool = False
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    sliding_window: int | None = None
    embedding_size: int | None = None  # width of embed_tokens when it differs (the talker's codec table)

    @classmethod
    def from_hf(cls, d: dict) -> "DecoderConfig":
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if rope.get("rope_type", "default") not in ("default", None):
            raise ValueError(f"unsupported rope_type {rope.get('rope_type')!r}")
        head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
        section = rope.get("mrope_section")
        return cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_layers=d["num_hidden_layers"],
            num_heads=d["num_attention_heads"],
            num_kv_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
            head_dim=head_dim, rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 1_000_000.0))),
            mrope_section=tuple(section) if section else None,
            mrope_interleaved=bool(rope.get("mrope_interleaved", False)),
            hidden_act=d.get("hidden_act", "silu"),
            max_position_embeddings=d.get("max_position_embeddings", 32768),
            sliding_window=d.get("sliding_window") if d.get("use_sliding_window") else None,
            embedding_size=d.get("embedding_size"),
        )

    @property
    def attention(self) -> AttentionConfig:
        return AttentionConfig(self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim,
                               qkv_bias=self.qkv_bias, qk_norm=self.qk_norm,
                               rms_norm_eps=self.rms_norm_eps, sliding_window=self.sliding_window)


class DecoderLayer(nnx.Module):
    """Pre-norm attention + feed-forward block, names as in transformers.

    The feed-forward is a gated MLP unless `mlp` is given (e.g. a MoE block).
    """

    def __init__(self, cfg, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs,
                 mlp: nnx.Module | None = None):
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        self.self_attn = Attention(cfg.attention, rngs=rngs, **kw)
        self.mlp = mlp if mlp is not None else GatedMLP(cfg.hidden_size, cfg.intermediate_size,
                                                        act=cfg.hidden_act, rngs=rngs, **kw)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)

    def __call__(self, x, cos, sin, meta, kv_cache=None):
        h, kv_cache = self.self_attn(self.input_layernorm(x, meta.backend), cos, sin, meta, kv_cache)
        # The residual add and the norm in one kernel on a GPU. (Leaving the layer's last add
        # open for the next layer's norm saves no launch: on a GPU XLA fuses that add into
        # the kernel before it, the down projection's split-K sum or the MoE combine.)
        h, x = self.post_attention_layernorm.add(x, h, meta.backend)
        return x + self._feed_forward(h, meta), kv_cache

    def _feed_forward(self, h, meta):
        return self.mlp(h)


class TextDecoder(nnx.Module):
    """embed_tokens -> layers -> norm over a packed token batch [T]."""

    def __init__(self, cfg: DecoderConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        self.dtype = dtype
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.embedding_size or cfg.hidden_size, dtype=dtype,
                                      param_dtype=param_dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
                                for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)

    def embed(self, token_ids: jnp.ndarray) -> jnp.ndarray:
        """Token ids [T] -> embeddings [T, hidden]."""
        return jnp.take(self.embed_tokens.embedding[...], token_ids, axis=0).astype(self.dtype)

    def __call__(self, inputs_embeds, positions, meta: AttentionMetadata, kv_caches=None,
                 capture_layers: Sequence[int] = ()):
        """Run the stack. positions: [3, T] (M-RoPE) or [T].

        Returns (normed hidden [T, hidden], kv_caches list or None, {layer index: hidden [T, hidden]}).
        """
        cfg = self.cfg
        # Trace-time constants: kept off the module so they are not mistaken for state.
        inv_freq = inv_frequencies(cfg.head_dim, cfg.rope_theta)
        band_rows = mrope_band_rows(cfg.mrope_section, cfg.head_dim // 2, cfg.mrope_interleaved)
        cos, sin = rope_cos_sin(positions, inv_freq, band_rows, dtype=inputs_embeds.dtype)
        captured = {}
        x = inputs_embeds
        new_caches = [] if kv_caches is not None else None
        for i, layer in enumerate(self.layers):
            if i in capture_layers:
                captured[i] = x
            x, cache = layer(x, cos, sin, meta, None if kv_caches is None else kv_caches[i])
            if new_caches is not None:
                new_caches.append(cache)
        x = self.norm(x, meta.backend)
        if self.cfg.num_layers in capture_layers:
            captured[self.cfg.num_layers] = x
        return x, new_caches, captured
