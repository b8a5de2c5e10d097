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


@pytest.fixture(scope="module")
def served(thinking_ckpt, pipeline_yaml, tmp_path_factory):
    """`omni-jax serve` on the checkpoint with no --modalities and no --reasoning-parser: its URL
    and an `openai` client."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = tmp_path_factory.mktemp("thinking_serve") / "serve.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "omni_jax.cli", "serve", "--model", thinking_ckpt,
                             "--served-model-name", "thinking", "--pipeline", pipeline_yaml, "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(1)
        yield url, openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()


def test_served_with_text_only(served, reference):
    """`omni-jax serve` on the checkpoint with no --modalities: text out, no voices, 400s for audio;
    replies are read for reasoning (a checkpoint without a talker whose vocabulary has the tags)."""
    url, client = served
    assert [m.id for m in client.models.list().data] == ["thinking"]
    assert httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["modalities"] == ["text"]
    assert httpx.get(f"{url}/v1/audio/voices", timeout=30).json() == {"voices": []}
    reply = client.chat.completions.create(model="thinking", messages=MESSAGES, temperature=0.0,
                                           max_tokens=MAX_TOKENS)
    assert reply.choices[0].message.content and reply.usage.completion_tokens == len(reference[1])
    # the random model does not think: all of its reply is the answer
    assert reply.choices[0].message.reasoning_content is None
    assert reply.usage.completion_tokens_details.reasoning_tokens == 0
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


# The random model made to think and then answer, the tags as the tokens they are (a grammar that
# names them holds the whole reply; any other holds the answer after the thinking).
THOUGHT, ANSWER = "The user coughs.", "A cough."
THINK = {"structured_outputs": {"grammar": f'start: <think> {json.dumps(chr(10) + THOUGHT + chr(10))} </think> '
                                           f'"\\n\\n" {json.dumps(ANSWER)}'}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
THINK_CALL = {"structured_outputs": {"grammar": f'start: <think> {json.dumps(chr(10) + THOUGHT + chr(10))} </think> '
                                                f'"\\n\\n" <tool_call> {json.dumps(chr(10) + CALL + chr(10))} </tool_call>'}}


def _thinking_tokens(ckpt: str) -> int:
    from omni_jax.models.registry import prompt_processor

    return len(prompt_processor(ckpt).tokenizer.encode(f"<think>\n{THOUGHT}\n</think>"))


def test_chat_gives_the_thinking_apart_from_the_answer(served, thinking_ckpt):
    """message.reasoning_content (and .reasoning) and content; streamed, the thinking's deltas
    first, then the answer's; the thinking's tokens in usage; none of it with include_reasoning
    false (vLLM's); a call after the thinking read from the answer."""
    _, client = served
    kw = dict(model="thinking", messages=MESSAGES, temperature=0.0, max_tokens=40)
    r = client.chat.completions.create(**kw, extra_body=THINK)
    m = r.choices[0].message
    assert (m.reasoning_content, m.reasoning, m.content) == (THOUGHT, THOUGHT, ANSWER)
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens_details.reasoning_tokens == _thinking_tokens(thinking_ckpt)
    assert r.usage.completion_tokens > r.usage.completion_tokens_details.reasoning_tokens
    hidden = client.chat.completions.create(**kw, extra_body={**THINK, "include_reasoning": False})
    assert hidden.choices[0].message.content == ANSWER and "reasoning_content" not in hidden.choices[0].message.model_extra
    hidden = list(client.chat.completions.create(**kw, extra_body={**THINK, "include_reasoning": False}, stream=True))
    assert not any("reasoning_content" in (c.choices[0].delta.model_extra or {}) for c in hidden if c.choices)
    assert "".join(c.choices[0].delta.content or "" for c in hidden if c.choices) == ANSWER

    chunks = list(client.chat.completions.create(**kw, extra_body=THINK, stream=True,
                                                 stream_options={"include_usage": True}))
    kinds = []
    for c in chunks[:-1]:
        d = c.choices[0].delta
        if getattr(d, "reasoning_content", None):
            assert d.reasoning == d.reasoning_content
            kinds.append(("reasoning", d.reasoning_content))
        if d.content:
            kinds.append(("content", d.content))
    assert "".join(t for k, t in kinds if k == "reasoning") == THOUGHT
    assert "".join(t for k, t in kinds if k == "content") == ANSWER
    first_answer = [k for k, _ in kinds].index("content")
    assert all(k == "content" for k, _ in kinds[first_answer:])
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == _thinking_tokens(thinking_ckpt)

    r = client.chat.completions.create(**kw, tools=[WEATHER], extra_body=THINK_CALL)
    m = r.choices[0].message
    assert m.reasoning_content == THOUGHT and m.content is None and r.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == [
        ("get_weather", {"city": "Paris"})]


def test_a_constraint_holds_the_answer_after_the_thinking(served):
    """response_format on a reasoning model: the thinking is free (here the random model is made
    to open it and go on thinking by a bias on <think>, which JSON alone would not allow)."""
    url, client = served
    start = httpx.post(f"{url}/tokenize", json={"model": "thinking", "prompt": "<think>"}, timeout=30).json()["tokens"]
    assert len(start) == 1
    r = client.chat.completions.create(model="thinking", messages=MESSAGES, temperature=0.0, max_tokens=4,
                                       response_format={"type": "json_object"}, logit_bias={str(start[0]): 100})
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "length" and m.content is None
    assert m.reasoning_content == "<think>" * 3 and r.usage.completion_tokens_details.reasoning_tokens == 4


def test_a_thinking_budget_ends_the_thinking(served):
    """vLLM's thinking_token_budget: the model, made to open its thinking and go on by a bias on
    <think>, ends it after the budget's tokens (the tags not counted) and answers; streamed the
    same; taken by the Responses API; refused with a grammar that holds the thinking itself."""
    url, client = served
    start = httpx.post(f"{url}/tokenize", json={"model": "thinking", "prompt": "<think>"}, timeout=30).json()["tokens"]
    bias = {str(start[0]): 100}
    kw = dict(model="thinking", messages=MESSAGES, temperature=0.0, max_tokens=8, logit_bias=bias)
    r = client.chat.completions.create(**kw, extra_body={"thinking_token_budget": 2})
    m = r.choices[0].message
    # <think>, two thinking tokens, </think>; then the bias's token as the answer's text
    assert (m.reasoning_content, m.content) == ("<think>" * 2, "<think>" * 4)
    assert r.usage.completion_tokens_details.reasoning_tokens == 4 and r.choices[0].finish_reason == "length"
    unbounded = client.chat.completions.create(**kw)
    assert unbounded.choices[0].message.reasoning_content == "<think>" * 7
    chunks = list(client.chat.completions.create(**kw, extra_body={"thinking_token_budget": 2}, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == m.reasoning_content
    assert "".join(d.content or "" for d in deltas) == m.content

    # the Responses API takes it too; a reply that does not open its thinking is not changed
    kw = dict(model="thinking", input="Describe the sound, please.", temperature=0.0, max_output_tokens=8)
    r = client.responses.create(**kw, extra_body={"thinking_token_budget": 0})
    assert r.output_text == client.responses.create(**kw).output_text and r.usage.output_tokens == 8

    for path, body in (("chat/completions", {"messages": MESSAGES}), ("responses", {"input": "Hello"})):
        refused = httpx.post(f"{url}/v1/{path}", timeout=60, json={
            "model": "thinking", **body, "thinking_token_budget": 4, **THINK})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "thinking_token_budget", refused.text


def test_responses_give_a_reasoning_item(served, thinking_ckpt):
    """The Responses API: a `reasoning` item before the message, its events in OpenAI's order,
    the thinking's tokens in usage; the next turn by previous_response_id and statelessly with
    the reasoning item given back, or only its encrypted_content (include, as store: false clients
    ask)."""
    _, client = served
    kw = dict(model="thinking", input="Describe the sound, please.", temperature=0.0, max_output_tokens=40,
              extra_body=THINK)
    r = client.responses.create(**kw)
    assert [o.type for o in r.output] == ["reasoning", "message"] and r.status == "completed"
    assert r.output[0].content[0].text == THOUGHT and r.output[0].summary == [] and r.output_text == ANSWER
    assert r.usage.output_tokens_details.reasoning_tokens == _thinking_tokens(thinking_ckpt)

    events = list(client.responses.create(**kw, stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    thinking_done = types.index("response.reasoning_text.done")
    assert set(types[4:thinking_done]) == {"response.reasoning_text.delta"}
    assert types[thinking_done:thinking_done + 5] == [
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == THOUGHT
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ANSWER
    assert [e.output_index for e in events if e.type == "response.output_item.added"] == [0, 1]
    assert events[2].item.type == "reasoning" and events[thinking_done + 3].item.type == "message"
    done = events[-1].response
    assert [o.type for o in done.output] == ["reasoning", "message"] and done.output[0].content[0].text == THOUGHT
    assert done.output[0].status == "completed" and done.output_text == ANSWER

    nxt = client.responses.create(model="thinking", previous_response_id=r.id, input="And then?",
                                  temperature=0.0, max_output_tokens=4)
    assert nxt.error is None
    given_back = [{"role": "user", "content": "Describe the sound, please."},
                  r.output[0].model_dump(exclude_none=True), r.output[1].model_dump(exclude_none=True),
                  {"role": "user", "content": "And then?"}]
    stateless = client.responses.create(model="thinking", input=given_back, temperature=0.0, max_output_tokens=4)
    assert stateless.output_text == nxt.output_text
    # A client that keeps no state asks for the thinking as encrypted_content and gives only that back.
    sealed = client.responses.create(**kw, store=False, include=["reasoning.encrypted_content"])
    thought = sealed.output[0]
    assert thought.encrypted_content and THOUGHT not in thought.encrypted_content
    opaque = {"type": "reasoning", "id": thought.id, "summary": [], "encrypted_content": thought.encrypted_content}
    given_back[1] = opaque
    again = client.responses.create(model="thinking", input=given_back, temperature=0.0, max_output_tokens=4)
    assert again.output_text == nxt.output_text
    assert r.output[0].encrypted_content is None  # only when asked for
    given_back[1] = {**opaque, "encrypted_content": "made up"}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="thinking", input=given_back, max_output_tokens=4)
    assert e.value.body["param"] == "input[1].encrypted_content"


def test_thinking_given_back_is_written_as_the_library_writes_it(served, thinking_ckpt):
    """An assistant message's reasoning_content in a conversation: the server's prompt (/tokenize)
    is the library's for the same messages (the thinking kept in the call loop after the last user
    message), and a reasoning item's text given to the Responses API is the same turn."""
    from omni_jax.models.registry import prompt_processor

    url, _ = served
    messages = [*MESSAGES, {"role": "assistant", "content": "", "reasoning_content": THOUGHT, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "20 C"}]
    got = httpx.post(f"{url}/tokenize", json={"model": "thinking", "messages": messages, "tools": [WEATHER]},
                     timeout=30).json()["tokens"]
    want = prompt_processor(thinking_ckpt).process({"messages": messages, "tools": [WEATHER]}).prompt_token_ids
    assert got == want.tolist()
    assert f"<think>\n{THOUGHT}\n</think>" in prompt_processor(thinking_ckpt).tokenizer.decode(got)
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.reasoning_content is only allowed in assistant"):
        openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0).chat.completions.create(
            model="thinking", messages=[{"role": "user", "content": "x", "reasoning_content": "y"}])



def test_realtime_says_the_answer_and_not_the_thinking(served):
    """A realtime reply is what is said: the thinking is left out of its text and its item."""
    from test_realtime import _text_of, _until

    _, client = served
    with client.realtime.connect(model="thinking") as conn:
        _until(conn, "session.created")
        conn.session.update(session={"type": "realtime", "output_modalities": ["text"]})
        _until(conn, "session.updated")
        conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "Describe the sound, please."}]})
        conn.response.create(response={"max_output_tokens": 40, "temperature": 0.0, "sampling_params_list": [
            {"structured_outputs": THINK["structured_outputs"]}]})
        seen = []
        done = _until(conn, "response.done", seen)
    assert _text_of(seen, "response.output_text.delta") == ANSWER
    assert done.response.status == "completed" and done.response.output[0].content[0].text == ANSWER
