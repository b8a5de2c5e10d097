"""Qwen2.5-Omni token2wav DiT: codec tokens -> mel spectrogram by flow matching, in Flax NNX.

The model predicts a velocity field ``v(x, t)`` over mel frames (``repeats`` = 2 frames per
codec token) conditioned on the codec tokens, a speaker ``cond`` vector (``enc_emb_dim``) and
an ECAPA-TDNN embedding of a reference mel. ``sample`` integrates the ODE from Gaussian noise
at t=0 to the mel at t=1 exactly as transformers' ``Qwen2_5OmniToken2WavDiTModel.sample``:

* time grid: ``num_steps`` *points* ``linspace(0, 1)`` (so ``num_steps - 1`` intervals, 9 for
  the default 10), warped by sway sampling ``t += s * (cos(pi/2 t) - 1 + t)``;
* one RK4 step (the 3/8 rule: stages at t, t+h/3, t+2h/3, t+h) per interval;
* classifier-free guidance: each evaluation runs the batch twice, the second copy with code
  0 everywhere, zero ``cond`` and the speaker embedding of an all-zero reference mel;
  ``v = v_c + (v_c - v_u) * guidance_scale``.

Attribute names mirror ``token2wav.code2wav_dit_model.*`` in the checkpoint; the three
``nn.ModuleList`` with activations in between are renamed by :data:`HF_RENAMES`.

Block-local attention is computed block by block (each block of ``block_size`` frames
attends to itself plus ``look_backward``/``look_ahead`` neighbouring blocks), so memory is
linear in the number of frames; it is the same mask as HF's dense
``-look_backward <= block_j - block_i <= look_ahead``. RoPE rotates only head 0 (the
checkpoint's training quirk), after de-interleaving its q/k dims as transformers does.

Batching: transformers batches only equal lengths. Here ``frame_mask``/``code_lens`` pad
sequences to a common length: padded key frames are masked out of attention, every other
op is per frame, so the valid frames equal an unpadded run given the same noise on them.
The reference mel is not masked: sequences in one call share its length (voices are
cached per speaker; compute :meth:`Qwen2_5OmniDiT.speaker_embedding` per voice and pass
``speaker_embeds`` to batch voices with different reference lengths).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from omni_jax.models.layers.linear import Linear
from omni_jax.models.layers.rope import apply_rope, inv_frequencies, rope_cos_sin

# HF key (relative to "token2wav.code2wav_dit_model.") -> NNX path. The time MLP
# (Linear, SiLU, Linear), the attention output (Linear, Dropout) and the feed-forward
# (Linear, GELU, Dropout, Linear) are ModuleLists with parameter-free entries in between.
HF_RENAMES = [
    (r"^time_embed\.time_mlp\.0\.", "time_embed.time_mlp.fc1."),
    (r"^time_embed\.time_mlp\.2\.", "time_embed.time_mlp.fc2."),
    (r"^(transformer_blocks\.\d+)\.attn\.to_out\.0\.", r"\1.attn.to_out."),
    (r"^(transformer_blocks\.\d+)\.ff\.ff\.0\.", r"\1.ff.fc1."),
    (r"^(transformer_blocks\.\d+)\.ff\.ff\.3\.", r"\1.ff.fc2."),
]

# transformers runs token2wav in fp32 without TF32; keep fp32 matmuls exact on GPUs too.
DEFAULT_PRECISION = jax.lax.Precision.HIGHEST

_TIME_FREQ_DIM = 256  # DiTTimestepEmbedding's sinusoid width (fixed in HF)
_ADA_LN_EPS = 1e-6
_ASP_EPS = 1e-12


@dataclasses.dataclass(frozen=True)
class DiTConfig:
    """Sizes of the DiT (the HF ``token2wav_config.dit_config``); defaults are HF's."""

    hidden_size: int = 1024
    num_hidden_layers: int = 22
    num_attention_heads: int = 16
    head_dim: int = 64
    ff_mult: int = 2
    emb_dim: int = 512
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    block_size: int = 24
    look_ahead_layers: tuple[int, ...] = (10,)
    look_backward_layers: tuple[int, ...] = (0, 20)
    repeats: int = 2
    num_embeds: int = 8193
    mel_dim: int = 80
    enc_emb_dim: int = 192
    enc_dim: int = 128
    enc_channels: tuple[int, ...] = (256, 256, 256, 256, 768)
    enc_kernel_sizes: tuple[int, ...] = (5, 3, 3, 3, 1)
    enc_dilations: tuple[int, ...] = (1, 2, 3, 4, 1)
    enc_attention_channels: int = 64
    enc_res2net_scale: int = 2
    enc_se_channels: int = 64

    @classmethod
    def from_hf(cls, d: dict) -> "DiTConfig":
        """Build from the ``dit_config`` dict of an HF Qwen2.5-Omni config.json."""
        names = {f.name for f in dataclasses.fields(cls)} - {"rope_theta"}
        kwargs = {k: (tuple(d[k]) if isinstance(d[k], list) else d[k]) for k in names if k in d}
        rope = d.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"DiT rope_type {rope['rope_type']!r} is not supported (only 'default')")
        theta = rope.get("rope_theta", d.get("rope_theta"))
        if theta is not None:
            kwargs["rope_theta"] = float(theta)
        cfg = cls(**kwargs)
        if not (len(cfg.enc_channels) == len(cfg.enc_kernel_sizes) == len(cfg.enc_dilations)):
            raise ValueError("enc_channels, enc_kernel_sizes and enc_dilations must have the same length")
        if cfg.enc_channels[-1] != sum(cfg.enc_channels[1:-1]):
            raise ValueError("enc_channels[-1] must equal the sum of enc_channels[1:-1] (MFA input)")
        return cfg

    def layer_window(self, i: int) -> tuple[int, int]:
        """(look_backward, look_ahead) blocks of transformer block ``i``."""
        return int(i in self.look_backward_layers), int(i in self.look_ahead_layers)


