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
(:meth:`Qwen3OmniCode2Wav.chunked_decode`, as transformers' ``chunked_decode``), and the
convolutions can stream: :meth:`Qwen3OmniCode2Wav.convolve_stream` takes only the new
frames and carries each convolution's last input samples from one call to the next
(`ConvStream`), so a streamed chunk costs its own frames, not its left context.

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
from ..layers.linear import Linear
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


class ConvStream:
    """The per-row bookkeeping of one streamed `convolve_stream` call, threaded through the layers.

    Each row is one request's new frames (right-padded to the call's length), `frames` of
    them real. A causal conv with history P takes the P input samples before the chunk
    from `states` (in layer order) and leaves its P last real ones in `new_states`; a
    transposed conv whose kernel spans two strides does the same with one input sample.

    A `fresh` row starts its window: zero history, as the whole decode's left padding.
    The whole decode drops each transposed conv's first output block (it would need an
    input before the first); a streamed call keeps every row at frames x rate samples
    instead and zeroes those blocks (`lag` samples at the current rate), which to the
    causal layers after them is the same zero padding. So a fresh row's waveform starts
    with `lag` extra samples: what the whole decode of T frames falls short of T x total_upsample.
    """

    def __init__(self, frames, fresh, states):
        self.frames = frames              # [B] int32: real new frames per row
        self.fresh = fresh                # [B] bool
        self._states = list(states)
        self.new_states: list = []
        self.rate = 1                     # samples per frame at the current layer
        self.lag = 0                      # samples a fresh row runs ahead by at the current rate

    def history(self, x, size: int):
        """x [B, T, C] with `size` samples of history in front; keeps each row's new history."""
        state = self._states.pop(0)
        x = jnp.concatenate([jnp.where(self.fresh[:, None, None], 0.0, state).astype(x.dtype), x], axis=1)
        # The `size` samples before each row's end (its real samples end at frames * rate).
        ends = self.frames * self.rate
        self.new_states.append(jax.vmap(lambda row, end: jax.lax.dynamic_slice_in_dim(row, end, size))(x, ends))
        return x

    def mask(self, y):
        """Zero the samples of fresh rows that the whole decode does not have."""
        if not self.lag:
            return y
        real = ~self.fresh[:, None] | (jnp.arange(y.shape[1])[None, :] >= self.lag)
        return y * real[..., None].astype(y.dtype)


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
        self.in_channels = in_ch
        if stride != 1:  # streaming (ConvStream) keeps one output per input sample
            raise NotImplementedError("code2wav's causal convs have stride 1")

    def state_shape(self) -> tuple[int, int] | None:
        """(samples, channels) of input history a streamed call carries; None when it reads none."""
        return (self.left_pad, self.in_channels) if self.left_pad else None

    def __call__(self, x, stream: ConvStream | None = None):
        if stream is not None:  # the chunk's outputs, its history taken from the call before
            # Unmasked: the blocks holding a causal conv mask where a history reads the output.
            return self.conv(stream.history(x, self.left_pad) if self.left_pad else x)
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
        if kernel_size not in (stride, 2 * stride):  # the two shapes code2wav uses (and streams)
            raise NotImplementedError(f"causal transposed conv: kernel {kernel_size} is neither stride {stride} "
                                      f"nor twice it")
        self.trim = kernel_size - stride
        self.stride = stride
        self.in_channels = in_ch

    def state_shape(self) -> tuple[int, int] | None:
        """A kernel of two strides reads the input sample before: one sample of history."""
        return (1, self.in_channels) if self.trim else None

    def __call__(self, x, stream: ConvStream | None = None):
        if stream is None:
            y = self.conv(x)
            return y[:, self.trim:y.shape[1] - self.trim] if self.trim else y
        s, t = self.stride, x.shape[1]
        if self.trim:
            # Blocks 1..t of [sample before, chunk]: block k reads inputs k-1 and k.
            y = self.conv(stream.history(x, 1))[:, s:(t + 1) * s]
            # A fresh row's first block is the one the whole decode trims (no input before it).
            stream.lag = (stream.lag + 1) * s
        else:
            y = self.conv(x)
            stream.lag *= s
        stream.rate *= s
        return stream.mask(y)


class SnakeBeta(nnx.Module):
    """x + sin^2(x * e^alpha) / e^beta per channel (HF ``Qwen3OmniMoeSnakeBeta``, log-scale params)."""

    def __init__(self, channels: int, *, param_dtype=jnp.float32):
        self.alpha = nnx.Param(jnp.zeros((channels,), param_dtype))
        self.beta = nnx.Param(jnp.zeros((channels,), param_dtype))

    def __call__(self, x, stream: ConvStream | None = None):  # pointwise: streams need no history
        alpha = jnp.exp(self.alpha[...]).astype(x.dtype)
        beta = jnp.exp(self.beta[...]).astype(x.dtype)
        return x + (1.0 / (beta + 1e-9)) * jnp.sin(x * alpha) ** 2


class ConvNeXtBlock(nnx.Module):
    """Depthwise causal conv, LayerNorm, pointwise MLP (GELU), gamma-scaled residual."""

    def __init__(self, dim: int, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.dwconv = CausalConvNet(dim, dim, 7, groups=dim, **kw)
        self.norm = nnx.LayerNorm(dim, epsilon=1e-6, **kw)
        self.pwconv1 = Linear(dim, 4 * dim, **kw)
        self.pwconv2 = Linear(4 * dim, dim, **kw)
        self.gamma = nnx.Param(jnp.full((dim,), 1e-6, param_dtype))

    def __call__(self, x, stream: ConvStream | None = None):
        h = self.norm(self.dwconv(x, stream))
        h = self.pwconv2(jax.nn.gelu(self.pwconv1(h), approximate=False))
        y = x + self.gamma[...].astype(h.dtype) * h
        return y if stream is None else stream.mask(y)


class ResidualUnit(nnx.Module):
    """SnakeBeta, dilated causal conv (k7), SnakeBeta, causal conv (k1), plus the input."""

    def __init__(self, dim: int, dilation: int, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.act1 = SnakeBeta(dim, param_dtype=param_dtype)
        self.conv1 = CausalConvNet(dim, dim, 7, dilation=dilation, **kw)
        self.act2 = SnakeBeta(dim, param_dtype=param_dtype)
        self.conv2 = CausalConvNet(dim, dim, 1, **kw)

    def __call__(self, x, stream: ConvStream | None = None):
        y = x + self.conv2(self.act2(self.conv1(self.act1(x), stream)), stream)
        return y if stream is None else stream.mask(y)


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

    def __call__(self, x, stream: ConvStream | None = None):
        for layer in self.block:
            x = layer(x, stream)
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

    def __call__(self, codes, *, clip: bool = True):
        """Decode a whole code sequence [B, Q, T] -> [B, samples] (in [-1, 1] unless not `clip`).

        samples is a little under T * total_upsample: each decoder block's causal
        transposed conv turns L frames into (L - 1) * rate (as transformers).
        """
        return self.convolve(self.frame_states(codes), clip=clip)

    def frame_states(self, codes):
        """codes [B, Q, T] -> the pre-transformer's output [B, T, hidden] (one vector per frame)."""
        if codes.shape[1] != self.cfg.num_quantizers:
            raise ValueError(f"expected {self.cfg.num_quantizers} code groups, got {codes.shape[1]}")
        return jax.vmap(self.pre_transformer)(self.embed_codes(codes))

    def convolve(self, x, stream: ConvStream | None = None, *, clip: bool = True):
        """Frame states [B, T, hidden] -> waveform [B, samples]: the upsampling convolutions."""
        for stage in self.upsample:
            for layer in stage:
                x = layer(x, stream)
        for layer in self.decoder:
            x = layer(x, stream)
        return jnp.clip(x[..., 0], -1.0, 1.0) if clip else x[..., 0]

    def convolve_stream(self, x, frames, fresh, states, *, clip: bool = True):
        """The convolutions over a chunk of new frame states, with each convolution's history.

        x [B, T, hidden] holds `frames` [B] real new frames per row (right-padded); `states`
        the history left by the row's previous call (`conv_state_shapes`, batched), ignored
        where `fresh` [B] (a window's first call). Returns (waveform [B, T * total_upsample],
        new states): a continued row's samples follow its previous call's exactly; a fresh
        row's start with `total_upsample * T - samples(T)` samples the whole decode does not
        have, to drop. The samples after each row's real frames are padding.
        """
        stream = ConvStream(frames, fresh, states)
        wav = self.convolve(x, stream, clip=clip)
        return wav, tuple(stream.new_states)

    def conv_state_shapes(self) -> list[tuple[int, int]]:
        """(samples, channels) of each convolution's history, in the order `convolve_stream` uses them."""
        convs = []
        for trans, block in self.upsample:
            convs += [trans, block.dwconv]
        for layer in self.decoder:
            if isinstance(layer, CausalConvNet):
                convs.append(layer)
            elif isinstance(layer, DecoderBlock):
                convs.append(layer.block[1])
                convs += [c for unit in layer.block[2:] for c in (unit.conv1, unit.conv2)]
        return [shape for shape in (c.state_shape() for c in convs) if shape]

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
