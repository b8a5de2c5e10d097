"""Convert a Hugging Face Qwen-Omni checkpoint into an OmniJax checkpoint.

    omni-jax convert --hf-dir HF_DIR --out OUT_DIR [--dtype bfloat16|float32]
    python -m conversion.convert --hf-dir HF_DIR --out OUT_DIR

Weights are read with numpy (no torch). Every stage of the family whose weights are
in the HF directory is converted (see omni_jax/models/registry.py). The output is
written to a temporary directory beside OUT_DIR and renamed at the end, so a failed
run leaves nothing half-written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import jax
import ml_dtypes
import numpy as np
from tqdm import tqdm

from omni_jax.checkpoint import CONFIG_FILE, FORMAT_VERSION, building_dir, read_config, save_stage
from omni_jax.config import default_pipeline_for
from omni_jax.errors import CheckpointError, UnknownModelError
from omni_jax.models.registry import abstract_stage, family_of, get_family, param_shapes

from .mapping import convert_tensors, map_hf_tensors
from .safetensors_reader import SafetensorsCheckpoint

NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}

# Tokenizer, processor and generation files served next to the weights.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
    "added_tokens.json", "preprocessor_config.json", "processor_config.json", "chat_template.json",
    "chat_template.jinja", "generation_config.json", "video_preprocessor_config.json",
)


def read_hf_config(hf_dir: str) -> dict:
    """config.json of an HF directory, with clear errors for the common mistakes."""
    if not os.path.isdir(hf_dir):
        raise CheckpointError(f"HF directory {hf_dir} does not exist")
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"{hf_dir} has no config.json; is it a Hugging Face model directory?")
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None


def convert(hf_dir: str, out_dir: str, dtype: str = "bfloat16", overwrite: bool = False,
            progress: bool = True) -> str:
    """Convert `hf_dir` into `out_dir` (see module docstring). Returns out_dir."""
    if dtype not in NP_DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(NP_DTYPES)}, got {dtype!r}")
    hf_config = read_hf_config(hf_dir)
    family = family_of(hf_config)
    model_family = get_family(family)
    weights = SafetensorsCheckpoint(hf_dir)
    specs = model_family.stages
    present = {n: s for n, s in specs.items()
               if s.config_key in hf_config and any(k.startswith(s.hf_prefix) for k in weights)}
    if not present:
        raise CheckpointError(f"{hf_dir}: no weights of any {family} stage ({', '.join(specs)}) found")

    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and os.listdir(out_dir) and not overwrite:
        raise FileExistsError(f"{out_dir} exists and is not empty (pass --overwrite to replace it)")
    parameters = {}
    with building_dir(out_dir, ".omni-jax-convert-") as tmp:
        for name, spec in present.items():
            stage_cfg = spec.parse_config(hf_config[spec.config_key])
            shapes = param_shapes(abstract_stage(spec, stage_cfg))
            source = spec.tensor_view(weights) if spec.tensor_view else weights
            plan = map_hf_tensors(source.keys(), shapes, spec.hf_prefix, spec.renames, spec.ignore)
            bar = tqdm(total=len(plan), desc=f"converting {name}", unit="tensor", disable=not progress)
            arrays = convert_tensors(source.get, plan, shapes, NP_DTYPES[dtype], on_tensor=bar.update,
                                     place=_on_host())
            bar.close()
            parameters[name] = sum(int(a.size) for a in arrays.values())
            save_stage(os.path.join(tmp, name), arrays)
        if model_family.side_files is not None:
            model_family.side_files(hf_dir, weights.get, hf_config, tmp)
        for fname in TOKENIZER_FILES:
            src = os.path.join(hf_dir, fname)
            if os.path.isfile(src):
                shutil.copy2(src, os.path.join(tmp, fname))
        config = {"format_version": FORMAT_VERSION, "family": family, "dtype": dtype,
                  "stages": list(present), "parameters": parameters, "hf_config": hf_config}
        with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
            json.dump(config, f, indent=1)
    return out_dir


def _on_host():
    """Each converted tensor as a JAX array in host memory: orbax copies the numpy arrays it is
    given into JAX arrays before writing, which held a stage twice (a 61 GB Qwen3-Omni thinker
    needed 122 GB of RAM); given JAX arrays it writes them as they are. None where JAX has no
    CPU backend (JAX_PLATFORMS without cpu): numpy as before."""
    try:
        host = jax.devices("cpu")[0]
    except RuntimeError:
        return None
    return lambda a: jax.device_put(a, host)


def describe(ckpt_dir: str) -> str:
    """What a converted checkpoint holds, for a person: family, stages and the pipeline they get,
    voices, dtype and size."""
    cfg = read_config(ckpt_dir)
    family, stages = cfg["family"], cfg["stages"]
    pipeline = default_pipeline_for(family, checkpoint_stages=stages)
    count = sum(cfg.get("parameters", {}).values())
    size = count * np.dtype(NP_DTYPES[cfg["dtype"]]).itemsize
    speech = "audio" in pipeline.output_modalities
    if speech:
        try:
            voices = get_family(family).handoff(ckpt_dir).voices.names
        except (OSError, ValueError, KeyError) as e:
            voices = f"none ({e})"
    else:
        voices = "none (no speech stages: text replies only)"
    return "\n".join([
        f"  family:   {family} ({'speech out' if speech else 'text out only'})",
        f"  stages:   {', '.join(stages)} (default pipeline {pipeline.name!r})",
        f"  voices:   {voices if isinstance(voices, str) else ', '.join(voices) or 'none'}",
        f"  weights:  {count / 1e9:.2f} B parameters, {cfg['dtype']}, {size / 1e9:.2f} GB"])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hf-dir", required=True, help="Hugging Face model directory (config.json + safetensors), or "
                                                   "a Hub id (Qwen/Qwen2.5-Omni-7B) to fetch it from")
    p.add_argument("--out", required=True, help="output directory for the OmniJax checkpoint")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(NP_DTYPES), help="stored parameter dtype")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    """CLI body: returns the process exit code; errors go to stderr, one line."""
    try:
        out = convert(args.hf_dir, args.out, args.dtype, args.overwrite, progress=not args.no_progress)
    except (CheckpointError, UnknownModelError, FileExistsError, ValueError) as e:
        print(f"omni-jax convert: error: {e}", file=sys.stderr)
        return 1
    print(f"converted {args.hf_dir} -> {out}\n{describe(out)}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m conversion.convert", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
