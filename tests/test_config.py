"""Tests for omni_jax.config: presets load, stage selection, and errors that name the field."""

from __future__ import annotations

import copy
import json
import pickle
import re

import pytest
import yaml

import hf_tiny_qwen3
from omni_jax.checkpoint import CONFIG_FILE, FORMAT_VERSION, load_checkpoint, read_config

from omni_jax.config import (
    ConfigError,
    PipelineConfig,
    StageConfig,
    UnknownStageError,
    default_pipeline_for,
    list_presets,
    load_pipeline_config,
    pipeline_config_from_dict,
)
from omni_jax.errors import CheckpointError
from omni_jax.models.qwen2_5_omni.tiny import tiny_config
from omni_jax.models.registry import get_family, prompt_processor, resolve_model

pytestmark = pytest.mark.pipeline

PRESETS = ("qwen2_5_omni", "qwen2_5_omni_tiny", "qwen3_omni")


def base() -> dict:
    """A small valid pipeline as a dict; tests break one field at a time."""
    return {
        "name": "p",
        "family": "qwen2_5_omni",
        "stages": [
            {"name": "thinker", "max_num_seqs": 4, "max_num_batched_tokens": 64, "max_model_len": 256,
             "num_blocks": 64, "final_output": "text", "hidden_layers": [0, 3]},
            {"name": "talker", "inputs_from": "thinker", "max_num_seqs": 4, "max_num_batched_tokens": 64,
             "max_model_len": 256, "num_blocks": 64},
            {"name": "token2wav", "runner": "oneshot", "inputs_from": "talker", "final_output": "audio"},
        ],
    }


def with_stage(i: int, **changes) -> dict:
    d = base()
    d["stages"][i].update(changes)
    return d


def error_of(d: dict) -> str:
    with pytest.raises(ConfigError) as e:
        pipeline_config_from_dict(d)
    return str(e.value)


# --------------------------------------------------------------------------- presets


def test_presets_listed():
    assert set(PRESETS) <= set(list_presets())


@pytest.mark.parametrize("name", PRESETS)
def test_preset_loads_and_round_trips(name):
    cfg = load_pipeline_config(name)
    assert cfg.name == name
    assert cfg.stages[0].inputs_from is None
    assert cfg.stages_for(["text"])[-1].final_output == "text"
    assert cfg.stages_for(["text", "audio"]) == cfg.stages
    assert cfg.source.endswith(f"{name}.yaml")
    # Plain-data form reads back to an equal config, and the config survives pickling
    # (it is handed to spawned stage processes).
    assert pipeline_config_from_dict(cfg.to_dict()) == cfg
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    for s in cfg.stages:
        assert s.sampling_params() is not None  # default_sampling builds SamplingParams


def test_qwen2_5_omni_preset():
    cfg = load_pipeline_config("qwen2_5_omni")
    assert cfg.family == "qwen2_5_omni"
    assert cfg.stage_names == ("thinker", "talker", "token2wav")
    thinker, talker, t2w = cfg.stages
    assert (thinker.max_num_seqs, thinker.max_num_batched_tokens, thinker.max_model_len) == (64, 4096, 32768)
    assert thinker.hidden_layers == (0, 28)
    assert thinker.default_sampling == {"temperature": 0.0, "max_tokens": 2048}
    assert talker.default_sampling["top_k"] == 40 and talker.inputs_from == "thinker"
    assert (t2w.runner, t2w.model_stage, t2w.final_output, t2w.max_num_seqs) == ("oneshot", "token2wav", "audio", 8)
    assert [s.name for s in cfg.stages_for(["text"])] == ["thinker"]
    assert [s.name for s in cfg.stages_for(["text", "audio"])] == ["thinker", "talker", "token2wav"]
    assert [s.name for s in cfg.stages_for("audio")] == ["thinker", "talker", "token2wav"]


def test_tiny_preset():
    cfg = default_pipeline_for("qwen2_5_omni", tiny=True)
    assert cfg.name == "qwen2_5_omni_tiny"
    th = cfg.stage("thinker")
    assert (th.max_num_seqs, th.max_num_batched_tokens, th.max_model_len, th.num_blocks) == (8, 64, 512, 128)
    assert th.token_buckets == (16, 32, 64) and th.decode_buckets == (1, 2, 4, 8)
    assert th.audio_chunk_buckets == (1, 4, 32) and th.vision_patch_buckets == (64, 256)
    assert th.hidden_layers == (0, 3) and (th.backend, th.dtype) == (None, "float32")
    assert th.runner_config().resolved().backend == "cpu"  # the platform's: the C++ kernels here
    assert cfg.stage("token2wav").runner == "oneshot"


