"""Checkpoints of random weights: no torch, no download.

The built-in tiny models (`--model tiny`, `tiny-qwen3_omni`), the suite's stand-ins where
torch is absent and the GPU check's real-size models are written here, from an HF-style
config of any size: the weights drawn as `random_weights` says, the result an OmniJax
checkpoint like one `omni-jax convert` writes.
"""

from __future__ import annotations

import json
import os
from typing import Callable

import numpy as np

from ..checkpoint import CONFIG_FILE, DTYPES, FORMAT_VERSION, GENERATION_CONFIG_FILE, building_dir, save_stage
from .random_weights import device_params, random_params
from .registry import family_of, get_family


def write_random_checkpoint(out_dir: str, hf_config: dict, *, seed: int = 0, dtype: str = "float32",
                            on_device: bool = False, generation_config: dict | None = None,
                            speakers: dict | None = None,
                            write_tokenizer: Callable[[str], object] | None = None) -> str:
    """Write an OmniJax checkpoint of random weights for `hf_config` into `out_dir`.

    Every stage of the config's family whose config is present is written, drawn with numpy
    (fixed values for a seed) or, `on_device`, with JAX on the default device (minutes faster
    at real size); `speakers` are the voices of a family that keeps them in a file
    (Qwen2.5-Omni's spk_dict.pt), and `write_tokenizer(dir)` writes the tokenizer files. Built
    beside `out_dir` and renamed at the end, so an interrupted build leaves nothing half-written.
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
            arrays = (device_params(spec.build, cfg, DTYPES[dtype], seed + i) if on_device
                      else random_params(spec.build, cfg, rng, DTYPES[dtype]))
            save_stage(os.path.join(tmp, name), arrays)
            if ("model", "embed_tokens", "embedding") in arrays:
                # on the host: the side files read rows of it by id lists (jax arrays take no lists)
                tables[f"{name}.model.embed_tokens.weight"] = np.asarray(arrays[("model", "embed_tokens", "embedding")])
            stages.append(name)
            parameters[name] = sum(int(a.size) for a in arrays.values())
            del arrays
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
