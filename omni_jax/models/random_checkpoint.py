"""Checkpoints of random weights, written with numpy: no torch, no download.

The built-in tiny models (`--model tiny`, `tiny-qwen3_omni`) and the suite's stand-ins where
torch is absent are made here, from an HF-style config of any size: the stages are traced
for their shapes only, their weights drawn with numpy, and the result is an OmniJax
checkpoint like one `omni-jax convert` writes.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Callable

import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..checkpoint import CONFIG_FILE, FORMAT_VERSION, GENERATION_CONFIG_FILE, save_stage
from .registry import abstract_module, family_of, get_family


def random_params(build, cfg, rng: np.random.Generator) -> dict[tuple, np.ndarray]:
    """A stage's parameters by path, drawn with numpy as flax's default initializers would
    (biases and log-scale activations 0, norm scales 1, kernels, embeddings and fused expert
    weights `[E, out, in]` normal with variance 1/fan-in), except layer scales: normal with
    std 0.1 instead of their 1e-6 start, so that the blocks they scale contribute. The module
    is only traced for its shapes: running flax's initializers compiles one program per
    parameter shape, half a minute for the tiny model."""
    module = abstract_module(lambda rngs: build(cfg, jnp.float32, rngs))
    _, params, _ = nnx.split(module, nnx.Param, ...)
    arrays = {}
    for path, v in nnx.to_flat_state(params):
        shape, leaf = v.get_value().shape, path[-1]
        if leaf in ("bias", "alpha", "beta"):
            a = np.zeros(shape)
        elif leaf in ("scale", "weight") and len(shape) == 1:
            a = np.ones(shape)
        elif leaf in ("kernel", "embedding"):
            fan_in = shape[-1] if leaf == "embedding" else int(np.prod(shape[:-1]))
            a = rng.standard_normal(shape) / np.sqrt(fan_in)
        elif leaf in ("gate_up_proj", "down_proj"):
            a = rng.standard_normal(shape) / np.sqrt(shape[-1])
        elif leaf == "gamma":
            a = 0.1 * rng.standard_normal(shape)
        else:
            raise ValueError(f"no random initializer for parameter {'/'.join(map(str, path))} {shape}")
        arrays[path] = a.astype(np.float32)
    return arrays


def write_random_checkpoint(out_dir: str, hf_config: dict, *, seed: int = 0,
                            generation_config: dict | None = None, speakers: dict | None = None,
                            write_tokenizer: Callable[[str], object] | None = None) -> str:
    """Write an fp32 OmniJax checkpoint of random weights for `hf_config` into `out_dir`.

    Every stage of the config's family whose config is present is written; `speakers` are the
    voices of a family that keeps them in a file (Qwen2.5-Omni's spk_dict.pt), and
    `write_tokenizer(dir)` writes the tokenizer files. Built beside `out_dir` and renamed at
    the end, so an interrupted build leaves nothing half-written.
    """
    family = family_of(hf_config)
    specs = get_family(family).stages
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".omni-jax-random-", dir=parent)
    try:
        stages, tables = [], {}
        rng = np.random.default_rng(seed)
        for name, spec in specs.items():
            if spec.config_key not in hf_config:
                continue
            arrays = random_params(spec.build, spec.parse_config(hf_config[spec.config_key]), rng)
            save_stage(os.path.join(tmp, name), arrays)
            if ("model", "embed_tokens", "embedding") in arrays:
                tables[f"{name}.model.embed_tokens.weight"] = arrays[("model", "embed_tokens", "embedding")]
            stages.append(name)
        side_files = get_family(family).side_files
        if side_files is not None:
            side_files(None, tables.__getitem__, hf_config, tmp, speakers=speakers)
        if write_tokenizer is not None:
            write_tokenizer(tmp)
        if generation_config is not None:
            with open(os.path.join(tmp, GENERATION_CONFIG_FILE), "w") as f:
                json.dump(generation_config, f)
        with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
            json.dump({"format_version": FORMAT_VERSION, "family": family, "dtype": "float32",
                       "stages": stages, "hf_config": hf_config}, f, indent=1)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
