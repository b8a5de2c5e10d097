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

from ..models.qwen3_omni.audio_encoder import audio_output_lengths
from .rope_index import RopeIndexConfig, _temporal_ids, _vision_positions, decode_positions

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
    n_tokens = ids.shape[0]
    images = np.zeros((0, 3), np.int64) if image_grid_thw is None else np.asarray(image_grid_thw).reshape(-1, 3)
    videos = np.zeros((0, 3), np.int64) if video_grid_thw is None else np.asarray(video_grid_thw).reshape(-1, 3)
    audio_lens = None if audio_seqlens is None else audio_output_lengths(
        np.asarray(audio_seqlens).reshape(-1), n_window)
    spg = np.ones(len(videos)) if second_per_grids is None else np.asarray(second_per_grids, np.float64).reshape(-1)
    if len(spg) != len(videos):
        raise ValueError(f"second_per_grids has {len(spg)} entries for {len(videos)} videos")

    c = config
    merge = c.spatial_merge_size
    media = np.flatnonzero(np.isin(ids, [c.image_token_id, c.video_token_id, c.audio_token_id]))

    def audio_len(idx: int, start: int) -> int:
        if audio_lens is None:
            raise ValueError(f"prompt has an audio placeholder at {start} but no audio_seqlens")
        if idx >= len(audio_lens):
            raise ValueError(f"prompt has more audios than audio_seqlens ({len(audio_lens)})")
        n = int(audio_lens[idx])
        if n <= 0:
            raise ValueError(f"audio {idx} is too short to give any token ({audio_seqlens[idx]} mel frames)")
        return n

    def check(start: int, n: int, allowed, what: str) -> None:
        span = ids[start:start + n]
        if len(span) != n or not np.isin(span, allowed).all():
            raise ValueError(f"{what} at token {start} expects {n} placeholder tokens")

    positions = np.empty((3, n_tokens), np.int64)
    cursor = 0    # first token not yet given a position
    next_pos = 0  # position id of the next token
    n_img = n_vid = n_aud = 0
    while True:
        k = np.searchsorted(media, cursor)
        if k >= len(media):
            break
        start = int(media[k])
        tok = ids[start]
        kind = "image" if tok == c.image_token_id else "video" if tok == c.video_token_id else "audio"
        with_audio = (use_audio_in_video and kind != "image" and start >= 2
                      and ids[start - 1] == c.audio_start_token_id and ids[start - 2] == c.vision_start_token_id)
        n_bos = 2 if with_audio else 1
        text_end = start - n_bos
        if text_end < cursor:
            raise ValueError(f"{kind} placeholder at token {start} is not preceded by its start token")
        # Text, then the start token(s): consecutive ids (two distinct ones for video + audio).
        positions[:, cursor:start] = np.arange(next_pos, next_pos + start - cursor)
        next_pos += start - cursor

        if with_audio:
            if n_vid >= len(videos):
                raise ValueError(f"prompt has more videos than video_grid_thw ({len(videos)})")
            t_ids = _temporal_ids(int(videos[n_vid][0]), spg[n_vid], c.position_id_per_seconds)
            video = _vision_positions(videos[n_vid], merge, t_ids, next_pos)
            n_v, n_a = video.shape[1], audio_len(n_aud, start)
            check(start, n_v + n_a, [c.video_token_id, c.audio_token_id], "video with audio")
            span = ids[start:start + n_v + n_a]
            is_video = span == c.video_token_id
            if is_video.sum() != n_v:
                raise ValueError(f"video at token {start} expects {n_v} video and {n_a} audio tokens, "
                                 f"got {int(is_video.sum())} and {int((~is_video).sum())}")
            block = np.empty((3, n_v + n_a), np.int64)
            block[:, is_video] = video
            block[:, ~is_video] = np.arange(next_pos, next_pos + n_a)
            # The end tokens follow the last run of one kind (transformers' merge tail).
            change = np.flatnonzero(is_video[1:] != is_video[:-1])
            tail_start = int(change[-1]) + 1 if change.size else 0
            last_max = int(block[:, tail_start:].max())
            n_vid += 1
            n_aud += 1
        elif kind == "audio":
            n = audio_len(n_aud, start)
            check(start, n, [c.audio_token_id], "audio")
            block = np.broadcast_to(np.arange(next_pos, next_pos + n), (3, n))
            last_max = next_pos + n - 1
            n_aud += 1
        elif kind == "image":
            if n_img >= len(images):
                raise ValueError(f"prompt has more images than image_grid_thw ({len(images)})")
            t_ids = _temporal_ids(int(images[n_img][0]), 1.0, c.position_id_per_seconds)
            block = _vision_positions(images[n_img], merge, t_ids, next_pos)
            check(start, block.shape[1], [c.image_token_id], "image")
            last_max = int(block.max())
            n_img += 1
        else:
            if n_vid >= len(videos):
                raise ValueError(f"prompt has more videos than video_grid_thw ({len(videos)})")
            t_ids = _temporal_ids(int(videos[n_vid][0]), spg[n_vid], c.position_id_per_seconds)
            block = _vision_positions(videos[n_vid], merge, t_ids, next_pos)
            check(start, block.shape[1], [c.video_token_id], "video")
            last_max = int(block.max())
            n_vid += 1

        n = block.shape[1]
        positions[:, start:start + n] = block
        end = start + n + n_bos
        if end > n_tokens:
            raise ValueError(f"{kind} at token {start} has no end token")
        positions[:, start + n:end] = last_max + 1 + np.arange(n_bos)
        next_pos = last_max + 1 + n_bos
        cursor = end

    positions[:, cursor:] = np.arange(next_pos, next_pos + n_tokens - cursor)
    if (n_img, n_vid) != (len(images), len(videos)) or (audio_lens is not None and n_aud != len(audio_lens)):
        raise ValueError(
            f"prompt has {n_img} images, {n_vid} videos, {n_aud} audios; inputs give "
            f"{len(images)}, {len(videos)}, {'?' if audio_lens is None else len(audio_lens)}"
        )
    delta = int(positions.max()) + 1 - n_tokens if n_tokens else 0
    return positions.astype(np.int32), delta