# ----------------------------------------------------------------------------- helpers

def _layer_norm(x, eps: float = _ADA_LN_EPS):
    """LayerNorm without affine parameters (two-pass variance, like torch)."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    centered = x - mean
    var = jnp.mean(centered * centered, axis=-1, keepdims=True)
    return centered * jax.lax.rsqrt(var + eps)


def _same_reflect_pad(x, kernel_size: int, dilation: int):
    """torch Conv1d ``padding="same", padding_mode="reflect"`` on [B, L, C] (left gets the floor)."""
    total = dilation * (kernel_size - 1)
    if total == 0:
        return x
    left = total // 2
    return jnp.pad(x, ((0, 0), (left, total - left), (0, 0)), mode="reflect")


def block_window_positions(seq_len: int, block_size: int, look_backward: int, look_ahead: int):
    """Key frame of each slot of the blockwise attention window, host-side.

    Returns ``(key_pos [num_blocks, W * block_size] int32, key_ok bool of the same shape)``
    with ``W = 1 + look_backward + look_ahead``: block ``b`` sees blocks
    ``b - look_backward .. b + look_ahead``; slots before frame 0 or past ``seq_len`` are not ok.
    """
    nb = -(-seq_len // block_size)
    offsets = np.arange(-look_backward, look_ahead + 1)
    blocks = np.arange(nb)[:, None] + offsets[None, :]                        # [nb, W]
    pos = blocks[:, :, None] * block_size + np.arange(block_size)[None, None]  # [nb, W, bs]
    pos = pos.reshape(nb, -1)
    return pos.astype(np.int32), (pos >= 0) & (pos < seq_len)


def block_attention_mask(seq_len: int, block_size: int, look_backward: int, look_ahead: int) -> np.ndarray:
    """Dense [L, L] boolean mask that the blockwise attention implements (query i, key j)."""
    pos, ok = block_window_positions(seq_len, block_size, look_backward, look_ahead)
    nb = pos.shape[0]
    mask = np.zeros((nb * block_size, seq_len), bool)
    rows = np.repeat(np.arange(nb * block_size), pos.shape[1]).reshape(nb * block_size, -1)
    qpos = np.repeat(pos.reshape(nb, 1, -1), block_size, axis=1).reshape(nb * block_size, -1)
    qok = np.repeat(ok.reshape(nb, 1, -1), block_size, axis=1).reshape(nb * block_size, -1)
    mask[rows[qok], qpos[qok]] = True
    return mask[:seq_len]


@functools.lru_cache(maxsize=32)
def time_grid(num_steps: int, sway_coefficient: float | None) -> np.ndarray:
    """The ODE time points [num_steps] float32: linspace(0, 1) with sway sampling, as HF."""
    t = np.linspace(0.0, 1.0, num_steps, dtype=np.float64).astype(np.float32)
    if sway_coefficient is not None:
        s = np.float32(sway_coefficient)
        t = t + s * (np.cos(np.float32(np.pi / 2) * t) - np.float32(1.0) + t)
    return t.astype(np.float32)


def _is_prng_key(x) -> bool:
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return False
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return True
    return np.dtype(dtype) == np.uint32 and tuple(np.shape(x)) == (2,)


# ----------------------------------------------------------------------------- ECAPA-TDNN

class TimeDelayNetBlock(nnx.Module):
    """Conv1d ("same", reflect padding, dilated) + ReLU on [B, L, C]."""

    def __init__(self, in_channels, out_channels, kernel_size, dilation, *, dtype, param_dtype, precision, rngs):
        self.kernel_size = kernel_size
        self.dilation = dilation
        self.conv = nnx.Conv(in_channels, out_channels, kernel_size=(kernel_size,), kernel_dilation=(dilation,),
                             padding="VALID", dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)

    def __call__(self, x):
        return jax.nn.relu(self.conv(_same_reflect_pad(x, self.kernel_size, self.dilation)))


class Res2NetBlock(nnx.Module):
    """Channel groups processed hierarchically: group i>1 sees the previous group's output."""

    def __init__(self, in_channels, out_channels, scale, kernel_size, dilation, *, rngs, **kw):
        if in_channels % scale or out_channels % scale:
            raise ValueError(f"Res2Net channels {in_channels}/{out_channels} must be divisible by scale {scale}")
        self.scale = scale
        self.blocks = nnx.List([
            TimeDelayNetBlock(in_channels // scale, out_channels // scale, kernel_size, dilation, rngs=rngs, **kw)
            for _ in range(scale - 1)])

    def __call__(self, x):
        parts = jnp.split(x, self.scale, axis=-1)
        outs = [parts[0]]
        for i in range(1, self.scale):
            inp = parts[i] if i == 1 else parts[i] + outs[-1]
            outs.append(self.blocks[i - 1](inp))
        return jnp.concatenate(outs, axis=-1)


class SqueezeExcitationBlock(nnx.Module):
    """Rescale channels by a gate computed from their time average."""

    def __init__(self, in_channels, se_channels, out_channels, *, dtype, param_dtype, precision, rngs):
        kw = dict(kernel_size=(1,), dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        self.conv1 = nnx.Conv(in_channels, se_channels, **kw)
        self.conv2 = nnx.Conv(se_channels, out_channels, **kw)

    def __call__(self, x):
        s = jnp.mean(x, axis=1, keepdims=True)
        s = jax.nn.sigmoid(self.conv2(jax.nn.relu(self.conv1(s))))
        return x * s


class AttentiveStatisticsPooling(nnx.Module):
    """Attention-weighted mean and std over time, with global context: [B, L, C] -> [B, 2C]."""

    def __init__(self, channels, attention_channels, *, dtype, param_dtype, precision, rngs):
        self.tdnn = TimeDelayNetBlock(channels * 3, attention_channels, 1, 1, dtype=dtype, param_dtype=param_dtype,
                                      precision=precision, rngs=rngs)
        self.conv = nnx.Conv(attention_channels, channels, kernel_size=(1,), dtype=dtype, param_dtype=param_dtype,
                             precision=precision, rngs=rngs)

    @staticmethod
    def _stats(x, w):
        mean = jnp.sum(w * x, axis=1)
        d = x - mean[:, None]
        std = jnp.sqrt(jnp.maximum(jnp.sum(w * d * d, axis=1), _ASP_EPS))
        return mean, std

    def __call__(self, x):
        length = x.shape[1]
        # HF weights every frame by mask / total = 1 / L (no padding inside the reference mel).
        mean, std = self._stats(x, jnp.asarray(1.0 / length, x.dtype))
        ctx = jnp.concatenate([x, jnp.broadcast_to(mean[:, None], x.shape), jnp.broadcast_to(std[:, None], x.shape)],
                              axis=-1)
        att = jax.nn.softmax(self.conv(jnp.tanh(self.tdnn(ctx))), axis=1)
        mean, std = self._stats(x, att)
        return jnp.concatenate([mean, std], axis=-1)


class SqueezeExcitationRes2NetBlock(nnx.Module):
    """ECAPA block: TDNN (k1) -> Res2Net -> TDNN (k1) -> squeeze-excitation, plus residual."""

    def __init__(self, in_channels, out_channels, res2net_scale, se_channels, kernel_size, dilation, *, rngs, **kw):
        self.tdnn1 = TimeDelayNetBlock(in_channels, out_channels, 1, 1, rngs=rngs, **kw)
        self.res2net_block = Res2NetBlock(out_channels, out_channels, res2net_scale, kernel_size, dilation,
                                          rngs=rngs, **kw)
        self.tdnn2 = TimeDelayNetBlock(out_channels, out_channels, 1, 1, rngs=rngs, **kw)
        self.se_block = SqueezeExcitationBlock(out_channels, se_channels, out_channels, rngs=rngs, **kw)

    def __call__(self, x):
        return self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x)))) + x


