"""`omni-jax serve` as a user runs it: a real server process on a loopback port, driven by the
official `openai` client, checked against `OmniJax.generate` with the same prompt and params.

One server (API key on) and one library instance serve the whole module; JAX's persistent
compilation cache lets the second of them skip most compiling. Tests run in file order:
the stage-death and shutdown tests come last because they end the server.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import wave
from importlib import resources

import httpx
import numpy as np
import openai
import pytest
import yaml

from omni_jax import OmniJax, SamplingParams
from omni_jax.server.app import build_app
from omni_jax.server.engine import ServedEngine
from omni_jax.server.speech import speech_prompt

pytestmark = pytest.mark.server

API_KEY = "test-key-123"
MODEL = "tiny"
MAX_BODY_MB = 1
MAX_IMAGE_PIXELS = 448 * 336  # --media-limits (see _serve_args)
HELLO = [{"role": "user", "content": "Hello"}]
SR = 24000
# The vocoder draws its initial noise from the request's seed: fix it on both sides.
VOCODER_SEED = {"seed": 1234}
SPL = {"sampling_params_list": [None, None, VOCODER_SEED]}


# ---------------------------------------------------------------------------------------- fixtures

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def _children(pid: int) -> list[int]:
    """Live processes whose parent is `pid`."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
                out.append(int(d))
    return out