@pytest.mark.parametrize("family, seconds", [("qwen2_5_omni", 6.4), ("qwen3_omni", 8.0)])
def test_a_tiny_preset_takes_a_spoken_turn_of_seconds(family, seconds):
    """`omni-jax serve --model tiny` and its voice page: the thinker's largest audio bucket holds a
    spoken turn of several seconds in one encoder call (it held 0.8 s on Qwen2.5's, and a longer
    turn was refused before audio took several calls)."""
    buckets = default_pipeline_for(family, tiny=True).stage("thinker").audio_chunk_buckets
    assert prompt_processor(resolve_model(f"tiny-{family}")).audio_seconds(buckets[-1]) == pytest.approx(seconds)


def test_qwen3_omni_preset():
    cfg = default_pipeline_for("qwen3_omni")
    assert cfg.stage_names == ("thinker", "talker", "code2wav")
    assert cfg.stage("thinker").hidden_layers == (0, 24)
    assert cfg.stage("code2wav").final_output == "audio"


def test_default_pipeline_for_errors():
    with pytest.raises(ConfigError, match="qwen2_5_omni"):
        default_pipeline_for("llama")
    assert default_pipeline_for("qwen3_omni", tiny=True).name == "qwen3_omni_tiny"


def test_load_from_path(tmp_path):
    d = base()
    del d["name"]  # a file may leave the name to its file name
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(d))
    cfg = load_pipeline_config(str(path))
    assert cfg.name == "mine" and cfg.source == str(path)
    assert load_pipeline_config(path) == cfg
    assert load_pipeline_config(cfg) is cfg


# --------------------------------------------------------------------------- defaults and helpers


def test_stage_defaults():
    s = StageConfig(name="thinker")
    assert s.model_stage == "thinker" and s.runner == "ar"
    assert (s.max_num_seqs, s.max_num_batched_tokens, s.max_model_len, s.block_size) == (32, 2048, 8192, 16)
    assert s.num_blocks is None and s.kv_memory_fraction == 0.9
    assert s.audio_chunk_buckets == (1, 4, 16, 64) and s.vision_patch_buckets == (1024, 4096, 16384)
    assert s.enable_prefix_caching and s.backend is None and s.dtype is None
    assert s.default_sampling == {} and s.hidden_layers == () and s.ready_timeout_s == 600.0
    assert s.health_timeout_s == 30.0 and s.auto_restart is True
    assert s.resolved_token_buckets == (16, 32, 64, 128, 256, 512, 1024, 2048)
    assert s.resolved_decode_buckets == (1, 2, 4, 8, 16, 32)
    assert s.blocks_per_seq == 512
    hash(s)


def test_runner_config_follows_the_stage():
    s = StageConfig(name="thinker", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512,
                    token_buckets=[16, 64], hidden_layers=[0, 3], backend="reference")
    rc = s.runner_config(num_blocks=2, backend="pallas")
    assert (rc.max_num_seqs, rc.max_num_batched_tokens, rc.max_model_len, rc.token_buckets) == (8, 64, 512, (16, 64))
    assert (rc.capture_layers, rc.num_blocks, rc.backend) == ((0, 3), 2, "pallas")
    assert s.runner_config().num_blocks is None and s.runner_config().backend == "reference"


def test_lists_become_tuples():
    s = StageConfig(name="x", token_buckets=[16, 2048], hidden_layers=[0, 2], max_num_seqs=4)
    assert s.token_buckets == (16, 2048) and s.hidden_layers == (0, 2)


def test_kv_num_blocks():
    s = StageConfig(name="x", max_model_len=64, block_size=16)
    assert s.kv_num_blocks(available_bytes=1000, bytes_per_block=10) == 90
    assert StageConfig(name="x", max_model_len=64, num_blocks=7).kv_num_blocks(10**9, 1) == 7
    with pytest.raises(ConfigError, match="max_model_len"):
        s.kv_num_blocks(available_bytes=40, bytes_per_block=10)


