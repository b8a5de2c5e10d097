"""The engines of the Qwen2.5-Omni stages: around a stage module (`*_engine`), and loaded from a
converted checkpoint and warmed up (`build_*_engine`)."""

from __future__ import annotations

import dataclasses

from ...checkpoint import load_checkpoint, read_config
from ...engine.ar_engine import AREngine, EngineConfig
from ...engine.oneshot_engine import OneShotEngine, chunk_sizes
from ...engine.runner import RunnerConfig, stage_mesh
from ...inputs.rope_index import RopeIndexConfig
from ..thinker_engine import load_thinker_engine, media_ar_engine
from ..thinker_media import MediaBuckets
from .media_encoder import Qwen2_5ThinkerMediaEncoder
from .token2wav import StreamContext, Token2WavSynthesizer
from .voices import Voices


def talker_engine(model, cfg, runner: RunnerConfig) -> AREngine:
    """The talker's engine (codec tokens from thinker states); its prompts are embeddings,
    so prefix caching is off."""
    text = cfg.text
    return AREngine(
        model, EngineConfig(runner=dataclasses.replace(runner, rich_inputs=True), enable_prefix_caching=False,
                            eos_token_ids=cfg.eos_token_ids, vocab_size=text.vocab_size,
                            # room for the ids past the vocoder's codebook (see pipeline.py)
                            banned_width=512),
        num_layers=text.num_layers, num_kv_heads=text.num_kv_heads, head_dim=text.head_dim,
        hidden_size=cfg.embedding_size)


def build_talker_engine(ckpt_dir: str, runner: RunnerConfig, *, dtype: str | None = None,
                        warmup: bool = True, progress: bool = True) -> AREngine:
    """Load the talker stage and warm it up."""
    model, cfg = load_checkpoint(ckpt_dir, stage="talker", dtype=dtype, mesh=stage_mesh(runner))
    engine = talker_engine(model, cfg, runner)
    if warmup:
        engine.warmup(progress=progress)
    return engine


def thinker_engine(model, cfg, runner: RunnerConfig, *, hf_config: dict, media_buckets: MediaBuckets = MediaBuckets(),
                   **options) -> AREngine:
    """The thinker's engine with its media encoders (`engine.media_encoder`); `options`:
    `media_ar_engine`'s."""
    media = Qwen2_5ThinkerMediaEncoder(model, cfg, RopeIndexConfig.from_hf(hf_config), media_buckets)
    return media_ar_engine(model, cfg, dataclasses.replace(runner, rich_inputs=True), media, **options)


def build_thinker_engine(ckpt_dir: str, runner: RunnerConfig, *, dtype: str | None = None,
                         media_buckets: MediaBuckets = MediaBuckets(), enable_prefix_caching: bool = True,
                         hidden_cache_bytes: int = EngineConfig.hidden_cache_bytes, async_scheduling: bool = True,
                         warmup: bool = True, progress: bool = True) -> AREngine:
    """Load the thinker stage, its media encoders and tokenizer, and warm everything up."""
    return load_thinker_engine(thinker_engine, ckpt_dir, runner, dtype=dtype, warmup=warmup, progress=progress,
                               hf_config=read_config(ckpt_dir)["hf_config"], media_buckets=media_buckets,
                               enable_prefix_caching=enable_prefix_caching, hidden_cache_bytes=hidden_cache_bytes,
                               async_scheduling=async_scheduling)


def token2wav_engine(model, voices: Voices, *, length_buckets=(64, 256, 1024), batch_buckets=(1, 2, 4),
                     max_num_batched_tokens: int | None = None, max_model_len: int | None = None,
                     max_num_seqs: int | None = None, chunk_frames: int = 25, initial_chunk_frames: int = 10,
                     streamed: bool = False, left_context: int | None = None, right_context: int | None = None,
                     clip: bool = True) -> OneShotEngine:
    """The vocoder's engine: requests batched through DiT + BigVGAN (fp32, no KV cache), whole or
    streamed; its synthesizer is `engine.synthesizer`.

    `max_num_seqs` requests per step (default batch_buckets[-1]); more than the largest
    batch take several calls, run side by side. `max_num_batched_tokens`: codes per step and
    padded codes per call, bounding a call's memory (default max_num_seqs * the largest
    length bucket); `max_model_len`: codes of the longest request, at most the largest length
    bucket (larger buckets go unused). With async chunk the engine streams a request
    once `initial_chunk_frames`, then chunks growing to `chunk_frames` new codes arrived; the
    streamed calls are compiled for windows of each chunk size plus its context (`left_context`
    and `right_context` codes of DiT context, None: `StreamContext`'s). `streamed`: requests
    arrive streamed (the pipeline's async_chunk), so warm-up compiles the streamed calls
    instead of the whole-request ones (the other path still works, compiling on first use).
    `clip`: clamp the waveform to [-1, 1] (the stage's clip_audio).
    """
    max_num_seqs = max_num_seqs or batch_buckets[-1]
    max_codes = min(max_model_len or length_buckets[-1], length_buckets[-1])
    per_step = max_num_batched_tokens or max_num_seqs * length_buckets[-1]
    if max_codes > per_step:
        raise ValueError(f"requests of up to {max_codes} codes (max_model_len, within the largest length bucket) "
                         f"exceed max_num_batched_tokens ({per_step}): they could never be scheduled")
    synth = Token2WavSynthesizer(model, voices, length_buckets=length_buckets, batch_buckets=batch_buckets,
                                 max_num_seqs=max_num_seqs, max_codes=max_codes, max_batch_codes=per_step,
                                 stream_chunk_codes=chunk_sizes(initial_chunk_frames, chunk_frames),
                                 stream_context=StreamContext.given(left_context, right_context), clip=clip)
    engine = OneShotEngine(synth, max_num_seqs=max_num_seqs, max_num_batched_tokens=per_step,
                           max_model_len=max_codes + 1, vocab_size=model.cfg.dit.num_embeds,
                           validate=synth.validate, warmup_fn=synth.warmup_stream if streamed else synth.warmup,
                           chunk_frames=chunk_frames, initial_chunk_frames=initial_chunk_frames)
    engine.synthesizer = synth
    return engine


def build_token2wav_engine(ckpt_dir: str, *, warmup: bool = True, **kw) -> OneShotEngine:
    """Load the vocoder stage and its voices (`token2wav_engine`'s arguments) and warm it up."""
    model, _ = load_checkpoint(ckpt_dir, stage="token2wav", dtype="float32")
    engine = token2wav_engine(model, Voices.load(ckpt_dir), **kw)
    if warmup:
        engine.warmup()
    return engine