def _wait_gone(pids, timeout=20.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Environment of the server and this process: CPU JAX; the servers' stages share the
    session's persistent compilation cache (conftest) with the rest of the suite."""
    e = {"JAX_PLATFORMS": "cpu"}
    saved = {k: os.environ.get(k) for k in e}
    os.environ.update(e)
    yield {**os.environ, **e}
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def pipeline_yaml(tmp_path_factory) -> str:
    """The tiny preset with few buckets (quick warm-up) and a greedy talker (reproducible speech)."""
    cfg = yaml.safe_load(resources.files("omni_jax").joinpath("configs/qwen2_5_omni_tiny.yaml").read_text())
    st = {s["name"]: s for s in cfg["stages"]}
    cfg["name"] = "qwen2_5_omni_tiny_server_test"
    st["thinker"].update(token_buckets=[64], decode_buckets=[1, 8], max_num_seqs=8)
    st["talker"].update(token_buckets=[64], decode_buckets=[1, 4], max_num_seqs=4,
                        default_sampling=dict(temperature=0.0, repetition_penalty=1.05, max_tokens=40))
    st["token2wav"].update(token_buckets=[48], decode_buckets=[1, 4], max_num_seqs=4)
    path = tmp_path_factory.mktemp("pipeline") / "server_test.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def with_audio_buckets(server_yaml: str, buckets: list[int], tag: str) -> str:
    """A copy of the server's pipeline (its compiles are cached) whose thinker has these audio
    encoder buckets (the tiny encoder's chunks are 0.2 s; the preset's largest bucket is 32)."""
    with open(server_yaml) as f:
        cfg = yaml.safe_load(f)
    next(s for s in cfg["stages"] if s["name"] == "thinker")["audio_chunk_buckets"] = buckets
    path = server_yaml.replace(".yaml", f"_{tag}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    """One folder of media for the session's modules (a kept server allows its path)."""
    from PIL import Image

    import av

    d = tmp_path_factory.getbasetemp() / "server_media"
    if d.is_dir():
        return d
    d.mkdir()
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (56, 56, 3), np.uint8)).save(d / "cat.png")
    with av.open(str(d / "clip.mp4"), "w") as out:
        stream = out.add_stream("mpeg4", rate=4)
        stream.width, stream.height, stream.pix_fmt = 64, 64, "yuv420p"
        for _ in range(8):
            frame = av.VideoFrame.from_ndarray(rng.integers(0, 255, (64, 64, 3), np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return d


class Server:
    """A running `omni-jax serve` subprocess."""

    def __init__(self, proc, url, log_path, health_seen):
        self.proc, self.url, self.log_path, self.health_seen = proc, url, log_path, health_seen

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def stage_pids(self) -> dict[str, int]:
        m = re.search(r"stage pids (\{.*\})", self.log())
        return {k: int(v) for k, v in re.findall(r"'(\w+)': (\d+)", m.group(1))}


def _start_server(args, env, log_path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "omni_jax.cli", "serve", "--port", str(port), *args],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    return proc, f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def serving(args, env, log_path):
    """`omni-jax serve` with `args`, once /health says 200 (what it said before is kept); stopped
    with SIGTERM afterwards."""
    proc, url = _start_server(args, env, log_path)
    seen = []
    deadline = time.monotonic() + 900
    try:
        while True:
            assert proc.poll() is None, open(log_path).read()
            assert time.monotonic() < deadline, "server not ready in time:\n" + open(log_path).read()
            try:
                r = httpx.get(f"{url}/health", timeout=5)
                seen.append((r.status_code, r.json()))
                if r.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        yield Server(proc, url, log_path, seen)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)


def _serve_args(pipeline_yaml, media_dir) -> list[str]:
    """The test server's command line on `pipeline_yaml`."""
    return ["--model", MODEL, "--pipeline", pipeline_yaml, "--api-key", API_KEY,
            "--allowed-local-media-path", str(media_dir), "--max-request-body-mb", str(MAX_BODY_MB),
            # the fixtures' media are at most 64 x 64 (a video's frames count too), the voice chat
            # page's camera stills 448 x 336
            "--media-limits", json.dumps({"max_image_pixels": MAX_IMAGE_PIXELS}), "--prompt-timeout-s", "60"]


def _pipeline_text(pipeline_yaml) -> str:
    with open(pipeline_yaml) as f:
        return f.read()


@pytest.fixture(scope="module")
def server(request, kept, env, pipeline_yaml, media_dir, tmp_path_factory):
    """`omni-jax serve` on `pipeline_yaml`, kept for the modules that serve the same pipeline
    after this one (conftest's RUN_TOGETHER)."""
    def start(stack):
        log_path = str(tmp_path_factory.mktemp("server") / "serve.log")
        return stack.enter_context(serving(_serve_args(pipeline_yaml, media_dir), env, log_path))

    args = _serve_args(_pipeline_text(pipeline_yaml), media_dir)
    return kept.get(("server", *args), start, request.module.__name__)


@pytest.fixture(scope="module")
def library(request, kept, server, pipeline_yaml):
    """OmniJax with the server's pipeline (started after the server: its compiles are cached), kept
    as the server is."""
    def start(stack):
        omni = OmniJax(model=MODEL, pipeline=pipeline_yaml, output_modalities=["text", "audio"])
        stack.callback(omni.shutdown)
        return omni

    return kept.get(("library", _pipeline_text(pipeline_yaml)), start, request.module.__name__)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _lib_params(library, max_tokens: int, talker=None) -> list:
    """Thinker greedy, the talker's given or default params, the vocoder seeded as SPL."""
    vocoder = library.pipeline.stage("token2wav").sampling_params().updated(**VOCODER_SEED)
    return [SamplingParams(temperature=0.0, max_tokens=max_tokens), talker, vocoder]


def _auth() -> dict:
    return {"Authorization": f"Bearer {API_KEY}"}


def _pcm16_round(audio: np.ndarray) -> np.ndarray:
    return np.round(np.clip(audio, -1, 1) * 32767.0) / 32767.0


def _wav(data: bytes) -> tuple[int, np.ndarray]:
    with wave.open(io.BytesIO(data)) as w:
        assert w.getnchannels() == 1 and w.getsampwidth() == 2
        return w.getframerate(), np.frombuffer(w.readframes(w.getnframes()), "<i2") / 32767.0


def _assert_same_audio(got: np.ndarray, want: np.ndarray) -> None:
    assert want is not None and len(want) > 0
    assert got.shape == want.shape
    np.testing.assert_allclose(got, _pcm16_round(want), atol=1e-4, rtol=0)


def _metrics(server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", headers=_auth(), timeout=30).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _idle(server, timeout=15.0) -> dict[str, float]:
    """Wait until every stage holds no request and no KV block; the last metrics."""
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(server)
        busy = {k: v for k, v in m.items() if k.startswith(("omni_jax_stage_kv_cache_usage",
                                                            "omni_jax_stage_requests_running",
                                                            "omni_jax_stage_requests_waiting",
                                                            "omni_jax_requests_in_flight")) and v != 0}
        if not busy:
            return m
        assert time.monotonic() < deadline, f"stages still busy: {busy}"
        time.sleep(0.2)


# ---------------------------------------------------------------------------------------- readiness

def test_health_is_503_while_loading_then_200(server):
    status, body = server.health_seen[0]
    assert status == 503 and body["error"]["code"] == "service_unavailable" and "loading" in body["error"]["message"]
    assert server.health_seen[-1][0] == 200
    assert "ready" in server.log() and "listening on http://127.0.0.1:" in server.log()


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


# ---------------------------------------------------------------------------------------- chat

def test_text_reply_equals_library(client, library):
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, temperature=0.0)
    want = library.generate({"messages": HELLO}, SamplingParams(temperature=0.0, max_tokens=8),
                            output_modalities=["text"])[0]
    assert len(r.choices) == 1 and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.text and want.text
    assert r.choices[0].message.audio is None
    assert r.choices[0].finish_reason == want.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(want.prompt_token_ids), len(want.token_ids))


def test_logprobs_equal_the_library(client, library):
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5, temperature=0.0,
                                       logprobs=True, top_logprobs=2)
    want = library.generate({"messages": HELLO}, SamplingParams(temperature=0.0, max_tokens=5, logprobs=2),
                            output_modalities=["text"])[0]
    content = r.choices[0].logprobs.content
    assert len(content) == len(want.token_ids) == 5
    for item, token, lp in zip(content, want.token_ids, want.logprobs):
        assert abs(item.logprob - lp[token].logprob) < 1e-6
        assert [abs(t.logprob - v.logprob) < 1e-6 for t, v in zip(item.top_logprobs, sorted(
            (v for v in lp.values() if v.rank <= 2), key=lambda v: v.rank))] == [True, True]
        assert item.top_logprobs[0].token == item.token  # greedy: the chosen token ranks first
    streamed = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5, temperature=0.0,
                                              logprobs=True, top_logprobs=2, stream=True)
    got = [c for chunk in streamed if chunk.choices and chunk.choices[0].logprobs
           for c in chunk.choices[0].logprobs.content]
    assert [c.logprob for c in got] == [c.logprob for c in content]


