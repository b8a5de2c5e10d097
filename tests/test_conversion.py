"""HF -> OmniJax conversion: round trip, bf16, and every bad-input path."""

from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np
import pytest
import safetensors.numpy as stnp

from conversion.convert import convert, main as convert_main
from conversion.mapping import inverse_transform_for, map_hf_tensors
from omni_jax import load_checkpoint
from omni_jax.checkpoint import CONFIG_FILE, eos_token_ids, read_config
from omni_jax.errors import CheckpointError, ConfigKeyError, UnknownModelError
from omni_jax.models.registry import abstract_stage, param_shapes, stages_of

pytestmark = pytest.mark.conversion


@pytest.fixture(scope="session")
def hf_tensors(qwen2_5_omni_hf_dir):
    return stnp.load_file(os.path.join(qwen2_5_omni_hf_dir, "model.safetensors"))


@pytest.fixture(scope="session")
def converted_fp32(converted_thinker_fp32):
    return converted_thinker_fp32


def _bad_copy(src_dir, dst_dir, edit=None, weights=True):
    """Copy an HF dir, optionally rewriting the weights through `edit(dict) -> dict`."""
    os.makedirs(dst_dir)
    shutil.copy(os.path.join(src_dir, "config.json"), dst_dir)
    if weights:
        tensors = stnp.load_file(os.path.join(src_dir, "model.safetensors"))
        if edit is not None:
            tensors = edit(tensors)
        stnp.save_file(tensors, os.path.join(dst_dir, "model.safetensors"))
    return dst_dir


def _assert_nothing_written(out_dir):
    parent = os.path.dirname(out_dir)
    assert not os.path.exists(out_dir)
    assert not [f for f in os.listdir(parent) if f.startswith(".omni-jax-convert-")]


@pytest.mark.parametrize("stage", ["thinker", "talker"])
def test_round_trip_every_tensor(converted_fp32, hf_tensors, stage):
    import orbax.checkpoint as ocp

    cfg = read_config(converted_fp32)
    assert cfg["family"] == "qwen2_5_omni" and {"thinker", "talker"} <= set(cfg["stages"])
    spec = stages_of("qwen2_5_omni")[stage]
    shapes = param_shapes(abstract_stage(spec, spec.parse_config(cfg["hf_config"][spec.config_key])))
    plan = map_hf_tensors(hf_tensors.keys(), shapes, spec.hf_prefix, spec.renames)
    stored = ocp.StandardCheckpointer().restore(os.path.abspath(os.path.join(converted_fp32, stage)))
    assert len(stored) == len(plan) == sum(k.startswith(spec.hf_prefix) for k in hf_tensors)
    for path, (key, leaf) in plan.items():
        back = inverse_transform_for(leaf, np.asarray(stored[".".join(map(str, path))]))
        np.testing.assert_array_equal(back, hf_tensors[key], err_msg=key)


def test_voices_converted_without_torch_at_serving(converted_fp32, qwen2_5_omni_hf_dir, hf_tensors):
    import torch

    from omni_jax.models.qwen2_5_omni.voices import Voices

    voices = Voices.load(converted_fp32)
    spk = torch.load(os.path.join(qwen2_5_omni_hf_dir, "spk_dict.pt"), weights_only=True)
    assert voices.names == sorted(spk)
    for name, ref in spk.items():
        v = voices.get(name)
        assert v.bos_token == int(ref["bos_token"])
        np.testing.assert_array_equal(v.cond, ref["cond"].numpy())
        np.testing.assert_array_equal(v.ref_mel, ref["ref_mel"].numpy().reshape(v.ref_mel.shape))
        np.testing.assert_array_equal(v.bos_embed, hf_tensors["thinker.model.embed_tokens.weight"][v.bos_token])
    np.testing.assert_array_equal(voices.row("codec_bos_embed"), hf_tensors["talker.model.embed_tokens.weight"][8293])
    with pytest.raises(ValueError, match="available voices: Chelsie, Ethan"):
        voices.get("Nobody")


