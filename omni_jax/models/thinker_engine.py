"""A thinker's engine as both families build it: the AR engine over the thinker's decoder, with
the family's media encoder preparing each request's inputs (`engine.media_encoder`), and its
loading from a converted checkpoint (tokenizer, end tokens, warm-up)."""

from __future__ import annotations

from .. import checkpoint
from ..engine.ar_engine import AREngine, EngineConfig
from ..engine.runner import RunnerConfig, stage_mesh
from ..inputs.detokenizer import load_tokenizer
from .thinker_media import ThinkerMediaEncoder


def media_ar_engine(model, cfg, runner: RunnerConfig, media: ThinkerMediaEncoder, *,
                    enable_prefix_caching: bool = True, hidden_cache_bytes: int = EngineConfig.hidden_cache_bytes,
                    async_scheduling: bool = True, eos_token_ids: tuple[int, ...] = (), tokenizer=None) -> AREngine:
    """The AR engine of a thinker `model` (config `cfg`) whose requests `media` prepares; `runner`
    as the family sets it (rich inputs on)."""
    text = cfg.text
    engine = AREngine(
        model, EngineConfig(runner=runner, enable_prefix_caching=enable_prefix_caching,
                            hidden_cache_bytes=hidden_cache_bytes, async_scheduling=async_scheduling,
                            eos_token_ids=eos_token_ids, vocab_size=text.vocab_size),
        num_layers=text.num_layers, num_kv_heads=text.num_kv_heads, head_dim=text.head_dim,
        hidden_size=text.hidden_size, tokenizer=tokenizer, prepare_inputs=media.prepare)
    engine.media_encoder = media
    return engine


def load_thinker_engine(thinker_engine, ckpt_dir: str, runner: RunnerConfig, *, dtype: str | None = None,
                        warmup: bool = True, progress: bool = True, **options) -> AREngine:
    """A checkpoint's thinker in the family's `thinker_engine(model, cfg, runner, **options)`, with
    the checkpoint's tokenizer and end tokens, its media encoders and steps warmed up."""
    model, cfg = checkpoint.load_checkpoint(ckpt_dir, stage="thinker", dtype=dtype, mesh=stage_mesh(runner))
    engine = thinker_engine(model, cfg, runner, eos_token_ids=checkpoint.eos_token_ids(ckpt_dir),
                            tokenizer=load_tokenizer(ckpt_dir), **options)
    if warmup:
        engine.media_encoder.warmup()
        engine.warmup(progress=progress)
    return engine
