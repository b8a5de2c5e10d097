"""Build the in-process engines of the Qwen2.5-Omni stages from a converted checkpoint."""

from __future__ import annotations

import json
import os

from tokenizers import AddedToken, Tokenizer

from ...checkpoint import eos_token_ids, load_checkpoint, read_config
from ...engine.ar_engine import AREngine, EngineConfig
from ...engine.oneshot_engine import OneShotEngine, chunk_sizes
from ...engine.runner import RunnerConfig, stage_mesh
from ...inputs.rope_index import RopeIndexConfig
from .media_encoder import MediaBuckets, ThinkerMediaEncoder
from .token2wav import StreamContext, Token2WavSynthesizer
from .voices import Voices



def load_tokenizer(ckpt_dir: str):
    """The stage's detokenizer (it only decodes), or None when the checkpoint has no tokenizer.

    `tokenizer.json` is read with the `tokenizers` library, the one transformers' fast
    tokenizers wrap, with the tokens transformers marks special marked so: importing
    transformers also imports torch, seconds of every thinker start. transformers decodes
    what only it handles (slow-tokenizer files, cleaning up tokenization spaces).
    """
    fast, config_path = os.path.join(ckpt_dir, "tokenizer.json"), os.path.join(ckpt_dir, "tokenizer_config.json")
    config = {}
    if os.path.isfile(config_path):
        with open(config_path) as f:
            config = json.load(f)
    if os.path.isfile(fast) and not config.get("clean_up_tokenization_spaces"):
        tokenizer = Tokenizer.from_file(fast)
        specials = [t for t in _special_tokens(config) if tokenizer.token_to_id(t) is not None]
        tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        return tokenizer
    if not os.path.isfile(fast) and not os.path.isfile(os.path.join(ckpt_dir, "vocab.json")):
        return None
    # Slow-tokenizer files or space clean-up: transformers' own tokenizer (imports torch).
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ckpt_dir)


# tokenizer_config.json keys naming one special token each (transformers' SPECIAL_TOKENS_ATTRIBUTES).
_NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _special_tokens(config: dict) -> set[str]:
    """The tokens `tokenizer_config.json` declares special (skip_special_tokens drops them)."""
    def text(t):
        return t if isinstance(t, str) else t.get("content") if isinstance(t, dict) else None

    def many(v):
        return list(v.values()) if isinstance(v, dict) else list(v or [])

    found = [t for t in config.get("added_tokens_decoder", {}).values() if t.get("special")]
    found += [config.get(k) for k in _NAMED_SPECIALS]
    for key in ("extra_special_tokens", "additional_special_tokens", "model_specific_special_tokens"):
        found += many(config.get(key))
    return {text(t) for t in found} - {None}


def build_talker_engine(ckpt_dir: str, runner: RunnerConfig, *, dtype: str | None = None,
                        warmup: bool = True, progress: bool = True) -> AREngine:
    """Load the talker stage (codec tokens from thinker states) and warm it up.

    Its prompts are embeddings, so prefix caching is off.
    """
    import dataclasses

    model, cfg = load_checkpoint(ckpt_dir, stage="talker", dtype=dtype, mesh=stage_mesh(runner))
    text = cfg.text
    engine = AREngine(
        model, EngineConfig(runner=dataclasses.replace(runner, rich_inputs=True), enable_prefix_caching=False,
                            eos_token_ids=cfg.eos_token_ids, vocab_size=text.vocab_size,
                            # room for the ids past the vocoder's codebook (see pipeline.py)
                            banned_width=512),
        num_layers=text.num_layers, num_kv_heads=text.num_kv_heads, head_dim=text.head_dim,
        hidden_size=cfg.embedding_size)
    if warmup:
        engine.warmup(progress=progress)
    return engine


def build_thinker_engine(ckpt_dir: str, runner: RunnerConfig, *, dtype: str | None = None,
                         media_buckets: MediaBuckets = MediaBuckets(), enable_prefix_caching: bool = True,
                         hidden_cache_bytes: int = EngineConfig.hidden_cache_bytes, async_scheduling: bool = True,
                         warmup: bool = True, progress: bool = True) -> AREngine:
    """Load the thinker stage, its media encoders and tokenizer, and warm everything up."""
    import dataclasses

    model, cfg = load_checkpoint(ckpt_dir, stage="thinker", dtype=dtype, mesh=stage_mesh(runner))
    hf_config = read_config(ckpt_dir)["hf_config"]
    media = ThinkerMediaEncoder(model, cfg, RopeIndexConfig.from_hf(hf_config), media_buckets)
    text = cfg.text
    engine = AREngine(
        model, EngineConfig(runner=dataclasses.replace(runner, rich_inputs=True),
                            enable_prefix_caching=enable_prefix_caching, hidden_cache_bytes=hidden_cache_bytes,
                            async_scheduling=async_scheduling, eos_token_ids=eos_token_ids(ckpt_dir),
                            vocab_size=text.vocab_size),
        num_layers=text.num_layers, num_kv_heads=text.num_kv_heads, head_dim=text.head_dim,
        hidden_size=text.hidden_size, tokenizer=load_tokenizer(ckpt_dir), prepare_inputs=media.prepare)
    engine.media_encoder = media
    if warmup:
        media.warmup()
        engine.warmup(progress=progress)
    return engine


def build_token2wav_engine(ckpt_dir: str, *, length_buckets=(64, 256, 1024), batch_buckets=(1, 2, 4),
                           max_num_batched_tokens: int | None = None, max_num_seqs: int | None = None,
                           chunk_frames: int = 25, initial_chunk_frames: int = 10, streamed: bool = False,
                           left_context: int | None = None, right_context: int | None = None,
                           clip: bool = True, warmup: bool = True):
    """The vocoder stage: requests batched through DiT + BigVGAN (fp32, no KV cache), whole or streamed.

    `max_num_seqs` requests per step (default batch_buckets[-1]); more than the largest
    batch take several calls, run side by side. With async chunk the engine streams a request
    once `initial_chunk_frames`, then chunks growing to `chunk_frames` new codes arrived; the
    streamed calls are compiled for windows of each chunk size plus its context (`left_context`
    and `right_context` codes of DiT context, None: `StreamContext`'s). `streamed`: requests
    arrive streamed (the pipeline's async_chunk), so warm-up compiles the streamed calls
    instead of the whole-request ones (the other path still works, compiling on first use).
    `clip`: clamp the waveform to [-1, 1] (the stage's clip_audio).
    """
    model, cfg = load_checkpoint(ckpt_dir, stage="token2wav", dtype="float32")
    max_num_seqs = max_num_seqs or batch_buckets[-1]
    synth = Token2WavSynthesizer(model, Voices.load(ckpt_dir), length_buckets=length_buckets,
                                 batch_buckets=batch_buckets, max_num_seqs=max_num_seqs,
                                 stream_chunk_codes=chunk_sizes(initial_chunk_frames, chunk_frames),
                                 stream_context=StreamContext.given(left_context, right_context), clip=clip)

    engine = OneShotEngine(synth, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens or max_num_seqs * length_buckets[-1],
                           max_model_len=length_buckets[-1] + 1, vocab_size=cfg.dit.num_embeds,
                           validate=synth.validate, warmup_fn=synth.warmup_stream if streamed else synth.warmup,
                           chunk_frames=chunk_frames,
                           initial_chunk_frames=initial_chunk_frames)
    engine.synthesizer = synth
    if warmup:
        engine.warmup()
    return engine
