"""The Qwen2.5-Omni talker: a Qwen2 decoder that turns thinker states into codec tokens.

Its `embed_tokens` table is the codec vocabulary in the *thinker's* hidden width;
inputs (codec embeddings plus thinker hidden states and embeddings, see
pipeline.py) go through `thinker_to_talker_proj` into the talker's own width, then
the decoder, then `codec_head`. Names follow the checkpoint (`talker.` prefix).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax.numpy as jnp
from flax import nnx

from ...errors import require
from ..layers.attention import AttentionMetadata
from ..layers.decoder import DecoderConfig, TextDecoder
from ..layers.linear import Linear

# Where from_hf reads its token ids (errors name it).
SECTION = "talker_config"


@dataclasses.dataclass(frozen=True)
class TalkerConfig:
    """Decoder sizes plus the codec and text special ids the handoff uses."""

    text: DecoderConfig
    embedding_size: int
    codec_bos: int = 8293
    codec_eos: int = 8294
    codec_pad: int = 8292
    codec_mask: int = 8296
    text_bos: int = 151860
    text_eos: int = 151861
    text_pad: int = 151859

    @classmethod
    def from_hf(cls, d: dict) -> "TalkerConfig":
        return cls(
            text=DecoderConfig.from_hf(d), embedding_size=d["embedding_size"],
            codec_bos=require(d, "tts_codec_start_token_id", section=SECTION),
            codec_eos=require(d, "tts_codec_end_token_id", section=SECTION),
            codec_pad=require(d, "tts_codec_pad_token_id", section=SECTION),
            codec_mask=require(d, "tts_codec_mask_token_id", section=SECTION),
            text_bos=require(d, "tts_text_start_token_id", section=SECTION),
            text_eos=require(d, "tts_text_end_token_id", section=SECTION),
            text_pad=require(d, "tts_text_pad_token_id", section=SECTION))

    @property
    def eos_token_ids(self) -> tuple[int, int]:
        """Codec pad and codec end both end the speech (transformers' talker eos)."""
        return (self.codec_pad, self.codec_eos)


class Qwen2_5OmniTalker(nnx.Module):
    """Talker stage model: codec embeddings -> projection -> Qwen2 decoder -> codec head."""

    def __init__(self, cfg: TalkerConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.thinker_to_talker_proj = Linear(cfg.embedding_size, cfg.text.hidden_size, **kw)
        self.model = TextDecoder(cfg.text, **kw)
        self.codec_head = Linear(cfg.text.hidden_size, cfg.text.vocab_size, use_bias=False, **kw)

    def embed(self, token_ids):
        """Codec embeddings [T, embedding_size] (the thinker's width)."""
        return self.model.embed(token_ids)

    def __call__(self, inputs_embeds, positions, meta: AttentionMetadata, kv_caches=None,
                 capture_layers: Sequence[int] = ()):
        """inputs_embeds [T, embedding_size] -> (hidden [T, hidden], kv caches, captured)."""
        return self.model(self.thinker_to_talker_proj(inputs_embeds), positions, meta, kv_caches, capture_layers)

    def compute_logits(self, hidden):
        return self.codec_head(hidden).astype(jnp.float32)
