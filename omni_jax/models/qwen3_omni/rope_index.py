"""Qwen3-Omni 3-D M-RoPE position ids, computed on the host with numpy.

Same scheme as Qwen2.5-Omni (inputs/rope_index.py: text and audio tokens get three
equal consecutive ids, images/videos `start + (t, h, w)` over the merged grid), but
transformers' `Qwen3OmniMoePreTrainedModelForConditionalGeneration.get_rope_index`
differs in three places, which is why this is its own function:

* audio tokens per audio: Qwen3's encoder gives 13 tokens per 100-frame chunk plus the
  conv length of the rest (`audio_encoder.audio_output_lengths`), not Qwen2.5's /4;
* a video with its audio track (`use_audio_in_video`) is laid out
  `<vision_bos><audio_bos> ... <audio_eos><vision_eos>` and the two start tokens get two
  *consecutive* ids (Qwen2.5: one shared id), as do the two end tokens;
* inside such a block, video and audio tokens are merged by temporal position (a video
  token goes first when its t <= the audio token's t), not in 2-second chunks.

The interleaved block is read from the prompt itself: video placeholders take the video
positions in order and audio placeholders the audio positions, which is what
transformers computes for prompts its processor (or ours) laid out. The end tokens
follow the *last run* of the block (transformers' "tail" of the merge).

Deviation: transformers keeps fractional temporal ids (seconds_per_grid x
position_id_per_seconds, e.g. 0.5 s x 13 = 6.5) as float positions; OmniJax's
positions are integers, so they are truncated as Qwen2.5 does. Every frame rate whose
seconds per grid times 13 is integral (the default 2 fps: 1.0 s) matches exactly.
A video without audio under `use_audio_in_video` is treated as a plain video
(transformers would read its tokens as text).
"""

from __future__ import annotations

import numpy as np

from .audio_encoder import audio_output_lengths
from ...inputs.rope_index import RopeIndexConfig, decode_positions, walk_positions

__all__ = ["get_rope_index_qwen3", "decode_positions"]


def get_rope_index_qwen3(
    input_ids: np.ndarray,
    config: RopeIndexConfig,
    image_grid_thw=None,
    video_grid_thw=None,
    audio_seqlens=None,
    second_per_grids=None,
    use_audio_in_video: bool = False,
    n_window: int = 50,
) -> tuple[np.ndarray, int]:
    """3-D M-RoPE positions of one Qwen3-Omni prompt: (positions int32 [3, T], mrope_delta).

    Arguments as `rope_index.get_rope_index`; `n_window` is the audio encoder's
    (`audio_config.n_window`, 50 for the real model), which fixes tokens per audio.
    """
    ids = np.asarray(input_ids).reshape(-1)
    audio_lens = None if audio_seqlens is None else audio_output_lengths(
        np.asarray(audio_seqlens).reshape(-1), n_window)

    def with_audio(video, is_video, n_audio, start):
        # Video and audio merged by the prompt's own layout; the end tokens follow the
        # last run of one kind (transformers' merge tail).
        block = np.empty((3, len(is_video)), np.int64)
        block[:, is_video] = video
        block[:, ~is_video] = np.arange(start, start + n_audio)
        change = np.flatnonzero(is_video[1:] != is_video[:-1])
        tail_start = int(change[-1]) + 1 if change.size else 0
        return block, int(block[:, tail_start:].max())

    return walk_positions(ids, config, image_grid_thw, video_grid_thw, audio_lens, audio_seqlens,
                          second_per_grids, use_audio_in_video, with_audio, distinct_marks=True)
