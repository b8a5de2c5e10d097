"""Build a stage's engine from its pipeline config, and translate wire messages for it.

Runs inside the stage process. Each (family, model stage) pair maps to a builder
that loads the checkpoint part, makes the engine and warms it up.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .runner import RequestInputs, RunnerConfig


def runner_config(stage: dict) -> RunnerConfig:
    """RunnerConfig from a stage config (as a plain dict)."""
    return RunnerConfig(
        num_blocks=stage.get("num_blocks"), block_size=stage["block_size"],
        max_num_seqs=stage["max_num_seqs"], max_num_batched_tokens=stage["max_num_batched_tokens"],
        max_model_len=stage["max_model_len"],
        token_buckets=tuple(stage["token_buckets"]) if stage.get("token_buckets") else None,
        decode_buckets=tuple(stage["decode_buckets"]) if stage.get("decode_buckets") else None,
        backend=stage.get("backend"), capture_layers=tuple(stage.get("hidden_layers") or ()),
        kv_memory_fraction=stage.get("kv_memory_fraction") or 0.9)


def _qwen2_5_omni_thinker(stage: dict, ckpt_dir: str):
    from ..models.qwen2_5_omni.media import MediaBuckets
    from ..models.qwen2_5_omni.stages import build_thinker_engine

    buckets = MediaBuckets(tuple(stage["audio_chunk_buckets"]), tuple(stage["vision_patch_buckets"]))
    return build_thinker_engine(ckpt_dir, runner_config(stage), dtype=stage.get("dtype"), media_buckets=buckets,
                                enable_prefix_caching=stage.get("enable_prefix_caching", True),
                                async_scheduling=stage.get("async_scheduling", True), progress=False)


def _qwen2_5_omni_talker(stage: dict, ckpt_dir: str):
    from ..models.qwen2_5_omni.stages import build_talker_engine

    return build_talker_engine(ckpt_dir, runner_config(stage), dtype=stage.get("dtype"), progress=False)


def _qwen2_5_omni_token2wav(stage: dict, ckpt_dir: str):
    from ..models.qwen2_5_omni.stages import build_token2wav_engine

    # For a vocoder, token_buckets are code-length buckets and decode_buckets batch sizes.
    return build_token2wav_engine(ckpt_dir, length_buckets=tuple(stage["token_buckets"] or (64, 256, 1024)),
                                  batch_buckets=tuple(stage["decode_buckets"] or (1, 2, 4)),
                                  max_num_seqs=stage["max_num_seqs"])


def _qwen3_omni_thinker(stage: dict, ckpt_dir: str):
    from ..models.qwen3_omni.media import MediaBuckets
    from ..models.qwen3_omni.stages import build_thinker_engine

    buckets = MediaBuckets(tuple(stage["audio_chunk_buckets"]), tuple(stage["vision_patch_buckets"]))
    return build_thinker_engine(ckpt_dir, runner_config(stage), dtype=stage.get("dtype"), media_buckets=buckets,
                                enable_prefix_caching=stage.get("enable_prefix_caching", True),
                                async_scheduling=stage.get("async_scheduling", True), progress=False)


def _qwen3_omni_talker(stage: dict, ckpt_dir: str):
    from ..models.qwen3_omni.stages import build_talker_engine

    return build_talker_engine(ckpt_dir, runner_config(stage), dtype=stage.get("dtype"), progress=False)


def _qwen3_omni_code2wav(stage: dict, ckpt_dir: str):
    from ..models.qwen3_omni.code2wav_stage import build_code2wav_engine

    # For a vocoder, token_buckets are frame-length buckets and decode_buckets batch sizes.
    # max_num_batched_tokens / max_model_len are codec frames here.
    return build_code2wav_engine(ckpt_dir, length_buckets=tuple(stage["token_buckets"] or (64, 256, 325)),
                                 batch_buckets=tuple(stage["decode_buckets"] or (1, 2, 4)),
                                 max_num_batched_tokens=stage.get("max_num_batched_tokens"),
                                 max_model_len=stage.get("max_model_len"), max_num_seqs=stage["max_num_seqs"])


BUILDERS: dict[tuple[str, str], Callable[[dict, str], Any]] = {
    ("qwen2_5_omni", "thinker"): _qwen2_5_omni_thinker,
    ("qwen2_5_omni", "talker"): _qwen2_5_omni_talker,
    ("qwen3_omni", "thinker"): _qwen3_omni_thinker,
    ("qwen3_omni", "talker"): _qwen3_omni_talker,
    ("qwen3_omni", "code2wav"): _qwen3_omni_code2wav,
    ("qwen2_5_omni", "token2wav"): _qwen2_5_omni_token2wav,
}


def build_stage_engine(family: str, stage: dict, ckpt_dir: str):
    """The warmed-up engine of one stage, or a clear error if OmniJax cannot serve it."""
    key = (family, stage.get("model_stage") or stage["name"])
    if key not in BUILDERS:
        known = ", ".join(f"{f}/{s}" for f, s in BUILDERS)
        raise ValueError(f"no engine for stage {key[1]!r} of {family!r} yet (available: {known})")
    return BUILDERS[key](stage, ckpt_dir)


def to_engine_request(msg) -> dict:
    """AddRequest -> keyword arguments of `AREngine.add_request`."""
    from ..models.qwen2_5_omni.media import MultiModalData

    inputs = None
    if msg.inputs is not None:
        i = msg.inputs
        inputs = RequestInputs(mrope_positions=i.mrope_positions, mrope_delta=i.mrope_delta,
                               overlay_rows=i.overlay_rows, overlay_index=i.overlay_index,
                               extra_embeds=i.extra_embeds, extra_embeds_pad=i.extra_embeds_pad,
                               capture_hidden=i.capture_hidden, overlay_proj=i.overlay_proj,
                               overlay_add_ids=i.overlay_add_ids, extra_proj=i.extra_proj)
    mm = None
    if msg.multi_modal is not None:
        m = msg.multi_modal
        mm = MultiModalData(audio_features=list(m.audio_features), pixel_values=m.pixel_values,
                            image_grid_thw=m.image_grid_thw, pixel_values_videos=m.pixel_values_videos,
                            video_grid_thw=m.video_grid_thw, video_second_per_grid=m.video_second_per_grid,
                            use_audio_in_video=m.use_audio_in_video)
    kw = dict(request_id=msg.request_id, prompt_token_ids=np.asarray(msg.prompt_token_ids),
              sampling_params=msg.sampling_params, arrival_time=msg.arrival_time or None)
    if msg.voice is not None:  # vocoder stages
        kw["voice"] = msg.voice
    else:
        kw.update(inputs=inputs, multi_modal_data=mm)
    return kw
