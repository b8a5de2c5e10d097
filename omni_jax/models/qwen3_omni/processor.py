"""Prompt processing for Qwen3-Omni checkpoints: the rules of transformers' `Qwen3OmniMoeProcessor`.

Everything not listed here is shared with Qwen2.5-Omni (inputs/processor.py): prompt forms,
media loading, the WhisperFeatureExtractor / Qwen2VLImageProcessorPil parts, frame grouping
of videos, placeholder checks. What Qwen3-Omni does differently:

* placeholders: `<|vision_start|><|image_pad|><|vision_end|>`, `<|audio_start|><|audio_pad|>
  <|audio_end|>`, `<|vision_start|><|video_pad|><|vision_end|>` (real ids 151655 / 151675 / 151656);
* vision defaults (the released preprocessor_config.json, used when the checkpoint has none):
  16-pixel patches (32-pixel resize factor), mean = std = 0.5; videos 128..768 x 32 x 32
  pixels per frame (the processor's class defaults), sampled at 2 fps, 4..768 frames;
* audio tokens per clip: 13 per 100-frame chunk plus the conv length of the rest
  (`models.qwen3_omni.audio_encoder.audio_output_lengths`, n_window from the audio config);
* audio features: the processor pads the prompt's clips to the *longest clip of the prompt*
  (`padding=True`), not to 300 s, so a lone clip has floor(samples / hop) frames and its last
  frames see the signal's reflection rather than zeros. Done the same here, per prompt;
* use_audio_in_video: the video placeholder becomes `<|audio_start|> ... <|audio_end|>` (inside
  the vision start/end tokens) with video and audio tokens merged by time: a video token at
  frame group g has time g x seconds-per-group x position_id_per_seconds (13), an audio token
  its index; a video token goes first on a tie (`replace_video_with_audio_token`);
* no speech system prompt: the Qwen3-Omni talker speaks under any system message (transformers'
  processor and generate add none), so `speech_output` leaves the messages as they are.

Differences from transformers, on purpose: `video_second_per_grid` is temporal_patch_size / the
rate the frames were actually sampled at (transformers takes the `fps` kwarg and assumes 1.0 when
it is not passed, which qwen-omni-utils always passes); frames are resized with the PIL image
processor, as for Qwen2.5 (transformers' video processor needs torchvision).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ...inputs.chat_template import qwen_chat_template
from ...inputs.processor import InputProcessor
from ...errors import PromptError
from ...inputs.rope_index import RopeIndexConfig
from .audio_encoder import audio_output_lengths

__all__ = [
    "QWEN3_OMNI_CHAT_TEMPLATE",
    "QWEN3_OMNI_PREPROCESSOR_CONFIG",
    "QWEN3_OMNI_TOKENS",
    "QWEN3_OMNI_VIDEO_CONFIG",
    "Qwen3InputProcessor",
]

# Qwen/Qwen3-Omni-30B-A3B-Instruct preprocessor_config.json (audio + image settings).
QWEN3_OMNI_PREPROCESSOR_CONFIG = {
    "feature_size": 128, "sampling_rate": 16000, "hop_length": 160, "n_fft": 400,
    "chunk_length": 300, "padding_value": 0.0, "dither": 0.0,
    "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
}
# No video_preprocessor_config.json is released: Qwen3OmniMoeProcessor's video pixel range and
# Qwen's sampling (2 fps, Qwen2-VL's frame limits and total token budget).
QWEN3_OMNI_VIDEO_CONFIG = {
    "min_pixels": 128 * 32 * 32, "max_pixels": 768 * 32 * 32, "fps": 2.0, "min_frames": 4, "max_frames": 768,
    "max_video_tokens": 128000,
}
# Real Qwen3-Omni placeholder ids and timing (QWEN_NOTES.md; thinker ThinkerConfig's defaults).
QWEN3_OMNI_TOKENS = RopeIndexConfig(
    image_token_id=151655, video_token_id=151656, audio_token_id=151675,
    vision_start_token_id=151652, vision_end_token_id=151653,
    audio_start_token_id=151669, audio_end_token_id=151670,
    spatial_merge_size=2, position_id_per_seconds=13, seconds_per_chunk=2,
)

# Used only when neither the checkpoint nor its tokenizer brings a template. Like the released
# one for the parts that matter here: no default system turn, string or multi-part content, one
# placeholder triple per media part, optional "Picture n: " / "Audio n: " / "Video n: " labels,
# Qwen's function-calling turns (inputs/chat_template.py).
QWEN3_OMNI_CHAT_TEMPLATE = qwen_chat_template(
    image="<|vision_start|><|image_pad|><|vision_end|>", audio="<|audio_start|><|audio_pad|><|audio_end|>",
    video="<|vision_start|><|video_pad|><|vision_end|>")

# HF thinker_config keys of each RopeIndexConfig field (first present wins).
_TOKEN_KEYS = {
    "image_token_id": ("image_token_id", "image_token_index"),
    "video_token_id": ("video_token_id", "video_token_index"),
    "audio_token_id": ("audio_token_id", "audio_token_index"),
    "vision_start_token_id": ("vision_start_token_id",),
    "vision_end_token_id": ("vision_end_token_id",),
    "audio_start_token_id": ("audio_start_token_id",),
    "audio_end_token_id": ("audio_end_token_id",),
    "position_id_per_seconds": ("position_id_per_seconds",),
    "seconds_per_chunk": ("seconds_per_chunk",),
}


def qwen3_token_config(hf: dict) -> RopeIndexConfig:
    """Placeholder ids and timing from a Qwen3-Omni HF config dict (whole or thinker_config);
    keys it lacks keep the real model's values (the HF config class defaults are Qwen2.5's)."""
    thinker = dict(hf.get("thinker_config", hf))
    found = {}
    for name, keys in _TOKEN_KEYS.items():
        value = next((thinker[k] for k in keys if thinker.get(k) is not None), None)
        if value is not None:
            found[name] = value if name in ("position_id_per_seconds", "seconds_per_chunk") else int(value)
    merge = (thinker.get("vision_config") or {}).get("spatial_merge_size")
    if merge is not None:
        found["spatial_merge_size"] = int(merge)
    return dataclasses.replace(QWEN3_OMNI_TOKENS, **found)


class Qwen3InputProcessor(InputProcessor):
    """`InputProcessor` with Qwen3-Omni's rules (module docstring); arguments as `InputProcessor`
    (its `n_window` also fixes the audio tokens per clip)."""

    DEFAULT_PREPROCESSOR_CONFIG = QWEN3_OMNI_PREPROCESSOR_CONFIG
    DEFAULT_VIDEO_CONFIG = QWEN3_OMNI_VIDEO_CONFIG
    DEFAULT_CHAT_TEMPLATE = QWEN3_OMNI_CHAT_TEMPLATE
    SPEECH_SYSTEM_PROMPT = None
    PLACEHOLDER_TOKENS = {"image": "<|image_pad|>", "audio": "<|audio_pad|>", "video": "<|video_pad|>"}
    PLACEHOLDER_TRIPLES = {"image": "<|vision_start|><|image_pad|><|vision_end|>",
                           "audio": "<|audio_start|><|audio_pad|><|audio_end|>",
                           "video": "<|vision_start|><|video_pad|><|vision_end|>"}
    DEFAULT_N_WINDOW = 50

    @classmethod
    def default_token_config(cls) -> RopeIndexConfig:
        return QWEN3_OMNI_TOKENS

    @classmethod
    def _options_from_hf(cls, hf: dict) -> dict:
        if not hf:
            return {}
        return {"token_config": qwen3_token_config(hf)}

    def _audio_pad_length(self, waves: list[np.ndarray]) -> int:
        # Qwen3OmniMoeProcessor extracts features with padding=True: to the prompt's longest clip.
        return max((int(w.shape[0]) for w in waves), default=0)

    def _num_audio_tokens(self, frames: int) -> int:
        return int(audio_output_lengths(np.array([frames]), self.n_window)[0])

    def _audio_tokens(self, feats: np.ndarray, wave: np.ndarray, what: str) -> int:
        if feats.shape[1] < 1:
            raise PromptError(f"{what} is too short: {wave.shape[0] / self.sampling_rate * 1000:.1f} ms "
                              f"gives no audio token")
        return super()._audio_tokens(feats, wave, what)

    def audio_features(self, wave: np.ndarray, pad_to: int | None = None) -> np.ndarray:
        """Log-mel features [feature_size, frames] of one waveform, zero-padded to `pad_to` samples
        (default: none, as a prompt holding this clip alone)."""
        n = int(wave.shape[0])
        pad_to = n if pad_to is None else max(int(pad_to), n)
        # The STFT's reflect padding needs more than n_fft / 2 samples.
        if pad_to <= int(self.preprocessor_config["n_fft"]) // 2:
            raise PromptError(f"audio is too short: {n / self.sampling_rate * 1000:.1f} ms gives no audio token")
        return super().audio_features(wave, pad_to)

    def _video_with_audio(self, grid: np.ndarray, spg: float, n_audio: int) -> np.ndarray:
        """<|audio_start|> video and audio tokens merged by time <|audio_end|>.

        Qwen3OmniMoeProcessor.replace_video_with_audio_token: a stable merge of two sorted
        time lines (video token: frame group x seconds per group x position ids per second,
        in float64 as the processor; audio token: its index), the video token first on ties.
        """
        c = self.tokens
        gt, gh, gw = (int(x) for x in grid)
        per_frame = (gh // self.merge_size) * (gw // self.merge_size)
        v_time = np.repeat(np.arange(gt, dtype=np.float64), per_frame) * spg * c.position_id_per_seconds
        a_time = np.arange(n_audio, dtype=np.float64)
        order = np.argsort(np.concatenate([v_time, a_time]), kind="stable")
        body = np.concatenate([np.full(len(v_time), c.video_token_id), np.full(n_audio, c.audio_token_id)])[order]
        return np.concatenate([[c.audio_start_token_id], body, [c.audio_end_token_id]]).astype(np.int32)
