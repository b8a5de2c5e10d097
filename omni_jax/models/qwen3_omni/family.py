"""Qwen3-Omni as one object: its stages, engines, stage-input processors, prompt processor and
conversion mapping (see `models/family.py`)."""

from __future__ import annotations

from ..family import ModelFamily, served_talker, served_thinker
from ..thinker_media import MediaBuckets
from .code2wav_stage import build_code2wav_engine, code2wav_engine
from .pipeline import load_handoff
from .processor import Qwen3InputProcessor
from .specs import STAGES, write_side_files
from .stages import build_talker_engine, build_thinker_engine, talker_engine, thinker_engine
from .tiny import tiny_checkpoint


def _code2wav_args(stage, async_chunk: bool) -> dict:
    # For a vocoder, token_buckets are frame-length buckets and decode_buckets batch sizes;
    # max_num_batched_tokens / max_model_len are codec frames here. Streamed and whole requests
    # run different calls: the stage compiles those of its pipeline's path.
    return dict(length_buckets=stage.token_buckets or (64, 256, 325), batch_buckets=stage.decode_buckets or (1, 2, 4),
                max_num_batched_tokens=stage.max_num_batched_tokens, max_model_len=stage.max_model_len,
                max_num_seqs=stage.max_num_seqs, codec_chunk_frames=stage.codec_chunk_frames,
                initial_codec_chunk_frames=stage.initial_codec_chunk_frames, streamed=async_chunk,
                clip=stage.clip_audio)


FAMILY = ModelFamily(
    name="qwen3_omni",
    stages=STAGES,
    engines={"thinker": served_thinker(build_thinker_engine), "talker": served_talker(build_talker_engine),
             "code2wav": lambda stage, ckpt_dir, async_chunk: build_code2wav_engine(
                 ckpt_dir, **_code2wav_args(stage, async_chunk))},
    module_engines={
        "thinker": lambda stage, model, cfg, hf_config, runner: thinker_engine(
            model, cfg, runner, media_buckets=MediaBuckets.of(stage)),
        "talker": lambda stage, model, cfg, hf_config, runner: talker_engine(model, cfg, runner),
        "code2wav": lambda stage, model, cfg, hf_config, runner: code2wav_engine(
            model, **_code2wav_args(stage, async_chunk=False))},
    handoff=load_handoff,
    prompt_processor=Qwen3InputProcessor.from_checkpoint,
    side_files=write_side_files,
    tiny_checkpoint=tiny_checkpoint,
)
