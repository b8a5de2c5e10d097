"""The Qwen2.5-Omni thinker's media encoders (`models/thinker_media.py` runs them): audio
chunks through its audio tower, patches through its vision tower, M-RoPE positions from
`get_rope_index`."""

from __future__ import annotations

import numpy as np

from ...engine.protocol import MultiModalPayload
from ...inputs.rope_index import RopeIndexConfig
from ..layers.audio_chunks import num_chunks_for
from ..thinker_media import MediaBuckets, ThinkerMediaEncoder
from .audio_encoder import audio_output_lengths, prepare_audio_batch
from .rope_index import get_rope_index
from .thinker import ThinkerConfig
from .vision_encoder import vision_metadata


class Qwen2_5ThinkerMediaEncoder(ThinkerMediaEncoder):
    """Jitted, bucketed audio and vision encoders of a Qwen2.5-Omni thinker."""

    def __init__(self, thinker, cfg: ThinkerConfig, rope_cfg: RopeIndexConfig,
                 buckets: MediaBuckets = MediaBuckets()):
        super().__init__(thinker, cfg, rope_cfg, buckets)

    def _num_chunks(self, lens: np.ndarray) -> int:
        return num_chunks_for(lens, self.cfg.audio.n_window)

    def _audio_tokens(self, lens: np.ndarray) -> np.ndarray:
        return audio_output_lengths(lens)[1]

    def _encode_audio_call(self, features: list[np.ndarray], request_lens: np.ndarray) -> np.ndarray:
        lens, chunks, feats = self._audio_input(features)
        s = self.cfg.audio.chunk_tokens
        batch = prepare_audio_batch(lens, self.cfg.audio.n_window, num_chunks=chunks, num_tokens=chunks * (s // 2 + 1))
        out = self.jitted.audio(self.audio_params, feats, *batch.arrays())
        return np.asarray(out)[:batch.num_tokens]

    def _encode_vision_call(self, pixel_values: np.ndarray, grid_thw: np.ndarray) -> tuple[np.ndarray, None]:
        patches, padded = self._vision_input(pixel_values)
        meta = vision_metadata(grid_thw, self.cfg.vision, patches)
        out = self.jitted.vision(self.vision_params, padded, meta)
        return np.asarray(out)[:len(pixel_values) // self.cfg.vision.merge_unit], None

    def _encode(self, kind: str, mm: MultiModalPayload, request_lens: np.ndarray):
        if kind == "audio":  # each audio's rows are its own (the encoder attends within its chunks)
            return self.encode_audio(mm.audio_features), None
        pix, grid = (mm.pixel_values, mm.image_grid_thw) if kind == "image" else \
            (mm.pixel_values_videos, mm.video_grid_thw)
        return self.encode_vision(pix, grid, kind)

    def _rope_index(self, ids: np.ndarray, mm: MultiModalPayload, audio_lens) -> tuple[np.ndarray, int]:
        return get_rope_index(ids, self.rope_cfg, image_grid_thw=mm.image_grid_thw, video_grid_thw=mm.video_grid_thw,
                              audio_seqlens=audio_lens, second_per_grids=mm.video_second_per_grid,
                              use_audio_in_video=mm.use_audio_in_video)
