"""The Whisper-style audio encoder's layers both families' audio towers are built of: the
encoder config, sinusoidal positions, chunk attention and the pre-norm encoder layer."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .linear import Linear
from .mlp import ACTIVATIONS

LN_EPS = 1e-5  # torch.nn.LayerNorm default, used by every norm of the HF encoder


@dataclasses.dataclass(frozen=True)
class AudioEncoderConfig:
    """Hyper-parameters of the audio encoder (the HF ``audio_config``; Qwen2.5-Omni's, which
    Qwen3-Omni's extends)."""

    num_mel_bins: int = 128
    encoder_layers: int = 32
    encoder_attention_heads: int = 20
    encoder_ffn_dim: int = 5120
    d_model: int = 1280
    max_source_positions: int = 1500
    n_window: int = 100
    output_dim: int = 3584
    activation: str = "gelu"

    @classmethod
    def from_hf(cls, d: dict) -> "AudioEncoderConfig":
        """Build from the ``thinker_config.audio_config`` dict of an HF config.json."""
        names = {f.name for f in dataclasses.fields(cls)} - {"activation"}
        kwargs = {k: d[k] for k in names if k in d}
        act = d.get("activation_function", d.get("activation"))
        if act is not None:
            kwargs["activation"] = act
        return cls(**kwargs)

    @property
    def chunk_frames(self) -> int:
        """Mel frames per attention chunk (``W``)."""
        return 2 * self.n_window

    @property
    def chunk_tokens(self) -> int:
        """Tokens per attention chunk after the stride-2 conv (``S``)."""
        return conv_stride2_len(self.chunk_frames)


def conv_stride2_len(n):
    # Length after a kernel-3, padding-1, stride-2 convolution.
    return (n - 1) // 2 + 1


@functools.lru_cache(maxsize=8)
def sinusoid_positions(length: int, channels: int, max_timescale: float = 10000.0) -> np.ndarray:
    """Whisper sinusoidal position table ``[length, channels]`` (sin half, then cos half).

    Rounded through float32 at the same steps as transformers, so the angles (up to
    ``length`` radians) agree to the last bit before sin/cos.
    """
    if channels % 2:
        raise ValueError("sinusoidal positions need an even number of channels")
    half = channels // 2
    increment = np.float32(np.log(max_timescale) / (half - 1))
    inv_timescales = np.exp(-increment * np.arange(half, dtype=np.float32))
    angles = np.arange(length, dtype=np.float32)[:, None] * inv_timescales[None, :]
    table = np.concatenate([np.sin(angles), np.cos(angles)], axis=1).astype(np.float32)
    table.setflags(write=False)
    return table


class AudioAttention(nnx.Module):
    """Bidirectional multi-head attention inside each chunk of a ``[C, S, D]`` layout."""

    def __init__(self, config: AudioEncoderConfig, *, dtype, param_dtype, precision, rngs: nnx.Rngs):
        d = config.d_model
        self.num_heads = config.encoder_attention_heads
        if d % self.num_heads:
            raise ValueError(f"d_model {d} is not divisible by {self.num_heads} heads")
        self.head_dim = d // self.num_heads
        self.precision = precision
        lin = functools.partial(Linear, d, d, dtype=dtype, param_dtype=param_dtype,
                                precision=precision, rngs=rngs)
        self.q_proj = lin()
        self.k_proj = lin(use_bias=False)
        self.v_proj = lin()
        self.out_proj = lin()

    def __call__(self, x: jax.Array, key_mask: jax.Array) -> jax.Array:
        C, S, D = x.shape
        split = lambda t: t.reshape(C, S, self.num_heads, self.head_dim)
        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        scores = jnp.einsum("cqhd,ckhd->chqk", q, k, precision=self.precision) * (self.head_dim ** -0.5)
        # Softmax in fp32 as transformers does; a finite fill keeps fully padded
        # chunks (bucket padding) NaN-free.
        scores = scores.astype(jnp.float32)
        scores = jnp.where(key_mask[:, None, None, :], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("chqk,ckhd->cqhd", probs, v, precision=self.precision)
        return self.out_proj(out.reshape(C, S, D))


class AudioEncoderLayer(nnx.Module):
    """Pre-norm transformer layer: chunk attention, then a two-layer MLP."""

    def __init__(self, config: AudioEncoderConfig, *, dtype, param_dtype, precision, rngs: nnx.Rngs):
        d = config.d_model
        norm = functools.partial(nnx.LayerNorm, d, epsilon=LN_EPS, use_fast_variance=False,
                                 dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.activation = config.activation
        self.self_attn = AudioAttention(config, dtype=dtype, param_dtype=param_dtype,
                                        precision=precision, rngs=rngs)
        self.self_attn_layer_norm = norm()
        self.fc1 = Linear(d, config.encoder_ffn_dim, dtype=dtype, param_dtype=param_dtype,
                          precision=precision, rngs=rngs)
        self.fc2 = Linear(config.encoder_ffn_dim, d, dtype=dtype, param_dtype=param_dtype,
                          precision=precision, rngs=rngs)
        self.final_layer_norm = norm()

    def __call__(self, x: jax.Array, key_mask: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.self_attn_layer_norm(x), key_mask)
        h = ACTIVATIONS[self.activation](self.fc1(self.final_layer_norm(x)))
        return x + self.fc2(h)
