"""Qwen3-Omni thinker media: run the encoders once per request and plan the merge.

`Qwen3ThinkerMediaEncoder.prepare(token_ids, mm)` turns a request's multimodal data
(the same `MultiModalPayload` as Qwen2.5-Omni) into the runner's `StageInputs`:

* encoder features (audio, image, video, each in prompt order) become overlay rows
  placed at their placeholder tokens (`overlay_index`);
* the vision encoder's DeepStack features become `deepstack_rows [K, N, H]`, aligned
  with the overlay rows (zero for audio rows), which the runner adds after decoder
  layers 0..K-1 at the visual tokens during prefill: transformers' joint
  `visual_pos_masks` / `deepstack_visual_embeds` over images and videos;
* the 3-row M-RoPE positions come from `rope_index.get_rope_index_qwen3`.

Both encoders are jitted over their own shape buckets, padded on the host:

* audio: C conv chunks of 2*n_window frames (the bucket), the attention windows padded
  to G = C (the most any split of C chunks into audios can need) and the output rows to
  C * 13. With one long audio only ceil(C / R) windows are real (R = n_window_infer /
  chunk frames, 8 for the real model), so the encoder layers do up to R times the
  needed work on padding windows; a second (chunks, windows) bucket axis would remove
  it at the price of more compiled shapes. Audio of more chunks than the largest bucket
  takes several calls, cut at whole windows (`ThinkerMediaEncoder._audio_calls`).
* vision: patches (the bucket); attention is the dense per-frame segment mask. Images and video
  of more patches than the largest bucket take several calls, cut between frames
  (`ThinkerMediaEncoder._vision_calls`).
"""

from __future__ import annotations

import numpy as np

from ...engine.protocol import MultiModalPayload
from ..layers.audio_chunks import num_chunks_for
from ..thinker_media import MediaBuckets, ThinkerMediaEncoder
from .audio_encoder import audio_output_lengths, prepare_audio_batch
from .thinker import ThinkerConfig
from .rope_index import get_rope_index_qwen3
from .vision_encoder import vision_metadata

__all__ = ["MediaBuckets", "Qwen3ThinkerMediaEncoder"]


class Qwen3ThinkerMediaEncoder(ThinkerMediaEncoder):
    """Jitted, bucketed audio and vision encoders of a Qwen3-Omni thinker."""

    def __init__(self, thinker, cfg: ThinkerConfig, buckets: MediaBuckets = MediaBuckets()):
        super().__init__(thinker, cfg, cfg.rope_index, buckets)

    def _num_chunks(self, lens: np.ndarray) -> int:
        return num_chunks_for(lens, self.cfg.audio.n_window)

    def _audio_window_chunks(self) -> int:
        return self.cfg.audio.window_chunks

    def _audio_tokens(self, lens: np.ndarray) -> np.ndarray:
        return audio_output_lengths(lens, self.cfg.audio.n_window)

    def _chunk_extent(self, request_lens: np.ndarray) -> int:
        """The frames every chunk is padded to: transformers encodes all audios of a request in
        one call, padding each chunk to the longest of them."""
        return min(int(request_lens.max()), self.cfg.audio.chunk_frames)

    def _audio_tail(self, lens: np.ndarray) -> bytes:
        return b"extent %d" % self._chunk_extent(lens)

    def _encode_audio_call(self, features: list[np.ndarray], request_lens: np.ndarray) -> np.ndarray:
        acfg = self.cfg.audio
        lens, chunks, feats = self._audio_input(features)
        # a call over some of the request's audios (or pieces) pads as one call over all of them
        batch = prepare_audio_batch(lens, acfg.n_window, acfg.n_window_infer, num_chunks=chunks,
                                    num_windows=chunks, num_tokens=chunks * acfg.chunk_tokens,
                                    extent=self._chunk_extent(request_lens))
        out = self.jitted.audio(self.audio_params, feats, *batch.arrays())
        return np.asarray(out)[:batch.num_tokens]

    def _encode_vision_call(self, pixel_values: np.ndarray, grid_thw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(features [M, hidden], DeepStack features [K, M, hidden])."""
        patches, padded = self._vision_input(pixel_values)
        meta = vision_metadata(grid_thw, self.cfg.vision, patches)
        feats, deepstack = self.jitted.vision(self.vision_params, padded, meta)
        m = len(pixel_values) // self.cfg.vision.merge_unit
        return np.asarray(feats)[:m], np.asarray(deepstack)[:, :m]

    def _encode(self, kind: str, mm: MultiModalPayload, request_lens: np.ndarray):
        k, h = self.cfg.num_deepstack_layers, self.cfg.text.hidden_size
        if kind == "audio":
            feats = self.encode_audio(mm.audio_features, request_lens)
            return feats, np.zeros((k, len(feats), h), np.float32)  # audio rows get no DeepStack
        pix, grid = (mm.pixel_values, mm.image_grid_thw) if kind == "image" else \
            (mm.pixel_values_videos, mm.video_grid_thw)
        return self.encode_vision(pix, grid, kind)

    def _rope_index(self, ids: np.ndarray, mm: MultiModalPayload, audio_lens) -> tuple[np.ndarray, int]:
        return get_rope_index_qwen3(
            ids, self.rope_cfg, image_grid_thw=mm.image_grid_thw, video_grid_thw=mm.video_grid_thw,
            audio_seqlens=audio_lens, second_per_grids=mm.video_second_per_grid,
            use_audio_in_video=mm.use_audio_in_video, n_window=self.cfg.audio.n_window)

    def _extra_inputs(self, media: list) -> dict:
        # DeepStack rows follow the overlay rows (zero for audio), only when something is visual.
        visual = self.cfg.num_deepstack_layers > 0 and any(kind != "audio" for kind, _, _ in media)
        return dict(deepstack_rows=np.concatenate([d for _, _, d in media], axis=1).astype(np.float32)) \
            if visual else {}
