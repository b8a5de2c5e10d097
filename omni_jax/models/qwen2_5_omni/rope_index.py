"""Qwen2.5-Omni's M-RoPE position ids of a prompt (`get_rope_index`), on the host with numpy.

With `use_audio_in_video` (TMRoPE) a video's tokens and its audio's tokens are interleaved in
`seconds_per_chunk` chunks, and both streams count time from the same start id; the rest is
the walk both families share (`inputs/rope_index.py`).

The result equals transformers' `Qwen2_5OmniPreTrainedModelForConditionalGeneration
.get_rope_index` for one unpadded sequence, including its quirks (noted where they
happen), so that logits match the reference.
"""

from __future__ import annotations

import numpy as np

from ...inputs.rope_index import RopeIndexConfig, chunk_ids, walk_positions
from .audio_encoder import audio_output_lengths

__all__ = ["get_rope_index"]


def _interleaved_positions(video: np.ndarray, n_audio: int, start: int, per_chunk: int):
    """TMRoPE positions of a video with its audio: returns ([3, Nv+Na], max id of the last chunk).

    Both streams start at `start`; tokens are ordered video chunk 0, audio chunk 0,
    video chunk 1, ... The next id after the block comes from the *last appended chunk*
    (not the block maximum), as in transformers.
    """
    audio = np.broadcast_to(np.arange(n_audio, dtype=np.int64) + start, (3, n_audio))
    v_chunk = chunk_ids(video[0] - start, per_chunk)
    a_chunk = chunk_ids(audio[0] - start, per_chunk)
    # Sort key: chunk, then video (0) before audio (1); stable keeps each stream in order.
    key = np.concatenate([v_chunk * 2, a_chunk * 2 + 1])
    order = np.argsort(key, kind="stable")
    both = np.concatenate([video, audio], axis=1)[:, order]
    nv_chunks, na_chunks = v_chunk[-1] + 1, a_chunk[-1] + 1
    if na_chunks >= nv_chunks:  # audio's final chunk is appended after video's
        last = audio[:, a_chunk == na_chunks - 1]
    else:
        last = video[:, v_chunk == nv_chunks - 1]
    return both, int(last.max())


def get_rope_index(
    input_ids: np.ndarray,
    config: RopeIndexConfig,
    image_grid_thw=None,
    video_grid_thw=None,
    audio_seqlens=None,
    second_per_grids=None,
    use_audio_in_video: bool = False,
) -> tuple[np.ndarray, int]:
    """3-D M-RoPE positions of one prompt: returns (positions int32 [3, T], mrope_delta).

    input_ids: [T] token ids of one sequence, no padding. image_grid_thw [Ni, 3] /
    video_grid_thw [Nv, 3]: patch grids (before merging), in prompt order.
    audio_seqlens [Na]: mel frames per audio (sum of feature_attention_mask), in the order
    the audios appear in the prompt, audio inside videos included. second_per_grids [Nv]:
    seconds per temporal grid step of each video (temporal_patch_size / fps; default 1.0).
    use_audio_in_video: videos laid out as <vision_bos><audio_bos> interleaved chunks
    <audio_eos><vision_eos> carry their audio (TMRoPE). A video without audio keeps the plain
    layout and is treated as one (transformers would read its tokens as text).
    mrope_delta: add it to a token's 1-D index to get its position after the prompt.
    """
    ids = np.asarray(input_ids).reshape(-1)
    audio_lens = None if audio_seqlens is None else audio_output_lengths(np.asarray(audio_seqlens).reshape(-1))[1]
    per_chunk = int(config.position_id_per_seconds * config.seconds_per_chunk)

    def with_audio(video, is_video, n_audio, start):
        # TMRoPE: video and audio interleaved in chunks of seconds_per_chunk.
        return _interleaved_positions(video, n_audio, start, per_chunk)

    return walk_positions(ids, config, image_grid_thw, video_grid_thw, audio_lens, audio_seqlens,
                          second_per_grids, use_audio_in_video, with_audio, distinct_marks=False)