def test_stage_lookup():
    cfg = pipeline_config_from_dict(base())
    assert cfg.stage("talker").name == "talker" and cfg.stage_index("token2wav") == 2
    with pytest.raises(UnknownStageError, match=r"no stage 'vocoder'.*\['thinker', 'talker', 'token2wav'\]"):
        cfg.stage("vocoder")
    with pytest.raises(KeyError):  # also a KeyError, like a dict lookup
        cfg.stage("vocoder")


def test_stages_for_unknown_modality():
    cfg = pipeline_config_from_dict(base())
    with pytest.raises(ConfigError, match=r"'video'.*supported: \['text', 'audio'\]"):
        cfg.stages_for(["text", "video"])
    with pytest.raises(ConfigError, match="must not be empty"):
        cfg.stages_for([])
    text_only = base()
    del text_only["stages"][2]
    cfg = pipeline_config_from_dict(text_only)
    with pytest.raises(ConfigError, match=r"supported: \['text'\]"):
        cfg.stages_for(["audio"])


def test_replace_stage_and_overrides():
    cfg = pipeline_config_from_dict(base())
    new = cfg.replace_stage("thinker", max_num_seqs=2)
    assert new.stage("thinker").max_num_seqs == 2 and cfg.stage("thinker").max_num_seqs == 4
    new = cfg.with_overrides(thinker={"dtype": "bfloat16"}, talker={"backend": "reference"})
    assert new.stage("thinker").dtype == "bfloat16" and new.stage("talker").backend == "reference"
    assert new.stage("token2wav") == cfg.stage("token2wav")
    with pytest.raises(ConfigError, match=r"stages\[0\] \(thinker\)\.max_num_seqs: must be a positive integer"):
        cfg.replace_stage("thinker", max_num_seqs=0)
    with pytest.raises(ConfigError, match=r"max_num_seq: unknown field \(did you mean max_num_seqs\?\)"):
        cfg.replace_stage("thinker", max_num_seq=2)
    with pytest.raises(UnknownStageError):
        cfg.with_overrides(vocoder={"max_num_seqs": 2})


def test_direct_stage_construction_validates():
    with pytest.raises(ConfigError, match=r"stage 'thinker', max_num_seqs: must be a positive integer, got -1"):
        StageConfig(name="thinker", max_num_seqs=-1)


# --------------------------------------------------------------------------- errors name the field


def test_negative_value_names_pipeline_stage_and_field():
    msg = error_of(with_stage(0, max_num_seqs=-1))
    assert msg == "pipeline 'p', stages[0] (thinker).max_num_seqs: must be a positive integer, got -1"


@pytest.mark.parametrize("field,value,expected", [
    ("max_num_seqs", "8", "must be a positive integer, got '8'"),
    ("max_model_len", 1.5, "must be a positive integer, got 1.5"),
    ("max_num_batched_tokens", True, "must be a positive integer, got True"),
    ("enable_prefix_caching", "yes", "must be true or false"),
    ("hidden_cache_mb", -1, "must be an integer >= 0, got -1"),
    ("kv_memory_fraction", 1.5, "in (0, 1]"),
    ("memory_fraction", 0, "in (0, 1]"),
    ("ready_timeout_s", -1, "positive number of seconds"),
    ("health_timeout_s", 0, "positive number of seconds"),
    ("health_timeout_s", float("inf"), "positive number of seconds"),
    ("auto_restart", "yes", "must be true or false"),
    ("runner", "diffusion", "must be one of 'ar', 'oneshot'"),
    ("backend", "triton", "must be one of null, 'pallas', 'cpu', 'reference'"),
    ("dtype", "float16", "must be one of null, 'float32', 'bfloat16'"),
    ("final_output", "video", "must be one of null, 'text', 'audio'"),
    ("hidden_layers", [0, -1], "integers >= 0"),
    ("hidden_layers", 3, "must be a list of integers"),
    ("device", -1, "device index"),
    ("audio_chunk_buckets", [4, 1], "strictly increasing"),
    ("vision_patch_buckets", [], "must not be empty"),
    ("num_blocks", 1, "integer >= 2"),
    ("num_blocks", 8, "must be >= 17 so that one request of max_model_len (256)"),
    ("default_sampling", [1], "must be a mapping"),
    ("codec_right_context_frames", -1, "must be null or an integer >= 0, got -1"),
    ("codec_left_context_frames", 2.5, "must be null or an integer >= 0, got 2.5"),
    ("clip_audio", "no", "must be true or false, got 'no'"),
])
def test_bad_values_name_the_field(field, value, expected):
    msg = error_of(with_stage(0, **{field: value}))
    assert f"stages[0] (thinker).{field}: " in msg
    assert expected in msg


