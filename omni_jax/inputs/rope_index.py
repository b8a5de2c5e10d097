"""3-D M-RoPE position ids, computed on the host with numpy: what both Qwen-Omni families share.

Every prompt token gets three position ids (temporal, height, width). Text and audio
tokens get three equal, consecutive ids. Image and video placeholders get
`start + (t, h, w)` over their merged patch grid, where t advances by
`position_id_per_seconds` per second of media (`walk_positions`). A family lays out a video
that carries its audio its own way (`models/<family>/rope_index.py`: Qwen2.5-Omni interleaves
the two streams in `seconds_per_chunk` chunks, TMRoPE; Qwen3-Omni merges them by time). After
the prompt, decode positions are all three rows equal to `token index + mrope_delta`
(`decode_positions`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

__all__ = ["RopeIndexConfig", "chunk_ids", "decode_positions", "walk_positions"]


@dataclasses.dataclass(frozen=True)
class RopeIndexConfig:
    """Placeholder token ids and timing constants of the position walk (defaults: Qwen2.5-Omni-7B)."""

    image_token_id: int = 151655
    video_token_id: int = 151656
    audio_token_id: int = 151646
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    audio_start_token_id: int = 151647
    audio_end_token_id: int = 151648
    spatial_merge_size: int = 2
    position_id_per_seconds: float = 25
    seconds_per_chunk: float = 2

    @classmethod
    def from_hf(cls, thinker_config: Mapping[str, Any] | Any) -> "RopeIndexConfig":
        """Build from an HF thinker config (dict, a full Qwen2.5-Omni config dict, or a PretrainedConfig)."""
        cfg = thinker_config.to_dict() if hasattr(thinker_config, "to_dict") else dict(thinker_config)
        if "thinker_config" in cfg:  # a whole Qwen2_5OmniConfig dict
            cfg = dict(cfg["thinker_config"])
        vision = cfg.get("vision_config") or {}
        if hasattr(vision, "to_dict"):
            vision = vision.to_dict()
        d = cls()

        def pick(*keys, default):
            # HF stores the placeholder ids as `*_token_index` with `*_token_id` aliases.
            for k in keys:
                if cfg.get(k) is not None:
                    return cfg[k]
            return default

        return cls(
            image_token_id=int(pick("image_token_index", "image_token_id", default=d.image_token_id)),
            video_token_id=int(pick("video_token_index", "video_token_id", default=d.video_token_id)),
            audio_token_id=int(pick("audio_token_index", "audio_token_id", default=d.audio_token_id)),
            vision_start_token_id=int(pick("vision_start_token_id", default=d.vision_start_token_id)),
            vision_end_token_id=int(pick("vision_end_token_id", default=d.vision_end_token_id)),
            audio_start_token_id=int(pick("audio_start_token_id", default=d.audio_start_token_id)),
            audio_end_token_id=int(pick("audio_end_token_id", default=d.audio_end_token_id)),
            spatial_merge_size=int(vision.get("spatial_merge_size", d.spatial_merge_size)),
            position_id_per_seconds=pick("position_id_per_seconds", default=d.position_id_per_seconds),
            seconds_per_chunk=pick("seconds_per_chunk", default=d.seconds_per_chunk),
        )


def _temporal_ids(grid_t: int, seconds_per_grid: float, per_second: float) -> np.ndarray:
    """Temporal position offsets of `grid_t` frames, `seconds_per_grid` apart.

    Computed in float32 and truncated, as transformers does, so that non-integral
    products (e.g. 0.7 s * 25) land on the same integer.
    """
    t = np.arange(grid_t, dtype=np.float32) * np.float32(seconds_per_grid) * np.float32(per_second)
    return t.astype(np.int64)


def _vision_positions(grid_thw, merge: int, t_ids: np.ndarray, start: int) -> np.ndarray:
    """[3, t*h*w/merge^2] positions of one image/video, frame-major then row-major."""
    _, h, w = (int(x) for x in grid_thw)
    gh, gw = h // merge, w // merge
    per_frame = gh * gw
    t_row = np.repeat(t_ids, per_frame)
    h_row = np.tile(np.repeat(np.arange(gh, dtype=np.int64), gw), len(t_ids))
    w_row = np.tile(np.arange(gw, dtype=np.int64), len(t_ids) * gh)
    return np.stack([t_row, h_row, w_row]) + start


def chunk_ids(offsets: np.ndarray, per_chunk: int) -> np.ndarray:
    """Chunk number of each token for the audio/video interleave, given its temporal offset.

    transformers scans the tokens and opens a new chunk when an offset reaches
    `(chunks so far) * per_chunk`, at most one new chunk per token. So a jump over
    several chunk boundaries opens them one token at a time rather than skipping them.
    In closed form: chunk_i = min(offset_i // per_chunk, chunk_{i-1} + 1), chunk_{-1} = 0,
    which unrolls to i + min(1, min_{j<=i}(f_j - j)).
    """
    n = offsets.shape[0]
    if n == 0:
        return np.zeros(0, np.int64)
    idx = np.arange(n, dtype=np.int64)
    f = offsets.astype(np.int64) // int(per_chunk)
    return idx + np.minimum(1, np.minimum.accumulate(f - idx))


def walk_positions(ids, config, image_grid_thw, video_grid_thw, audio_lens, audio_seqlens, second_per_grids,
                   use_audio_in_video, with_audio_block, *, distinct_marks: bool) -> tuple[np.ndarray, int]:
    """The prompt walk shared by the Qwen-Omni families: text and audio tokens get three
    equal consecutive ids, images/videos `start + (t, h, w)`, each media block between its
    start and end tokens. Families differ in how a video carrying its audio is laid out
    (`with_audio_block(video_positions, is_video_mask, n_audio, start) -> (block, last_max)`)
    and in whether the two start/end tokens of such a video share one id or take two
    (`distinct_marks`). audio_lens: tokens per audio (the family's encoder lengths).
    """
    n_tokens = ids.shape[0]
    images = np.zeros((0, 3), np.int64) if image_grid_thw is None else np.asarray(image_grid_thw).reshape(-1, 3)
    videos = np.zeros((0, 3), np.int64) if video_grid_thw is None else np.asarray(video_grid_thw).reshape(-1, 3)
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

    def video_positions(start_pos: int) -> np.ndarray:
        if n_vid >= len(videos):
            raise ValueError(f"prompt has more videos than video_grid_thw ({len(videos)})")
        t_ids = _temporal_ids(int(videos[n_vid][0]), spg[n_vid], c.position_id_per_seconds)
        return _vision_positions(videos[n_vid], merge, t_ids, start_pos)

    positions = np.empty((3, n_tokens), np.int64)
    cursor = 0    # first token not yet given a position
    next_pos = 0  # position id for the next token: last block's max + 1
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
        n_marks = n_bos if distinct_marks else 1  # ids taken by the start (and the end) tokens
        text_end = start - n_bos
        if text_end < cursor:
            raise ValueError(f"{kind} placeholder at token {start} is not preceded by its start token")
        positions[:, cursor:text_end] = np.arange(next_pos, next_pos + text_end - cursor)
        next_pos += text_end - cursor
        positions[:, text_end:start] = next_pos + (np.arange(n_bos) if distinct_marks else 0)
        next_pos += n_marks

        if with_audio:
            video = video_positions(next_pos)
            n_v, n_a = video.shape[1], audio_len(n_aud, start)
            check(start, n_v + n_a, [c.video_token_id, c.audio_token_id], "video with audio")
            is_video = ids[start:start + n_v + n_a] == c.video_token_id
            if is_video.sum() != n_v:
                raise ValueError(f"video at token {start} expects {n_v} video and {n_a} audio tokens, "
                                 f"got {int(is_video.sum())} and {int((~is_video).sum())}")
            block, last_max = with_audio_block(video, is_video, n_a, next_pos)
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
            block = video_positions(next_pos)
            check(start, block.shape[1], [c.video_token_id], "video")
            last_max = int(block.max())
            n_vid += 1

        n = block.shape[1]
        positions[:, start:start + n] = block
        end = start + n + n_bos
        if end > n_tokens:
            raise ValueError(f"{kind} at token {start} has no end token")
        positions[:, start + n:end] = last_max + 1 + (np.arange(n_bos) if distinct_marks else 0)
        next_pos = last_max + 1 + n_marks
        cursor = end

    positions[:, cursor:] = np.arange(next_pos, next_pos + n_tokens - cursor)
    if (n_img, n_vid) != (len(images), len(videos)) or (audio_lens is not None and n_aud != len(audio_lens)):
        raise ValueError(
            f"prompt has {n_img} images, {n_vid} videos, {n_aud} audios; inputs give "
            f"{len(images)}, {len(videos)}, {'?' if audio_lens is None else len(audio_lens)}"
        )
    delta = int(positions.max()) + 1 - n_tokens if n_tokens else 0
    return positions.astype(np.int32), delta


def decode_positions(num_computed_tokens, deltas) -> np.ndarray:
    """M-RoPE positions [3, B] of the next token of each sequence: its index plus the prompt's delta.

    num_computed_tokens [B]: tokens already in the KV cache (= index of the token being fed);
    deltas [B]: each sequence's mrope_delta from `get_rope_index` (0 for text-only prompts).
    """
    pos = np.asarray(num_computed_tokens, np.int64) + np.asarray(deltas, np.int64)
    return np.repeat(pos.reshape(1, -1), 3, axis=0).astype(np.int32)
