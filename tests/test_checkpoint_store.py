"""How a stage's parameters are stored (checkpoint.save_stage): uncompressed, and a stage
written with zstd (orbax's default, what checkpoints converted before held) loads the same;
or not at all: a stage whose weights are drawn when it loads (RANDOM_WEIGHTS_FILE)."""

from __future__ import annotations

import os
import shutil

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from omni_jax import OmniJax, SamplingParams
from omni_jax.config import load_pipeline_config
from omni_jax.checkpoint import CONFIG_FILE, RANDOM_WEIGHTS_FILE, load_checkpoint, save_stage
from omni_jax.errors import CheckpointError
from omni_jax.models.qwen2_5_omni.tiny import build_random_checkpoint, tiny_config
from omni_jax.models.qwen2_5_omni.voices import VOICES_FILE
from omni_jax.models.random_weights import param_init


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


@pytest.fixture(scope="module")
def weightless(tmp_path_factory):
    """The tiny Qwen2.5-Omni written twice: with its weights, and with none stored."""
    base = tmp_path_factory.mktemp("weightless")
    stored, drawn = str(base / "stored"), str(base / "drawn")
    build_random_checkpoint(stored, tiny_config(), tokenizer=False)
    build_random_checkpoint(drawn, tiny_config(), store_weights=False)
    return stored, drawn


def test_a_checkpoint_without_weights_has_its_stages_drawn_at_load(weightless):
    stored, drawn = weightless
    cfg = {d: json.load(open(os.path.join(d, CONFIG_FILE))) for d in weightless}
    assert cfg[drawn]["stages"] == cfg[stored]["stages"] == ["thinker", "talker", "token2wav"]
    assert cfg[drawn]["parameters"] == cfg[stored]["parameters"]
    assert os.path.isfile(os.path.join(drawn, VOICES_FILE))  # the talker's side file, from drawn rows
    for stage in cfg[drawn]["stages"]:
        assert os.listdir(os.path.join(drawn, stage)) == [RANDOM_WEIGHTS_FILE], stage
        ref, drawn_a = _params(load_checkpoint(stored, stage)[0]), _params(load_checkpoint(drawn, stage)[0])
        drawn_b = _params(load_checkpoint(drawn, stage, dtype="bfloat16")[0])
        assert drawn_a.keys() == ref.keys() == drawn_b.keys()
        for p, a in drawn_a.items():  # the stored stage's shapes and dtypes, by the same rules
            assert a.shape == ref[p].shape and a.dtype == ref[p].dtype, (stage, p)
            assert drawn_b[p].dtype == jnp.bfloat16 and np.isfinite(a).all(), (stage, p)
            kind, x = param_init(p, a.shape)
            if kind == "const":
                assert np.all(a == x), (stage, p)
            elif a.size >= 4096:
                assert abs(a.std() * np.sqrt(x) - 1) < 0.1, (stage, p)
        # seeded: the same values at every load (the bf16 load is the same draw, cast)
        again = _params(load_checkpoint(drawn, stage)[0])
        assert all(np.array_equal(again[p], a) for p, a in drawn_a.items()), stage


def test_a_model_of_drawn_weights_serves(weightless):
    _, drawn = weightless
    with OmniJax(model=drawn, pipeline=load_pipeline_config("qwen2_5_omni_tiny"), output_modalities=["text"]) as omni:
        out = omni.generate({"prompt_token_ids": [1, 2, 3, 4]},
                            SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 5 and out[0].finish_reason == "length", out[0].error


@pytest.mark.parametrize("content, problem", [
    ("{\"seed\": -1}", "seed -1 is not a non-negative integer"),
    ("{\"seed\": \"7\"}", "seed '7' is not a non-negative integer"),
    ("{\"seeds\": 7}", "cannot read the seed of the stage's random weights (KeyError"),
    ("not json", "cannot read the seed of the stage's random weights (JSONDecodeError"),
])
def test_a_bad_random_weights_file_is_named(tmp_path, weightless, content, problem):
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(weightless[1], ckpt)
    marker = os.path.join(ckpt, "talker", RANDOM_WEIGHTS_FILE)
    with open(marker, "w") as f:
        f.write(content)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(ckpt, "talker")
    assert marker in str(e.value) and problem in str(e.value)