def test_cli_says_what_it_converted(qwen2_5_omni_hf_dir, tmp_path, capsys):
    out = str(tmp_path / "out")
    assert convert_main(["--hf-dir", qwen2_5_omni_hf_dir, "--out", out, "--dtype", "float32", "--no-progress"]) == 0
    said = capsys.readouterr().out
    count = sum(read_config(out)["parameters"].values())
    assert count == sum(v.size for v in stnp.load_file(os.path.join(qwen2_5_omni_hf_dir, "model.safetensors")).values())
    assert f"converted {qwen2_5_omni_hf_dir} -> {out}" in said
    assert "family:   qwen2_5_omni (speech out)" in said
    assert "stages:   thinker, talker, token2wav (default pipeline 'qwen2_5_omni')" in said
    assert "voices:   Chelsie, Ethan" in said
    assert f"weights:  {count / 1e9:.2f} B parameters, float32, {4 * count / 1e9:.2f} GB" in said


def test_missing_voices_are_told_at_conversion(qwen2_5_omni_hf_dir, converted_fp32, tmp_path, capsys, monkeypatch):
    """Without spk_dict.pt the checkpoint converts (text serves) and the conversion says that speech
    will not. Without torch the voices convert the same (read torch-free); a voices file in torch's
    old format, which only torch reads, then stops the conversion, saying what to install."""
    import torch

    src = str(tmp_path / "hf")
    shutil.copytree(qwen2_5_omni_hf_dir, src)
    os.remove(os.path.join(src, "spk_dict.pt"))
    out = convert(src, str(tmp_path / "out"), dtype="float32", progress=False)
    assert f"{src} has no spk_dict.pt: converted without voices, so its speech stages cannot start" in \
        capsys.readouterr().err
    assert not os.path.exists(os.path.join(out, "voices.safetensors"))
    spk = torch.load(os.path.join(qwen2_5_omni_hf_dir, "spk_dict.pt"), weights_only=True)
    torch.save(spk, os.path.join(src, "spk_dict.pt"), _use_new_zipfile_serialization=False)
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    out = convert(qwen2_5_omni_hf_dir, str(tmp_path / "no_torch"), dtype="float32", progress=False)
    want = stnp.load_file(os.path.join(converted_fp32, "voices.safetensors"))
    got = stnp.load_file(os.path.join(out, "voices.safetensors"))
    assert want.keys() == got.keys() and all(np.array_equal(want[k], got[k]) for k in want)
    out = str(tmp_path / "out2")
    with pytest.raises(CheckpointError, match=r"spk_dict\.pt holds the voices in a torch file that cannot be read "
                                              r"without torch \(it is not in torch's zip format.*install torch"):
        convert(src, out, dtype="float32", progress=False)
    _assert_nothing_written(out)


def test_load_checkpoint_builds_the_thinker(converted_fp32):
    module, cfg = load_checkpoint(converted_fp32, stage="thinker")
    assert cfg.text.num_layers == 3
    assert module.lm_head.kernel[...].shape == (64, cfg.text.vocab_size)


def test_bf16_conversion_loads_and_runs(qwen2_5_omni_hf_dir, converted_fp32, tmp_path):
    import jax.numpy as jnp
    from omni_jax.models.layers.attention import AttentionMetadata

    out = convert(qwen2_5_omni_hf_dir, str(tmp_path / "bf16"), dtype="bfloat16", progress=False)
    ids = jnp.asarray([9707, 11, 1879, 0, 872, 77091], jnp.int32)

    def logits(path):
        m, _ = load_checkpoint(path)
        h, _, _ = m(m.model.embed(ids), jnp.arange(6), AttentionMetadata.dense(6))
        return np.asarray(m.compute_logits(h))

    m16, _ = load_checkpoint(out)
    assert m16.lm_head.kernel[...].dtype == jnp.bfloat16
    lo16, lo32 = logits(out), logits(converted_fp32)
    assert np.isfinite(lo16).all()
    assert np.abs(lo16 - lo32).max() < 0.05 * max(1.0, np.abs(lo32).max())


