"""The Qwen2.5-Omni thinker: audio + vision encoders feeding a Qwen2 decoder with M-RoPE.

Attribute names follow the checkpoint (`model`, `audio_tower`, `visual`, `lm_head`
under the `thinker.` prefix) so conversion maps keys mechanically.

Encoder features reach the decoder through :meth:`Qwen2_5OmniThinker.merge_media`:
the host computes, per token, the row of the concatenated encoder output to take
(or -1 for a text token), which keeps the jitted step free of data-dependent shapes.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax.numpy as jnp
from flax import nnx

from ...errors import require
from ..layers.attention import AttentionMetadata
from ..layers.audio_blocks import AudioEncoderConfig
from ..layers.decoder import DecoderConfig, TextDecoder
from ..layers.linear import Linear
from .audio_encoder import Qwen2_5OmniAudioEncoder
from .vision_encoder import Qwen2_5OmniVisionEncoder, VisionEncoderConfig

# Where from_hf reads its token ids (errors name it).
SECTION = "thinker_config"


@dataclasses.dataclass(frozen=True)
class ThinkerConfig:
    """The thinker's parts and its special token ids, read from an HF `thinker_config`."""

    text: DecoderConfig
    audio: AudioEncoderConfig
    vision: VisionEncoderConfig
    audio_token_id: int = 151646
    image_token_id: int = 151655
    video_token_id: int = 151656
    audio_start_token_id: int = 151647
    audio_end_token_id: int = 151648
    vision_start_token_id: int = 151652
    position_id_per_seconds: int = 25
    seconds_per_chunk: int = 2

    @classmethod
    def from_hf(cls, d: dict) -> "ThinkerConfig":
        return cls(
            text=DecoderConfig.from_hf(d["text_config"]),
            audio=AudioEncoderConfig.from_hf(d["audio_config"]),
            vision=VisionEncoderConfig.from_hf(d["vision_config"]),
            audio_token_id=require(d, "audio_token_index", "audio_token_id", section=SECTION),
            image_token_id=require(d, "image_token_index", "image_token_id", section=SECTION),
            video_token_id=require(d, "video_token_index", "video_token_id", section=SECTION),
            audio_start_token_id=require(d, "audio_start_token_id", section=SECTION),
            audio_end_token_id=require(d, "audio_end_token_id", section=SECTION),
            vision_start_token_id=require(d, "vision_start_token_id", section=SECTION),
            position_id_per_seconds=d.get("position_id_per_seconds", 25),
            seconds_per_chunk=d.get("seconds_per_chunk", 2),
        )

    @property
    def media_token_ids(self) -> tuple[int, int, int]:
        return (self.audio_token_id, self.image_token_id, self.video_token_id)


class Qwen2_5OmniThinker(nnx.Module):
    """Thinker stage model: encoders, text decoder and LM head."""

    def __init__(self, cfg: ThinkerConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.model = TextDecoder(cfg.text, **kw)
        self.audio_tower = Qwen2_5OmniAudioEncoder(cfg.audio, **kw)
        self.visual = Qwen2_5OmniVisionEncoder(cfg.vision, **kw)
        self.lm_head = Linear(cfg.text.hidden_size, cfg.text.vocab_size, use_bias=False, **kw)

    def embed(self, token_ids):
        """Token embeddings [T, hidden] (placeholders keep their own embedding)."""
        return self.model.embed(token_ids)

    def merge_media(self, token_ids, media_embeds, media_index):
        """Input embeddings with encoder features placed at their placeholder tokens.

        token_ids [T]; media_embeds [N, hidden] (audio, image and video features in
        prompt order); media_index [T] = row of media_embeds for a placeholder, -1 else.
        """
        embeds = self.model.embed(token_ids)
        if media_embeds is None:
            return embeds
        rows = jnp.take(media_embeds, jnp.maximum(media_index, 0), axis=0).astype(embeds.dtype)
        return jnp.where((media_index >= 0)[:, None], rows, embeds)

    def __call__(self, inputs_embeds, positions, meta: AttentionMetadata, kv_caches=None,
                 capture_layers: Sequence[int] = ()):
        """Decoder forward; returns (final hidden [T, H], kv caches, captured hidden states)."""
        return self.model(inputs_embeds, positions, meta, kv_caches, capture_layers)

    def compute_logits(self, hidden):
        """LM head in fp32 (sampling and parity need full-precision logits)."""
        return self.lm_head(hidden).astype(jnp.float32)
