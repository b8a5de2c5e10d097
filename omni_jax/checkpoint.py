"""The OmniJax checkpoint format: one orbax checkpoint per stage plus a JSON config.

Layout of a converted directory::

    omni_jax_config.json   {"format_version", "family", "dtype", "stages": [...], "hf_config": {...}}
    thinker/               orbax checkpoint: flat {"model.layers.0.self_attn.q_proj.kernel": array, ...}
    tokenizer.json ...     tokenizer / processor files copied from the HF directory

Loading rebuilds the stage module from the stored HF config, then checks that every
expected parameter is present with the right shape and dtype before restoring, and
names the first one that is not.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .errors import CheckpointError, ConfigKeyError, require
from .models.registry import abstract_stage, get_family

CONFIG_FILE = "omni_jax_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"  # copied from the HF checkpoint
FORMAT_VERSION = 1
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def path_key(path: tuple) -> str:
    """Flat string key of a parameter path, as stored on disk."""
    return ".".join(str(p) for p in path)


def save_stage(stage_dir: str, arrays: dict[tuple, np.ndarray]) -> None:
    """Write one stage's parameters as an orbax checkpoint at `stage_dir`."""
    import orbax.checkpoint as ocp

    ckptr = ocp.StandardCheckpointer()
    ckptr.save(os.path.abspath(stage_dir), {path_key(p): a for p, a in arrays.items()})
    ckptr.wait_until_finished()
    ckptr.close()


def read_config(ckpt_dir: str) -> dict:
    """The JSON config of a converted checkpoint, with a clear error if it is not one."""
    cfg_path = os.path.join(ckpt_dir, CONFIG_FILE)
    if not os.path.isfile(cfg_path):
        raise CheckpointError(
            f"{ckpt_dir} is not an OmniJax checkpoint ({CONFIG_FILE} missing); "
            f"convert a Hugging Face checkpoint first with `omni-jax convert`")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if cfg.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{cfg_path}: format_version {cfg.get('format_version')} is not "
                              f"{FORMAT_VERSION}; reconvert the checkpoint")
    return cfg


def eos_token_ids(ckpt_dir: str) -> tuple[int, ...]:
    """The ids that end the thinker's reply: `eos_token_id` of the checkpoint's generation config."""
    path = os.path.join(ckpt_dir, GENERATION_CONFIG_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing: it names the thinker's end-of-reply ids (eos_token_id); "
                              f"reconvert the checkpoint from a Hugging Face directory that has it")
    with open(path) as f:
        eos = require(json.load(f), "eos_token_id", section=path)
    return tuple(int(i) for i in (eos if isinstance(eos, list) else [eos]))


def parse_stage_config(ckpt_dir: str, spec, hf_config: dict):
    """A stage's config from the checkpoint's HF config; a missing value names the file."""
    try:
        return spec.parse_config(hf_config[spec.config_key])
    except ConfigKeyError as e:
        raise ConfigKeyError(f"{os.path.join(ckpt_dir, CONFIG_FILE)} (hf_config.{e})") from None


def load_checkpoint(path: str, stage: str = "thinker", dtype: str | None = None) -> tuple[nnx.Module, Any]:
    """Load one stage of a converted checkpoint: returns (module, stage config).

    `dtype` casts the stored parameters ("float32" or "bfloat16"); by default they
    are used as stored. Every parameter is validated for presence, shape and dtype.
    """
    import orbax.checkpoint as ocp

    cfg = read_config(path)
    specs = get_family(cfg["family"]).stages
    if stage not in specs or stage not in cfg["stages"]:
        raise CheckpointError(f"checkpoint {path} has no stage {stage!r}; it has {cfg['stages']}")
    spec = specs[stage]
    stage_cfg = parse_stage_config(path, spec, cfg["hf_config"])
    stored = DTYPES[cfg["dtype"]]
    want = DTYPES[dtype] if dtype else stored

    t0 = time.perf_counter()
    abstract = abstract_stage(spec, stage_cfg, stored)
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    flat = dict(nnx.to_flat_state(params))
    stage_dir = os.path.abspath(os.path.join(path, stage))
    if not os.path.isdir(stage_dir):
        raise CheckpointError(f"checkpoint {path} lacks the directory of stage {stage!r}")
    ckptr = ocp.StandardCheckpointer()
    try:
        meta = ckptr.metadata(stage_dir).item_metadata.tree
    except Exception as e:  # orbax raises various types for damaged checkpoints
        raise CheckpointError(f"cannot read {stage_dir}: {e}") from e
    for p, var in flat.items():
        key = path_key(p)
        exp = var.get_value()
        if key not in meta:
            raise CheckpointError(f"{stage_dir}: parameter {key!r} is missing")
        got = meta[key]
        if tuple(got.shape) != tuple(exp.shape):
            raise CheckpointError(f"{stage_dir}: parameter {key!r} has shape {tuple(got.shape)}, "
                                  f"expected {tuple(exp.shape)}")
        if np.dtype(got.dtype) != np.dtype(exp.dtype):
            raise CheckpointError(f"{stage_dir}: parameter {key!r} has dtype {got.dtype}, expected {exp.dtype}")
    extra = sorted(set(meta) - {path_key(p) for p in flat})
    if extra:
        raise CheckpointError(f"{stage_dir}: unexpected parameter {extra[0]!r} (checkpoint and model differ)")
    target = {path_key(p): jax.ShapeDtypeStruct(v.get_value().shape, v.get_value().dtype) for p, v in flat.items()}
    restored = ckptr.restore(stage_dir, target)
    ckptr.close()
    for p, var in flat.items():
        var.set_value(jnp.asarray(restored[path_key(p)], dtype=want))
    module = nnx.merge(graphdef, nnx.from_flat_state(flat), rest)
    if want != stored:
        module = _with_compute_dtype(spec, stage_cfg, module, want)
    print(f"[omni-jax] loaded stage {stage!r} from {path} ({len(flat)} tensors, {time.perf_counter() - t0:.1f}s)",
          file=sys.stderr, flush=True)
    return module, stage_cfg


def _with_compute_dtype(spec, stage_cfg, module, dtype):
    """Rebuild the module graph for another compute dtype and move the parameters over."""
    graphdef, _, rest = nnx.split(abstract_stage(spec, stage_cfg, dtype), nnx.Param, ...)
    _, params, _ = nnx.split(module, nnx.Param, ...)
    return nnx.merge(graphdef, params, rest)