class ECAPATimeDelayNet(nnx.Module):
    """ECAPA-TDNN speaker encoder: reference mel [B, T, mel_dim] -> [B, enc_dim]."""

    def __init__(self, config: DiTConfig, *, rngs, **kw):
        c, k, d = config.enc_channels, config.enc_kernel_sizes, config.enc_dilations
        blocks = [TimeDelayNetBlock(config.mel_dim, c[0], k[0], d[0], rngs=rngs, **kw)]
        for i in range(1, len(c) - 1):
            blocks.append(SqueezeExcitationRes2NetBlock(c[i - 1], c[i], config.enc_res2net_scale,
                                                        config.enc_se_channels, k[i], d[i], rngs=rngs, **kw))
        self.blocks = nnx.List(blocks)
        self.mfa = TimeDelayNetBlock(c[-1], c[-1], k[-1], d[-1], rngs=rngs, **kw)
        self.asp = AttentiveStatisticsPooling(c[-1], config.enc_attention_channels, rngs=rngs, **kw)
        self.fc = nnx.Conv(c[-1] * 2, config.enc_dim, kernel_size=(1,), rngs=rngs, **kw)

    def __call__(self, mel):
        x = mel
        outs = []
        for block in self.blocks:
            x = block(x)
            outs.append(x)
        x = self.mfa(jnp.concatenate(outs[1:], axis=-1))
        pooled = self.asp(x)
        return self.fc(pooled[:, None, :])[:, 0, :]


