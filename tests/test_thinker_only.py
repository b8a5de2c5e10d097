"""Checkpoints released without speech stages (Qwen3-Omni-30B-A3B-Thinking and -Captioner: a
thinker, no talker): converted, they load with the preset's thinker-only variant, chosen from
the checkpoint; a text chat equals transformers' thinker; a speech request is an error naming
the model, in the library and, as a 400, through `omni-jax serve` and the `openai` client.

The stand-in is the tiny random Qwen3-Omni of the suite, saved as such a checkpoint is: the
thinker's weights only and `enable_audio_output: false`, with the built-in tiny model's
tokenizer files beside them.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import openai
import pytest
import safetensors.numpy as stnp

from omni_jax import OmniJax, SamplingParams
from omni_jax.api import resolve_checkpoint_and_pipeline
from omni_jax.checkpoint import read_config
from omni_jax.config import load_pipeline_config

from omni_jax.errors import ConfigError

pytestmark = [pytest.mark.e2e, pytest.mark.torch]

PRESET = "qwen3_omni_tiny_thinker"
MESSAGES = [{"role": "user", "content": "Describe the sound, please."}]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def thinking_ckpt(qwen3_omni_hf_dir, tmp_path_factory) -> str:
    """The tiny Qwen3-Omni as a Thinking checkpoint, converted (fp32)."""
    from conversion.convert import convert
    from omni_jax.models.qwen3_omni.tiny import tiny_checkpoint

    hf = tmp_path_factory.mktemp("thinking_hf")
    config = json.loads((open(os.path.join(qwen3_omni_hf_dir, "config.json")).read()))
    config["enable_audio_output"] = False
    (hf / "config.json").write_text(json.dumps(config))
    tensors = stnp.load_file(os.path.join(qwen3_omni_hf_dir, "model.safetensors"))
    stnp.save_file({k: v for k, v in tensors.items() if k.startswith("thinker.")}, str(hf / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(tiny_checkpoint(), name), hf)
    return convert(str(hf), str(tmp_path_factory.mktemp("thinking") / "ckpt"), dtype="float32", progress=False)


def test_converted_thinking_checkpoint_gets_the_thinker_only_pipeline(thinking_ckpt, capsys):
    from conversion.convert import describe

    assert read_config(thinking_ckpt)["stages"] == ["thinker"]
    said = describe(thinking_ckpt)
    assert "family:   qwen3_omni (text out only)" in said
    assert "stages:   thinker (default pipeline 'qwen3_omni_thinker')" in said
    assert "voices:   none (no speech stages: text replies only)" in said
    _, pipeline = resolve_checkpoint_and_pipeline(thinking_ckpt, None)
    assert pipeline.name == "qwen3_omni_thinker" and pipeline.stage_names == ("thinker",)
    assert pipeline.output_modalities == ("text",)
    assert "holds only the thinker stage(s): pipeline 'qwen3_omni_thinker', text replies only" in capsys.readouterr().err
    # A pipeline with speech stages names what the checkpoint lacks and the pipeline to use.
    with pytest.raises(ConfigError, match=r"runs stage\(s\) \['talker', 'code2wav'\], which the checkpoint .* does "
                                          r"not hold \(it has \['thinker'\]\); use pipeline 'qwen3_omni_tiny_thinker'"):
        resolve_checkpoint_and_pipeline(thinking_ckpt, "qwen3_omni_tiny")
    # Speech from it is refused before any stage starts, naming the model.
    with pytest.raises(ConfigError, match=r"model '.*ckpt' speaks no audio: its pipeline 'qwen3_omni_tiny_thinker' "
                                          r"delivers only \['text'\]"):
        OmniJax(model=thinking_ckpt, pipeline=PRESET, output_modalities=["text", "audio"])


@pytest.fixture(scope="module")
def pipeline_yaml(tmp_path_factory) -> str:
    """The tiny thinker-only preset with one bucket of each kind (fewer programs to compile), as
    a YAML file for the server; the library runs the same, so the server's compiles are cached."""
    import yaml

    pipeline = load_pipeline_config(PRESET).with_overrides(thinker=dict(
        token_buckets=[32], decode_buckets=[1], max_num_seqs=1, max_num_batched_tokens=32,
        audio_chunk_buckets=[1], vision_patch_buckets=[64]))
    path = tmp_path_factory.mktemp("pipeline") / "thinking.yaml"
    path.write_text(yaml.safe_dump(pipeline.to_dict()))
    return str(path)


@pytest.fixture(scope="module")
def reference(qwen3_omni_hf_model, thinking_ckpt):
    """The prompt ids of MESSAGES and transformers' greedy thinker reply to them."""
    import torch

    from omni_jax.models.registry import get_family

    ids = get_family("qwen3_omni").prompt_processor(thinking_ckpt).process({"messages": MESSAGES}).prompt_token_ids
    ids = torch.tensor(np.asarray(ids), dtype=torch.long)[None]
    with torch.no_grad():
        out = qwen3_omni_hf_model.thinker.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                                   max_new_tokens=MAX_TOKENS, do_sample=False)
    return ids[0].tolist(), out[0, ids.shape[1]:].tolist()


def test_chat_equals_transformers_and_speech_fails_per_request(thinking_ckpt, pipeline_yaml, reference):
    prompt_ids, want = reference
    with OmniJax(model=thinking_ckpt, pipeline=pipeline_yaml) as omni:
        assert omni.voices == []
        out = omni.generate({"messages": MESSAGES}, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                            use_tqdm=False)[0]
        assert out.error is None, out.error
        assert out.prompt_token_ids == prompt_ids and out.token_ids == want
        with pytest.raises(ConfigError, match="speaks no audio"):
            omni.generate({"messages": MESSAGES}, output_modalities=["text", "audio"], use_tqdm=False)
        # The engine serves on after the refused request.
        again = omni.generate({"messages": MESSAGES}, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                              use_tqdm=False)[0]
        assert again.token_ids == want


def test_served_with_text_only(thinking_ckpt, pipeline_yaml, reference, tmp_path):
    """`omni-jax serve` on the checkpoint with no --modalities: text out, no voices, 400s for audio."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "omni_jax.cli", "serve", "--model", thinking_ckpt,
                             "--served-model-name", "thinking", "--pipeline", pipeline_yaml, "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(1)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["thinking"]
        assert httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["modalities"] == ["text"]
        assert httpx.get(f"{url}/v1/audio/voices", timeout=30).json() == {"voices": []}
        reply = client.chat.completions.create(model="thinking", messages=MESSAGES, temperature=0.0,
                                               max_tokens=MAX_TOKENS)
        assert reply.choices[0].message.content and reply.usage.completion_tokens == len(reference[1])
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="thinking", messages=MESSAGES, modalities=["text", "audio"],
                                           audio={"voice": "ethan", "format": "wav"})
        err = e.value.body
        assert err["param"] == "modalities" and err["type"] == "invalid_request_error"
        assert "model 'thinking' answers in text only (its checkpoint has no speech stages)" in err["message"]
        with pytest.raises(openai.BadRequestError, match="answers in text only"):
            client.audio.speech.create(model="thinking", voice="ethan", input="Hello.")
        # The refusals cost nothing: the next chat is answered as the first.
        again = client.chat.completions.create(model="thinking", messages=MESSAGES, temperature=0.0,
                                               max_tokens=MAX_TOKENS)
        assert again.choices[0].message.content == reply.choices[0].message.content
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()

