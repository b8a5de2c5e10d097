"""Prompt processing for Qwen2.5-Omni checkpoints: the rules of transformers' `Qwen2_5OmniProcessor`.

Everything not listed here is shared with Qwen3-Omni (`inputs/processor.py`): prompt forms,
media loading, the WhisperFeatureExtractor / Qwen2VLImageProcessorPil parts, frame grouping
of videos, placeholder checks. What is Qwen2.5-Omni's own:

* placeholders: `<|vision_bos|><|IMAGE|><|vision_eos|>`, `<|audio_bos|><|AUDIO|><|audio_eos|>`,
  `<|vision_bos|><|VIDEO|><|vision_eos|>`;
* defaults (used when the checkpoint has no preprocessor_config.json): the released 7B's audio
  and image settings (14-pixel patches, CLIP mean and std), the processor's video pixel range,
  Qwen2-VL's frame sampling and 2 fps;
* audio: every clip zero-padded to `chunk_length` (300) seconds before feature extraction; tokens
  per clip: conv stride 2, then average-pool 2 (`audio_encoder.audio_output_lengths`);
* use_audio_in_video: the video placeholder becomes `<|audio_bos|>` video and audio tokens in
  alternating 2-second chunks `<|audio_eos|>` (TMRoPE);
* speech output: chats without a system message get the system prompt the talker was trained
  under (`DEFAULT_SYSTEM_PROMPT`).
"""

from __future__ import annotations

import numpy as np

from ...inputs.processor import InputProcessor
from ...inputs.qwen_tokenizer import DEFAULT_SYSTEM_PROMPT, QWEN2_5_OMNI_CHAT_TEMPLATE
from ...inputs.rope_index import RopeIndexConfig, chunk_ids
from .audio_encoder import audio_output_lengths

__all__ = ["QWEN2_5_OMNI_PREPROCESSOR_CONFIG", "QWEN2_5_OMNI_VIDEO_CONFIG", "Qwen2_5InputProcessor"]

# Qwen/Qwen2.5-Omni-7B preprocessor_config.json (audio + image settings).
QWEN2_5_OMNI_PREPROCESSOR_CONFIG = {
    "feature_size": 128, "sampling_rate": 16000, "hop_length": 160, "n_fft": 400,
    "chunk_length": 300, "padding_value": 0.0, "dither": 0.0,
    "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
}
# The checkpoint has no video_preprocessor_config.json: these are Qwen2_5OmniProcessor's video
# defaults (pixel range), Qwen2-VL's frame sampling defaults and Qwen's 2 fps.
QWEN2_5_OMNI_VIDEO_CONFIG = {
    "min_pixels": 128 * 28 * 28, "max_pixels": 768 * 28 * 28, "fps": 2.0, "min_frames": 4, "max_frames": 768,
    # Per-frame pixels are also capped by an even share of this many tokens (qwen-omni-utils'
    # VIDEO_TOTAL_PIXELS, transformers' `cap_pixels_per_frame`), so long videos stay bounded.
    "max_video_tokens": 128000,
}


class Qwen2_5InputProcessor(InputProcessor):
    """`InputProcessor` with Qwen2.5-Omni's rules (module docstring); arguments as `InputProcessor`."""

    DEFAULT_PREPROCESSOR_CONFIG = QWEN2_5_OMNI_PREPROCESSOR_CONFIG
    DEFAULT_VIDEO_CONFIG = QWEN2_5_OMNI_VIDEO_CONFIG
    DEFAULT_CHAT_TEMPLATE = QWEN2_5_OMNI_CHAT_TEMPLATE
    SPEECH_SYSTEM_PROMPT = DEFAULT_SYSTEM_PROMPT
    PLACEHOLDER_TOKENS = {"image": "<|IMAGE|>", "audio": "<|AUDIO|>", "video": "<|VIDEO|>"}
    PLACEHOLDER_TRIPLES = {"image": "<|vision_bos|><|IMAGE|><|vision_eos|>",
                           "audio": "<|audio_bos|><|AUDIO|><|audio_eos|>",
                           "video": "<|vision_bos|><|VIDEO|><|vision_eos|>"}
    DEFAULT_N_WINDOW = 100

    @classmethod
    def default_token_config(cls) -> RopeIndexConfig:
        return RopeIndexConfig()

    @classmethod
    def _options_from_hf(cls, hf: dict) -> dict:
        return {"token_config": RopeIndexConfig.from_hf(hf) if hf else None}

    def _audio_pad_length(self, waves: list[np.ndarray]) -> int:
        # Qwen2_5OmniProcessor pads to `chunk_length` seconds, whatever the clips.
        return int(self.preprocessor_config["chunk_length"]) * self.sampling_rate

    def _num_audio_tokens(self, frames: int) -> int:
        return int(audio_output_lengths(np.array([frames]))[1][0])  # conv stride 2, then avg-pool 2

    def _video_with_audio(self, grid: np.ndarray, spg: float, n_audio: int) -> np.ndarray:
        """<|audio_bos|> video and audio tokens in alternating time chunks <|audio_eos|>.

        Qwen2_5OmniProcessor.replace_video_with_audio_token: a video token's time is its frame
        group index * seconds per group * position ids per second (float64, as the processor),
        an audio token's time is its index; both streams are cut every `seconds_per_chunk`
        seconds, and chunk j of the video precedes chunk j of the audio.
        """
        c = self.tokens
        gt, gh, gw = (int(x) for x in grid)
        per_frame = (gh // self.merge_size) * (gw // self.merge_size)
        per_chunk = int(c.position_id_per_seconds * c.seconds_per_chunk)
        v_time = np.repeat(np.arange(gt), per_frame) * spg * c.position_id_per_seconds
        v_chunk = chunk_ids(np.floor(v_time).astype(np.int64), per_chunk)
        a_chunk = chunk_ids(np.arange(n_audio, dtype=np.int64), per_chunk)
        order = np.argsort(np.concatenate([v_chunk * 2, a_chunk * 2 + 1]), kind="stable")
        body = np.concatenate([np.full(len(v_chunk), c.video_token_id), np.full(n_audio, c.audio_token_id)])[order]
        return np.concatenate([[c.audio_start_token_id], body, [c.audio_end_token_id]]).astype(np.int32)
