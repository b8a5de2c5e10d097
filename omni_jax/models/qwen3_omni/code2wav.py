"""Qwen3-Omni code2wav: residual codec codes -> 24 kHz waveform, in Flax NNX.

Mirrors transformers' ``Qwen3OmniMoeCode2Wav`` (checkpoint prefix ``code2wav.``):

1. ``code_embedding``: one table holding every quantizer's codebook back to back
   (code ``c`` of group ``q`` is row ``q * codebook_size + c``); the frame vector is the
   mean of the ``num_quantizers`` group embeddings.
2. ``pre_transformer``: pre-norm transformer, causal sliding-window attention (72 frames
   in the real model), plain RoPE, layer scale on both residual branches.
3. ``upsample``: per ratio a causal transposed conv (kernel = stride) and a ConvNeXt block.
4. ``decoder``: causal conv, then per upsample rate a block of SnakeBeta + causal
   transposed conv (kernel 2x stride) + three dilated residual units, then SnakeBeta and a
   causal conv to one channel; clamped to [-1, 1].

``total_upsample`` = prod(upsampling_ratios + upsample_rates) samples per code frame
(1920 for the real model: 12.5 Hz codes -> 24 kHz). Every part is causal, so a chunk can
be decoded with some frames of left context and the context's samples dropped
(:meth:`Qwen3OmniCode2Wav.chunked_decode`, as transformers' ``chunked_decode``).

Layout: activations are channels-last ``[B, T, C]`` (Flax convolutions); HF's Conv1d
``weight [out, in, k]`` maps onto ``nnx.Conv`` kernels ``[k, in, out]`` and its
ConvTranspose1d ``weight [in, out, k]`` onto ``nnx.ConvTranspose(transpose_kernel=True)``
kernels ``[k, out, in]`` by the standard conversion rules (conversion/mapping.py).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..layers.attention import Attention, AttentionConfig, AttentionMetadata
from ..layers.mlp import GatedMLP
from ..layers.norms import RMSNorm
from ..layers.rope import inv_frequencies, mrope_band_rows, rope_cos_sin


@dataclasses.dataclass(frozen=True)
class Code2WavConfig:
    """Hyper-parameters of code2wav (the HF ``code2wav_config``)."""

    codebook_size: int = 2048
    hidden_size: int = 1024
    num_heads: int = 16
    num_kv_heads: int = 16
    head_dim: int = 64
    intermediate_size: int = 3072
    num_layers: int = 8
    num_quantizers: int = 16
    sliding_window: int = 72
    attention_bias: bool = False
    hidden_act: str = "silu"
    layer_scale_initial_scale: float = 0.01
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    upsample_rates: tuple[int, ...] = (8, 5, 4, 3)
    upsampling_ratios: tuple[int, ...] = (2, 2)
    decoder_dim: int = 1536

    @classmethod
    def from_hf(cls, d: dict) -> "Code2WavConfig":
        rope = d.get("rope_parameters") or {}
        if rope.get("rope_type", "default") not in ("default", None):
            raise ValueError(f"unsupported code2wav rope_type {rope.get('rope_type')!r}")
        heads = d.get("num_attention_heads", 16)
        hidden = d.get("hidden_size", 1024)
        return cls(
            codebook_size=d.get("codebook_size", 2048), hidden_size=hidden, num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or hidden // heads,
            intermediate_size=d.get("intermediate_size", 3072),
            num_layers=d.get("num_hidden_layers", 8), num_quantizers=d.get("num_quantizers", 16),
            sliding_window=d.get("sliding_window", 72), attention_bias=d.get("attention_bias", False),
            hidden_act=d.get("hidden_act", "silu"),
            layer_scale_initial_scale=d.get("layer_scale_initial_scale", 0.01),
            rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
            upsample_rates=tuple(d.get("upsample_rates", (8, 5, 4, 3))),
            upsampling_ratios=tuple(d.get("upsampling_ratios", (2, 2))),
            decoder_dim=d.get("decoder_dim", 1536),
        )

    @property
    def total_upsample(self) -> int:
        """Waveform samples per code frame."""
        return int(np.prod(self.upsample_rates + self.upsampling_ratios))

    @property
    def attention(self) -> AttentionConfig:
        return AttentionConfig(self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim,
                               qkv_bias=self.attention_bias, o_bias=self.attention_bias,
                               qk_norm=False, rms_norm_eps=self.rms_norm_eps,
                               sliding_window=self.sliding_window)


# ---------------------------------------------------------------------------------------
# Convolution building blocks
# ---------------------------------------------------------------------------------------


class CausalConvNet(nnx.Module):
    """Conv1d padded on the left only (HF ``Qwen3OmniMoeCausalConvNet``), x [B, T, C]."""

    def __init__(self, in_ch: int, out_ch: int, kernel_size: int, *, dilation: int = 1, stride: int = 1,
                 groups: int = 1, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.conv = nnx.Conv(in_ch, out_ch, (kernel_size,), strides=(stride,), kernel_dilation=(dilation,),
                             feature_group_count=groups, padding="VALID", dtype=dtype,
                             param_dtype=param_dtype, rngs=rngs)
        self.stride = stride
        self.effective_kernel = (kernel_size - 1) * dilation + 1
        self.left_pad = self.effective_kernel - stride

    def __call__(self, x):
        length = x.shape[1]
        # Right padding so the last (partial) stride still yields a frame, as HF does.
        n_frames = (length - self.effective_kernel + self.left_pad) / self.stride + 1
        ideal = (math.ceil(n_frames) - 1) * self.stride + (self.effective_kernel - self.left_pad)
        x = jnp.pad(x, ((0, 0), (self.left_pad, ideal - length), (0, 0)))
        return self.conv(x)


class CausalTransConvNet(nnx.Module):
    """ConvTranspose1d trimmed by kernel - stride on both ends (HF ``Qwen3OmniMoeCausalTransConvNet``)."""

    def __init__(self, in_ch: int, out_ch: int, kernel_size: int, stride: int, *,
                 dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        # transpose_kernel=True: kernel [k, out, in] and PyTorch's ConvTranspose1d semantics.
        self.conv = nnx.ConvTranspose(in_ch, out_ch, (kernel_size,), strides=(stride,), padding="VALID",
                                      transpose_kernel=True, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.trim = kernel_size - stride
        self.stride = stride

    def __call__(self, x):
        y = self.conv(x)
        return y[:, self.trim:y.shape[1] - self.trim] if self.trim else y


class SnakeBeta(nnx.Module):
    """x + sin^2(x * e^alpha) / e^beta per channel (HF ``Qwen3OmniMoeSnakeBeta``, log-scale params)."""

    def __init__(self, channels: int, *, param_dtype=jnp.float32):
        self.alpha = nnx.Param(jnp.zeros((channels,), param_dtype))
        self.beta = nnx.Param(jnp.zeros((channels,), param_dtype))

    def __call__(self, x):
        alpha = jnp.exp(self.alpha[...]).astype(x.dtype)
        beta = jnp.exp(self.beta[...]).astype(x.dtype)
        return x + (1.0 / (beta + 1e-9)) * jnp.sin(x * alpha) ** 2


class ConvNeXtBlock(nnx.Module):
    """Depthwise causal conv, LayerNorm, pointwise MLP (GELU), gamma-scaled residual."""

    def __init__(self, dim: int, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.dwconv = CausalConvNet(dim, dim, 7, groups=dim, **kw)
        self.norm = nnx.LayerNorm(dim, epsilon=1e-6, **kw)
        self.pwconv1 = nnx.Linear(dim, 4 * dim, **kw)
        self.pwconv2 = nnx.Linear(4 * dim, dim, **kw)
        self.gamma = nnx.Param(jnp.full((dim,), 1e-6, param_dtype))

    def __call__(self, x):
        h = self.norm(self.dwconv(x))
        h = self.pwconv2(jax.nn.gelu(self.pwconv1(h), approximate=False))
        return x + self.gamma[...].astype(h.dtype) * h


class ResidualUnit(nnx.Module):
    """SnakeBeta, dilated causal conv (k7), SnakeBeta, causal conv (k1), plus the input."""

    def __init__(self, dim: int, dilation: int, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.act1 = SnakeBeta(dim, param_dtype=param_dtype)
        self.conv1 = CausalConvNet(dim, dim, 7, dilation=dilation, **kw)
        self.act2 = SnakeBeta(dim, param_dtype=param_dtype)
        self.conv2 = CausalConvNet(dim, dim, 1, **kw)

    def __call__(self, x):
        return x + self.conv2(self.act2(self.conv1(self.act1(x))))


class DecoderBlock(nnx.Module):
    """One upsampling stage of the decoder: halves the channels, multiplies time by `rate`."""

    def __init__(self, cfg: Code2WavConfig, index: int, *, dtype=jnp.float32, param_dtype=jnp.float32,
                 rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        in_dim = cfg.decoder_dim // 2 ** index
        out_dim = cfg.decoder_dim // 2 ** (index + 1)
        rate = cfg.upsample_rates[index]
        self.block = nnx.List(
            [SnakeBeta(in_dim, param_dtype=param_dtype), CausalTransConvNet(in_dim, out_dim, 2 * rate, rate, **kw)]
            + [ResidualUnit(out_dim, d, **kw) for d in (1, 3, 9)])

    def __call__(self, x):
        for layer in self.block:
            x = layer(x)
        return x


# ---------------------------------------------------------------------------------------
# Pre-transformer
# ---------------------------------------------------------------------------------------


class LayerScale(nnx.Module):
    """Per-channel residual scale (param `scale`, as in the checkpoint)."""

    def __init__(self, dim: int, init: float, *, param_dtype=jnp.float32):
        self.scale = nnx.Param(jnp.full((dim,), init, param_dtype))

    def __call__(self, x):
        return self.scale[...].astype(x.dtype) * x


class Code2WavTransformerLayer(nnx.Module):
    """Pre-norm sliding-window attention + gated MLP, both residuals layer-scaled."""

    def __init__(self, cfg: Code2WavConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        self.self_attn = Attention(cfg.attention, rngs=rngs, **kw)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, act=cfg.hidden_act, rngs=rngs, **kw)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale,
                                                param_dtype=param_dtype)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale, param_dtype=param_dtype)

    def __call__(self, x, cos, sin, meta):
        h, _ = self.self_attn(self.input_layernorm(x), cos, sin, meta)
        x = x + self.self_attn_layer_scale(h)
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class Code2WavTransformer(nnx.Module):
    """layers -> norm over one sequence of frames [T, hidden] (causal, sliding window)."""

    def __init__(self, cfg: Code2WavConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        self.layers = nnx.List([Code2WavTransformerLayer(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
                                for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)

    def __call__(self, x):
        cfg = self.cfg
        t = x.shape[0]
        inv_freq = inv_frequencies(cfg.head_dim, cfg.rope_theta)
        cos, sin = rope_cos_sin(jnp.arange(t), inv_freq, mrope_band_rows(None, cfg.head_dim // 2), dtype=x.dtype)
        meta = AttentionMetadata.dense(t)
        for layer in self.layers:
            x = layer(x, cos, sin, meta)
        return self.norm(x)


# ---------------------------------------------------------------------------------------
# The vocoder
# ---------------------------------------------------------------------------------------


class Qwen3OmniCode2Wav(nnx.Module):
    """codes [B, num_quantizers, T] -> waveform [B, samples] in [-1, 1] (24 kHz)."""

    def __init__(self, cfg: Code2WavConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        h = cfg.hidden_size
        self.pre_transformer = Code2WavTransformer(cfg, **kw)
        self.code_embedding = nnx.Embed(cfg.codebook_size * cfg.num_quantizers, h, **kw)
        self.upsample = nnx.List([nnx.List([CausalTransConvNet(h, h, f, f, **kw), ConvNeXtBlock(h, **kw)])
                                  for f in cfg.upsampling_ratios])
        out_dim = cfg.decoder_dim // 2 ** len(cfg.upsample_rates)
        self.decoder = nnx.List(
            [CausalConvNet(h, cfg.decoder_dim, 7, **kw)]
            + [DecoderBlock(cfg, i, **kw) for i in range(len(cfg.upsample_rates))]
            + [SnakeBeta(out_dim, param_dtype=param_dtype), CausalConvNet(out_dim, 1, 7, **kw)])

    @property
    def total_upsample(self) -> int:
        return self.cfg.total_upsample

    def embed_codes(self, codes):
        """codes [B, Q, T] -> mean of the Q group embeddings [B, T, hidden]."""
        cfg = self.cfg
        offsets = (jnp.arange(cfg.num_quantizers, dtype=jnp.int32) * cfg.codebook_size)[None, :, None]
        rows = jnp.take(self.code_embedding.embedding[...], codes.astype(jnp.int32) + offsets, axis=0)
        return jnp.mean(rows, axis=1)

    def __call__(self, codes):
        """Decode a whole code sequence [B, Q, T] -> [B, samples].

        samples is a little under T * total_upsample: each decoder block's causal
        transposed conv turns L frames into (L - 1) * rate (as transformers).
        """
        return self.convolve(self.frame_states(codes))

    def frame_states(self, codes):
        """codes [B, Q, T] -> the pre-transformer's output [B, T, hidden] (one vector per frame)."""
        if codes.shape[1] != self.cfg.num_quantizers:
            raise ValueError(f"expected {self.cfg.num_quantizers} code groups, got {codes.shape[1]}")
        return jax.vmap(self.pre_transformer)(self.embed_codes(codes))

    def convolve(self, x):
        """Frame states [B, T, hidden] -> waveform [B, samples]: the upsampling convolutions."""
        for stage in self.upsample:
            for layer in stage:
                x = layer(x)
        for layer in self.decoder:
            x = layer(x)
        return jnp.clip(x[..., 0], -1.0, 1.0)

    def conv_reach_frames(self) -> int:
        """Frames of earlier frame states that `convolve`'s output at a frame depends on.

        Each causal conv reads (effective kernel - 1) samples back at its own rate; the
        transposed convs read none back (only the next input). So the samples of frames
        from f on, convolved from frame f - reach on, equal those convolved from the start.
        """
        reach, rate = 0.0, 1
        for trans, block in self.upsample:
            rate *= trans.stride
            reach += (block.dwconv.effective_kernel - 1) / rate
        for layer in self.decoder:
            if isinstance(layer, CausalConvNet):
                reach += (layer.effective_kernel - 1) / rate
            elif isinstance(layer, DecoderBlock):
                rate *= layer.block[1].stride
                reach += sum(u.conv1.effective_kernel + u.conv2.effective_kernel - 2 for u in layer.block[2:]) / rate
        return math.ceil(reach)

    def decode_with_context(self, codes, context_frames: int):
        """Decode [B, Q, T] whose first `context_frames` frames are left context; drop their samples."""
        return self(codes)[:, context_frames * self.total_upsample:]

    def chunked_decode(self, codes, chunk_size: int = 300, left_context_size: int = 25,
                       decode_fn: Callable | None = None):
        """Host-side chunked decode, equal to transformers' ``chunked_decode``.

        Chunks of `chunk_size` frames, each decoded with up to `left_context_size` frames
        of left context whose samples are dropped. `decode_fn(codes) -> [B, samples]`
        defaults to this module's forward (pass a jitted one to avoid eager execution).
        """
        decode = decode_fn or self
        total = codes.shape[-1]
        wavs, start = [], 0
        while start < total:
            end = min(start + chunk_size, total)
            # Same rule as transformers (it takes the whole prefix when it is shorter).
            context = left_context_size if start - left_context_size > 0 else start
            wav = decode(codes[..., start - context:end])
            wavs.append(wav[:, context * self.total_upsample:])
            start = end
        return jnp.concatenate(wavs, axis=-1)