def test_n_choices_are_samples_of_the_one_prompt(client, library):
    """n choices, each the library's reply with the request's seed + its index (vLLM's rule), whole
    and streamed; the prompt is counted once in usage, as OpenAI's."""
    params = dict(max_tokens=5, temperature=1.0, top_p=0.9)
    want = [library.generate({"messages": HELLO}, SamplingParams(seed=5 + j, **params),
                             output_modalities=["text"])[0] for j in range(3)]
    r = client.chat.completions.create(model=MODEL, messages=HELLO, n=3, seed=5, **params)
    assert [(c.index, c.message.content) for c in r.choices] == [(j, w.text) for j, w in enumerate(want)]
    assert len({w.text for w in want}) > 1
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(want[0].prompt_token_ids), 15)
    texts, reasons = ["", "", ""], [[], [], []]
    for chunk in client.chat.completions.create(model=MODEL, messages=HELLO, n=3, seed=5, stream=True, **params):
        c = chunk.choices[0]
        texts[c.index] += c.delta.content or ""
        reasons[c.index] += [c.finish_reason] if c.finish_reason else []
    assert texts == [w.text for w in want] and reasons == [["length"]] * 3
    # (the server processes the prompt once for its n samples: a prompt processed for text
    # replies is refused for a spoken one, whose prompt differs)
    prepared = library.process({"messages": HELLO}, ["text"])
    out = library.generate(prepared, SamplingParams(max_tokens=2), output_modalities=["text", "audio"])[0]
    assert "was processed for stages ['thinker']" in out.error


def test_stop_and_seed_reach_the_thinker(client, library):
    params = dict(max_tokens=6, temperature=0.8, top_p=0.9, seed=7)
    r = client.chat.completions.create(model=MODEL, messages=HELLO, **params)
    want = library.generate({"messages": HELLO}, SamplingParams(**params), output_modalities=["text"])[0]
    assert r.choices[0].message.content == want.text


def test_text_and_audio_whole_reply(client, library):
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, temperature=0.0,
                                       modalities=["text", "audio"], audio={"voice": "Chelsie", "format": "wav"},
                                       extra_body=SPL)
    want = library.generate({"messages": HELLO}, sampling_params_list=_lib_params(library, 8), output_modalities=["text", "audio"],
                            voice="Chelsie")[0]
    assert len(r.choices) == 1
    msg = r.choices[0].message
    assert msg.content == want.text and msg.audio.transcript == want.text
    assert msg.audio.id and msg.audio.expires_at > time.time()
    rate, got = _wav(base64.b64decode(msg.audio.data))
    assert rate == SR
    _assert_same_audio(got, want.audio)


def test_a_spoken_reply_says_its_words_and_not_its_calls(client, library):
    """Chat with audio and tools: the reply stops where the model opens a call (the random model is
    made to say "Sure." and then call by a grammar); its words are spoken, equal to the library's
    reply stopped at the tag, and the call is written after by the thinker alone, held to the
    tool's schema. Streamed alike. A named tool makes a reply of calls only, unspoken."""
    from omni_jax import StructuredOutputs

    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}}, "required": ["city"],
        "additionalProperties": False}}}
    grammar = 'start: "Sure." "\\n" <tool_call> "\\n{\\"name\\": \\"now\\"}\\n" </tool_call>'
    thinker = {"structured_outputs": {"grammar": grammar}}
    ask = dict(model=MODEL, messages=HELLO, max_tokens=40, temperature=0.0, modalities=["text", "audio"],
               tools=[tool], parallel_tool_calls=False, extra_body={"sampling_params_list": [thinker, None, VOCODER_SEED]})
    r = client.chat.completions.create(audio={"voice": "Chelsie", "format": "wav"}, **ask)
    tag = library.tokenizer.convert_tokens_to_ids("<tool_call>")
    lib = _lib_params(library, 40)
    lib[0] = lib[0].updated(structured_outputs=StructuredOutputs(grammar=grammar), stop_token_ids=(tag,))
    want = library.generate({"messages": HELLO, "tools": [tool]}, sampling_params_list=lib,
                            output_modalities=["text", "audio"], voice="Chelsie")[0]
    assert list(want.token_ids)[-1] == tag
    msg = r.choices[0].message
    assert msg.content == "Sure." and msg.audio.transcript == "Sure." and r.choices[0].finish_reason == "tool_calls"
    _assert_same_audio(_wav(base64.b64decode(msg.audio.data))[1], want.audio)
    assert [c.function.name for c in msg.tool_calls] == ["get_weather"]
    assert json.loads(msg.tool_calls[0].function.arguments)["city"] in ("Paris", "Lyon")
    assert r.usage.completion_tokens > len(want.token_ids)  # the call's tokens counted too
    text, transcript, pcm, calls, reasons = "", "", b"", [], []
    for chunk in client.chat.completions.create(audio={"voice": "Chelsie", "format": "pcm16"}, stream=True, **ask):
        delta = chunk.choices[0].delta
        text += delta.content or ""
        if delta.audio is not None:
            transcript += delta.audio.transcript or ""
            pcm += base64.b64decode(delta.audio.data) if delta.audio.data else b""
        calls += [(c.index, c.function.name, c.function.arguments) for c in delta.tool_calls or []]
        reasons += [chunk.choices[0].finish_reason] if chunk.choices[0].finish_reason else []
    assert (text, transcript, reasons) == ("Sure.", "Sure.", ["tool_calls"])
    # the call named, then its arguments (written after the spoken words, as chat streams any call)
    assert calls == [(0, c.function.name, "") for c in msg.tool_calls] + [(0, None, c.function.arguments)
                                                                          for c in msg.tool_calls]
    _assert_same_audio(np.frombuffer(pcm, "<i2") / 32767.0, want.audio)
    named = client.chat.completions.create(audio={"voice": "Chelsie", "format": "wav"}, tool_choice={
        "type": "function", "function": {"name": "get_weather"}}, **{**ask, "extra_body": {}})
    msg = named.choices[0].message
    assert msg.audio is None and msg.content is None and named.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in msg.tool_calls] == ["get_weather"]


