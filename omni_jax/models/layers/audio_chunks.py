"""The host side both audio encoders share: audios cut into chunks of ``W = 2 * n_window`` mel
frames (an audio's last chunk may be shorter), the padded gather of those frames, and the
feature concatenation and jitted call of the encoders' ``encode`` (tests and tools)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def num_chunks_for(feature_lens, n_window: int) -> int:
    """Number of chunks (``C``) the audios of ``feature_lens`` mel frames need."""
    lens = np.asarray(feature_lens, dtype=np.int64)
    return int(((lens + 2 * n_window - 1) // (2 * n_window)).sum())


@dataclasses.dataclass(frozen=True)
class Chunks:
    """Audios of ``lens`` frames in chunks of ``W`` frames, padded to ``C`` chunks.

    Per audio: ``per_audio`` chunks from ``first_chunk`` on; per real chunk (``n`` of them, in
    audio order): ``audio`` (whose chunk), ``length`` (frames); per padded chunk:
    ``frame_index [C, W]`` int32, the column of the concatenated features of each chunk frame
    (0 where masked), and ``frame_mask [C, W]``.
    """

    lens: np.ndarray
    per_audio: np.ndarray
    first_chunk: np.ndarray
    audio: np.ndarray
    length: np.ndarray
    frame_index: np.ndarray
    frame_mask: np.ndarray

    @property
    def n(self) -> int:
        return self.length.size


def chunk_audios(feature_lens, W: int, num_chunks: int | None = None) -> Chunks:
    """Cut audios of ``feature_lens`` frames into chunks of ``W`` frames; ``num_chunks`` pads
    ``C`` up to a bucket (default: exact)."""
    lens = np.asarray(feature_lens, dtype=np.int64).reshape(-1)
    if lens.size == 0 or (lens < 1).any():
        raise ValueError(f"every audio needs at least one mel frame, got feature_lens={lens.tolist()}")
    per_audio = (lens + W - 1) // W
    n = int(per_audio.sum())
    first_chunk = np.cumsum(per_audio) - per_audio
    audio = np.repeat(np.arange(lens.size), per_audio)
    in_audio = np.arange(n) - first_chunk[audio]
    start = (np.cumsum(lens) - lens)[audio] + in_audio * W
    length = np.minimum(W, lens[audio] - in_audio * W)

    C = n if num_chunks is None else int(num_chunks)
    if C < n:
        raise ValueError(f"num_chunks={num_chunks} is smaller than the {n} chunks needed")
    frame_mask = np.zeros((C, W), dtype=bool)
    frame_mask[:n] = np.arange(W) < length[:, None]
    frame_index = np.zeros((C, W), dtype=np.int32)
    frame_index[:n] = np.where(frame_mask[:n], start[:, None] + np.arange(W), 0)
    return Chunks(lens, per_audio, first_chunk, audio, length, frame_index, frame_mask)


def concatenated_features(features, feature_lens=None, num_frames: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(features [num_mel_bins, F], feature_lens [A])`` of an encoder call from a list of
    ``[num_mel_bins, F_i]`` arrays, or from one concatenated array with ``feature_lens``;
    ``num_frames`` pads ``F`` up to a bucket."""
    if isinstance(features, (list, tuple)):
        lens = np.array([f.shape[1] for f in features], dtype=np.int64)
        if feature_lens is not None and not np.array_equal(np.asarray(feature_lens).reshape(-1), lens):
            raise ValueError("feature_lens does not match the lengths of the feature list")
        feats = np.concatenate([np.asarray(f, dtype=np.float32) for f in features], axis=1)
    else:
        if feature_lens is None:
            raise ValueError("feature_lens is required with concatenated features")
        feats = np.asarray(features, dtype=np.float32)
        lens = np.asarray(feature_lens, dtype=np.int64).reshape(-1)
    total = int(lens.sum())
    if feats.shape[1] < total:
        raise ValueError(f"features have {feats.shape[1]} frames, feature_lens need {total}")
    if num_frames is not None:
        if num_frames < total:
            raise ValueError(f"num_frames={num_frames} is smaller than the {total} frames")
        feats = np.pad(feats[:, :total], ((0, 0), (0, num_frames - total)))
    return feats, lens


def run_encoder(encoder: nnx.Module, feats: np.ndarray, batch) -> np.ndarray:
    """The encoder's jitted forward over ``feats`` and an audio batch's arrays: its
    ``batch.num_tokens`` valid rows, as numpy."""
    graphdef, state = nnx.split(encoder)
    out = _jitted_forward(graphdef, state, jnp.asarray(feats), *map(jnp.asarray, batch.arrays()))
    return np.asarray(out[: batch.num_tokens])


@functools.partial(jax.jit, static_argnums=0)
def _jitted_forward(graphdef, state, *inputs):
    # One compilation per (module structure, input shapes) instead of op-by-op dispatch.
    return nnx.merge(graphdef, state)(*inputs)