# ----------------------------------------------------------------------------- DiT parts

class DiTInputEmbedding(nnx.Module):
    """proj([x, speaker embedding of ref mel, codec embedding, cond]) per frame."""

    def __init__(self, config: DiTConfig, *, rngs, **kw):
        in_dim = config.mel_dim + config.enc_dim + config.enc_emb_dim + config.emb_dim
        self.proj = Linear(in_dim, config.hidden_size, rngs=rngs, **kw)
        self.spk_encoder = ECAPATimeDelayNet(config, rngs=rngs, **kw)

    def __call__(self, x, spk, code_embed, cond):
        b, length, _ = x.shape
        spk = jnp.broadcast_to(spk[:, None, :], (b, length, spk.shape[-1]))
        cond = jnp.broadcast_to(cond[:, None, :], (b, length, cond.shape[-1]))
        return self.proj(jnp.concatenate([x, spk, code_embed, cond], axis=-1))


class DiTCodecEmbedding(nnx.Module):
    """Codec token embedding, each token repeated ``repeats`` times along time."""

    def __init__(self, num_embeds: int, emb_dim: int, repeats: int, *, dtype, param_dtype, rngs, **_):
        self.repeats = repeats
        self.codec_embed = nnx.Embed(num_embeds + 1, emb_dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, codes):
        return jnp.repeat(self.codec_embed(codes), self.repeats, axis=1)


