"""Build a stage's engine from its pipeline config, and translate wire messages for it.

Runs inside the stage process. The family object (`models/<family>/family.py`) maps each
model stage to a builder that loads the checkpoint part, makes the engine and warms it up.
"""

from __future__ import annotations

import numpy as np

from ..config import StageConfig
from ..engine.runner import RequestInputs
from ..models.qwen2_5_omni.media import MultiModalData
from ..models.registry import get_family


def build_stage_engine(family: str, stage: StageConfig, ckpt_dir: str):
    """The warmed-up engine of one stage, or a clear error if OmniJax cannot serve it."""
    engines = get_family(family).engines
    if stage.model_stage not in engines:
        known = ", ".join(f"{family}/{s}" for s in engines)
        raise ValueError(f"no engine for stage {stage.model_stage!r} of {family!r} yet (available: {known})")
    return engines[stage.model_stage](stage, ckpt_dir)


def to_engine_request(msg) -> dict:
    """AddRequest -> keyword arguments of `AREngine.add_request`."""
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
