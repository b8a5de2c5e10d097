"""Qwen2.5-Omni as one object: its stages, engines, stage-input processors, prompt processor,
conversion mapping and the built-in tiny model (see `models/family.py`)."""

from __future__ import annotations

from ...inputs.processor import InputProcessor
from ..family import ModelFamily
from .media_encoder import MediaBuckets
from .pipeline import load_handoff
from .specs import STAGES, write_side_files
from .stages import build_talker_engine, build_thinker_engine, build_token2wav_engine
from .tiny import tiny_checkpoint


def thinker_engine(build):
    """The `engines` entry of a thinker built by `build(ckpt_dir, runner_config, ...)` (both families')."""
    def make(stage, ckpt_dir: str, async_chunk: bool):
        buckets = MediaBuckets(stage.audio_chunk_buckets, stage.vision_patch_buckets)
        return build(ckpt_dir, stage.runner_config(), dtype=stage.dtype, media_buckets=buckets,
                     enable_prefix_caching=stage.enable_prefix_caching, hidden_cache_bytes=stage.hidden_cache_mb << 20,
                     async_scheduling=stage.async_scheduling, progress=False)
    return make


def talker_engine(build):
    """The `engines` entry of a talker built by `build(ckpt_dir, runner_config, ...)` (both families')."""
    return lambda stage, ckpt_dir, async_chunk: build(ckpt_dir, stage.runner_config(), dtype=stage.dtype,
                                                      progress=False)


def _token2wav(stage, ckpt_dir: str, async_chunk: bool):
    # For a vocoder, token_buckets are code-length buckets and decode_buckets batch sizes.
    return build_token2wav_engine(ckpt_dir, length_buckets=stage.token_buckets or (64, 256, 1024),
                                  batch_buckets=stage.decode_buckets or (1, 2, 4), max_num_seqs=stage.max_num_seqs,
                                  chunk_frames=stage.codec_chunk_frames,
                                  initial_chunk_frames=stage.initial_codec_chunk_frames, streamed=async_chunk,
                                  left_context=stage.codec_left_context_frames,
                                  right_context=stage.codec_right_context_frames, clip=stage.clip_audio)


FAMILY = ModelFamily(
    name="qwen2_5_omni",
    stages=STAGES,
    engines={"thinker": thinker_engine(build_thinker_engine), "talker": talker_engine(build_talker_engine),
             "token2wav": _token2wav},
    handoff=load_handoff,
    prompt_processor=InputProcessor.from_checkpoint,
    side_files=write_side_files,
    tiny_checkpoint=tiny_checkpoint,
)