class TimeMLP(nnx.Module):
    """fc2(SiLU(fc1(x))); HF's ModuleList indexes 0 and 2 (see HF_RENAMES)."""

    def __init__(self, in_dim: int, dim: int, *, rngs, **kw):
        self.fc1 = Linear(in_dim, dim, rngs=rngs, **kw)
        self.fc2 = Linear(dim, dim, rngs=rngs, **kw)

    def __call__(self, x):
        return self.fc2(jax.nn.silu(self.fc1(x)))


class DiTTimestepEmbedding(nnx.Module):
    """Sinusoidal embedding of t (scaled by 1000) followed by an MLP: [B] -> [B, hidden]."""

    def __init__(self, dim: int, *, rngs, **kw):
        self.time_mlp = TimeMLP(_TIME_FREQ_DIM, dim, rngs=rngs, **kw)

    def __call__(self, t):
        half = _TIME_FREQ_DIM // 2
        freqs = jnp.exp(jnp.arange(half, dtype=jnp.float32) * -(math.log(10000) / (half - 1)))
        # Same association as HF: (1000 * t) * freq, whose rounding matters at |arg| ~ 1000.
        arg = (1000.0 * t.astype(jnp.float32))[:, None] * freqs[None, :]
        emb = jnp.concatenate([jnp.sin(arg), jnp.cos(arg)], axis=-1).astype(t.dtype)
        return self.time_mlp(emb)


class AdaLayerNormZero(nnx.Module):
    """LayerNorm modulated by the time embedding; also returns the gates for attention/MLP."""

    def __init__(self, dim: int, *, rngs, **kw):
        self.linear = Linear(dim, dim * 6, rngs=rngs, **kw)

    def __call__(self, x, emb):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = jnp.split(
            self.linear(jax.nn.silu(emb)), 6, axis=-1)
        x = _layer_norm(x) * (1 + scale_msa[:, None]) + shift_msa[:, None]
        return x, gate_msa, shift_mlp, scale_mlp, gate_mlp


class AdaLayerNormZeroFinal(nnx.Module):
    """Final modulated LayerNorm (scale first, then shift)."""

    def __init__(self, dim: int, *, rngs, **kw):
        self.linear = Linear(dim, dim * 2, rngs=rngs, **kw)

    def __call__(self, x, emb):
        scale, shift = jnp.split(self.linear(jax.nn.silu(emb)), 2, axis=-1)
        return _layer_norm(x) * (1 + scale)[:, None] + shift[:, None]


class DiTMLP(nnx.Module):
    """fc2(GELU-tanh(fc1(x))); HF's ModuleList indexes 0 and 3 (see HF_RENAMES)."""

    def __init__(self, dim: int, mult: int, *, rngs, **kw):
        self.fc1 = Linear(dim, int(dim * mult), rngs=rngs, **kw)
        self.fc2 = Linear(int(dim * mult), dim, rngs=rngs, **kw)

    def __call__(self, x):
        return self.fc2(jax.nn.gelu(self.fc1(x), approximate=True))