def test_audio_formats_are_honoured(client):
    import av

    for fmt, codec in (("flac", "flac"), ("mp3", "mp3")):
        r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, temperature=0.0,
                                           modalities=["text", "audio"], audio={"voice": "Ethan", "format": fmt})
        with av.open(io.BytesIO(base64.b64decode(r.choices[0].message.audio.data))) as c:
            assert c.streams.audio[0].codec_context.name.startswith(codec)
            assert c.streams.audio[0].sample_rate == SR


def test_streamed_text_and_audio(client, library):
    stream = client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=8, temperature=0.0, modalities=["text", "audio"],
        audio={"voice": "Chelsie", "format": "pcm16"}, stream=True, stream_options={"include_usage": True},
        extra_body=SPL)
    want = library.generate({"messages": HELLO}, sampling_params_list=_lib_params(library, 8), output_modalities=["text", "audio"],
                            voice="Chelsie")[0]
    text, transcript, pcm, reasons, usage, ids = "", "", b"", [], None, set()
    for chunk in stream:
        if not chunk.choices:
            usage = chunk.usage
            continue
        assert len(chunk.choices) == 1
        delta = chunk.choices[0].delta
        text += delta.content or ""
        if delta.audio is not None:
            ids.add(delta.audio.id)
            transcript += delta.audio.transcript or ""
            pcm += base64.b64decode(delta.audio.data) if delta.audio.data else b""
        if chunk.choices[0].finish_reason:
            reasons.append(chunk.choices[0].finish_reason)
    assert text == want.text and transcript == want.text
    assert reasons == ["length"] and len(ids) == 1
    assert usage.completion_tokens == len(want.token_ids)
    _assert_same_audio(np.frombuffer(pcm, "<i2") / 32767.0, want.audio)


def test_stream_wire_format(server):
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 4, "temperature": 0, "stream": True,
            "modalities": ["text", "audio"], "audio": {"format": "pcm16"}}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=_auth(), timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines) and lines[-1] == "data: [DONE]"
    events = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    # audio travels in delta.audio, never inside delta.content
    audio_events = [e for e in events if "data" in (e["choices"][0]["delta"].get("audio") or {})]
    assert audio_events and all(not e["choices"][0]["delta"].get("content") for e in audio_events)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert [e["choices"][0]["finish_reason"] for e in events].count("length") == 1


def test_stream_refuses_other_audio_formats(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=HELLO, modalities=["text", "audio"],
                                       audio={"voice": "Chelsie", "format": "wav"}, stream=True)
    assert e.value.body["param"] == "audio.format" and "pcm16" in e.value.body["message"]


def test_sampling_params_list_reaches_the_talker(client, library):
    spl = [None, {"temperature": 0.9, "top_k": 40, "seed": 3}, VOCODER_SEED]
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, temperature=0.0,
                                       modalities=["text", "audio"], audio={"format": "wav"},
                                       extra_body={"sampling_params_list": spl})
    talker = library.pipeline.stage("talker").sampling_params().updated(**spl[1])
    want = library.generate({"messages": HELLO}, sampling_params_list=_lib_params(library, 4, talker),
                            output_modalities=["text", "audio"])[0]
    _assert_same_audio(_wav(base64.b64decode(r.choices[0].message.audio.data))[1], want.audio)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=HELLO, modalities=["text", "audio"],
                                       extra_body={"sampling_params_list": [None, {"top_p": 7}]})
    assert e.value.body["param"] == "sampling_params_list[1].top_p"


def test_image_from_allowed_dir_and_data_url(client, library, media_dir):
    path = str(media_dir / "cat.png")
    data = "data:image/png;base64," + base64.b64encode((media_dir / "cat.png").read_bytes()).decode()
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": path}},
                                         {"type": "text", "text": "What is it?"}]}]
    want = library.generate({"messages": [{"role": "user", "content": [{"type": "image", "image": path},
                                                                       {"type": "text", "text": "What is it?"}]}]},
                            SamplingParams(temperature=0.0, max_tokens=5), output_modalities=["text"])[0]
    for url in (path, "file://" + path, data):
        msgs[0]["content"][0]["image_url"]["url"] = url
        r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0.0)
        assert r.choices[0].message.content == want.text


