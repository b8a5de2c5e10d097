"""The Qwen3-Omni thinker: audio + vision encoders feeding a Qwen3-MoE decoder with DeepStack.

Attribute names follow the checkpoint (``model``, ``audio_tower``, ``visual``,
``lm_head`` under the ``thinker.`` prefix), so conversion maps keys mechanically
(per-expert tensors through conversion/moe.py's fused view, the vision mergers'
``mlp.0`` / ``mlp.2`` through vision_encoder.HF_RENAMES).

Encoder features reach the decoder the same way as for Qwen2.5-Omni: the host plans,
per prompt token, the row of the concatenated encoder output it takes (see
:func:`omni_jax.models.thinker_media.media_index`, shared). The vision
encoder's DeepStack features follow the same rows and are added after the first
decoder layers at the visual tokens (``deepstack=`` of :meth:`Qwen3OmniThinker.__call__`).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax.numpy as jnp
from flax import nnx

from ...errors import require
from ...inputs.rope_index import RopeIndexConfig
from ..layers.attention import AttentionMetadata
from ..layers.linear import Linear
from .audio_encoder import AudioEncoderConfig, Qwen3OmniAudioEncoder
from .thinker_text import Qwen3TextConfig, Qwen3TextDecoder
from .vision_encoder import Qwen3OmniVisionEncoder, VisionEncoderConfig

# Where from_hf reads its token ids (errors name it).
SECTION = "thinker_config"


@dataclasses.dataclass(frozen=True)
class ThinkerConfig:
    """The thinker's parts and its special token ids, read from an HF ``thinker_config``.

    Defaults are the real Qwen3-Omni ids (QWEN_NOTES.md); the HF config class declares
    only some of them (and with Qwen2.5 defaults), so a released config.json's values win.
    """

    text: Qwen3TextConfig
    audio: AudioEncoderConfig
    vision: VisionEncoderConfig
    audio_token_id: int = 151675
    image_token_id: int = 151655
    video_token_id: int = 151656
    audio_start_token_id: int = 151669
    audio_end_token_id: int = 151670
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    position_id_per_seconds: float = 13
    seconds_per_chunk: float = 2

    @classmethod
    def from_hf(cls, d: dict) -> "ThinkerConfig":
        d0 = cls.__dataclass_fields__

        def pick(*keys):
            for k in keys:
                if d.get(k) is not None:
                    return d[k]
            return d0[keys[0]].default

        return cls(
            text=Qwen3TextConfig.from_hf(d["text_config"]),
            audio=AudioEncoderConfig.from_hf(d["audio_config"]),
            vision=VisionEncoderConfig.from_hf(d["vision_config"]),
            audio_token_id=int(require(d, "audio_token_id", "audio_token_index", section=SECTION)),
            image_token_id=int(require(d, "image_token_id", "image_token_index", section=SECTION)),
            video_token_id=int(require(d, "video_token_id", "video_token_index", section=SECTION)),
            audio_start_token_id=int(require(d, "audio_start_token_id", section=SECTION)),
            audio_end_token_id=int(require(d, "audio_end_token_id", section=SECTION)),
            vision_start_token_id=int(require(d, "vision_start_token_id", section=SECTION)),
            vision_end_token_id=int(require(d, "vision_end_token_id", section=SECTION)),
            position_id_per_seconds=pick("position_id_per_seconds"),
            seconds_per_chunk=pick("seconds_per_chunk"),
        )

    @property
    def media_token_ids(self) -> tuple[int, int, int]:
        return (self.audio_token_id, self.image_token_id, self.video_token_id)

    @property
    def num_deepstack_layers(self) -> int:
        """Decoder layers that receive DeepStack features (one per ViT tap)."""
        return len(self.vision.deepstack_visual_indexes)

    @property
    def rope_index(self) -> RopeIndexConfig:
        """The token ids and timing constants of the M-RoPE position planner."""
        return RopeIndexConfig(
            image_token_id=self.image_token_id, video_token_id=self.video_token_id,
            audio_token_id=self.audio_token_id, vision_start_token_id=self.vision_start_token_id,
            vision_end_token_id=self.vision_end_token_id, audio_start_token_id=self.audio_start_token_id,
            audio_end_token_id=self.audio_end_token_id, spatial_merge_size=self.vision.spatial_merge_size,
            position_id_per_seconds=self.position_id_per_seconds, seconds_per_chunk=self.seconds_per_chunk)


class Qwen3OmniThinker(nnx.Module):
    """Thinker stage model: encoders, MoE text decoder and LM head."""

    def __init__(self, cfg: ThinkerConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.model = Qwen3TextDecoder(cfg.text, **kw)
        self.audio_tower = Qwen3OmniAudioEncoder(cfg.audio, **kw)
        self.visual = Qwen3OmniVisionEncoder(cfg.vision, **kw)
        self.lm_head = Linear(cfg.text.hidden_size, cfg.text.vocab_size, use_bias=False, **kw)

    def embed(self, token_ids):
        """Token embeddings [T, hidden] (placeholders keep their own embedding)."""
        return self.model.embed(token_ids)

    def __call__(self, inputs_embeds, positions, meta: AttentionMetadata, kv_caches=None,
                 capture_layers: Sequence[int] = (), deepstack=None):
        """Decoder forward; returns (final hidden [T, H], kv caches, captured hidden states).

        deepstack: None, or ``(mask [T] bool, features [K, T, H])``: features[k] is added
        to the tokens where mask is true after decoder layer k (Qwen3TextDecoder).

        Bucket padding rows go through the MoE like any token: experts act per token,
        so they cost compute but never change a real row (see the stage's notes).
        """
        return self.model(inputs_embeds, positions, meta, kv_caches, capture_layers, deepstack)

    def compute_logits(self, hidden):
        """LM head in fp32 (sampling and parity need full-precision logits)."""
        return self.lm_head(hidden).astype(jnp.float32)
