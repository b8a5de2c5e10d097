"""Build the in-process engines of the Qwen3-Omni stages from a converted checkpoint."""

from __future__ import annotations

import dataclasses

from ...checkpoint import load_checkpoint
from ...engine.ar_engine import AREngine, EngineConfig
from ...engine.runner import RunnerConfig
from ..qwen2_5_omni.stages import load_tokenizer
from .media import MediaBuckets, Qwen3ThinkerMediaEncoder

# <|endoftext|> and <|im_end|>: the thinker stops at either (as Qwen2.5-Omni's).
THINKER_EOS = (151643, 151645)


def build_thinker_engine(ckpt_dir: str, runner: RunnerConfig, *, dtype: str | None = None,
                         media_buckets: MediaBuckets = MediaBuckets(), enable_prefix_caching: bool = True,
                         eos_token_ids=THINKER_EOS, warmup: bool = True, progress: bool = True) -> AREngine:
    """Load the Qwen3-Omni thinker, its media encoders and tokenizer, and warm everything up.

    The runner gets the overlay variants (encoder features) and, when the vision
    encoder has DeepStack taps, the DeepStack prefill variant.

    MoE and bucket padding: padding tokens of a step go through the experts like real
    ones (the decoder does not pass a valid-token mask to the MoE block yet). Routing,
    expert matmuls and the weighted combine are all per token and attention never reads
    padding keys, so padding costs compute but cannot change a real token's output.
    """
    model, cfg = load_checkpoint(ckpt_dir, stage="thinker", dtype=dtype)
    media = Qwen3ThinkerMediaEncoder(model, cfg, media_buckets)
    text = cfg.text
    runner = dataclasses.replace(runner, rich_inputs=True, deepstack_layers=cfg.num_deepstack_layers)
    engine = AREngine(
        model, EngineConfig(runner=runner, enable_prefix_caching=enable_prefix_caching,
                            eos_token_ids=tuple(eos_token_ids), vocab_size=text.vocab_size),
        num_layers=text.num_layers, num_kv_heads=text.num_kv_heads, head_dim=text.head_dim,
        hidden_size=text.hidden_size, tokenizer=load_tokenizer(ckpt_dir), prepare_inputs=media.prepare)
    engine.media_encoder = media
    if warmup:
        media.warmup()
        engine.warmup(progress=progress)
    return engine