def test_block_size_power_of_two():
    msg = error_of(with_stage(1, block_size=24))
    assert "stages[1] (talker).block_size: must be a power of two, got 24" in msg


def test_bad_buckets():
    msg = error_of(with_stage(0, token_buckets=[16, 64, 32]))
    assert "stages[0] (thinker).token_buckets: must be strictly increasing" in msg
    msg = error_of(with_stage(0, token_buckets=[16, 32]))
    assert "stages[0] (thinker).token_buckets: the last bucket (32) must be >= max_num_batched_tokens (64)" in msg
    msg = error_of(with_stage(0, decode_buckets=[1, 2]))
    assert "stages[0] (thinker).decode_buckets: the last bucket (2) must be >= max_num_seqs (4)" in msg
    msg = error_of(with_stage(0, decode_buckets=[0, 4]))
    assert "decode_buckets: must contain only positive integers" in msg
    msg = error_of(with_stage(0, token_buckets=[]))
    assert "token_buckets: must not be empty" in msg
    # A vocoder's decode buckets are batch sizes per call: a step may take several calls.
    vocoder = pipeline_config_from_dict(with_stage(2, max_num_seqs=16, decode_buckets=[1, 4, 8])).stages[2]
    assert (vocoder.max_num_seqs, vocoder.decode_buckets) == (16, (1, 4, 8))
    assert "decode_buckets: must be strictly increasing" in error_of(with_stage(2, decode_buckets=[4, 1]))


def test_unknown_field_suggests():
    msg = error_of(with_stage(1, max_num_seq=4))
    assert "stages[1] (talker).max_num_seq: unknown field (did you mean max_num_seqs?)" in msg
    d = base()
    d["stagez"] = d.pop("stages")
    assert "pipeline 'p', stagez: unknown field (did you mean stages?)" in error_of(d)
    msg = error_of(with_stage(0, zzz=1))
    assert "stages[0] (thinker).zzz: unknown field (known fields: name, model_stage" in msg


def test_missing_required():
    d = base()
    del d["family"]
    assert "pipeline 'p', family: is required" in error_of(d)
    d = base()
    del d["stages"][1]["name"]
    assert "stages[1].name: is required" in error_of(d)
    d = base()
    d["stages"] = []
    assert "pipeline 'p', stages: must be a non-empty list" in error_of(d)
    d = base()
    d["stages"][0] = "thinker"
    assert "pipeline 'p', stages[0]: must be a mapping" in error_of(d)
    d = base()
    d["family"] = "qwen2_omni"
    assert "family: must be one of 'qwen2_5_omni', 'qwen3_omni'" in error_of(d)


def test_duplicate_stage_names():
    msg = error_of(with_stage(1, name="thinker"))
    assert "stages[1] (thinker).name: duplicate stage name 'thinker' (also stages[0])" in msg


def test_inputs_from_must_name_an_earlier_stage():
    msg = error_of(with_stage(1, inputs_from="token2wav"))
    assert "stages[1] (talker).inputs_from: stage 'token2wav' is stages[2], not an earlier stage" in msg
    msg = error_of(with_stage(1, inputs_from="talker"))  # itself
    assert "stages[1] (talker).inputs_from:" in msg and "not an earlier stage" in msg
    msg = error_of(with_stage(2, inputs_from="vocoder"))
    assert "stages[2] (token2wav).inputs_from: no stage named 'vocoder'; earlier stages: ['thinker', 'talker']" in msg
    msg = error_of(with_stage(2, inputs_from=None))
    assert "stages[2] (token2wav).inputs_from: must name an earlier stage" in msg
    msg = error_of(with_stage(0, inputs_from="talker"))
    assert "stages[0] (thinker).inputs_from: must be null: the first stage" in msg


