"""Qwen3-Omni thinker media: run the encoders once per request and plan the merge.

`Qwen3ThinkerMediaEncoder.prepare(token_ids, mm)` turns a request's multimodal data
(the same `MultiModalData` as Qwen2.5-Omni) into the runner's `RequestInputs`:

* encoder features (audio, image, video, each in prompt order) become overlay rows
  placed at their placeholder tokens (`overlay_index`);
* the vision encoder's DeepStack features become `deepstack_rows [K, N, H]`, aligned
  with the overlay rows (zero for audio rows), which the runner adds after decoder
  layers 0..K-1 at the visual tokens during prefill: transformers' joint
  `visual_pos_masks` / `deepstack_visual_embeds` over images and videos;
* the 3-row M-RoPE positions come from `rope_index_qwen3.get_rope_index_qwen3`.

Both encoders are jitted over their own shape buckets, padded on the host:

* audio: C conv chunks of 2*n_window frames (the bucket), the attention windows padded
  to G = C (the most any split of C chunks into audios can need) and the output rows to
  C * 13. With one long audio only ceil(C / R) windows are real (R = n_window_infer /
  chunk frames, 8 for the real model), so the encoder layers do up to R times the
  needed work on padding windows; a second (chunks, windows) bucket axis would remove
  it at the price of more compiled shapes.
* vision: patches (the bucket); attention is the dense per-frame segment mask.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from flax import nnx

from ...engine.buckets import pick_bucket
from ...engine.runner import RequestInputs
from ...inputs.rope_index_qwen3 import get_rope_index_qwen3
from ..qwen2_5_omni.media import MediaBuckets, MultiModalData
from ..qwen2_5_omni.thinker import media_index
from .audio_encoder import num_chunks_for, prepare_audio_batch
from .thinker import ThinkerConfig
from .vision_encoder import vision_metadata

__all__ = ["MediaBuckets", "MultiModalData", "Qwen3ThinkerMediaEncoder"]


class Qwen3ThinkerMediaEncoder:
    """Jitted, bucketed audio and vision encoders of a Qwen3-Omni thinker."""

    def __init__(self, thinker, cfg: ThinkerConfig, buckets: MediaBuckets = MediaBuckets()):
        self.cfg, self.buckets = cfg, buckets
        self.rope_cfg = cfg.rope_index
        self._audio = nnx.split(thinker.audio_tower)
        self._vision = nnx.split(thinker.visual)
        self._audio_fn = jax.jit(lambda g, s, *a: nnx.merge(g, s)(*a), static_argnums=0)
        self._vision_fn = jax.jit(lambda g, s, *a: nnx.merge(g, s)(*a), static_argnums=0)
        self.dtype = jax.tree_util.tree_leaves(self._audio[1])[0].dtype

    # ------------------------------------------------------------------ encoders
    def encode_audio(self, features: Sequence[np.ndarray]) -> np.ndarray:
        """Audio embeddings [tokens, hidden] of all audios of one request, in order."""
        acfg = self.cfg.audio
        for i, f in enumerate(features):
            f = np.asarray(f)
            if f.ndim != 2 or f.shape[0] != acfg.num_mel_bins or f.shape[1] < 1:
                raise ValueError(f"audio {i}: expected log-mel features [{acfg.num_mel_bins}, frames], "
                                 f"got shape {f.shape}")
        lens = np.array([np.asarray(f).shape[1] for f in features], np.int64)
        need = num_chunks_for(lens, acfg.n_window)
        try:
            chunks = pick_bucket(need, self.buckets.audio_chunks)
        except ValueError:
            raise ValueError(f"audio too long: {int(lens.sum())} mel frames need {need} encoder chunks, "
                             f"more than the largest bucket {self.buckets.audio_chunks[-1]}") from None
        # One extent group: transformers encodes all audios of a request in one call.
        batch = prepare_audio_batch(lens, acfg.n_window, acfg.n_window_infer, num_chunks=chunks,
                                    num_windows=chunks, num_tokens=chunks * acfg.chunk_tokens)
        feats = np.zeros((acfg.num_mel_bins, chunks * acfg.chunk_frames), np.float32)
        feats[:, :lens.sum()] = np.concatenate([np.asarray(f, np.float32) for f in features], axis=1)
        out = self._audio_fn(self._audio[0], self._audio[1], feats.astype(self.dtype), *batch.arrays())
        return np.asarray(out)[:batch.num_tokens]

    def encode_vision(self, pixel_values: np.ndarray, grid_thw: np.ndarray, what: str
                      ) -> tuple[np.ndarray, np.ndarray]:
        """(features [M, hidden], DeepStack features [K, M, hidden]) of all items of `grid_thw`."""
        vcfg = self.cfg.vision
        pixel_values = np.asarray(pixel_values)
        grid_thw = np.asarray(grid_thw, np.int64).reshape(-1, 3)
        n = int(np.prod(grid_thw, axis=1).sum())
        if pixel_values.ndim != 2 or pixel_values.shape != (n, vcfg.patch_dim):
            raise ValueError(f"{what}: pixel values of shape {pixel_values.shape} do not match grids "
                             f"{grid_thw.tolist()} (expected ({n}, {vcfg.patch_dim}))")
        try:
            patches = pick_bucket(n, self.buckets.vision_patches)
        except ValueError:
            raise ValueError(f"{what} too large: {n} patches, more than the largest bucket "
                             f"{self.buckets.vision_patches[-1]}") from None
        meta = vision_metadata(grid_thw, vcfg, patches)
        padded = np.zeros((patches, vcfg.patch_dim), self.dtype)
        padded[:n] = pixel_values
        feats, deepstack = self._vision_fn(self._vision[0], self._vision[1], padded, meta)
        m = n // vcfg.merge_unit
        return np.asarray(feats)[:m], np.asarray(deepstack)[:, :m]

    # ------------------------------------------------------------------ requests
    def prepare(self, token_ids: np.ndarray, mm: MultiModalData) -> tuple[RequestInputs, list]:
        """RequestInputs (overlay + DeepStack rows, M-RoPE positions) and prefix-cache media ranges."""
        cfg = self.cfg
        ids = np.asarray(token_ids)
        k, h = cfg.num_deepstack_layers, cfg.text.hidden_size
        parts, deep, order = [], [], []
        for kind, tok in (("audio", cfg.audio_token_id), ("image", cfg.image_token_id),
                          ("video", cfg.video_token_id)):
            if kind == "audio":
                feats = self.encode_audio(mm.audio_features) if mm.audio_features else None
                ds = None if feats is None else np.zeros((k, len(feats), h), np.float32)
            elif kind == "image":
                feats, ds = (None, None) if mm.pixel_values is None else \
                    self.encode_vision(mm.pixel_values, mm.image_grid_thw, "image")
            else:
                feats, ds = (None, None) if mm.pixel_values_videos is None else \
                    self.encode_vision(mm.pixel_values_videos, mm.video_grid_thw, "video")
            placeholders = int((ids == tok).sum())
            have = 0 if feats is None else len(feats)
            if placeholders != have:
                raise ValueError(f"the prompt has {placeholders} {kind} placeholder tokens but the {kind} "
                                 f"inputs give {have} features")
            if feats is not None:
                parts.append(feats)
                deep.append(ds)
                order.append(kind)
        if not parts:
            return RequestInputs(), []
        audio_lens = np.array([np.asarray(f).shape[1] for f in mm.audio_features], np.int64) \
            if mm.audio_features else None
        positions, delta = get_rope_index_qwen3(
            ids, self.rope_cfg, image_grid_thw=mm.image_grid_thw, video_grid_thw=mm.video_grid_thw,
            audio_seqlens=audio_lens, second_per_grids=mm.video_second_per_grid,
            use_audio_in_video=mm.use_audio_in_video, n_window=cfg.audio.n_window)
        index = media_index(ids, cfg, order)
        where = np.flatnonzero(index >= 0)
        ranges = [(int(where[0]), int(where[-1] - where[0] + 1), mm.content_hash())]
        visual = k > 0 and any(kind != "audio" for kind in order)
        deepstack_rows = np.concatenate(deep, axis=1).astype(np.float32) if visual else None
        return RequestInputs(mrope_positions=positions, mrope_delta=int(delta),
                             overlay_rows=np.concatenate(parts).astype(np.float32), overlay_index=index,
                             deepstack_rows=deepstack_rows), ranges

    def warmup(self) -> None:
        """Compile every encoder bucket."""
        acfg, vcfg = self.cfg.audio, self.cfg.vision
        for c in self.buckets.audio_chunks:
            self.encode_audio([np.zeros((acfg.num_mel_bins, c * acfg.chunk_frames), np.float32)])
        m = vcfg.spatial_merge_size
        for p in self.buckets.vision_patches:
            side = max(m, int(np.sqrt(p // (m * m))) * m)
            grid = np.array([[1, side, p // side]]) if p % side == 0 and (p // side) % m == 0 \
                else np.array([[1, m, p // m]])
            self.encode_vision(np.zeros((int(np.prod(grid)), vcfg.patch_dim), np.float32), grid, "image")
