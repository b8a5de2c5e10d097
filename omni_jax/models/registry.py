"""The registry of model families: a family's name or HF `model_type` -> its `ModelFamily`.

Families are imported on first use, by module path (as vLLM's model registry does): reading
a pipeline config or a checkpoint's JSON needs the family names, not the model code.
"""

from __future__ import annotations

import importlib
import json
import os
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from ..errors import UnknownModelError
from .family import ModelFamily, StageSpec

# name -> module defining FAMILY
FAMILY_MODULES: dict[str, str] = {
    "qwen2_5_omni": "omni_jax.models.qwen2_5_omni.family",
    "qwen3_omni": "omni_jax.models.qwen3_omni.family",
}

# HF `model_type` -> family name
MODEL_TYPES: dict[str, str] = {"qwen2_5_omni": "qwen2_5_omni", "qwen3_omni_moe": "qwen3_omni"}

# The family of `--model tiny`, the built-in demo model; `tiny-<family>` names any family's.
TINY_FAMILY = "qwen2_5_omni"


def family_names() -> tuple[str, ...]:
    """The families OmniJax serves."""
    return tuple(FAMILY_MODULES)


def get_family(name: str) -> ModelFamily:
    """The family object called `name`, or UnknownModelError listing the known ones."""
    if name not in FAMILY_MODULES:
        raise UnknownModelError(f"unknown model family {name!r}; known: {sorted(FAMILY_MODULES)}")
    return importlib.import_module(FAMILY_MODULES[name]).FAMILY


def family_of(hf_config: dict) -> str:
    """The OmniJax family of an HF config, or a clear error naming what was found."""
    model_type = hf_config.get("model_type")
    if model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    arch = hf_config.get("architectures")
    raise UnknownModelError(
        f"unsupported model: model_type={model_type!r}, architectures={arch!r}; "
        f"OmniJax supports {sorted(FAMILY_MODULES)}")


def stages_of(family: str) -> dict[str, StageSpec]:
    """The checkpoint stages of a family."""
    return get_family(family).stages


def tiny_family(model: str) -> str | None:
    """The family of a built-in tiny model's name ("tiny", "tiny-qwen3_omni"), else None."""
    if model == "tiny":
        return TINY_FAMILY
    if model.startswith("tiny-") and model[5:] in FAMILY_MODULES:
        return model[5:]
    return None


def resolve_model(model: str) -> str:
    """A checkpoint directory for a `model` argument (a built-in tiny model is built on first use)."""
    family = tiny_family(model)
    if family is None:
        return model
    build = get_family(family).tiny_checkpoint
    if build is None:
        raise UnknownModelError(f"family {family!r} has no built-in tiny model")
    return build()


class _ShapeOnlyStream(nnx.RngStream):
    """An rng stream that hands out its key as it is, without counting draws.

    An abstract build reads shapes only, so the keys' values do not matter. Counting them
    would: nnx's Variable.set_value probes `getattr(value, "sharding", None)` on the updated
    count, and on a tracer that raises an error whose message walks the whole jaxpr traced so
    far. Building a model under tracing would then cost time quadratic in its parameter count
    (the tiny token2wav: 2.7 s instead of 0.4 s).
    """

    def __call__(self) -> jax.Array:
        return self.key[...]


def abstract_module(build: Callable[[nnx.Rngs], nnx.Module]) -> nnx.Module:
    """`build(rngs)` with shapes only (no memory): for planning, loading and conversion."""
    def traced():
        rngs = nnx.Rngs()
        rngs.default = _ShapeOnlyStream(0, tag="default")  # every named stream falls back to it
        return build(rngs)
    return nnx.eval_shape(traced)


def abstract_stage(spec: StageSpec, stage_config, dtype=jnp.float32) -> nnx.Module:
    """The stage module with shapes only (no memory), for planning and loading."""
    return abstract_module(lambda rngs: spec.build(stage_config, dtype, rngs))


def param_shapes(module: nnx.Module) -> dict[tuple, tuple]:
    """Flat {path: shape} of a module's parameters."""
    _, state, _ = nnx.split(module, nnx.Param, ...)
    return {p: tuple(v.get_value().shape) for p, v in nnx.to_flat_state(state)}


def checkpoint_family(ckpt_dir: str) -> str:
    """The family of a converted checkpoint (its JSON names it) or of an HF directory (its model_type)."""
    for name in ("omni_jax_config.json", "config.json"):
        path = os.path.join(ckpt_dir, name)
        if os.path.isfile(path):
            with open(path) as f:
                cfg = json.load(f)
            return cfg["family"] if "family" in cfg else family_of(cfg)
    raise UnknownModelError(f"{ckpt_dir} has neither omni_jax_config.json nor config.json")


def prompt_processor(ckpt_dir: str):
    """The prompt processor of a checkpoint, of its family's class."""
    return get_family(checkpoint_family(ckpt_dir)).prompt_processor(ckpt_dir)