def _deinterleave(x):
    """(x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...) on the last axis."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


class DiTAttention(nnx.Module):
    """Block-local multi-head attention; RoPE on head 0 only."""

    def __init__(self, config: DiTConfig, *, rngs, precision, **kw):
        inner = config.head_dim * config.num_attention_heads
        self.heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.block_size = config.block_size
        self.precision = precision
        kw = dict(kw, precision=precision, rngs=rngs)
        self.to_q = Linear(config.hidden_size, inner, **kw)
        self.to_k = Linear(config.hidden_size, inner, **kw)
        self.to_v = Linear(config.hidden_size, inner, **kw)
        self.to_out = Linear(inner, config.hidden_size, **kw)

    def _rope_head0(self, x, cos, sin):
        # The checkpoint was trained with interleaved RoPE on head 0 only; HF de-interleaves
        # that head and applies half-split RoPE (q and k alike, so q.k is unchanged by the
        # permutation) and leaves the other heads unrotated.
        head0 = apply_rope(_deinterleave(x[:, :, :1]), cos, sin)
        return jnp.concatenate([head0, x[:, :, 1:]], axis=2)

    def __call__(self, x, cos, sin, look_backward: int, look_ahead: int, frame_mask=None):
        b, length, _ = x.shape
        h, d, bs = self.heads, self.head_dim, self.block_size
        q = self.to_q(x).reshape(b, length, h, d)
        k = self.to_k(x).reshape(b, length, h, d)
        v = self.to_v(x).reshape(b, length, h, d)
        q = self._rope_head0(q, cos, sin)
        k = self._rope_head0(k, cos, sin)

        nb = -(-length // bs)
        pad = nb * bs - length
        q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, nb, bs, h, d)
        # Keys/values of the neighbouring blocks: pad whole blocks on both sides and stack
        # the shifted views, [B, nb, W * bs, H, D].
        kv_pad = ((0, 0), (look_backward * bs, pad + look_ahead * bs), (0, 0), (0, 0))
        width = 1 + look_backward + look_ahead

        def windows(t):
            t = jnp.pad(t, kv_pad).reshape(b, nb + width - 1, bs, h, d)
            return jnp.concatenate([t[:, o:o + nb] for o in range(width)], axis=2)

        kw, vw = windows(k), windows(v)
        pos, ok = block_window_positions(length, bs, look_backward, look_ahead)
        key_ok = jnp.broadcast_to(jnp.asarray(ok)[None], (b,) + ok.shape)          # [B, nb, W*bs]
        if frame_mask is not None:
            valid = jnp.take(frame_mask, jnp.asarray(np.clip(pos, 0, length - 1)), axis=1)
            key_ok = key_ok & valid

        scores = jnp.einsum("bnqhd,bnkhd->bnhqk", q, kw, precision=self.precision) * (1.0 / math.sqrt(d))
        # finfo.min rather than -inf: a padding row with no valid key stays finite (uniform),
        # so it cannot poison valid rows through 0 * NaN later.
        scores = jnp.where(key_ok[:, :, None, None, :], scores, jnp.finfo(scores.dtype).min)
        probs = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("bnhqk,bnkhd->bnqhd", probs, vw, precision=self.precision)
        out = out.reshape(b, nb * bs, h * d)[:, :length]
        return self.to_out(out)


class DiTDecoderLayer(nnx.Module):
    """AdaLN-Zero DiT block: modulated block-local attention + modulated MLP, gated residuals."""

    def __init__(self, config: DiTConfig, look_backward: int, look_ahead: int, *, rngs, **kw):
        self.look_backward = look_backward
        self.look_ahead = look_ahead
        self.attn_norm = AdaLayerNormZero(config.hidden_size, rngs=rngs, **kw)
        self.attn = DiTAttention(config, rngs=rngs, **kw)
        self.ff = DiTMLP(config.hidden_size, config.ff_mult, rngs=rngs, **kw)

    def __call__(self, x, temb, cos, sin, frame_mask=None):
        norm, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.attn_norm(x, temb)
        x = x + gate_msa[:, None] * self.attn(norm, cos, sin, self.look_backward, self.look_ahead, frame_mask)
        norm = _layer_norm(x) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
        return x + gate_mlp[:, None] * self.ff(norm)


# ----------------------------------------------------------------------------- the model

class Qwen2_5OmniDiT(nnx.Module):
    """Qwen2.5-Omni token2wav DiT (``token2wav.code2wav_dit_model``): codec codes -> mel.

    Shapes: ``B`` sequences of ``T`` codec tokens give ``L = repeats * T`` mel frames.
    """

    def __init__(self, config: DiTConfig, *, dtype=jnp.float32, param_dtype=jnp.float32,
                 precision=DEFAULT_PRECISION, rngs: nnx.Rngs):
        self.config = config
        kw = dict(dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        self.time_embed = DiTTimestepEmbedding(config.hidden_size, **kw)
        self.text_embed = DiTCodecEmbedding(config.num_embeds, config.emb_dim, config.repeats, **kw)
        self.input_embed = DiTInputEmbedding(config, **kw)
        self.transformer_blocks = nnx.List([
            DiTDecoderLayer(config, *config.layer_window(i), **kw) for i in range(config.num_hidden_layers)])
        self.norm_out = AdaLayerNormZeroFinal(config.hidden_size, **kw)
        self.proj_out = Linear(config.hidden_size, config.mel_dim, **kw)

    # -- pieces ------------------------------------------------------------------------
    def speaker_embedding(self, ref_mel):
        """ECAPA-TDNN embedding of a reference mel [B, Tm, mel_dim] -> [B, enc_dim]."""
        return self.input_embed.spk_encoder(jnp.asarray(ref_mel, jnp.float32))

    def __call__(self, x, t, codes, cond, spk, frame_mask=None):
        """One velocity evaluation (no guidance): [B, L, mel_dim].

        x [B, L, mel_dim] noisy mel; t scalar or [B] in [0, 1]; codes [B, L // repeats] int;
        cond [B, enc_emb_dim]; spk [B, enc_dim] (:meth:`speaker_embedding`);
        frame_mask optional [B, L] bool, False = padding frame (never attended to).
        HF's ``forward(apply_cfg=False)`` with ``speaker_embedding=cond`` repeated over frames and
        ``condition_vector=ref_mel``; its CFG batch equals this call on the doubled batch
        built by :meth:`guided_velocity`.
        """
        b, length, _ = x.shape
        t = jnp.broadcast_to(jnp.asarray(t, x.dtype).reshape(-1), (b,))
        temb = self.time_embed(t)
        h = self.input_embed(x, spk, self.text_embed(codes), cond)
        cos, sin = rope_cos_sin(jnp.arange(length), inv_frequencies(self.config.head_dim, self.config.rope_theta),
                                np.zeros(self.config.head_dim // 2, np.int32), dtype=x.dtype)
        for block in self.transformer_blocks:
            h = block(h, temb, cos, sin, frame_mask)
        return self.proj_out(self.norm_out(h, temb))

    def guided_velocity(self, x, t, codes, cond, spk, spk_uncond, guidance_scale: float, frame_mask=None):
        """Classifier-free-guided velocity, as HF's ``ode_function`` inside ``sample``.

        The unconditional copy uses code 0 everywhere, a zero ``cond`` and ``spk_uncond`` (the
        speaker embedding of an all-zero reference mel). ``guidance_scale < 1e-5`` skips it.
        """
        if guidance_scale < 1e-5:
            return self(x, t, codes, cond, spk, frame_mask)
        b = x.shape[0]
        fm = None if frame_mask is None else jnp.concatenate([frame_mask, frame_mask], axis=0)
        out = self(jnp.concatenate([x, x], axis=0), t,
                   jnp.concatenate([codes, jnp.zeros_like(codes)], axis=0),
                   jnp.concatenate([cond, jnp.zeros_like(cond)], axis=0),
                   jnp.concatenate([spk, spk_uncond], axis=0), fm)
        cond_v, null_v = out[:b], out[b:]
        return cond_v + (cond_v - null_v) * guidance_scale

    # -- the ODE -----------------------------------------------------------------------
    def solve(self, codes, cond, ref_mel, noise, *, num_steps: int = 10, guidance_scale: float = 0.5,
              sway_coefficient: float | None = -1.0, frame_mask=None, speaker_embeds=None):
        """Traceable flow-matching solve (call inside jit): noise [B, L, mel] -> mel [B, L, mel].

        ``speaker_embeds`` = (spk [B, enc_dim], spk_uncond [B, enc_dim]) replaces ``ref_mel``
        (which may then be None), e.g. to batch voices with cached embeddings.
        """
        codes = jnp.asarray(codes, jnp.int32)
        cond = jnp.asarray(cond, jnp.float32)
        if speaker_embeds is None:
            ref_mel = jnp.asarray(ref_mel, jnp.float32)
            # HF recomputes ECAPA at every evaluation; it does not depend on x or t.
            spk = self.speaker_embedding(ref_mel)
            spk_uncond = self.speaker_embedding(jnp.zeros_like(ref_mel))
        else:
            spk, spk_uncond = speaker_embeds
        grid = jnp.asarray(time_grid(num_steps, sway_coefficient))

        def velocity(t, y):
            return self.guided_velocity(y, t, codes, cond, spk, spk_uncond, guidance_scale, frame_mask)

        third = jnp.float32(1.0 / 3.0)
        # RK4 3/8 rule as a loop over stages (one traced DiT instead of four): stage s
        # evaluates at t0 + c[s] h on y + h * sum_j a[s, j] k_j.
        c = jnp.asarray([0.0, 1.0 / 3.0, 2.0 / 3.0, 1.0], jnp.float32)
        a = jnp.asarray([[0, 0, 0], [1 / 3, 0, 0], [-1 / 3, 1, 0], [1, -1, 1]], jnp.float32)

        def interval(i, y):
            t0, t1 = grid[i], grid[i + 1]
            h = t1 - t0

            def stage(s, ks):
                mix = (a[s, 0] * ks[0] + a[s, 1] * ks[1]) + a[s, 2] * ks[2]
                # t1 itself at the last stage (t0 + h may differ from t1 in the last bit).
                ts = jnp.where(s == 3, t1, t0 + h * c[s])
                ys = jnp.where(s == 1, y + h * ks[0] * third, y + h * mix)
                return ks.at[s].set(velocity(ts, ys))

            ks = jax.lax.fori_loop(0, 4, stage, jnp.zeros((4,) + y.shape, y.dtype))
            return y + (ks[0] + 3 * (ks[1] + ks[2]) + ks[3]) * h / 8

        return jax.lax.fori_loop(0, num_steps - 1, interval, jnp.asarray(noise, jnp.float32))

    def sample(self, codes, cond, ref_mel, noise=None, *, num_steps: int = 10, guidance_scale: float = 0.5,
               sway_coefficient: float | None = -1.0, code_lens=None, key=None):
        """Codec codes -> mel [B, repeats * T, mel_dim] (jitted; HF returns it as [B, mel_dim, L]).

        codes [B, T] int; cond [B, enc_emb_dim]; ref_mel [B, Tm, mel_dim];
        noise: the initial state [B, L, mel_dim] (HF's ``torch.randn([B, L, mel_dim])``) or a
        JAX PRNG key to draw it from (``key=`` also works); code_lens [B] optional valid codes
        per row for padded batches (frames past ``repeats * code_lens`` are padding; their
        output is meaningless). ``num_steps`` counts time points, as in HF.
        """
        cfg = self.config
        codes = jnp.asarray(codes, jnp.int32)
        b, n_codes = codes.shape
        length = n_codes * cfg.repeats
        if length > cfg.max_position_embeddings:
            raise ValueError(f"requested mel length ({length}) exceeds max_position_embeddings "
                             f"({cfg.max_position_embeddings}); pass shorter codes")
        if num_steps < 2:
            raise ValueError("num_steps counts time points and must be at least 2")
        if noise is None and key is None:
            raise ValueError("pass the initial noise or a PRNG key")
        if noise is None or _is_prng_key(noise):
            noise = jax.random.normal(noise if noise is not None else key, (b, length, cfg.mel_dim), jnp.float32)
        noise = jnp.asarray(noise, jnp.float32)
        if noise.shape != (b, length, cfg.mel_dim):
            raise ValueError(f"noise has shape {noise.shape}, expected {(b, length, cfg.mel_dim)}")
        frame_mask = None
        if code_lens is not None:
            lens = np.asarray(code_lens).reshape(-1)
            if lens.shape != (b,) or (lens > n_codes).any() or (lens < 1).any():
                raise ValueError(f"code_lens {lens.tolist()} must be {b} lengths in [1, {n_codes}]")
            frame_mask = jnp.asarray(np.arange(length)[None, :] < (lens[:, None] * cfg.repeats))
        graphdef, state = nnx.split(self)
        sway = None if sway_coefficient is None else float(sway_coefficient)
        return _jitted_solve(graphdef, state, codes, jnp.asarray(cond, jnp.float32),
                             jnp.asarray(ref_mel, jnp.float32), noise, frame_mask,
                             num_steps=int(num_steps), guidance_scale=float(guidance_scale), sway_coefficient=sway)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("num_steps", "guidance_scale", "sway_coefficient"))
def _jitted_solve(graphdef, state, codes, cond, ref_mel, noise, frame_mask, *, num_steps, guidance_scale,
                  sway_coefficient):
    model = nnx.merge(graphdef, state)
    return model.solve(codes, cond, ref_mel, noise, num_steps=num_steps, guidance_scale=guidance_scale,
                       sway_coefficient=sway_coefficient, frame_mask=frame_mask)


__all__ = [
    "DiTConfig",
    "HF_RENAMES",
    "Qwen2_5OmniDiT",
    "block_attention_mask",
    "block_window_positions",
    "time_grid",
]