def test_input_audio_and_video_parts(client, library, media_dir):
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
        w.writeframes((np.sin(np.arange(8000) * 0.05) * 8000).astype("<i2").tobytes())  # 0.5 s: tiny buckets
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(buf.getvalue()).decode(),
                                                   "format": "wav"}}
    question = {"type": "text", "text": "What is this?"}
    params = SamplingParams(temperature=0.0, max_tokens=5)
    want = library.generate({"messages": [{"role": "user", "content": [part, question]}]}, params,
                            output_modalities=["text"])[0]
    assert want.error is None and want.text
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [part, question]}],
                                       max_tokens=5, temperature=0.0)
    assert r.choices[0].message.content == want.text
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)

    # A video reaches the engine; at the tiny model's few vision buckets it is refused as too large,
    # which is the requester's problem (400), with the library's own words.
    video = str(media_dir / "clip.mp4")
    want = library.generate({"messages": [{"role": "user", "content": [{"type": "video", "video": video}, question]}]},
                            params, output_modalities=["text"])[0]
    assert want.error and "video" in want.error
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": video}}, question]}])
    assert want.error.split(": ", 1)[1] in e.value.body["message"]
    assert want.error_code == e.value.body["code"] == "context_length_exceeded"  # more than the model takes at once


@pytest.mark.parametrize("error_code, status, code, param", [
    ("invalid_request", 400, "invalid_request", "sampling_params_list"),
    ("context_length_exceeded", 400, "context_length_exceeded", "messages"),
    ("unavailable", 503, "service_unavailable", None),
    ("internal", 500, "internal_error", None),
])
def test_a_failed_request_is_answered_by_its_error_code_not_its_words(error_code, status, code, param):
    """The library's error_code alone picks the HTTP error (a message that merely mentions "too
    long" or "died" changes nothing); the refusal's "request 'id': " prefix is left out."""
    from types import SimpleNamespace

    from omni_jax.runtime.outputs import OmniRequestOutput
    from omni_jax.server.generation import failure

    healthy = SimpleNamespace(check=lambda: (True, ""))
    out = OmniRequestOutput("r1", finished=True, finish_reason="error", error_code=error_code,
                            error="request 'r1': the stage died of a too long name")
    err = failure(healthy, out)
    assert (err.status, err.code, err.param) == (status, code, param)
    if status == 400:
        assert err.message == "the stage died of a too long name"
    # Whatever the code, an engine that cannot serve answers 503.
    assert failure(SimpleNamespace(check=lambda: (False, "dead")), out).status == 503


# ---------------------------------------------------------------------------------------- speech

def test_speech_wav_and_sse(server, library):
    text = "Good morning to you"
    thinker = library.pipeline.stage("thinker").sampling_params().updated(max_tokens=1, min_tokens=0)
    want = library.generate(speech_prompt(library.processor, text), sampling_params_list=[thinker, *_lib_params(library, 1)[1:]],
                            output_modalities=["text", "audio"], voice="Ethan")[0]
    r = httpx.post(f"{server.url}/v1/audio/speech", headers=_auth(), timeout=120,
                   json={"model": MODEL, "input": text, "voice": "Ethan", "response_format": "wav", **SPL})
    assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
    rate, got = _wav(r.content)
    assert rate == SR
    _assert_same_audio(got, want.audio)

    body = {"model": MODEL, "input": text, "voice": "Ethan", "response_format": "pcm", "stream_format": "sse", **SPL}
    with httpx.stream("POST", f"{server.url}/v1/audio/speech", json=body, headers=_auth(), timeout=120) as r:
        assert r.status_code == 200
        events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: ")]
    assert [e["type"] for e in events][-1] == "speech.audio.done"
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert deltas and events[-1]["usage"]["output_tokens"] == len(want.token_ids)
    pcm = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    _assert_same_audio(np.frombuffer(pcm, "<i2") / 32767.0, want.audio)


def test_speech_takes_instructions(server, library):
    """`instructions` (the Agents SDK's TTS always sends them) are a system message after the
    speech system prompt: the reply is the library's on that prompt."""
    text, instructions = "Good morning to you", "Speak slowly and warmly."
    prompt = speech_prompt(library.processor, text, instructions)
    assert instructions in library.tokenizer.decode(list(prompt["prompt_token_ids"]))
    thinker = library.pipeline.stage("thinker").sampling_params().updated(max_tokens=1, min_tokens=0)
    want = library.generate(prompt, sampling_params_list=[thinker, *_lib_params(library, 1)[1:]],
                            output_modalities=["text", "audio"], voice="Ethan")[0]
    r = httpx.post(f"{server.url}/v1/audio/speech", headers=_auth(), timeout=120,
                   json={"model": MODEL, "input": text, "voice": "Ethan", "response_format": "wav",
                         "instructions": instructions, **SPL})
    assert r.status_code == 200, r.text
    _assert_same_audio(_wav(r.content)[1], want.audio)


def test_speech_at_another_speed(server, library):
    """`speed` paces the speech at the same pitch: the reply is the library's waveform through
    server/tempo.py, 1/speed as long, whole and streamed alike."""
    from omni_jax.server.tempo import stretch

    text = "Good morning to you"
    thinker = library.pipeline.stage("thinker").sampling_params().updated(max_tokens=1, min_tokens=0)
    want = library.generate(speech_prompt(library.processor, text), sampling_params_list=[thinker, *_lib_params(library, 1)[1:]],
                            output_modalities=["text", "audio"], voice="Ethan")[0].audio
    for speed in (0.5, 2.0):
        r = httpx.post(f"{server.url}/v1/audio/speech", headers=_auth(), timeout=120,
                       json={"model": MODEL, "input": text, "voice": "Ethan", "response_format": "wav", "speed": speed,
                             **SPL})
        got = _wav(r.content)[1]
        assert len(got) == round(len(want) / speed)
        _assert_same_audio(got, stretch(want, speed))
    body = {"model": MODEL, "input": text, "voice": "Ethan", "response_format": "pcm", "stream_format": "sse",
            "speed": 1.5, **SPL}
    with httpx.stream("POST", f"{server.url}/v1/audio/speech", json=body, headers=_auth(), timeout=120) as r:
        events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: ")]
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    _assert_same_audio(np.frombuffer(pcm, "<i2") / 32767.0, stretch(want, 1.5))


