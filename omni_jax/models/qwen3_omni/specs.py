"""Qwen3-Omni's checkpoint stages (HF key prefixes, config sections, module builders, renames,
the per-expert key view) and the side file conversion writes beside them (the tts rows)."""

from __future__ import annotations

import os

import numpy as np
import safetensors.numpy

from ..family import StageSpec, prefixed_renames
from . import vision_encoder
from .code2wav import Code2WavConfig, Qwen3OmniCode2Wav
from .expert_keys import FusedExperts
from .talker import Qwen3OmniTalker, TalkerConfig
from .thinker import Qwen3OmniThinker, ThinkerConfig

# The thinker embedding rows of tts_bos / tts_eos / tts_pad, which the talker prompt needs.
TTS_ROWS_FILE = "tts_rows.safetensors"

STAGES: dict[str, StageSpec] = {
    "thinker": StageSpec(
        name="thinker", hf_prefix="thinker.", config_key="thinker_config",
        parse_config=ThinkerConfig.from_hf,
        build=lambda cfg, dtype, rngs: Qwen3OmniThinker(cfg, dtype=dtype, param_dtype=dtype, rngs=rngs),
        renames=prefixed_renames(vision_encoder.HF_RENAMES, "visual"),
        tensor_view=FusedExperts,
    ),
    "talker": StageSpec(
        name="talker", hf_prefix="talker.", config_key="talker_config",
        parse_config=TalkerConfig.from_hf,
        build=lambda cfg, dtype, rngs: Qwen3OmniTalker(cfg, dtype=dtype, param_dtype=dtype, rngs=rngs),
        tensor_view=FusedExperts,
    ),
    # The vocoder runs in fp32 whatever the checkpoint dtype (as Qwen2.5's token2wav).
    "code2wav": StageSpec(
        name="code2wav", hf_prefix="code2wav.", config_key="code2wav_config",
        parse_config=Code2WavConfig.from_hf,
        build=lambda cfg, dtype, rngs: Qwen3OmniCode2Wav(cfg, rngs=rngs),
    ),
}


def write_side_files(hf_dir: str | None, get_tensor, hf_config: dict, out_dir: str, **unused) -> None:
    """The thinker embedding rows of the tts special tokens (the talker handoff needs them)."""
    if "talker_config" not in hf_config:
        return
    table = get_tensor("thinker.model.embed_tokens.weight")
    rows = {name: np.asarray(table[int(hf_config[f"{name}_token_id"])], np.float32)
            for name in ("tts_bos", "tts_eos", "tts_pad")}
    safetensors.numpy.save_file(rows, os.path.join(out_dir, TTS_ROWS_FILE))
