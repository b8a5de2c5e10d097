"""Qwen2.5-Omni as one object: its stages, engines, stage-input processors, prompt processor,
conversion mapping and the built-in tiny model (see `models/family.py`)."""

from __future__ import annotations

from ..family import ModelFamily, served_talker, served_thinker
from ..thinker_media import MediaBuckets
from .pipeline import load_handoff
from .processor import Qwen2_5InputProcessor
from .specs import STAGES, write_side_files
from .stages import (build_talker_engine, build_thinker_engine, build_token2wav_engine, talker_engine,
                     thinker_engine, token2wav_engine)
from .tiny import tiny_checkpoint
from .voices import Voices


def _token2wav_args(stage, async_chunk: bool) -> dict:
    # For a vocoder, token_buckets are code-length buckets and decode_buckets batch sizes;
    # max_num_batched_tokens / max_model_len are codes per step (and call) / of a request.
    return dict(length_buckets=stage.token_buckets or (64, 256, 1024), batch_buckets=stage.decode_buckets or (1, 2, 4),
                max_num_batched_tokens=stage.max_num_batched_tokens, max_model_len=stage.max_model_len,
                max_num_seqs=stage.max_num_seqs, chunk_frames=stage.codec_chunk_frames,
                initial_chunk_frames=stage.initial_codec_chunk_frames, streamed=async_chunk,
                left_context=stage.codec_left_context_frames, right_context=stage.codec_right_context_frames,
                clip=stage.clip_audio)


FAMILY = ModelFamily(
    name="qwen2_5_omni",
    stages=STAGES,
    engines={"thinker": served_thinker(build_thinker_engine), "talker": served_talker(build_talker_engine),
             "token2wav": lambda stage, ckpt_dir, async_chunk: build_token2wav_engine(
                 ckpt_dir, **_token2wav_args(stage, async_chunk))},
    module_engines={
        "thinker": lambda stage, model, cfg, hf_config, runner: thinker_engine(
            model, cfg, runner, hf_config=hf_config, media_buckets=MediaBuckets.of(stage)),
        "talker": lambda stage, model, cfg, hf_config, runner: talker_engine(model, cfg, runner),
        "token2wav": lambda stage, model, cfg, hf_config, runner: token2wav_engine(
            model, Voices({}), **_token2wav_args(stage, async_chunk=False))},
    handoff=load_handoff,
    prompt_processor=Qwen2_5InputProcessor.from_checkpoint,
    side_files=write_side_files,
    tiny_checkpoint=tiny_checkpoint,
)