def test_bad_default_sampling():
    msg = error_of(with_stage(1, default_sampling={"temperature": -1}))
    assert "stages[1] (talker).default_sampling: " in msg and "temperature" in msg
    msg = error_of(with_stage(1, default_sampling={"temprature": 0.5}))
    assert "stages[1] (talker).default_sampling: unknown SamplingParams field 'temprature'" in msg
    assert "did you mean temperature?" in msg
    msg = error_of(with_stage(1, default_sampling={"max_tokens": 0}))
    assert "default_sampling: " in msg and "max_tokens" in msg


def test_output_stages():
    msg = error_of(with_stage(0, final_output=None))
    assert "pipeline 'p', stages: no stage has final_output 'text'" in msg
    msg = error_of(with_stage(1, final_output="audio"))
    assert "stages[2] (token2wav).final_output: 'audio' is already delivered by stages[1] (talker)" in msg


def test_error_field_attribute():
    with pytest.raises(ConfigError) as e:
        pipeline_config_from_dict(with_stage(1, block_size=3))
    assert e.value.field == "stages[1].block_size"
    assert e.value.problem == "must be a power of two, got 3"


# --------------------------------------------------------------------------- loading errors


def test_unknown_preset_lists_presets():
    with pytest.raises(ConfigError) as e:
        load_pipeline_config("qwen2_omni")
    msg = str(e.value)
    assert "unknown pipeline preset 'qwen2_omni'" in msg
    for name in PRESETS:
        assert name in msg


def test_missing_file():
    with pytest.raises(ConfigError, match="not found"):
        load_pipeline_config("/nonexistent/dir/x.yaml")


def test_bad_yaml_names_the_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("name: x\nstages: [\n  - {name: thinker\n")
    with pytest.raises(ConfigError, match=re.escape(str(path))):
        load_pipeline_config(str(path))


