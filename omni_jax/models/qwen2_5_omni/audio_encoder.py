"""Qwen2.5-Omni audio encoder (Whisper-style, chunked attention) in Flax NNX.

The encoder turns log-mel features into audio embeddings for the thinker:
conv1 (k3) + GELU, conv2 (k3, stride 2) + GELU, sinusoidal positions restarted in every
chunk, pre-norm transformer layers whose attention is bidirectional *within* one chunk
of ``2 * n_window`` mel frames (``n_window`` tokens after conv2), stride-2 average
pooling over each audio's token sequence, ``ln_post`` and ``proj``. With the real
config (``n_window`` 100) 100 mel frames become 25 output tokens.

Shape contract
--------------
The split between host and device keeps the jitted part free of data-dependent shapes:

* Host (numpy), :func:`prepare_audio_batch`: from ``feature_lens [A]`` it builds the
  padded chunk layout of ``C`` chunks of ``W = 2 * n_window`` frames
  (``S = (W - 1) // 2 + 1`` tokens after conv2) and ``P`` pooled output slots.
  ``C`` and ``P`` may be padded up to buckets; padding chunks are fully masked and
  padding output slots are computed from slot 0 and must be ignored.
* Device, :meth:`Qwen2_5OmniAudioEncoder.__call__`:
  ``input_features [num_mel_bins, T]`` (all audios concatenated along time, as
  transformers does with ``feature_attention_mask``; ``T`` may be padded to a bucket,
  frames past ``sum(feature_lens)`` are never read) plus the batch arrays
  ``frame_index [C, W]``, ``frame_mask [C, W]``, ``token_mask [C, S]``,
  ``pool_index [P, 2]`` -> ``[P, output_dim]``; the first ``sum(output_lens)`` rows are
  the audio embeddings in audio order, exactly what transformers'
  ``get_audio_features(...).last_hidden_state`` returns.
* :meth:`Qwen2_5OmniAudioEncoder.encode` does both for tests and tools (jitted per shape).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..layers.audio_blocks import LN_EPS, AudioEncoderConfig, AudioEncoderLayer, conv_stride2_len, sinusoid_positions
from ..layers.audio_chunks import chunk_audios, concatenated_features, run_encoder
from ..layers.linear import Linear
from ..layers.mlp import ACTIVATIONS

def audio_output_lengths(feature_lens) -> tuple[np.ndarray, np.ndarray]:
    """Mel frames -> (tokens after the convs, output tokens after pooling), per audio.

    Same as transformers' ``_get_feat_extract_output_lengths``.
    """
    lens = np.asarray(feature_lens, dtype=np.int64)
    after_cnn = conv_stride2_len(lens)
    return after_cnn, (after_cnn - 2) // 2 + 1


@dataclasses.dataclass(frozen=True)
class AudioBatch:
    """Host-side (numpy) layout of one encoder call; see the module docstring.

    ``frame_index [C, W]`` int32: column of ``input_features`` for each chunk frame
    (0 where masked); ``frame_mask [C, W]`` bool; ``token_mask [C, S]`` bool: valid
    keys after conv2; ``pool_index [P, 2]`` int32: the two flat ``c * S + s`` token
    slots averaged into each output; ``output_lens [A]``: output tokens per audio.
    """

    frame_index: np.ndarray
    frame_mask: np.ndarray
    token_mask: np.ndarray
    pool_index: np.ndarray
    output_lens: np.ndarray

    @property
    def num_tokens(self) -> int:
        """Number of valid output rows (the rest of the ``P`` slots are padding)."""
        return int(self.output_lens.sum())

    @property
    def num_frames(self) -> int:
        """Number of mel frames the batch reads (``sum(feature_lens)``)."""
        return int(self.frame_mask.sum())

    def arrays(self) -> tuple[np.ndarray, ...]:
        """The positional arguments after ``input_features`` of the encoder call."""
        return self.frame_index, self.frame_mask, self.token_mask, self.pool_index


def prepare_audio_batch(feature_lens, n_window: int, *, num_chunks: int | None = None,
                        num_tokens: int | None = None) -> AudioBatch:
    """Plan the padded chunk layout for audios of ``feature_lens`` mel frames.

    ``num_chunks`` / ``num_tokens`` pad ``C`` / ``P`` up to a bucket (default: exact).
    """
    W = 2 * n_window
    S = conv_stride2_len(W)
    chunks = chunk_audios(feature_lens, W, num_chunks)
    token_mask = np.zeros((chunks.frame_mask.shape[0], S), dtype=bool)
    token_mask[:chunks.n] = np.arange(S) < conv_stride2_len(chunks.length)[:, None]

    # Every chunk but an audio's last is full (S tokens), so token p of audio a sits at
    # flat slot first_chunk[a] * S + p of the [C * S] layout, and pooling averages the
    # pairs (2k, 2k+1) of each audio's token sequence, dropping an odd last token.
    _, output_lens = audio_output_lengths(chunks.lens)
    n_out = int(output_lens.sum())
    P = n_out if num_tokens is None else num_tokens
    if P < n_out:
        raise ValueError(f"num_tokens={num_tokens} is smaller than the {n_out} output tokens")
    out_audio = np.repeat(np.arange(chunks.lens.size), output_lens)
    k = np.arange(n_out) - np.repeat(np.cumsum(output_lens) - output_lens, output_lens)
    first = chunks.first_chunk[out_audio] * S + 2 * k
    pool_index = np.zeros((P, 2), dtype=np.int32)
    pool_index[:n_out, 0] = first
    pool_index[:n_out, 1] = first + 1
    return AudioBatch(chunks.frame_index, chunks.frame_mask, token_mask, pool_index, output_lens)


class Qwen2_5OmniAudioEncoder(nnx.Module):
    """The Qwen2.5-Omni audio tower (``thinker.audio_tower`` in the HF checkpoint).

    Attribute names mirror transformers so checkpoint keys map mechanically. ``precision``
    applies to every matmul/conv; the default is HIGHEST for float32 compute (parity, and no
    TF32 on GPU) and the backend default otherwise.
    """

    def __init__(self, config: AudioEncoderConfig, *, dtype=jnp.float32, param_dtype=jnp.float32,
                 precision=None, rngs: nnx.Rngs):
        if config.activation not in ACTIVATIONS:
            raise ValueError(f"unsupported audio encoder activation {config.activation!r}")
        if config.chunk_tokens > config.max_source_positions:
            raise ValueError("a chunk has more tokens than max_source_positions")
        if precision is None and jnp.dtype(dtype) == jnp.float32:
            precision = jax.lax.Precision.HIGHEST
        self.config = config
        self.dtype = dtype
        d = config.d_model
        common = dict(dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        self.conv1 = nnx.Conv(config.num_mel_bins, d, kernel_size=(3,), padding=((1, 1),), **common)
        self.conv2 = nnx.Conv(d, d, kernel_size=(3,), strides=(2,), padding=((1, 1),), **common)
        # In the checkpoint but unused by the encoder itself; kept so the checkpoint maps completely.
        self.audio_bos_eos_token = nnx.Embed(2, config.output_dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.layers = nnx.List([AudioEncoderLayer(config, **common) for _ in range(config.encoder_layers)])
        self.ln_post = nnx.LayerNorm(d, epsilon=LN_EPS, use_fast_variance=False,
                                     dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.proj = Linear(d, config.output_dim, **common)

    def __call__(self, input_features: jax.Array, frame_index: jax.Array, frame_mask: jax.Array,
                 token_mask: jax.Array, pool_index: jax.Array) -> jax.Array:
        """``[num_mel_bins, T]`` features + an :class:`AudioBatch`'s arrays -> ``[P, output_dim]``."""
        # Gather the chunks as [C, W, mel] (NWC for the convs); masked frames are zero,
        # which is also what conv1's right-hand padding reads at a chunk's end.
        x = jnp.take(input_features.T, frame_index, axis=0)
        x = jnp.where(frame_mask[..., None], x, 0).astype(self.dtype)
        x = jax.nn.gelu(self.conv1(x), approximate=False)
        # conv2 must see zeros past a short chunk's end, not conv1's bias.
        x = jnp.where(frame_mask[..., None], x, 0)
        x = jax.nn.gelu(self.conv2(x), approximate=False)
        C, S, D = x.shape
        x = x + jnp.asarray(sinusoid_positions(S, D), dtype=x.dtype)[None]

        for layer in self.layers:
            x = layer(x, token_mask)

        flat = x.reshape(C * S, D)
        pooled = (jnp.take(flat, pool_index[:, 0], axis=0) + jnp.take(flat, pool_index[:, 1], axis=0)) / 2
        return self.proj(self.ln_post(pooled))

    def encode(self, features, feature_lens=None, *, num_frames: int | None = None,
               num_chunks: int | None = None, num_tokens: int | None = None) -> np.ndarray:
        """Host prep + jitted forward: audio embeddings ``[sum(output_lens), output_dim]`` (numpy).

        ``features`` is a list of ``[num_mel_bins, T_i]`` arrays, or one concatenated
        ``[num_mel_bins, T]`` array with ``feature_lens``. ``num_frames``/``num_chunks``/
        ``num_tokens`` pad the call to buckets (the result is sliced back to the valid rows).
        """
        feats, lens = concatenated_features(features, feature_lens, num_frames)
        return run_encoder(self, feats, prepare_audio_batch(lens, self.config.n_window, num_chunks=num_chunks,
                                                            num_tokens=num_tokens))
