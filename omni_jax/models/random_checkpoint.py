"""Checkpoints of random weights: no torch, no download.

The built-in tiny models (`--model tiny`, `tiny-qwen3_omni`), the suite's stand-ins where
torch is absent and the GPU check's real-size models are written here, from an HF-style
config of any size: the weights drawn as `random_weights` says, the result an OmniJax
checkpoint like one `omni-jax convert` writes.
"""

from __future__ import annotations

import json
import math
import os
from typing import Callable

import numpy as np

from ..checkpoint import (CONFIG_FILE, DTYPES, FORMAT_VERSION, GENERATION_CONFIG_FILE, building_dir, save_stage,
                          write_random_weights_marker)
from .random_weights import RandomRows, random_params
from .registry import abstract_stage, family_of, get_family, param_shapes


def write_random_checkpoint(out_dir: str, hf_config: dict, *, seed: int = 0, dtype: str = "float32",
                            generation_config: dict | None = None,
                            speakers: dict | None = None,
                            write_tokenizer: Callable[[str], object] | None = None,
                            store_weights: bool = True) -> str:
    """Write an OmniJax checkpoint of random weights for `hf_config` into `out_dir`.

    Every stage of the config's family whose config is present is written, drawn with numpy
    (fixed values for a seed); `speakers` are the voices of a family that keeps them in a file
    (Qwen2.5-Omni's spk_dict.pt), and `write_tokenizer(dir)` writes the tokenizer files.
    `store_weights=False` writes no weights: each stage's directory says its weights are drawn,
    with JAX on the device, when it loads, so a model of any size costs no disk and no write
    (the GPU check's real-size speech pipeline: 14 GiB took 95 s to write there). Built beside
    `out_dir` and renamed at the end, so an interrupted build leaves nothing half-written.
    """
    family = family_of(hf_config)
    specs = get_family(family).stages
    with building_dir(out_dir, ".omni-jax-random-") as tmp:
        stages, tables, parameters = [], {}, {}
        rng = np.random.default_rng(seed)
        for i, (name, spec) in enumerate(specs.items()):
            if spec.config_key not in hf_config:
                continue
            cfg = spec.parse_config(hf_config[spec.config_key])
            stage_dir = os.path.join(tmp, name)
            embed = ("model", "embed_tokens", "embedding")
            if store_weights:
                arrays = random_params(spec.build, cfg, rng, DTYPES[dtype])
                save_stage(stage_dir, arrays)
                shapes = {p: a.shape for p, a in arrays.items()}
                if embed in arrays:
                    # on the host: the side files read rows of it by id lists (jax arrays take no lists)
                    tables[f"{name}.model.embed_tokens.weight"] = np.asarray(arrays[embed])
                del arrays
            else:
                write_random_weights_marker(stage_dir, seed + i)
                shapes = param_shapes(abstract_stage(spec, cfg, DTYPES[dtype]))
                if embed in shapes:
                    tables[f"{name}.model.embed_tokens.weight"] = RandomRows(shapes[embed], seed + i)
            stages.append(name)
            parameters[name] = sum(math.prod(s) for s in shapes.values())
        side_files = get_family(family).side_files
        if side_files is not None:
            side_files(None, tables.__getitem__, hf_config, tmp, speakers=speakers)
        if write_tokenizer is not None:
            write_tokenizer(tmp)
        if generation_config is not None:
            with open(os.path.join(tmp, GENERATION_CONFIG_FILE), "w") as f:
                json.dump(generation_config, f)
        with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
            json.dump({"format_version": FORMAT_VERSION, "family": family, "dtype": dtype,
                       "stages": stages, "parameters": parameters, "hf_config": hf_config}, f, indent=1)
    return out_dir