def test_duplicate_yaml_key(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("name: x\nfamily: qwen2_5_omni\nfamily: qwen3_omni\nstages: []\n")
    with pytest.raises(ConfigError, match="duplicate key 'family'"):
        load_pipeline_config(str(path))


def test_validation_error_in_file_names_the_file(tmp_path):
    path = tmp_path / "neg.yaml"
    path.write_text(yaml.safe_dump(with_stage(0, max_num_seqs=-1)))
    with pytest.raises(ConfigError) as e:
        load_pipeline_config(str(path))
    assert "stages[0] (thinker).max_num_seqs: must be a positive integer, got -1" in str(e.value)
    assert str(path) in str(e.value)


def test_top_level_not_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_pipeline_config(str(path))


def test_input_dict_not_mutated():
    d = base()
    before = copy.deepcopy(d)
    cfg = pipeline_config_from_dict(d)
    assert d == before
    assert isinstance(cfg, PipelineConfig)


# --------------------------------------------------------------------------- checkpoint configs (issue 20)


def _checkpoint_with(tmp_path, family: str, hf: dict, dtype="float32") -> str:
    """A converted-checkpoint directory holding only its JSON config (no weights)."""
    cfg = {"format_version": FORMAT_VERSION, "family": family, "dtype": dtype,
           "stages": list(get_family(family).stages), "hf_config": hf}
    (tmp_path / CONFIG_FILE).write_text(json.dumps(cfg))
    return str(tmp_path)


def _qwen2_5_hf():
    return tiny_config()


def _qwen3_hf():
    return hf_tiny_qwen3.qwen3_omni_config_dict()


BAD_CHECKPOINT_VALUES = [
    # (family config, stage, path of the value, value, what the error says)
    (_qwen2_5_hf, "thinker", "thinker_config.text_config.vocab_size", 0, "= 0 must be a positive integer"),
    (_qwen2_5_hf, "thinker", "thinker_config.text_config.hidden_size", -1, "= -1 must be a positive integer"),
    (_qwen2_5_hf, "thinker", "thinker_config.text_config.num_attention_heads", 0, "must be a positive integer"),
    (_qwen2_5_hf, "thinker", "thinker_config.text_config.rms_norm_eps", float("nan"), "= nan must be a finite"),
    (_qwen2_5_hf, "thinker", "thinker_config.text_config.rope_parameters.rope_theta", float("inf"),
     "= inf must be a finite number"),
    (_qwen2_5_hf, "thinker", "thinker_config.text_config.rms_norm_eps", 0.0, "= 0.0 must be positive"),
    (_qwen2_5_hf, "thinker", "thinker_config.text_config.intermediate_size", -5,
     "parsed thinker_config.text.intermediate_size = -5 must not be negative"),
    (_qwen2_5_hf, "talker", "talker_config.head_dim", 0, "must be a positive integer"),
    (_qwen3_hf, "thinker", "thinker_config.text_config.vocab_size", 0, "must be a positive integer"),
    (_qwen3_hf, "thinker", "thinker_config.text_config.rms_norm_eps", float("nan"), "must be a finite number"),
    (_qwen3_hf, "code2wav", "code2wav_config.rope_parameters.rope_theta", float("inf"), "must be a finite number"),
]


@pytest.mark.parametrize("make_hf, stage, path, value, expected", BAD_CHECKPOINT_VALUES,
                         ids=[f"{c[0].__name__[1:-3]}-{c[2].split('.')[-1]}={c[3]}" for c in BAD_CHECKPOINT_VALUES])
def test_impossible_checkpoint_value_names_the_field_and_the_file(tmp_path, make_hf, stage, path, value, expected):
    """Absurd checkpoint values used to fail with ZeroDivisionError / TypeError deep in the model,
    or load silently (rms_norm_eps NaN: every token 0): now a CheckpointError names both."""
    hf = make_hf()
    *parents, leaf = path.split(".")
    node = hf
    for key in parents:
        node = node[key]
    assert leaf in node, path  # break a value the config really has
    node[leaf] = value
    family = hf.get("model_type", "qwen3_omni")
    ckpt = _checkpoint_with(tmp_path, "qwen2_5_omni" if family == "qwen2_5_omni" else "qwen3_omni", hf)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(ckpt, stage)
    msg = str(e.value)
    assert str(tmp_path / CONFIG_FILE) in msg and expected in msg and leaf.split("_")[0] in msg, msg


@pytest.mark.parametrize("make_hf", [_qwen2_5_hf, _qwen3_hf])
def test_sane_checkpoint_config_passes_the_checks(tmp_path, make_hf):
    """The checks refuse nothing real: a valid config gets as far as the (absent) weights."""
    hf = make_hf()
    ckpt = _checkpoint_with(tmp_path, "qwen2_5_omni" if hf.get("model_type") == "qwen2_5_omni" else "qwen3_omni", hf)
    with pytest.raises(CheckpointError, match="lacks the directory of stage 'thinker'"):
        load_checkpoint(ckpt, "thinker")


def test_unknown_checkpoint_dtype_names_the_field_and_the_file(tmp_path):
    """dtype float16 used to be a bare KeyError('float16')."""
    ckpt = _checkpoint_with(tmp_path, "qwen2_5_omni", _qwen2_5_hf(), dtype="float16")
    want = re.escape(f"{tmp_path / CONFIG_FILE}: dtype 'float16' is not one of ['bfloat16', 'float32']")
    with pytest.raises(CheckpointError, match=want):
        read_config(ckpt)
    ok = _checkpoint_with(tmp_path, "qwen2_5_omni", _qwen2_5_hf())
    with pytest.raises(CheckpointError, match=r"load_checkpoint: dtype 'fp8' is not one of"):
        load_checkpoint(ok, "thinker", dtype="fp8")


def test_thinker_only_presets():
    """Every preset has its thinker-only variant: the stages up to the text reply, capturing no
    hidden layers (only the talker read them)."""
    for name in ("qwen2_5_omni", "qwen2_5_omni_tiny", "qwen3_omni", "qwen3_omni_tiny"):
        full, only = load_pipeline_config(name), load_pipeline_config(name + "_thinker")
        assert name + "_thinker" in list_presets()
        assert only.name == name + "_thinker" and only.family == full.family
        assert only.stage_names == ("thinker",) and only.output_modalities == ("text",)
        assert full.stage("thinker").hidden_layers and only.stage("thinker").hidden_layers == ()
        assert only.stage("thinker").to_dict() | {"hidden_layers": ()} == full.stage("thinker").to_dict() | {
            "hidden_layers": ()}
    assert default_pipeline_for("qwen3_omni", checkpoint_stages=["thinker", "talker", "code2wav"]).name == "qwen3_omni"
    assert default_pipeline_for("qwen3_omni", checkpoint_stages=["thinker"]).name == "qwen3_omni_thinker"
    with pytest.raises(ConfigError, match="unknown pipeline preset 'qwen3_omni_talker'"):
        load_pipeline_config("qwen3_omni_talker")