def test_a_stage_loads_a_run_of_parameters_at_a_time(converted_fp32, monkeypatch):
    """Host memory holds one run of RESTORE_GROUP_BYTES while a stage loads, not the stage: the
    parameters restored in runs (here each alone) equal those restored at once, on the default
    device."""
    import jax
    from flax import nnx

    import omni_jax.checkpoint as checkpoint

    def params(module):
        return jax.tree.leaves(nnx.state(module, nnx.Param))

    whole = params(load_checkpoint(converted_fp32, stage="thinker")[0])
    runs, groups = [], checkpoint._groups

    def recorded(flat, limit):
        runs.extend(groups(flat, limit))
        return runs

    monkeypatch.setattr(checkpoint, "_groups", recorded)
    monkeypatch.setattr(checkpoint, "RESTORE_GROUP_BYTES", 1)
    alone = params(load_checkpoint(converted_fp32, stage="thinker")[0])
    assert len(runs) == len(alone) == len(whole) > 100
    assert all(np.array_equal(a, w) and a.dtype == w.dtype for a, w in zip(alone, whole))
    assert all(not a.committed for a in alone)


def test_a_stage_is_held_once_in_host_memory_while_written(qwen2_5_omni_hf_dir, tmp_path, monkeypatch):
    """Orbax copies numpy arrays into JAX arrays before it writes them, holding a stage twice (2 GiB
    of numpy arrays peaked at 4.3 GiB of RSS, as JAX arrays 2.5 GiB): conversion hands it each
    tensor as a JAX array on the host CPU (never a GPU), made as the tensor is read."""
    import jax
    from flax import nnx

    import conversion.convert as convert_mod

    seen = {}
    save = convert_mod.save_stage

    def recording(stage_dir, arrays):
        seen[os.path.basename(stage_dir)] = (all(isinstance(a, jax.Array) for a in arrays.values()),
                                             {d.platform for a in arrays.values() for d in a.devices()})
        save(stage_dir, arrays)

    monkeypatch.setattr(convert_mod, "save_stage", recording)
    out = convert(qwen2_5_omni_hf_dir, str(tmp_path / "c"), dtype="float32", progress=False)
    assert seen == {name: (True, {"cpu"}) for name in ("thinker", "talker", "token2wav")}
    # orbax records those arrays' CPU placement; loading must not restore onto it (off the GPU,
    # and committed there: the engine's steps compiled again after warm-up).
    module, _ = load_checkpoint(out, stage="talker")
    params = jax.tree.leaves(nnx.state(module, nnx.Param))
    assert params and all(not a.committed and a.devices() == {jax.devices()[0]} for a in params)


def test_no_weights(qwen2_5_omni_hf_dir, tmp_path):
    src = _bad_copy(qwen2_5_omni_hf_dir, str(tmp_path / "hf"), weights=False)
    out = str(tmp_path / "out")
    with pytest.raises(CheckpointError, match="no safetensors weights"):
        convert(src, out, progress=False)
    _assert_nothing_written(out)


