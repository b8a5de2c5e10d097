"""A `model` given as a Hugging Face checkpoint directory or a Hub id (omni_jax/model_source.py):
fetched from a Hub on loopback (tests/fake_hub.py), converted once into the cache, served; and
each way it can go wrong, said."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from fake_hub import FakeHub
from test_server import serving
from omni_jax import model_source
from omni_jax.checkpoint import CONFIG_FILE, read_config
from omni_jax.errors import CheckpointError
from omni_jax.models.registry import resolve_model

REPO = "Qwen/Tiny-Omni"


@pytest.fixture
def caches(tmp_path, monkeypatch) -> Path:
    """Empty OmniJax and Hugging Face caches for this test."""
    monkeypatch.setenv("OMNI_JAX_CACHE", str(tmp_path / "omni-jax"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return tmp_path


def _checkpoint_dir(model: str, revision: str = "", **env: str) -> subprocess.CompletedProcess:
    """`checkpoint_dir(model, revision)` in a new process with these environment variables
    (huggingface_hub reads its own, HF_ENDPOINT and HF_HUB_OFFLINE, once, when imported)."""
    code = ("import sys; from omni_jax.model_source import checkpoint_dir; "
            "print(checkpoint_dir(sys.argv[1], sys.argv[2] or None, progress=False))")
    return subprocess.run([sys.executable, "-c", code, model, revision], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


@pytest.fixture
def hf_checkpoint(qwen2_5_omni_hf_dir, tmp_path) -> str:
    """The tiny Qwen2.5-Omni as a released checkpoint holds it: transformers' files, the
    tokenizer's (the built-in tiny model's), and a file conversion never reads."""
    d = tmp_path / "Tiny-Omni"
    shutil.copytree(qwen2_5_omni_hf_dir, d)
    tiny = resolve_model("tiny")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(tiny, name), d / name)
    (d / "pytorch_model.bin").write_bytes(b"\0" * 1024)
    return str(d)


def _refuse_conversion(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(model_source, "convert", refuse)


def test_a_checkpoint_directory_is_converted_once_and_again_when_it_changes(hf_checkpoint, caches, monkeypatch, capfd):
    out = model_source.checkpoint_dir(hf_checkpoint, progress=False)
    assert out.startswith(str(caches / "omni-jax" / "converted" / "Tiny-Omni-"))
    cfg = read_config(out)
    assert cfg["dtype"] == "float32" and cfg["stages"] == ["thinker", "talker", "token2wav"]  # the checkpoint's dtype
    for name in ("tokenizer.json", "voices.safetensors"):
        assert os.path.isfile(os.path.join(out, name)), name
    assert "converting it to OmniJax's format" in capfd.readouterr().err

    _refuse_conversion(monkeypatch)
    assert model_source.checkpoint_dir(hf_checkpoint) == out  # the next start loads the conversion
    assert model_source.checkpoint_dir(out) == out  # a converted checkpoint is itself
    monkeypatch.undo()
    monkeypatch.setenv("OMNI_JAX_CACHE", str(caches / "omni-jax"))
    weights = os.path.join(hf_checkpoint, "model.safetensors")
    os.utime(weights, ns=(time.time_ns(), time.time_ns() + 10**9))  # new weights in the same place
    again = model_source.checkpoint_dir(hf_checkpoint, progress=False)
    assert again != out and os.path.isfile(os.path.join(again, CONFIG_FILE))


def test_a_hub_id_is_fetched_converted_and_served_then_started_offline(hf_checkpoint, caches):
    hub = FakeHub(REPO, hf_checkpoint)
    try:
        got = _checkpoint_dir(REPO, HF_ENDPOINT=hub.url)
    finally:
        hub.close()
    assert got.returncode == 0, got.stderr[-2000:]
    out = got.stdout.strip()
    # only what conversion reads came down: not the .bin
    assert sorted(hub.fetched) == ["chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
                                   "spk_dict.pt", "tokenizer.json", "tokenizer_config.json"]
    assert out == str(caches / "omni-jax" / "converted" / f"Qwen--Tiny-Omni-{hub.commit[:12]}")
    assert "fetching its weights from the Hugging Face Hub" in got.stderr and "converted Qwen/Tiny-Omni" in got.stderr
    hub = FakeHub(REPO, hf_checkpoint)  # the same repo again (another port), asked for by its commit
    try:
        pinned = _checkpoint_dir(REPO, hub.commit, HF_ENDPOINT=hub.url)
    finally:
        hub.close()
    assert pinned.returncode == 0 and pinned.stdout.strip() == out and "converting" not in pinned.stderr
    assert hub.fetched == []  # all in the cache
    # `omni-jax convert` takes the Hub id too, into a directory of one's choice
    mine = caches / "mine"
    conv = subprocess.run([sys.executable, "-m", "omni_jax.cli", "convert", "--hf-dir", REPO, "--out", str(mine),
                           "--dtype", "float32", "--no-progress"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert conv.returncode == 0 and read_config(str(mine))["stages"] == ["thinker", "talker", "token2wav"], conv.stderr
    # the download deleted once converted (22 GB for the 7B): the next start fetches the config alone
    shutil.rmtree(caches / "hf")
    hub = FakeHub(REPO, hf_checkpoint)
    try:
        again = _checkpoint_dir(REPO, HF_ENDPOINT=hub.url)
    finally:
        hub.close()
    assert again.returncode == 0 and again.stdout.strip() == out, again.stderr[-2000:]
    assert hub.fetched == ["config.json"] and "fetching its weights" not in again.stderr
    # The Hub gone and offline: the server starts from the caches, converting nothing, and serves
    # the model under its Hub id.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": hub.url}
    with serving(["--model", REPO, "--pipeline", "qwen2_5_omni_tiny", "--modalities", "text"], env,
                 str(caches / "serve.log")) as server:
        assert [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]] == [REPO]
        reply = httpx.post(f"{server.url}/v1/chat/completions", timeout=120,
                           json={"model": REPO, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4, reply.text
        log = server.log()
    assert f"loaded stage 'thinker' from {out}" in log and "converting" not in log
    # start-up says what the stage is doing and when it is done (text only: the thinker alone)
    starting = log.find("[omni-jax] stage 'thinker': loading and compiling")
    assert starting >= 0 and re.search(r"\[omni-jax\] stage 'thinker' ready in [0-9.]+ s", log[starting:]), log[-3000:]


def test_hub_failures_are_said(caches, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    hub = FakeHub(REPO, str(empty), gated=("Qwen/Gated",))
    try:
        missing = _checkpoint_dir("Qwen/Nope", HF_ENDPOINT=hub.url)
        gated = _checkpoint_dir("Qwen/Gated", HF_ENDPOINT=hub.url)
        no_revision = _checkpoint_dir(REPO, "v9", HF_ENDPOINT=hub.url)
        serve = subprocess.run([sys.executable, "-m", "omni_jax.cli", "serve", "--model", "Qwen/Nope"],
                               capture_output=True, text=True, timeout=300, env={**os.environ, "HF_ENDPOINT": hub.url})
        conv = subprocess.run([sys.executable, "-m", "omni_jax.cli", "convert", "--hf-dir", "Qwen/Gated", "--out",
                               str(tmp_path / "out")], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "HF_ENDPOINT": hub.url})
    finally:
        hub.close()
    unreachable = _checkpoint_dir(REPO, HF_ENDPOINT=hub.url)
    offline = _checkpoint_dir(REPO, HF_ENDPOINT=hub.url, HF_HUB_OFFLINE="1")
    kept = caches / "omni-jax" / "converted" / "Qwen--Tiny-Omni-0123456789ab"  # an earlier conversion
    kept.mkdir(parents=True)
    (kept / CONFIG_FILE).write_text("{}")
    hinted = _checkpoint_dir(REPO, HF_ENDPOINT=hub.url, HF_HUB_OFFLINE="1")
    shutil.rmtree(caches / "omni-jax" / "converted")
    for run, said in ((missing, "Qwen/Nope: no such directory, and no such model on the Hugging Face Hub"),
                      (gated, "Qwen/Gated is gated on the Hugging Face Hub: accept its terms"),
                      (no_revision, "Qwen/Tiny-Omni has no revision 'v9'"),
                      (unreachable, "Qwen/Tiny-Omni is not in the Hugging Face cache and the Hub cannot be reached"),
                      (offline, "Qwen/Tiny-Omni is not in the Hugging Face cache")):
        assert run.returncode == 1 and f"CheckpointError: {said}" in run.stderr, run.stderr[-2000:]
    assert "hf download Qwen/Tiny-Omni" in unreachable.stderr
    assert hinted.returncode == 1 and f"Converted before, and loadable as the model: {kept}" in hinted.stderr
    assert serve.returncode == 1 and "omni-jax serve: error: Qwen/Nope: no such directory, and no such model" in serve.stderr, serve.stderr[-2000:]
    assert "listening" not in serve.stdout  # it stopped before opening its port
    assert conv.returncode == 1 and "omni-jax convert: error: Qwen/Gated is gated" in conv.stderr, conv.stderr[-2000:]
    assert not os.path.exists(caches / "omni-jax" / "converted")


def test_what_is_not_a_model_is_said(caches, tmp_path):
    with pytest.raises(CheckpointError, match="no such directory, and not a Hugging Face model id"):
        model_source.checkpoint_dir(str(tmp_path / "nowhere"))
    with pytest.raises(CheckpointError, match=r"is not an OmniJax checkpoint \(omni_jax_config.json missing\) nor a Hugging Face one"):
        model_source.checkpoint_dir(str(tmp_path))
    with pytest.raises(CheckpointError, match=r"a revision \('v1'\) is for a Hugging Face Hub id, and .* is not one"):
        model_source.checkpoint_dir(str(tmp_path), "v1")
    cli = subprocess.run([sys.executable, "-m", "omni_jax.cli", "generate", "--model", "tiny", "--revision", "v1",
                          "--prompt", "Hello"],
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode == 1 and "error: a revision ('v1') is for a Hugging Face Hub id, and tiny" in cli.stderr
    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(CheckpointError, match=r"unsupported model: model_type='llama'"):
        model_source.checkpoint_dir(str(other))
    assert not os.path.exists(caches / "omni-jax" / "converted")  # nothing written


def _fake_checkpoint(d: Path, weights: int = 1000) -> str:
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "qwen2_5_omni", "torch_dtype": "bfloat16"}')
    (d / "model.safetensors").write_bytes(b"\0" * weights)
    return str(d)


def test_a_disk_too_small_is_said_before_writing(caches, tmp_path, monkeypatch):
    hf = _fake_checkpoint(tmp_path / "big", weights=4096)
    _refuse_conversion(monkeypatch)
    monkeypatch.setattr(model_source.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**6, 10**6 - 100, 100))
    with pytest.raises(CheckpointError, match=r"needs about 0.0 GB in .*converted, which has 0.0 GB free.*OMNI_JAX_CACHE"):
        model_source.checkpoint_dir(hf)
    monkeypatch.undo()  # room enough, but the disk fills up as it writes
    monkeypatch.setenv("OMNI_JAX_CACHE", str(caches / "omni-jax"))

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(model_source, "convert", full)
    with pytest.raises(CheckpointError, match=r"converting .*big into .* failed: \[Errno 28\] No space left"):
        model_source.checkpoint_dir(hf)


def test_processes_starting_together_convert_once(caches, tmp_path, monkeypatch):
    """Two starts of one model at once (a server and a notebook): one converts, the other waits
    for it and loads the same directory."""
    hf = _fake_checkpoint(tmp_path / "m")
    made = []

    def slow_convert(hf_dir, out, dtype, overwrite, progress):
        made.append(dtype)
        time.sleep(0.5)
        os.makedirs(out)
        Path(out, CONFIG_FILE).write_text("{}")
        return out

    monkeypatch.setattr(model_source, "convert", slow_convert)
    monkeypatch.setattr(model_source, "describe", lambda out: "")
    got = []
    threads = [threading.Thread(target=lambda: got.append(model_source.checkpoint_dir(hf))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert made == ["bfloat16"] and len(set(got)) == 1 and len(got) == 3


def _plan_resolve(model: str, **env: str) -> subprocess.CompletedProcess:
    """`omni-jax plan`'s reading of `model` (preset, HF config), in a new process (as _checkpoint_dir)."""
    code = ("import json, sys; from omni_jax.gpu.plan import _resolve; "
            "preset, hf = _resolve(sys.argv[1], None); print(json.dumps([preset, hf]))")
    return subprocess.run([sys.executable, "-c", code, model], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def test_plan_takes_a_model_as_serve_does_reading_its_config_alone(caches, tmp_path):
    """`omni-jax plan --model` takes a Hub id (its config.json alone fetched: the 30B weights are
    61 GB) or a Hugging Face directory as well as a preset or converted checkpoint; a config
    without audio output plans the thinker alone."""
    from omni_jax.gpu.programs import real_hf_config

    real = real_hf_config("qwen3_omni")
    hub_dir, thinking = tmp_path / "hub", tmp_path / "Thinking"
    for d, cfg in ((hub_dir, real), (thinking, {**real, "enable_audio_output": False})):
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
    (hub_dir / "model-00001-of-00016.safetensors").write_bytes(b"\0" * 1024)
    hub = FakeHub("Qwen/Qwen3-Omni-30B-A3B-Instruct", str(hub_dir))
    try:
        fetched = _plan_resolve("Qwen/Qwen3-Omni-30B-A3B-Instruct", HF_ENDPOINT=hub.url)
    finally:
        hub.close()
    assert fetched.returncode == 0, fetched.stderr[-2000:]
    assert json.loads(fetched.stdout) == ["qwen3_omni", real] and hub.fetched == ["config.json"]
    assert json.loads(_plan_resolve(str(thinking)).stdout) == ["qwen3_omni_thinker", {**real, "enable_audio_output": False}]
    assert json.loads(_plan_resolve("qwen3_omni").stdout) == ["qwen3_omni", None]  # a preset: its real model
    tiny = json.loads(_plan_resolve(resolve_model("tiny")).stdout)
    assert tiny == ["qwen2_5_omni", read_config(resolve_model("tiny"))["hf_config"]]
    nowhere = str(tmp_path / "nowhere")
    for argv, said in (([nowhere], (f"error: --model {nowhere!r} is not a preset ['qwen2_5_omni', ",
                                    f"as a model: {nowhere}: no such directory, and not a Hugging Face model id")),
                       (["qwen3_omni", "--revision", "v1"],
                        ("error: a revision ('v1') is for a Hugging Face Hub id, and qwen3_omni is a preset",))):
        run = subprocess.run([sys.executable, "-m", "omni_jax.cli", "plan", "--model", *argv], capture_output=True,
                             text=True, timeout=300)
        assert run.returncode == 1 and "omni-jax plan: error: " in run.stderr, run.stderr
        assert all(part in run.stderr for part in said), run.stderr
    assert not os.path.exists(caches / "omni-jax" / "converted")  # nothing converted
