"""How a stage's parameters are stored (checkpoint.save_stage): uncompressed, and a stage
written with zstd (orbax's default, what checkpoints converted before held) loads the same."""

from __future__ import annotations

import os
import shutil

import jax
import numpy as np
from flax import nnx

from omni_jax.checkpoint import load_checkpoint, save_stage
from omni_jax.models.qwen2_5_omni.tiny import build_random_checkpoint, tiny_config


def _params(module) -> dict:
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}


def _bytes(path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def test_stages_are_stored_uncompressed_and_compressed_ones_load(tmp_path):
    plain = str(tmp_path / "plain")
    build_random_checkpoint(plain, tiny_config(), dtype="bfloat16", tokenizer=False)
    module, _ = load_checkpoint(plain, "talker")
    params = _params(module)
    zstd = str(tmp_path / "zstd")
    shutil.copytree(plain, zstd)
    shutil.rmtree(os.path.join(zstd, "talker"))
    save_stage(os.path.join(zstd, "talker"), {p: jax.numpy.asarray(a) for p, a in params.items()}, compress=True)
    # random normal bf16 compresses by about a fifth: the default wrote every byte
    assert _bytes(os.path.join(zstd, "talker")) < 0.9 * _bytes(os.path.join(plain, "talker"))
    again, _ = load_checkpoint(zstd, "talker")
    loaded = _params(again)
    assert loaded.keys() == params.keys()
    for p, a in params.items():
        assert loaded[p].dtype == a.dtype and np.array_equal(loaded[p], a), p
