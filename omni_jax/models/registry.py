"""Model families and their stages: how to build each stage's module from an HF config.

A family is recognised from the HF `config.json` (`model_type`). Each stage names
the HF key prefix of its weights, the config section it is built from, and any key
renames the mechanical mapping (conversion/mapping.py) needs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np
from flax import nnx


class UnknownModelError(ValueError):
    """The checkpoint's architecture is not one OmniJax serves."""


@dataclasses.dataclass(frozen=True)
class StageSpec:
    """How one stage of a family is built and where its weights live in the HF checkpoint."""

    name: str
    hf_prefix: str
    config_key: str
    parse_config: Callable[[dict], Any]
    build: Callable[..., nnx.Module]
    renames: tuple[tuple[str, str], ...] = ()
    ignore: tuple[str, ...] = ()
    # Wraps the checkpoint (keys()/get()) when the stage's names are not 1:1 with the
    # files, e.g. per-expert tensors presented fused (conversion/moe.py FusedExperts).
    tensor_view: Callable[[Any], Any] | None = None


def _prefixed(renames, sub: str):
    """Re-anchor a sub-module's key renames (written relative to `sub.`) at the stage level."""
    out = []
    for pattern, repl in renames:
        anchored = pattern[1:] if pattern.startswith("^") else pattern
        out.append(("^" + sub.replace(".", r"\.") + r"\." + anchored, sub + "." + repl))
    return tuple(out)


def _qwen2_5_omni_stages() -> dict[str, StageSpec]:
    from .qwen2_5_omni import token2wav_bigvgan, token2wav_dit, vision_encoder
    from .qwen2_5_omni.talker import Qwen2_5OmniTalker, TalkerConfig
    from .qwen2_5_omni.token2wav import Qwen2_5OmniToken2Wav, Token2WavConfig
    from .qwen2_5_omni.thinker import Qwen2_5OmniThinker, ThinkerConfig

    return {
        "thinker": StageSpec(
            name="thinker", hf_prefix="thinker.", config_key="thinker_config",
            parse_config=ThinkerConfig.from_hf,
            build=lambda cfg, dtype, rngs: Qwen2_5OmniThinker(cfg, dtype=dtype, param_dtype=dtype, rngs=rngs),
            renames=_prefixed(getattr(vision_encoder, "HF_RENAMES", ()), "visual"),
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
            renames=_prefixed(token2wav_dit.HF_RENAMES, "code2wav_dit_model")
            + _prefixed(token2wav_bigvgan.HF_RENAMES, "code2wav_bigvgan_model"),
        ),
    }


def _qwen2_5_omni_side_files(hf_dir: str | None, get_tensor, hf_config: dict, out_dir: str,
                             speakers: dict | None = None) -> None:
    """voices.safetensors from spk_dict.pt (or `speakers`) and the embedding tables."""
    from .qwen2_5_omni.talker import TalkerConfig
    from .qwen2_5_omni.voices import read_spk_dict, write_voices

    if speakers is None and hf_dir is not None:
        speakers = read_spk_dict(hf_dir)
    if not speakers or "talker_config" not in hf_config:
        return
    talker_cfg = TalkerConfig.from_hf(hf_config["talker_config"])
    thinker_table = get_tensor("thinker.model.embed_tokens.weight")
    talker_table = get_tensor("talker.model.embed_tokens.weight")
    write_voices(out_dir, speakers, lambda ids: np.asarray(thinker_table[list(ids)], np.float32),
                 lambda ids: np.asarray(talker_table[list(ids)], np.float32), talker_cfg)


def _fused_experts(weights):
    # Imported on use: only conversion needs it, and `conversion` is a sibling package.
    from conversion.moe import FusedExperts

    return FusedExperts(weights)


def _qwen3_omni_stages() -> dict[str, StageSpec]:
    from .qwen3_omni import vision_encoder
    from .qwen3_omni.code2wav import Code2WavConfig, Qwen3OmniCode2Wav
    from .qwen3_omni.talker import Qwen3OmniTalker, TalkerConfig
    from .qwen3_omni.thinker import Qwen3OmniThinker, ThinkerConfig

    return {
        "thinker": StageSpec(
            name="thinker", hf_prefix="thinker.", config_key="thinker_config",
            parse_config=ThinkerConfig.from_hf,
            build=lambda cfg, dtype, rngs: Qwen3OmniThinker(cfg, dtype=dtype, param_dtype=dtype, rngs=rngs),
            renames=_prefixed(vision_encoder.HF_RENAMES, "visual"),
            tensor_view=_fused_experts,
        ),
        "talker": StageSpec(
            name="talker", hf_prefix="talker.", config_key="talker_config",
            parse_config=TalkerConfig.from_hf,
            build=lambda cfg, dtype, rngs: Qwen3OmniTalker(cfg, dtype=dtype, param_dtype=dtype, rngs=rngs),
            tensor_view=_fused_experts,
        ),
        # The vocoder runs in fp32 whatever the checkpoint dtype (as Qwen2.5's token2wav).
        "code2wav": StageSpec(
            name="code2wav", hf_prefix="code2wav.", config_key="code2wav_config",
            parse_config=Code2WavConfig.from_hf,
            build=lambda cfg, dtype, rngs: Qwen3OmniCode2Wav(cfg, rngs=rngs),
        ),
    }


FAMILIES: dict[str, Callable[[], dict[str, StageSpec]]] = {
    "qwen2_5_omni": _qwen2_5_omni_stages,
    "qwen3_omni": _qwen3_omni_stages,
}

# HF `model_type`s whose family name differs.
MODEL_TYPES: dict[str, str] = {"qwen3_omni_moe": "qwen3_omni"}

def _qwen3_omni_side_files(hf_dir: str | None, get_tensor, hf_config: dict, out_dir: str, **unused) -> None:
    """The thinker embedding rows of the tts special tokens (pipeline.py's handoff needs them)."""
    from .qwen3_omni.pipeline import write_tts_rows

    if "talker_config" in hf_config:
        write_tts_rows(out_dir, hf_config, get_tensor("thinker.model.embed_tokens.weight"))


# Files a family writes beside the stage checkpoints: (hf_dir, get_tensor(name), hf_config, out_dir).
SIDE_FILES: dict[str, Callable] = {
    "qwen2_5_omni": _qwen2_5_omni_side_files,
    "qwen3_omni": _qwen3_omni_side_files,
}


def family_of(hf_config: dict) -> str:
    """The OmniJax family of an HF config, or a clear error naming what was found."""
    model_type = hf_config.get("model_type")
    family = MODEL_TYPES.get(model_type, model_type)
    if family in FAMILIES:
        return family
    arch = hf_config.get("architectures")
    raise UnknownModelError(
        f"unsupported model: model_type={model_type!r}, architectures={arch!r}; "
        f"OmniJax supports {sorted(FAMILIES)}")


def stages_of(family: str) -> dict[str, StageSpec]:
    if family not in FAMILIES:
        raise UnknownModelError(f"unknown model family {family!r}; known: {sorted(FAMILIES)}")
    return FAMILIES[family]()


def abstract_stage(spec: StageSpec, stage_config, dtype=jnp.float32) -> nnx.Module:
    """The stage module with shapes only (no memory), for planning and loading."""
    return nnx.eval_shape(lambda: spec.build(stage_config, dtype, nnx.Rngs(0)))


def param_shapes(module: nnx.Module) -> dict[tuple, tuple]:
    """Flat {path: shape} of a module's parameters."""
    _, state, _ = nnx.split(module, nnx.Param, ...)
    return {p: tuple(v.get_value().shape) for p, v in nnx.to_flat_state(state)}