def test_speech_through_openai_client(client):
    r = client.audio.speech.create(model=MODEL, input="Hello there", voice="Chelsie", response_format="wav")
    assert _wav(r.read())[0] == SR
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.speech.create(model=MODEL, input="Hi", voice="Chelsie", speed=4.5)
    assert e.value.body["param"] == "speed"


# ---------------------------------------------------------------------------------------- errors

WEATHER_TOOL = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}


def _big_tool(name: str) -> dict:
    """A tool whose schema alone a grammar may hold, but not two of them."""
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"a": {"enum": ["x" * 40000]}}}}}


@pytest.mark.parametrize("change, param", [
    ({"temperature": 5}, "temperature"),
    ({"n": 0}, "n"),
    ({"n": 65}, "n"),
    ({"n": 2, "modalities": ["text", "audio"]}, "n"),
    # OpenAI's fields the server does not serve: refused by name, not ignored
    ({"functions": [{"name": "weather", "parameters": {}}]}, "functions"),
    ({"function_call": {"name": "weather"}}, "function_call"),
    # function calling
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ({"tools": [WEATHER_TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [_big_tool("f"), _big_tool("g")], "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER_TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}]}]}, "messages[0].tool_calls[0]"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"not a name": 1}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"a": json.loads("[" * 200 + "]" * 200)}}, "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": "x", "reasoning_content": "y"}]}, "messages[0].reasoning_content"),
    ({"thinking_token_budget": 8}, "thinking_token_budget"),  # this model does not think
    ({"thinking_token_budget": -1}, "thinking_token_budget"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 2}, "min_tokens"),
    ({"logit_bias": {"15": 500}}, "logit_bias"),
    ({"logit_bias": {"token": 5}}, "logit_bias"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"modalities": ["audio"]}, "modalities"),
    ({"audio": {"voice": "Nobody"}, "modalities": ["text", "audio"]}, "audio.voice"),
    ({"messages": []}, "messages"),
    ({"stop": ["\ud800"]}, "stop"),  # a lone surrogate from a JSON escape: no UTF-8 form for the wire
    ({"messages": [{"role": "user", "content": "bad \udfff text"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x.org/a.png"}}]}]},
     "messages[0].content[0].image_url.url"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "/etc/passwd"}}]}]},
     "messages[0].content[0].image_url.url"),
    ({"messages": [{"role": "user", "content": [{"type": "file", "file": {}}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio",
                                                 "input_audio": {"data": "aGk=", "format": "ogg"}}]}]},
     "messages[0].content[0].input_audio.format"),
])
def test_400_names_the_field(server, change, param):
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 4, **change}
    # json.dumps writes a lone surrogate as the escape a client would send (httpx's json= refuses it)
    r = httpx.post(f"{server.url}/v1/chat/completions", content=json.dumps(body), timeout=60,
                   headers={**_auth(), "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert param.rsplit(".", 1)[-1].split("[")[0] in err["message"]


def test_unserved_fields_at_their_off_values_are_accepted(client):
    """What clients send by default (no tools, a text response) is not a refusal."""
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, temperature=0.0, tools=[],
                                       tool_choice="none", response_format={"type": "text"}, logit_bias={})
    assert r.choices[0].finish_reason in ("stop", "length")


def test_media_limits_flag_and_typed_special_tokens(client, library, media_dir):
    """--media-limits reaches the prompt processor: a 449 x 336 image is a 400 naming the limit.
    Placeholder or turn-end strings typed in a message are text (they were a 400, or a new turn)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (449, 336)).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}]}])
    assert f"449x336 = 150864 pixels, more than the limit of {MAX_IMAGE_PIXELS}" in e.value.body["message"]
    typed = [{"role": "user", "content": "what is <|IMAGE|> or <|im_end|>?"}]
    r = client.chat.completions.create(model=MODEL, messages=typed, max_tokens=4, temperature=0.0)
    want = library.generate({"messages": typed}, SamplingParams(temperature=0.0, max_tokens=4), output_modalities=["text"])[0]
    assert r.choices[0].message.content == want.text
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert library.processor.tokens.image_token_id not in want.prompt_token_ids


@pytest.mark.parametrize("flag, value, message", [
    ("--media-limits", '{"max_pixels": 5}', "keys among"),
    ("--media-limits", '{"max_image_pixels": 0}', "max_image_pixels must be a positive int"),
    ("--media-limits", "{oops", "not valid JSON"),
    ("--prompt-timeout-s", "0", "prompt_timeout_s must be a positive number"),
    ("--prompt-workers", "0", "prompt_workers must be a positive integer"),
    ("--stored-responses-mb", "-1", "--stored-responses-mb must be 0 or more"),
    ("--stored-responses-mb", "nan", "--stored-responses-mb must be 0 or more"),
    ("--allowed-origins", "https://app.example.org", "--allowed-origins must be a JSON list of origins"),
    ("--allowed-origins", '["https://a.example", 3]', "--allowed-origins must be a JSON list of origins"),
])
def test_bad_serving_flags_exit_2_naming_them(flag, value, message, capsys):
    from omni_jax.cli import main

    assert main(["serve", "--port", "0", flag, value]) == 2  # before binding or loading anything
    assert message in capsys.readouterr().err


def test_remote_url_refusal_is_clear(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}]}])
    assert "remote URLs are not fetched" in e.value.body["message"]


def test_401_without_or_with_a_wrong_key(server):
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        c.chat.completions.create(model=MODEL, messages=HELLO)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": HELLO})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert httpx.get(f"{server.url}/metrics").status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200  # open to load balancers


def test_404_unknown_model(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=HELLO)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


def test_413_body_too_large(server):
    big = "data:image/png;base64," + "A" * (MAX_BODY_MB << 20)
    body = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": big}}]}]}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=_auth(), timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    # without a Content-Length (chunked upload) the limit holds too
    chunks = iter([json.dumps(body).encode()[i:i + 65536] for i in range(0, len(json.dumps(body)), 65536)])
    r = httpx.post(f"{server.url}/v1/chat/completions", content=chunks, timeout=60,
                   headers={**_auth(), "Content-Type": "application/json"})
    assert r.status_code == 413


def test_an_empty_body_is_answered_at_once(server):
    """A POST with no body is the app's to judge at once (the body gate once left the app waiting
    on it until the client gave up)."""
    r = httpx.post(f"{server.url}/v1/chat/completions", content=b"", timeout=10,
                   headers={**_auth(), "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    r = httpx.post(f"{server.url}/v1/realtime/client_secrets", content=b"", headers=_auth(), timeout=10)
    assert r.status_code == 200 and r.json()["value"].startswith("ek_")  # all defaults


def test_api_key_off_and_not_ready_in_process():
    """The same app without an API key: every endpoint is open; an engine not ready gives 503."""
    engine = ServedEngine(MODEL, MODEL)  # never started: loading
    app = build_app(engine, api_key=None)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            models = await c.get("/v1/models")
            health = await c.get("/health")
            chat = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO})
            return models, health, chat

    models, health, chat = asyncio.run(go())
    assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL
    assert health.status_code == 503 and chat.status_code == 503
    assert chat.json()["error"]["code"] == "service_unavailable"


def test_pages_of_allowed_origins_may_call_and_others_may_not_in_process():
    """--allowed-origins: CORS for the pages it names (a preflight needs no key; the key still
    does its work), none for others; without it, none at all."""
    engine = ServedEngine(MODEL, MODEL)
    allowed = build_app(engine, api_key=API_KEY, allowed_origins=("https://app.example.org",))
    closed = build_app(engine, api_key=API_KEY)
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}

    async def go():
        out = {}
        for name, app in (("allowed", allowed), ("closed", closed)):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                for origin in ("https://app.example.org", "https://evil.example"):
                    out[name, origin, "options"] = await c.options("/v1/realtime/calls",
                                                                   headers={"Origin": origin, **preflight})
                    out[name, origin, "get"] = await c.get("/v1/models", headers={"Origin": origin, **_auth()})
                out[name, "no key"] = await c.get("/v1/models", headers={"Origin": "https://app.example.org"})
        return out

    r = asyncio.run(go())
    ok = r["allowed", "https://app.example.org", "options"]
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example.org"
    assert "POST" in ok.headers["access-control-allow-methods"]
    get = r["allowed", "https://app.example.org", "get"]
    assert get.status_code == 200 and get.headers["access-control-allow-origin"] == "https://app.example.org"
    assert "location" in get.headers["access-control-expose-headers"].lower()  # a created call's address
    assert r["allowed", "no key"].status_code == 401
    for key in (("allowed", "https://evil.example", "options"), ("allowed", "https://evil.example", "get"),
                ("closed", "https://app.example.org", "options"), ("closed", "https://app.example.org", "get")):
        assert "access-control-allow-origin" not in r[key].headers, key


# ---------------------------------------------------------------------------------------- load, abort

def test_client_disconnect_frees_every_kv_block(server):
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 400, "ignore_eos": True, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=_auth(), timeout=60) as r:
        lines = r.iter_lines()
        got = 0
        for ln in lines:
            got += ln.startswith("data: ")
            if got >= 5:
                break
        m = _metrics(server)
        assert m['omni_jax_stage_kv_cache_usage{stage="thinker"}'] > 0  # mid-stream: blocks are held
    m = _idle(server)  # the stream was closed: the request must be aborted and its blocks freed
    aborted = m['omni_jax_requests_total{endpoint="chat",finish_reason="abort"}']
    assert aborted >= 1
    # a client of a whole (non-streamed) reply that gives up is noticed too
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.url}/v1/chat/completions", headers=_auth(), timeout=0.5,
                   json={**body, "stream": False, "modalities": ["text", "audio"]})
    m = _idle(server)
    assert m['omni_jax_requests_total{endpoint="chat",finish_reason="abort"}'] == aborted + 1


def test_64_concurrent_streams_complete_without_leak(server, library):
    # a speech reply's prompt carries the speech system prompt, so its text differs
    want = {mods: library.generate({"messages": HELLO}, SamplingParams(temperature=0.0, max_tokens=6),
                                   output_modalities=list(mods))[0].text for mods in (("text",), ("text", "audio"))}
    c = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)

    async def one(i):
        audio = i % 4 == 0
        kw = dict(modalities=["text", "audio"], audio={"voice": "Chelsie", "format": "pcm16"}) if audio else {}
        stream = await c.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, temperature=0.0,
                                                 stream=True, **kw)
        text, n_audio, reason = "", 0, None
        async for chunk in stream:
            d = chunk.choices[0].delta
            text += d.content or ""
            if d.audio is not None and d.audio.data:
                n_audio += len(base64.b64decode(d.audio.data))
            reason = chunk.choices[0].finish_reason or reason
        return text, n_audio, reason, audio

    async def bad():  # one bad request among them disturbs nobody
        with pytest.raises(openai.BadRequestError):
            await c.chat.completions.create(model=MODEL, messages=HELLO, modalities=["text", "audio"],
                                            audio={"voice": "Nobody", "format": "pcm16"}, stream=True)

    async def go():
        results = await asyncio.gather(*(one(i) for i in range(64)), bad(), bad())
        await c.close()
        return results[:64]

    for text, n_audio, reason, audio in asyncio.run(go()):
        assert text == want[("text", "audio") if audio else ("text",)] and reason == "length"
        assert (n_audio > 0) == audio
    m = _idle(server)
    assert m["omni_jax_requests_in_flight"] == 0
    assert m["omni_jax_time_to_first_token_seconds_count"] >= 64
    assert m["omni_jax_time_to_first_audio_seconds_count"] >= 16
    assert m['omni_jax_errors_total{type="bad_request"}'] >= 2


def test_bench_against_the_server(server, env):
    r = subprocess.run([sys.executable, "-m", "omni_jax.cli", "bench", "--base-url", server.url, "--api-key", API_KEY,
                        "--concurrency", "2", "--num-requests", "4", "--modalities", "text,audio",
                        "--max-tokens", "4"], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "4 requests (0 failed)" in r.stdout and "req/s" in r.stdout
    for name in ("ttft", "tpot", "ttfa", "rtf"):
        assert re.search(rf"^\s+{name}\s+mean", r.stdout, re.M), r.stdout


# ---------------------------------------------------------------------------------------- death, shutdown

def test_dead_stage_gives_503_until_it_is_back(server, client):
    """A killed stage is restarted by the library: /health and requests through it answer 503
    naming it meanwhile, then the server serves again (stage restarts in the metrics)."""
    pids = server.stage_pids()
    assert set(pids) == {"thinker", "talker", "token2wav"}
    os.kill(pids["talker"], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while (health := httpx.get(f"{server.url}/health")).status_code != 503:
        assert time.monotonic() < deadline, "health still 200 after a stage died"
        time.sleep(0.05)
    assert "'talker' is restarting" in health.json()["error"]["message"]
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, modalities=["text", "audio"],
                                       audio={"voice": "Chelsie", "format": "wav"})
    assert e.value.status_code == 503 and "talker" in e.value.message
    deadline = time.monotonic() + 120
    while httpx.get(f"{server.url}/health").status_code != 200:
        assert time.monotonic() < deadline, "the talker did not come back"
        time.sleep(0.2)
    reply = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, modalities=["text", "audio"],
                                           audio={"voice": "Chelsie", "format": "wav"})
    assert reply.choices[0].message.audio is not None
    assert _metrics(server)['omni_jax_stage_restarts{stage="talker"}'] == 1


def test_sigint_shuts_every_stage_down(server):
    pids = list(server.stage_pids().values())
    server.proc.send_signal(signal.SIGINT)
    assert server.proc.wait(60) == 0, server.log()[-3000:]
    assert _wait_gone(pids) == []
    assert _children(server.proc.pid) == []
    assert "Traceback" not in server.log()


def test_sigterm_while_loading_leaves_no_process(env, pipeline_yaml, tmp_path):
    proc, url = _start_server(["--model", MODEL, "--pipeline", pipeline_yaml], env, str(tmp_path / "log"))
    deadline = time.monotonic() + 120
    while True:  # wait until the stage processes exist, then stop the server mid-load
        assert proc.poll() is None and time.monotonic() < deadline
        kids = [p for p in _children(proc.pid)]
        if len(kids) >= 3:
            break
        time.sleep(0.2)
    assert httpx.get(f"{url}/health").status_code == 503
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    assert _wait_gone(kids) == []


def test_a_model_that_cannot_load_ends_the_command(env, tmp_path):
    proc, url = _start_server(["--model", str(tmp_path)], env, str(tmp_path / "log"))
    assert proc.wait(120) == 1
    log = (tmp_path / "log").read_text()
    assert "error" in log and "not an OmniJax checkpoint" in log


@pytest.mark.parametrize("fmt, rate", [("wav", SR), ("flac", SR), ("mp3", SR), ("opus", 48000), ("aac", SR)])
def test_audio_encodings_decode_to_the_same_length(fmt, rate):
    import av

    from omni_jax.server.audio import encode

    x = (0.5 * np.sin(np.arange(SR) * 2 * np.pi * 440 / SR)).astype(np.float32)
    with av.open(io.BytesIO(encode(x, SR, fmt))) as c:
        s = c.streams.audio[0]
        n = sum(f.samples for f in c.decode(s))
        assert s.sample_rate == rate
    assert abs(n / rate - 1.0) < 0.1  # codecs pad a frame or two
