"""Qwen3-Omni audio encoder (``Qwen3OmniMoeAudioEncoder``) in Flax NNX.

Log-mel features are cut, per audio, into chunks of ``W = 2 * n_window`` frames (100 for
the real model; an audio's last chunk may be shorter). Each chunk goes through three
3x3 stride-2 Conv2d + GELU over (mel, time), the (channel, mel) map of every time step is
flattened and projected by ``conv_out`` (no bias), and sinusoidal positions restarting in
every chunk are added: a full chunk gives ``T = 13`` tokens. Pre-norm transformer layers
attend bidirectionally inside *attention windows* of ``n_window_infer // W`` consecutive
chunks of one audio (8 chunks = 104 tokens for the real model). Then ``ln_post``,
``proj1``, GELU, ``proj2``. There is no pooling (unlike Qwen2.5-Omni).

transformers quirk reproduced here: it zero-pads every chunk of the call to the longest
chunk ``L`` (``W`` as soon as one audio has a full chunk) and runs the convolutions over
that padded length, so the last token of a short chunk sees conv outputs computed from
padding. This module runs the convolutions on fixed ``W``-frame chunks and masks the conv
activations past ``L``'s lengths, which reproduces that exactly; ``L`` is a per-chunk
``chunk_extent`` planned on the host (by default the longest chunk of the call, as
transformers; ``extent_groups`` makes it per group of audios, e.g. per request).

Shape contract
--------------
* Host (numpy), :func:`prepare_audio_batch` -> :class:`AudioBatch`: ``C`` chunks of ``W``
  frames, ``G`` attention windows of ``L = R * T`` token slots (``R = n_window_infer // W``)
  and ``P`` output rows; each may be padded up to a bucket.
* Device, :meth:`Qwen3OmniAudioEncoder.__call__`: ``input_features [num_mel_bins, F]``
  (all audios concatenated along time, as transformers' ``get_audio_features`` does with
  ``feature_attention_mask``; ``F`` may be padded, frames past ``sum(feature_lens)`` are
  never read) + ``frame_index [C, W]``, ``frame_mask [C, W]``, ``chunk_extent [C]``,
  ``token_index [G, L]``, ``token_mask [G, L]``, ``output_index [P]`` ->
  ``[P, output_dim]``. Rows ``0 .. sum(output_lens) - 1`` are the audio embeddings in audio
  order (= transformers' ``last_hidden_state``); padding rows are finite garbage.
* :meth:`Qwen3OmniAudioEncoder.encode`: host prep + jitted forward, numpy out.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from omni_jax.models.layers.linear import Linear
from omni_jax.models.layers.audio_blocks import AudioEncoderConfig as _BaseAudioEncoderConfig
from omni_jax.models.layers.audio_blocks import LN_EPS, AudioAttention, AudioEncoderLayer, sinusoid_positions
from omni_jax.models.layers.audio_chunks import chunk_audios, concatenated_features, run_encoder
from omni_jax.models.layers.mlp import ACTIVATIONS


@dataclasses.dataclass(frozen=True)
class AudioEncoderConfig(_BaseAudioEncoderConfig):
    """Hyper-parameters of the Qwen3-Omni audio encoder (the HF ``audio_config``): the
    Qwen2.5 fields (same ``from_hf``, ``chunk_frames``) plus the attention window of
    inference and the conv width."""

    n_window: int = 50
    n_window_infer: int = 800
    downsample_hidden_size: int = 480

    @property
    def chunk_tokens(self) -> int:
        """Tokens of a full chunk after the three stride-2 convs (``T``; 13 for W = 100)."""
        return int(conv_output_lengths(self.chunk_frames)[2])

    @property
    def window_chunks(self) -> int:
        """Chunks per attention window (``R = n_window_infer // W``)."""
        return self.n_window_infer // self.chunk_frames

    @property
    def window_tokens(self) -> int:
        """Token slots per attention window (``L = R * T``; 104 for the real model)."""
        return self.window_chunks * self.chunk_tokens

    @property
    def freq_bins(self) -> int:
        """Mel bins left after the three stride-2 convs."""
        return int(conv_output_lengths(self.num_mel_bins)[2])


def _conv_len(n):
    # Length after a kernel-3, padding-1, stride-2 convolution (0 stays 0).
    return (n - 1) // 2 + 1


def conv_output_lengths(lengths):
    """Lengths after conv2d1, conv2d2 and conv2d3 (kernel 3, padding 1, stride 2 each)."""
    n1 = _conv_len(np.asarray(lengths, dtype=np.int64))
    n2 = _conv_len(n1)
    return n1, n2, _conv_len(n2)


def audio_output_lengths(feature_lens, n_window: int = 50) -> np.ndarray:
    """Mel frames -> audio tokens (encoder output rows = placeholder tokens), per audio.

    ``T`` tokens per full ``2 * n_window``-frame chunk plus the conv length of the rest.
    Equals transformers' ``_get_feat_extract_output_lengths``, which hard-codes 13 tokens
    per full chunk and so holds for ``n_window == 50`` only (as does transformers' own
    encoder: with another ``n_window`` its attention windows no longer add up).
    """
    lens = np.asarray(feature_lens, dtype=np.int64)
    W = 2 * n_window
    full = conv_output_lengths(W)[2]
    return (lens // W) * full + conv_output_lengths(lens % W)[2]


def num_windows_for(feature_lens, n_window: int, n_window_infer: int) -> int:
    """Number of attention windows (``G``) the audios of ``feature_lens`` need."""
    W = 2 * n_window
    R = n_window_infer // W
    if R < 1:
        raise ValueError(f"n_window_infer={n_window_infer} is smaller than a chunk of {W} frames")
    chunks = (np.asarray(feature_lens, dtype=np.int64) + W - 1) // W
    return int(((chunks + R - 1) // R).sum())


@dataclasses.dataclass(frozen=True)
class AudioBatch:
    """Host-side (numpy) layout of one encoder call; see the module docstring.

    ``frame_index [C, W]`` int32: column of ``input_features`` per chunk frame (0 where
    masked); ``frame_mask [C, W]`` bool; ``chunk_extent [C]`` int32: the padded chunk
    length transformers convolves this chunk at (0 for padding chunks);
    ``token_index [G, L]`` int32: flat ``c * T + t`` conv-output slot of each window slot;
    ``token_mask [G, L]`` bool: valid window slots (keys); ``output_index [P]`` int32: flat
    ``g * L + j`` window slot of each output row; ``output_lens [A]``: tokens per audio.
    """

    frame_index: np.ndarray
    frame_mask: np.ndarray
    chunk_extent: np.ndarray
    token_index: np.ndarray
    token_mask: np.ndarray
    output_index: np.ndarray
    output_lens: np.ndarray

    @property
    def num_tokens(self) -> int:
        """Number of valid output rows (the rest of the ``P`` rows are padding)."""
        return int(self.output_lens.sum())

    @property
    def num_frames(self) -> int:
        """Number of mel frames the batch reads (``sum(feature_lens)``)."""
        return int(self.frame_mask.sum())

    def arrays(self) -> tuple[np.ndarray, ...]:
        """The positional arguments after ``input_features`` of the encoder call."""
        return (self.frame_index, self.frame_mask, self.chunk_extent, self.token_index,
                self.token_mask, self.output_index)


def prepare_audio_batch(feature_lens, n_window: int, n_window_infer: int, *,
                        num_chunks: int | None = None, num_windows: int | None = None,
                        num_tokens: int | None = None, extent_groups=None, extent: int | None = None) -> AudioBatch:
    """Plan the padded chunk / window / output layout for audios of ``feature_lens`` frames.

    ``num_chunks`` / ``num_windows`` / ``num_tokens`` pad ``C`` / ``G`` / ``P`` up to a
    bucket (default: exact). ``extent_groups`` (one int per audio) makes the conv padding
    length per group (audios of one transformers call share a group); default: one group,
    i.e. exactly what one transformers call over all these audios computes. ``extent`` sets
    every chunk's (audios or pieces of them encoded apart from the rest of their call).
    """
    W = 2 * n_window
    R = n_window_infer // W
    if R < 1:
        raise ValueError(f"n_window_infer={n_window_infer} is smaller than a chunk of {W} frames")
    T = int(conv_output_lengths(W)[2])
    L = R * T
    chunks = chunk_audios(feature_lens, W, num_chunks)
    A, n_chunks = chunks.lens.size, chunks.n
    per_audio, first_chunk, chunk_audio, chunk_len = chunks.per_audio, chunks.first_chunk, chunks.audio, chunks.length

    groups = np.zeros(A, np.int64) if extent_groups is None else np.asarray(extent_groups).reshape(-1)
    if groups.size != A:
        raise ValueError(f"extent_groups has {groups.size} entries for {A} audios")
    # transformers pads the chunks of one call to the longest of them.
    _, group_of = np.unique(groups, return_inverse=True)
    group_extent = np.zeros(group_of.max() + 1, np.int64)
    np.maximum.at(group_extent, group_of[chunk_audio], chunk_len)
    extent_of = group_extent[group_of[chunk_audio]]
    if extent is not None:
        if extent < chunk_len.max() or extent > W:
            raise ValueError(f"extent={extent} must be between the longest chunk ({chunk_len.max()}) and {W} frames")
        extent_of = np.full_like(extent_of, extent)

    chunk_extent = np.zeros((chunks.frame_mask.shape[0],), np.int32)
    chunk_extent[:n_chunks] = extent_of

    # Attention windows: R consecutive chunks of one audio. Every chunk but an audio's last
    # is full, so a window's tokens are its chunks' valid conv slots in order, which is
    # transformers' split of each audio's tokens into windows of T * R (of the padded
    # length's token count when no chunk is full: then one chunk = one window).
    chunk_tokens = conv_output_lengths(chunk_len)[2]
    win_per_audio = (per_audio + R - 1) // R
    n_windows = int(win_per_audio.sum())
    G = n_windows if num_windows is None else int(num_windows)
    if G < n_windows:
        raise ValueError(f"num_windows={num_windows} is smaller than the {n_windows} windows needed")
    window_audio = np.repeat(np.arange(A), win_per_audio)
    window_in_audio = np.arange(n_windows) - (np.cumsum(win_per_audio) - win_per_audio)[window_audio]
    window_first_chunk = first_chunk[window_audio] + window_in_audio * R
    slot_chunk = window_first_chunk[:, None] + np.arange(L)[None] // T  # [n_windows, L]
    slot_pos = np.broadcast_to(np.arange(L)[None] % T, slot_chunk.shape)
    chunk_end = (first_chunk + per_audio)[window_audio]
    in_audio = slot_chunk < chunk_end[:, None]
    safe_chunk = np.where(in_audio, slot_chunk, 0)
    valid = in_audio & (slot_pos < chunk_tokens[safe_chunk])
    token_index = np.zeros((G, L), np.int32)
    token_index[:n_windows] = np.where(valid, safe_chunk * T + slot_pos, 0)
    token_mask = np.zeros((G, L), bool)
    token_mask[:n_windows] = valid

    output_lens = np.bincount(chunk_audio, weights=chunk_tokens, minlength=A).astype(np.int64)
    n_out = int(output_lens.sum())
    P = n_out if num_tokens is None else int(num_tokens)
    if P < n_out:
        raise ValueError(f"num_tokens={num_tokens} is smaller than the {n_out} output tokens")
    output_index = np.zeros((P,), np.int32)
    output_index[:n_out] = np.flatnonzero(token_mask[:n_windows].reshape(-1))
    return AudioBatch(chunks.frame_index, chunks.frame_mask, chunk_extent, token_index, token_mask, output_index,
                      output_lens)


class Qwen3AudioAttention(AudioAttention):
    """Qwen2.5-Omni's masked attention over a ``[G, L, D]`` window layout; k_proj has a bias here."""

    def __init__(self, config: AudioEncoderConfig, *, dtype, param_dtype, precision, rngs: nnx.Rngs):
        super().__init__(config, dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        d = config.d_model
        self.k_proj = Linear(d, d, dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)


class Qwen3AudioEncoderLayer(AudioEncoderLayer):
    """Same pre-norm layer as Qwen2.5-Omni's (self_attn, fc1/fc2, two LayerNorms)."""

    def __init__(self, config: AudioEncoderConfig, *, dtype, param_dtype, precision, rngs: nnx.Rngs):
        super().__init__(config, dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        self.self_attn = Qwen3AudioAttention(config, dtype=dtype, param_dtype=param_dtype,
                                             precision=precision, rngs=rngs)


class Qwen3OmniAudioEncoder(nnx.Module):
    """The Qwen3-Omni audio tower (``thinker.audio_tower`` in the HF checkpoint).

    Attribute names mirror transformers. ``precision`` applies to every matmul/conv; the
    default is HIGHEST for float32 compute (parity, no TF32 on GPU), else the backend's.
    """

    def __init__(self, config: AudioEncoderConfig, *, dtype=jnp.float32, param_dtype=jnp.float32,
                 precision=None, rngs: nnx.Rngs):
        if config.activation not in ACTIVATIONS:
            raise ValueError(f"unsupported audio encoder activation {config.activation!r}")
        if config.window_chunks < 1:
            raise ValueError("n_window_infer must be at least 2 * n_window")
        if config.chunk_tokens > config.max_source_positions:
            raise ValueError("a chunk has more tokens than max_source_positions")
        if precision is None and jnp.dtype(dtype) == jnp.float32:
            precision = jax.lax.Precision.HIGHEST
        self.config = config
        self.dtype = dtype
        d, ds = config.d_model, config.downsample_hidden_size
        common = dict(dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        conv = functools.partial(nnx.Conv, kernel_size=(3, 3), strides=(2, 2), padding=((1, 1), (1, 1)),
                                 **common)
        self.conv2d1 = conv(1, ds)
        self.conv2d2 = conv(ds, ds)
        self.conv2d3 = conv(ds, ds)
        self.conv_out = Linear(ds * config.freq_bins, d, use_bias=False, **common)
        self.layers = nnx.List([Qwen3AudioEncoderLayer(config, **common) for _ in range(config.encoder_layers)])
        self.ln_post = nnx.LayerNorm(d, epsilon=LN_EPS, use_fast_variance=False,
                                     dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.proj1 = Linear(d, d, **common)
        self.proj2 = Linear(d, config.output_dim, **common)

    def __call__(self, input_features: jax.Array, frame_index: jax.Array, frame_mask: jax.Array,
                 chunk_extent: jax.Array, token_index: jax.Array, token_mask: jax.Array,
                 output_index: jax.Array) -> jax.Array:
        """``[num_mel_bins, F]`` features + an :class:`AudioBatch`'s arrays -> ``[P, output_dim]``."""
        gelu = functools.partial(jax.nn.gelu, approximate=False)  # F.gelu in the conv stem
        # Chunks as NHWC images [C, mel, W, 1]; frames past a chunk's end are zero, as in
        # transformers' zero-padded chunk batch.
        x = jnp.take(input_features.T, frame_index, axis=0)  # [C, W, mel]
        x = jnp.where(frame_mask[..., None], x, 0).astype(self.dtype)
        x = jnp.transpose(x, (0, 2, 1))[..., None]

        def keep_extent(h, n):
            # Zero conv outputs at time steps transformers' padded batch does not have
            # (>= the conv length of the chunk's padded extent): the next conv reads its
            # zero padding there.
            t = jnp.arange(h.shape[2])
            return jnp.where((t[None, :] < n[:, None])[:, None, :, None], h, 0)

        n1 = (chunk_extent - 1) // 2 + 1
        n2 = (n1 - 1) // 2 + 1
        x = keep_extent(gelu(self.conv2d1(x)), n1)
        x = keep_extent(gelu(self.conv2d2(x)), n2)
        x = gelu(self.conv2d3(x))  # [C, F3, T, ds]
        C, F3, T, ds = x.shape
        # transformers flattens (channel, freq) per time step, channel-major.
        x = self.conv_out(jnp.transpose(x, (0, 2, 3, 1)).reshape(C, T, ds * F3))
        x = x + jnp.asarray(sinusoid_positions(T, x.shape[-1]), dtype=x.dtype)[None]

        h = jnp.take(x.reshape(C * T, -1), token_index, axis=0)  # [G, L, D]
        for layer in self.layers:
            h = layer(h, token_mask)

        h = jnp.take(h.reshape(-1, h.shape[-1]), output_index, axis=0)
        h = ACTIVATIONS[self.config.activation](self.proj1(self.ln_post(h)))
        return self.proj2(h)

    def encode(self, features, feature_lens=None, *, num_frames: int | None = None,
               num_chunks: int | None = None, num_windows: int | None = None,
               num_tokens: int | None = None, extent_groups=None) -> np.ndarray:
        """Host prep + jitted forward: audio embeddings ``[sum(output_lens), output_dim]`` (numpy).

        ``features`` is a list of ``[num_mel_bins, F_i]`` arrays, or one concatenated
        ``[num_mel_bins, F]`` array with ``feature_lens``. ``num_frames`` / ``num_chunks`` /
        ``num_windows`` / ``num_tokens`` pad the call to buckets (the result is sliced back).
        """
        feats, lens = concatenated_features(features, feature_lens, num_frames)
        c = self.config
        return run_encoder(self, feats, prepare_audio_batch(
            lens, c.n_window, c.n_window_infer, num_chunks=num_chunks, num_windows=num_windows,
            num_tokens=num_tokens, extent_groups=extent_groups))


__all__ = [
    "AudioBatch",
    "AudioEncoderConfig",
    "Qwen3OmniAudioEncoder",
    "audio_output_lengths",
    "conv_output_lengths",
    "num_windows_for",
    "prepare_audio_batch",
]
