"""Qwen3-Omni test prompts: token ids in the processor's layout plus their media (tiny model)."""

from __future__ import annotations

import numpy as np

import hf_tiny_qwen3 as tiny
from omni_jax.models.qwen3_omni.audio_encoder import audio_output_lengths
from omni_jax.engine.protocol import MultiModalPayload


class Prompt:
    """Token ids plus the media a processor would return with them (Qwen3-Omni layout)."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.ids: list[int] = [tiny.IM_START, tiny.USER_TOKEN, 198]
        self.mm = MultiModalPayload()
        self.images: list[np.ndarray] = []
        self.videos: list[np.ndarray] = []
        self.image_grids: list[tuple] = []
        self.video_grids: list[tuple] = []
        self.patch_dim = 3 * 2 * 16 * 16

    def text(self, n: int) -> "Prompt":
        self.ids += self.rng.integers(0, 151000, n).tolist()
        return self

    def _pixels(self, grid):
        return self.rng.standard_normal((int(np.prod(grid)), self.patch_dim)).astype(np.float32)

    def _mel(self, frames):
        mel = self.rng.standard_normal((128, frames)).astype(np.float32)
        self.mm.audio_features.append(mel)
        return int(audio_output_lengths([frames])[0])

    def image(self, grid) -> "Prompt":
        self.images.append(self._pixels(grid))
        self.image_grids.append(tuple(grid))
        self.ids += [tiny.VISION_START] + [tiny.IMAGE_TOKEN] * (int(np.prod(grid)) // 4) + [tiny.VISION_END]
        return self

    def audio(self, frames) -> "Prompt":
        n = self._mel(frames)
        self.ids += [tiny.AUDIO_START] + [tiny.AUDIO_TOKEN] * n + [tiny.AUDIO_END]
        return self

    def video(self, grid, with_audio_frames: int | None = None) -> "Prompt":
        self.videos.append(self._pixels(grid))
        self.video_grids.append(tuple(grid))
        n_v = int(np.prod(grid)) // 4
        if with_audio_frames is None:
            self.ids += [tiny.VISION_START] + [tiny.VIDEO_TOKEN] * n_v + [tiny.VISION_END]
            return self
        # Qwen3OmniMoeProcessor.replace_video_with_audio_token: merge by temporal position.
        n_a = self._mel(with_audio_frames)
        t_video = np.repeat(np.arange(grid[0]) * 1.0 * 13, n_v // grid[0])
        merged, i, j = [], 0, 0
        while i < n_v and j < n_a:
            if t_video[i] <= j:
                merged.append(tiny.VIDEO_TOKEN)
                i += 1
            else:
                merged.append(tiny.AUDIO_TOKEN)
                j += 1
        merged += [tiny.VIDEO_TOKEN] * (n_v - i) + [tiny.AUDIO_TOKEN] * (n_a - j)
        self.ids += [tiny.VISION_START, tiny.AUDIO_START] + merged + [tiny.AUDIO_END, tiny.VISION_END]
        self.mm.use_audio_in_video = True
        return self

    def done(self) -> "Prompt":
        self.ids += [tiny.IM_END, 198, tiny.IM_START, tiny.ASSISTANT_TOKEN, 198]
        if self.images:
            self.mm.pixel_values = np.concatenate(self.images)
            self.mm.image_grid_thw = np.array(self.image_grids)
        if self.videos:
            self.mm.pixel_values_videos = np.concatenate(self.videos)
            self.mm.video_grid_thw = np.array(self.video_grids)
            self.mm.video_second_per_grid = np.ones(len(self.videos))
        return self

    def hf_kwargs(self) -> dict:
        """The media arguments of transformers' thinker forward / generate."""
        import torch

        kw = {}
        if self.mm.audio_features:
            frames = [f.shape[1] for f in self.mm.audio_features]
            feats = np.zeros((len(frames), 128, max(frames)), np.float32)
            mask = np.zeros((len(frames), max(frames)), np.int64)
            for i, f in enumerate(self.mm.audio_features):
                feats[i, :, :f.shape[1]] = f
                mask[i, :f.shape[1]] = 1
            kw.update(input_features=torch.tensor(feats), feature_attention_mask=torch.tensor(mask))
        if self.images:
            kw.update(pixel_values=torch.tensor(self.mm.pixel_values),
                      image_grid_thw=torch.tensor(self.mm.image_grid_thw))
        if self.videos:
            kw.update(pixel_values_videos=torch.tensor(self.mm.pixel_values_videos),
                      video_grid_thw=torch.tensor(self.mm.video_grid_thw),
                      video_second_per_grid=torch.tensor(self.mm.video_second_per_grid))
        if self.mm.use_audio_in_video:
            kw["use_audio_in_video"] = True
        return kw
