"""The OmniJax checkpoint format: one orbax checkpoint per stage plus a JSON config.

Layout of a converted directory::

    omni_jax_config.json   {"format_version", "family", "dtype", "stages": [...],
                            "parameters": {stage: count}, "hf_config": {...}}
    thinker/               orbax checkpoint: flat {"model.layers.0.self_attn.q_proj.kernel": array, ...}
                           (or only random_weights.json: weights drawn at load, see RANDOM_WEIGHTS_FILE)
    tokenizer.json ...     tokenizer / processor files copied from the HF directory

Loading rebuilds the stage module from the stored HF config, then checks that every
expected parameter is present with the right shape and dtype before restoring, and
names the first one that is not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from .engine import sharding
from .errors import CheckpointError, ConfigKeyError
from .models.random_weights import device_params
from .models.registry import abstract_stage, get_family

CONFIG_FILE = "omni_jax_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"  # copied from the HF checkpoint
END_OF_TURN = "<|im_end|>"  # the token every Qwen chat template (both families) closes a turn with
FORMAT_VERSION = 1
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# A stage is restored this many bytes at a time, each run moved to the device before the next is
# read: host memory holds one run, not the stage (61 GB for the Qwen3-Omni-30B-A3B thinker).
RESTORE_GROUP_BYTES = 1 << 30
# In a stage directory in place of its orbax checkpoint: the stage's weights are random, drawn
# when it loads from the seed this JSON gives (benchmarks at real size: nothing written or read).
RANDOM_WEIGHTS_FILE = "random_weights.json"

# Config fields that size a tensor or a loop: 0 builds an empty model or divides by zero. Other
# integers may be 0 (a MoE model's dense intermediate_size) but never negative once parsed.
POSITIVE_FIELDS = frozenset({
    "vocab_size", "hidden_size", "num_hidden_layers", "num_layers", "num_attention_heads", "num_heads",
    "num_key_value_heads", "num_kv_heads", "head_dim", "d_model", "encoder_layers", "encoder_attention_heads",
    "num_mel_bins", "mel_dim", "emb_dim", "num_embeds", "depth", "patch_size", "temporal_patch_size",
    "spatial_merge_size", "in_channels", "out_hidden_size", "output_dim",
})


def path_key(path: tuple) -> str:
    """Flat string key of a parameter path, as stored on disk."""
    return ".".join(str(p) for p in path)


@contextlib.contextmanager
def building_dir(out_dir: str, prefix: str):
    """A temporary directory beside `out_dir` to write a checkpoint into, renamed to `out_dir`
    (replacing it) when the block ends, removed if anything fails: an interrupted build leaves
    nothing half-written."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=prefix, dir=parent)
    try:
        yield tmp
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_stage(stage_dir: str, arrays: dict[tuple, np.ndarray], *, compress: bool = False) -> None:
    """Write one stage's parameters as an orbax checkpoint at `stage_dir`. Uncompressed by
    default: zstd saved a fifth of the disk (bf16) and made every start's load 1.3x slower
    (benchmarks/checkpoint_speed.py); a stage written `compress`ed loads all the same."""
    import orbax.checkpoint as ocp

    with ocp.PyTreeCheckpointer(use_compression=compress) as ckptr:
        ckptr.save(os.path.abspath(stage_dir), args=ocp.args.PyTreeSave({path_key(p): a for p, a in arrays.items()}))


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
    check_dtype(cfg.get("dtype"), f"{cfg_path}: dtype")
    return cfg


