"""Qwen2.5-Omni's checkpoint stages (HF key prefixes, config sections, module builders, renames)
and the side files conversion writes beside them (the voices)."""

from __future__ import annotations

import os
import sys

import numpy as np

from ..family import StageSpec, prefixed_renames
from . import token2wav_bigvgan, token2wav_dit, vision_encoder
from .talker import Qwen2_5OmniTalker, TalkerConfig
from .thinker import Qwen2_5OmniThinker, ThinkerConfig
from .token2wav import Qwen2_5OmniToken2Wav, Token2WavConfig
from .voices import read_spk_dict, write_voices

STAGES: dict[str, StageSpec] = {
    "thinker": StageSpec(
        name="thinker", hf_prefix="thinker.", config_key="thinker_config",
        parse_config=ThinkerConfig.from_hf,
        build=lambda cfg, dtype, rngs: Qwen2_5OmniThinker(cfg, dtype=dtype, param_dtype=dtype, rngs=rngs),
        renames=prefixed_renames(getattr(vision_encoder, "HF_RENAMES", ()), "visual"),
    ),
    "talker": StageSpec(
        name="talker", hf_prefix="talker.", config_key="talker_config",
        parse_config=TalkerConfig.from_hf,
        build=lambda cfg, dtype, rngs: Qwen2_5OmniTalker(cfg, dtype=dtype, param_dtype=dtype, rngs=rngs),
    ),
    # The vocoder always runs in fp32 (as transformers does), whatever the checkpoint dtype.
    "token2wav": StageSpec(
        name="token2wav", hf_prefix="token2wav.", config_key="token2wav_config",
        parse_config=Token2WavConfig.from_hf,
        build=lambda cfg, dtype, rngs: Qwen2_5OmniToken2Wav(cfg, rngs=rngs),
        renames=prefixed_renames(token2wav_dit.HF_RENAMES, "code2wav_dit_model")
        + prefixed_renames(token2wav_bigvgan.HF_RENAMES, "code2wav_bigvgan_model"),
    ),
}


def write_side_files(hf_dir: str | None, get_tensor, hf_config: dict, out_dir: str,
                     speakers: dict | None = None) -> None:
    """voices.safetensors from spk_dict.pt (or `speakers`) and the embedding tables."""
    if speakers is None and hf_dir is not None:
        speakers = read_spk_dict(hf_dir)
    if not os.path.isdir(os.path.join(out_dir, "talker")):  # no talker converted: no speech, no voices
        return
    if not speakers:  # the checkpoint converts (text serves), but speech would fail at start: say so now
        print(f"[omni-jax] {hf_dir or 'the checkpoint'} has no spk_dict.pt: converted without voices, so its "
              "speech stages cannot start; add the spk_dict.pt of the release and convert again", file=sys.stderr)
        return
    talker_cfg = TalkerConfig.from_hf(hf_config["talker_config"])
    thinker_table = get_tensor("thinker.model.embed_tokens.weight")
    talker_table = get_tensor("talker.model.embed_tokens.weight")
    write_voices(out_dir, speakers, lambda ids: np.asarray(thinker_table[list(ids)], np.float32),
                 lambda ids: np.asarray(talker_table[list(ids)], np.float32), talker_cfg)
