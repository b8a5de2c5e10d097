"""Build a stage's engine from its pipeline config, and translate wire messages for it.

Runs inside the stage process. The family object (`models/<family>/family.py`) maps each
model stage to a builder that loads the checkpoint part, makes the engine and warms it up.
"""

from __future__ import annotations

import numpy as np

from ..config import StageConfig
from ..models.registry import get_family


def build_stage_engine(family: str, stage: StageConfig, ckpt_dir: str):
    """The warmed-up engine of one stage, or a clear error if OmniJax cannot serve it."""
    engines = get_family(family).engines
    if stage.model_stage not in engines:
        known = ", ".join(f"{family}/{s}" for s in engines)
        raise ValueError(f"no engine for stage {stage.model_stage!r} of {family!r} yet (available: {known})")
    return engines[stage.model_stage](stage, ckpt_dir)


def to_engine_request(msg) -> dict:
    """AddRequest -> keyword arguments of the engine's `add_request` (the same inputs and media types)."""
    kw = dict(request_id=msg.request_id, prompt_token_ids=np.asarray(msg.prompt_token_ids),
              sampling_params=msg.sampling_params, arrival_time=msg.arrival_time or None)
    if msg.voice is not None:  # vocoder stages
        kw["voice"] = msg.voice
    else:
        kw.update(inputs=msg.inputs, multi_modal_data=msg.multi_modal)
    return kw