def check_dtype(name: Any, where: str) -> Any:
    """The jnp dtype called `name`, or CheckpointError naming `where` and the dtypes there are."""
    if not isinstance(name, str) or name not in DTYPES:
        raise CheckpointError(f"{where} {name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


def _value_problem(field: str, value: Any, parsed: bool) -> str | None:
    """Why a config value cannot be right, or None. `parsed`: a value of the stage's own config
    (any negative integer is wrong); raw HF values keep their -1 sentinels."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return "must be a finite number"
    if field in POSITIVE_FIELDS and (not isinstance(value, int) or value < 1):
        return "must be a positive integer"
    if field.endswith(("eps", "theta")) and value <= 0:
        return "must be positive"
    if parsed and value < 0:
        return "must not be negative"
    return None


def _config_values(node: Any, path: str, field: str):
    """(path, field name, value) of every leaf of a config: dataclass fields, dict keys, list items."""
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        for f in dataclasses.fields(node):
            yield from _config_values(getattr(node, f.name), f"{path}.{f.name}", f.name)
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from _config_values(v, f"{path}.{k}", str(k))
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            yield from _config_values(v, f"{path}[{i}]", field)
    else:
        yield path, field, node


def check_config_values(node: Any, where: str, section: str, parsed: bool) -> None:
    """CheckpointError naming the file and the field of the first value no model can have
    (sizes of 0 or below, NaN or infinite floats, a norm epsilon or rope theta of 0)."""
    for path, field, value in _config_values(node, section, section):
        problem = _value_problem(field, value, parsed)
        if problem:
            raise CheckpointError(f"{where}: {path} = {value!r} {problem}")


def eos_token_ids(ckpt_dir: str) -> tuple[int, ...]:
    """The ids that end the thinker's reply: `eos_token_id` of the checkpoint's generation
    config. A checkpoint saved without one (transformers' `save_pretrained` may leave it out)
    ends at the tokenizer's eos token and the chat template's end of turn instead, and says so."""
    path = os.path.join(ckpt_dir, GENERATION_CONFIG_FILE)
    generation = {}
    if os.path.isfile(path):
        with open(path) as f:
            generation = json.load(f)
    eos = generation.get("eos_token_id")
    if eos is not None and eos != []:
        return tuple(int(i) for i in (eos if isinstance(eos, list) else [eos]))
    found = "has no eos_token_id" if generation else "is missing"
    ids = _tokenizer_end_ids(ckpt_dir)
    if not ids:
        raise CheckpointError(
            f"{path} {found}, and the tokenizer files name neither an eos_token nor {END_OF_TURN}: "
            f"no id ends the thinker's reply; add eos_token_id to {GENERATION_CONFIG_FILE}")
    print(f"[omni-jax] {path} {found}: the reply ends at "
          + ", ".join(f"{token} ({i})" for token, i in ids.items())
          + " (the tokenizer's eos token and the chat template's end of turn)", file=sys.stderr)
    return tuple(sorted(set(ids.values())))


def _tokenizer_end_ids(ckpt_dir: str) -> dict[str, int]:
    """{token: id} of the tokenizer's eos token and END_OF_TURN, read from the tokenizer files
    (`tokenizer_config.json`, `special_tokens_map.json`, `tokenizer.json`) without building it."""
    def read(name):
        p = os.path.join(ckpt_dir, name)
        if not os.path.isfile(p):
            return {}
        with open(p) as f:
            return json.load(f)

    config, special, fast = read("tokenizer_config.json"), read("special_tokens_map.json"), read("tokenizer.json")
    vocab = {t["content"]: int(t["id"]) for t in fast.get("added_tokens", ())}
    vocab.update({t["content"]: int(i) for i, t in config.get("added_tokens_decoder", {}).items()})
    eos = config.get("eos_token") or special.get("eos_token")
    if isinstance(eos, dict):  # an AddedToken written out
        eos = eos.get("content")
    return {token: vocab[token] for token in dict.fromkeys((eos, END_OF_TURN)) if token in vocab}


def parse_stage_config(ckpt_dir: str, spec, hf_config: dict):
    """A stage's config from the checkpoint's HF config, its values checked before any model is
    built from them; a missing or impossible value names the file and the field."""
    where = os.path.join(ckpt_dir, CONFIG_FILE)
    section = f"hf_config.{spec.config_key}"
    if spec.config_key not in hf_config:
        raise ConfigKeyError(f"{where}: missing {section}")
    raw = hf_config[spec.config_key]
    check_config_values(raw, where, section, parsed=False)
    try:
        parsed = spec.parse_config(raw)
    except ConfigKeyError as e:
        raise ConfigKeyError(f"{where} (hf_config.{e})") from None
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise CheckpointError(f"{where}: cannot read {section}: {type(e).__name__}: {e}") from None
    check_config_values(parsed, where, f"parsed {spec.config_key}", parsed=True)
    return parsed


def load_checkpoint(path: str, stage: str = "thinker", dtype: str | None = None,
                    mesh: Mesh | None = None) -> tuple[nnx.Module, Any]:
    """Load one stage of a converted checkpoint: returns (module, stage config).

    `dtype` casts the stored parameters ("float32" or "bfloat16"); by default they
    are used as stored. Every parameter is validated for presence, shape and dtype, then the
    stage is restored in runs of RESTORE_GROUP_BYTES, each moved before the next is read.
    `mesh` (a stage spanning devices, engine/runner.stage_mesh): each parameter is restored
    straight into its place on the mesh (engine/sharding.PARAM_RULES, by the stage config's
    text.num_kv_heads), each device reading only its shard: the whole model is never on one
    device. Without it, everything goes to the default device. A stage directory holding
    RANDOM_WEIGHTS_FILE instead of an orbax checkpoint has its weights drawn here (on the default
    device, then placed on the mesh), by `models/random_weights`' rules.
    """
    cfg = read_config(path)
    specs = get_family(cfg["family"]).stages
    if stage not in specs or stage not in cfg["stages"]:
        raise CheckpointError(f"checkpoint {path} has no stage {stage!r}; it has {cfg['stages']}")
    spec = specs[stage]
    stage_cfg = parse_stage_config(path, spec, cfg["hf_config"])
    stored = DTYPES[cfg["dtype"]]  # checked by read_config
    want = check_dtype(dtype, "load_checkpoint: dtype") if dtype else stored

    t0 = time.perf_counter()
    abstract = abstract_stage(spec, stage_cfg, stored)
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    flat = dict(nnx.to_flat_state(params))
    stage_dir = os.path.abspath(os.path.join(path, stage))
    if not os.path.isdir(stage_dir):
        raise CheckpointError(f"checkpoint {path} lacks the directory of stage {stage!r}")
    seed = random_weights_seed(stage_dir)
    if seed is None:
        _restore(stage_dir, flat, _restore_args(mesh, stage_cfg, stage), want)
        how = "loaded"
    else:  # a stage of random weights (write_random_checkpoint(store_weights=False)): drawn here
        where = None if mesh is None else _mesh_placement(mesh, stage_cfg, stage)
        for p, array in device_params(spec.build, stage_cfg, stored, seed).items():
            array = jnp.asarray(array, dtype=want)
            if where is not None:
                array = jax.device_put(array, where("/".join(map(str, p)), array.shape))
            flat[p].set_value(array)
        how = f"drew random weights (seed {seed}) for"
    module = nnx.merge(graphdef, nnx.from_flat_state(flat), rest)
    if want != stored:
        module = _with_compute_dtype(spec, stage_cfg, module, want)
    print(f"[omni-jax] {how} stage {stage!r} from {path} ({len(flat)} tensors, {time.perf_counter() - t0:.1f}s)",
          file=sys.stderr, flush=True)
    return module, stage_cfg


def _restore(stage_dir: str, flat: dict, how, want) -> None:
    """Check every parameter of `flat` is stored in `stage_dir` with its shape and dtype (naming
    the first that is not), then restore them into `flat` in runs of RESTORE_GROUP_BYTES."""
    import orbax.checkpoint as ocp

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
    ckptr.close()
    with ocp.PyTreeCheckpointer() as reader:
        for group in _groups(flat, RESTORE_GROUP_BYTES):
            item = {path_key(p): flat[p].get_value() for p in group}
            args = {path_key(p): how("/".join(map(str, p)), flat[p].get_value()) for p in group}
            restored = reader.restore(stage_dir, args=ocp.args.PyTreeRestore(
                item=item, restore_args=args, partial_restore=True))
            for p in group:  # the cast keeps each array's sharding
                flat[p].set_value(jnp.asarray(restored.pop(path_key(p)), dtype=want))


def _groups(flat: dict, limit: int) -> list[list[tuple]]:
    """The parameters in order, in runs of at most `limit` bytes (a larger one alone)."""
    groups, size = [[]], 0
    for p, var in flat.items():
        nbytes = math.prod(var.get_value().shape) * np.dtype(var.get_value().dtype).itemsize
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += nbytes
    return groups


def _restore_args(mesh: Mesh | None, stage_cfg, stage: str):
    """(parameter path, abstract value) -> how orbax restores it: into the mesh's sharding by
    PARAM_RULES, or without a mesh as a numpy array that the caller moves to the default device.
    Never as the checkpoint recorded it: a stage converted from JAX host arrays records their
    CPU placement, and a parameter restored onto it (committed there) would be off the GPU and
    make the engine's steps compile again after warm-up."""
    import orbax.checkpoint as ocp

    if mesh is None:
        return lambda path, value: ocp.RestoreArgs(restore_type=np.ndarray)
    where = _mesh_placement(mesh, stage_cfg, stage)
    return lambda path, value: ocp.ArrayRestoreArgs(
        sharding=where(path, value.shape), global_shape=value.shape, dtype=value.dtype)


def _mesh_placement(mesh: Mesh, stage_cfg, stage: str):
    """(parameter path, shape) -> its sharding on `mesh` (engine/sharding.PARAM_RULES)."""
    text = getattr(stage_cfg, "text", None)
    if text is None or not hasattr(text, "num_kv_heads"):
        raise CheckpointError(f"stage {stage!r} runs on one device (no decoder to split over a mesh)")
    sharding.check_kv_heads(mesh, text.num_kv_heads)
    return sharding.param_sharding(mesh, text.num_kv_heads)


def random_weights_seed(stage_dir: str) -> int | None:
    """The seed of a stage whose weights are drawn at load (its RANDOM_WEIGHTS_FILE), or None
    for a stage of stored weights; CheckpointError for a file that does not give one."""
    marker = os.path.join(stage_dir, RANDOM_WEIGHTS_FILE)
    if not os.path.isfile(marker):
        return None
    try:
        with open(marker) as f:
            seed = json.load(f)["seed"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{marker}: cannot read the seed of the stage's random weights "
                              f"({type(e).__name__}: {e})") from None
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise CheckpointError(f"{marker}: seed {seed!r} is not a non-negative integer")
    return seed


def write_random_weights_marker(stage_dir: str, seed: int) -> None:
    """Make `stage_dir` a stage whose weights `load_checkpoint` draws (no weights stored)."""
    os.makedirs(stage_dir, exist_ok=True)
    with open(os.path.join(stage_dir, RANDOM_WEIGHTS_FILE), "w") as f:
        json.dump({"seed": seed}, f)


def _with_compute_dtype(spec, stage_cfg, module, dtype):
    """Rebuild the module graph for another compute dtype and move the parameters over."""
    graphdef, _, rest = nnx.split(abstract_stage(spec, stage_cfg, dtype), nnx.Param, ...)
    _, params, _ = nnx.split(module, nnx.Param, ...)
    return nnx.merge(graphdef, params, rest)