def test_other_architecture(qwen2_5_omni_hf_dir, tmp_path):
    src = _bad_copy(qwen2_5_omni_hf_dir, str(tmp_path / "hf"), weights=False)
    with open(os.path.join(src, "config.json"), "w") as f:
        json.dump({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, f)
    out = str(tmp_path / "out")
    with pytest.raises(UnknownModelError, match="llama"):
        convert(src, out, progress=False)
    _assert_nothing_written(out)


def test_truncated_safetensors(qwen2_5_omni_hf_dir, tmp_path):
    src = _bad_copy(qwen2_5_omni_hf_dir, str(tmp_path / "hf"))
    path = os.path.join(src, "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    out = str(tmp_path / "out")
    with pytest.raises(CheckpointError, match="model.safetensors.*truncated"):
        convert(src, out, progress=False)
    _assert_nothing_written(out)


def test_wrong_shape_names_key_and_shapes(qwen2_5_omni_hf_dir, tmp_path):
    key = "thinker.model.layers.1.mlp.up_proj.weight"

    def edit(t):
        t[key] = np.zeros((100, 64), np.float32)
        return t

    src = _bad_copy(qwen2_5_omni_hf_dir, str(tmp_path / "hf"), edit)
    out = str(tmp_path / "out")
    with pytest.raises(CheckpointError) as e:
        convert(src, out, progress=False)
    msg = str(e.value)
    assert key in msg and "(100, 64)" in msg and "(128, 64)" in msg
    _assert_nothing_written(out)


def test_missing_tensor_names_it(qwen2_5_omni_hf_dir, tmp_path):
    key = "thinker.audio_tower.layers.0.fc1.bias"
    src = _bad_copy(qwen2_5_omni_hf_dir, str(tmp_path / "hf"), lambda t: {k: v for k, v in t.items() if k != key})
    out = str(tmp_path / "out")
    with pytest.raises(CheckpointError, match=r"audio_tower\.layers\.0\.fc1\.bias"):
        convert(src, out, progress=False)
    _assert_nothing_written(out)


def test_cli_exit_code_and_message(qwen2_5_omni_hf_dir, tmp_path, capsys):
    src = _bad_copy(qwen2_5_omni_hf_dir, str(tmp_path / "hf"), weights=False)
    out = str(tmp_path / "out")
    assert convert_main(["--hf-dir", src, "--out", out, "--no-progress"]) == 1
    assert "no safetensors weights" in capsys.readouterr().err
    _assert_nothing_written(out)


def test_load_rejects_mismatched_checkpoint(converted_fp32, tmp_path):
    bad = str(tmp_path / "bad")
    shutil.copytree(converted_fp32, bad)
    cfg_path = os.path.join(bad, CONFIG_FILE)
    cfg = json.load(open(cfg_path))
    cfg["hf_config"]["thinker_config"]["text_config"]["intermediate_size"] = 96
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(CheckpointError, match=r"mlp\.(gate|up|down)_proj\.kernel.*shape"):
        load_checkpoint(bad)


def test_load_rejects_non_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="not an OmniJax checkpoint"):
        load_checkpoint(str(tmp_path))


def test_converted_checkpoint_keeps_the_generation_config(converted_fp32):
    assert eos_token_ids(converted_fp32) == (151643, 151645)


def test_missing_token_ids_name_the_key_and_the_file(converted_fp32, tmp_path):
    """Token ids come from the checkpoint's configs; a missing one is an error, never a built-in number."""
    bad = str(tmp_path / "bad")
    shutil.copytree(converted_fp32, bad)
    cfg_path = os.path.join(bad, CONFIG_FILE)
    cfg = json.load(open(cfg_path))
    del cfg["hf_config"]["talker_config"]["tts_codec_pad_token_id"]
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(ConfigKeyError, match=r"omni_jax_config\.json.*talker_config.*'tts_codec_pad_token_id'"):
        load_checkpoint(bad, stage="talker")


def test_a_generation_config_without_eos_ends_at_the_tokenizers_end_tokens(tmp_path, capsys):
    """A checkpoint saved without eos_token_id (or without generation_config.json) ends the reply
    at the tokenizer's eos token and <|im_end|>, and says so; with neither, the error names the file."""
    from transformers import AutoTokenizer

    from omni_jax.models.qwen2_5_omni.tiny import tiny_checkpoint

    ckpt = str(tmp_path)  # the small files are all it reads: the built-in tiny model's, no weights
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(tiny_checkpoint(), name), ckpt)
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    expected = tuple(sorted({tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}))
    gen_path = os.path.join(ckpt, "generation_config.json")
    gen = json.load(open(gen_path))
    del gen["eos_token_id"]
    json.dump(gen, open(gen_path, "w"))
    assert eos_token_ids(ckpt) == expected
    assert "generation_config.json has no eos_token_id: the reply ends at <|im_end|> (151645)" in capsys.readouterr().err
    os.remove(gen_path)
    assert eos_token_ids(ckpt) == expected
    assert "generation_config.json is missing: the reply ends at" in capsys.readouterr().err
    # As the released checkpoints write them: the ids in tokenizer_config.json, the eos an AddedToken.
    os.remove(os.path.join(ckpt, "tokenizer.json"))
    json.dump({"eos_token": {"content": "<|endoftext|>"},
               "added_tokens_decoder": {"151643": {"content": "<|endoftext|>"}, "151645": {"content": "<|im_end|>"}}},
              open(os.path.join(ckpt, "tokenizer_config.json"), "w"))
    assert eos_token_ids(ckpt) == (151643, 151645)
    # Tokenizer files that name neither token: nothing ends the reply.
    os.remove(os.path.join(ckpt, "tokenizer_config.json"))
    with pytest.raises(CheckpointError, match=r"generation_config\.json is missing, and the tokenizer files name "
                                              r"neither an eos_token nor <\|im_end\|>.*add eos_token_id"):
        eos_token_ids(ckpt)
