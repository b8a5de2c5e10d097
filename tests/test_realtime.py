"""`/v1/realtime` as a voice client uses it: the official `openai` client's realtime connection
against a real `omni-jax serve` (test_server's fixtures: the same tiny pipeline, so its
compiles are cached), checked against `OmniJax.generate`; then hostile clients with a raw
WebSocket. The VAD, buffer and event parsing are tested on their own first.

Speech for the tests is synthesised with espeak-ng (installed by .ci/setup) and padded with
silence, so the server's VAD sees a real spoken turn.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import io
import json
import re
import shutil
import subprocess
import sys
import threading
import time
import warnings
import wave
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import openai
import pytest
import soxr
import uvicorn
import websockets.sync.client as ws_client
from websockets.exceptions import ConnectionClosed, InvalidStatus

from omni_jax import SamplingParams
from omni_jax.config import load_pipeline_config
from omni_jax.server import g711
from omni_jax.server.realtime.audio_buffer import InputAudioBuffer
from omni_jax.server.realtime.conversation import Conversation, ConversationItem, Part, without_oldest_turn
from omni_jax.server.realtime.events import EventError, ServerVADConfig, parse
from omni_jax.server.errors import APIError
from omni_jax.server.realtime import ClientSecrets, wire_audio
from omni_jax.server.realtime.session import SessionConfig
from omni_jax.server.realtime.turns import Turns
from omni_jax.server.app import build_app
from omni_jax.server.engine import ServedEngine
from omni_jax.server.vad import ServerVAD
from test_async_chunk_pipeline import pipeline_for
from test_server import (API_KEY, HELLO, MAX_BODY_MB, MAX_IMAGE_PIXELS, MODEL, VOCODER_SEED,  # noqa: F401
                         _assert_same_audio, _idle, _auth, _free_port, _lib_params, _metrics, client, env,
                         library, media_dir, server, with_audio_buckets)
from test_server import pipeline_yaml as server_pipeline_yaml

pytestmark = pytest.mark.server
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

SR = 24000
SPL = [None, None, VOCODER_SEED]
# A reply still playing seconds after its first audio, for the barge-in test: the thinker
# writes to its length limit whatever it says (the response ends when its text does; the test
# pipeline's talker stops at 40 codes), about 2 s after the first audio on a quiet machine.
LONG_REPLY = dict(max_output_tokens=450, sampling_params_list=[{"ignore_eos": True}, None, VOCODER_SEED])


def _speech(text: str, lead_s: float = 0.3, tail_s: float = 1.0) -> np.ndarray:
    """espeak-ng saying `text`, at 24 kHz, between silences."""
    assert shutil.which("espeak-ng"), "espeak-ng is needed (bash .ci/setup installs it)"
    wav = subprocess.run(["espeak-ng", "--stdout", text], capture_output=True, check=True).stdout
    with wave.open(io.BytesIO(wav)) as w:
        rate, x = w.getframerate(), np.frombuffer(w.readframes(w.getnframes()), "<i2") / 32768.0
    x = soxr.resample(x, rate, SR).astype(np.float32)
    return np.concatenate([np.zeros(int(lead_s * SR), np.float32), x, np.zeros(int(tail_s * SR), np.float32)])


def _b64(audio: np.ndarray) -> str:
    return base64.b64encode((np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()).decode()


def _voiced(audio: np.ndarray) -> tuple[float, float]:
    """(first, last) time in ms where the signal is not silent."""
    idx = np.flatnonzero(np.abs(audio) > 0.01)
    return idx[0] * 1000 / SR, idx[-1] * 1000 / SR


# ---------------------------------------------------------------------------------------- pieces

def test_vad_finds_one_spoken_turn_and_keeps_its_audio():
    audio = _speech("Hello there. What is the weather like today?", lead_s=1.0, tail_s=1.5)
    start, end = _voiced(audio)
    turns = Turns(60, ServerVADConfig(type="server_vad", prefix_padding_ms=300, silence_duration_ms=500))
    events = []
    for i in range(0, len(audio), 2400):  # 100 ms appends, as a client streams them
        events += turns.append(audio[i:i + 2400])
        assert len(turns.buffer) <= 16000 * (end / 1000 + 1)  # between turns only the padding is held
    assert [e.kind for e, _ in events] == ["speech_started", "speech_stopped"]
    (started, _), (stopped, turn) = events
    # the turn opens prefix_padding before the voice and closes silence_duration after it
    assert abs(started.ms - (start - 300)) <= 60
    assert end + 500 - 60 <= stopped.ms <= end + 500 + 400  # espeak's last syllable fades
    assert len(turn) == stopped.sample - started.sample  # the whole turn, at 16 kHz
    assert np.abs(turn).max() > 0.1 and len(turns.buffer) < 16000
    assert ServerVAD().feed(np.zeros(SR, np.float32)) == []


@pytest.mark.parametrize("eagerness, silence_ms", [("high", 500), ("auto", 1000), ("low", 2000)])
def test_semantic_vad_ends_a_turn_after_the_silence_of_its_eagerness(eagerness, silence_ms):
    # The Agents SDK's default turn detection: here silence-based, eagerness choosing the silence.
    update = {"type": "session.update", "session": {"audio": {"input": {"turn_detection": {
        "type": "semantic_vad", "eagerness": eagerness}}}}}
    td = parse(json.dumps(update)).session.audio.input.turn_detection
    audio = _speech("What is the weather like today?", lead_s=0.5, tail_s=2.5)
    _, end = _voiced(audio)
    turns = Turns(60, td)
    events = []
    for i in range(0, len(audio), 2400):
        events += turns.append(audio[i:i + 2400])
    assert [e.kind for e, _ in events] == ["speech_started", "speech_stopped"]
    assert end + silence_ms - 60 <= events[1][0].ms <= end + silence_ms + 400


def test_g711_equals_the_reference_codec():
    """mu-law and A-law against Python's own codec (audioop, in the standard library up to 3.12)
    for every 16-bit sample and every code."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import audioop
    pcm = np.arange(-32768, 32768, dtype=np.int16)
    codes = bytes(range(256))
    for law, lin2, to_lin in [("ulaw", audioop.lin2ulaw, audioop.ulaw2lin),
                              ("alaw", audioop.lin2alaw, audioop.alaw2lin)]:
        assert g711.encode(pcm, law) == lin2(pcm.astype("<i2").tobytes(), 2)
        assert np.array_equal(g711.decode(codes, law), np.frombuffer(to_lin(codes, 2), "<i2"))


@pytest.mark.parametrize("fmt", [wire_audio.PCMU, wire_audio.PCMA])
def test_g711_reply_audio_streams_as_one_piece(fmt):
    """A reply's 24 kHz deltas, in pieces of any size, come out as the 8 kHz G.711 of the whole."""
    t = np.arange(SR) / SR
    audio = (0.4 * np.sin(2 * np.pi * 300 * t) * np.sin(2 * np.pi * 2 * t)).astype(np.float32)
    rng = np.random.default_rng(0)
    cuts = np.sort(rng.choice(np.arange(1, SR), 20, replace=False))
    out = wire_audio.OutputAudio(fmt)
    pieces = [p for chunk in np.split(audio, cuts) for p in out.pieces(chunk, 4800)] + out.flush()
    assert sum(n for _, n in pieces) == SR and all(n <= 4800 for _, n in pieces)
    got = np.concatenate([wire_audio.decode(p, fmt) for p, _ in pieces])
    want = soxr.resample(audio, SR, 8000)
    assert len(got) == len(want) == 8000
    assert np.abs(got - want).max() < 0.02  # G.711's steps at this level: no clicks at the joins
    # and the input side: 8 kHz G.711 in, the same 16 kHz samples the buffer would get from PCM
    coded = base64.b64encode(g711.encode(np.round(want * 32767).astype(np.int16), wire_audio.FORMATS[fmt][1])).decode()
    buf = InputAudioBuffer(60, rate=8000)
    heard = buf.append(wire_audio.decode(coded, fmt))  # (the resampler holds the last ~70 ms back)
    assert 14500 < len(heard) <= 16000 and buf.rate == 8000
    assert np.abs(heard - soxr.resample(want, 8000, 16000)[:len(heard)]).max() < 0.02


def test_buffer_bounds_and_positions():
    buf = InputAudioBuffer(max_seconds=1.0)
    buf.append(np.zeros(SR // 2, np.float32))
    with pytest.raises(ValueError, match="at most 1 s"):
        buf.append(np.zeros(SR, np.float32))
    held = len(buf)
    assert buf.take(end=buf.start + 100).shape == (100,) and len(buf) == held - 100
    buf.clear()
    assert len(buf) == 0 and buf.start == buf.end


@pytest.mark.parametrize("message, code, param", [
    ("{not json", "invalid_json", None),
    ("[1, 2]", "invalid_event", None),
    ('{"type": "response.explode"}', "unknown_event_type", "type"),
    ('{"type": "input_audio_buffer.append"}', "invalid_value", "audio"),
    ('{"type": "session.update", "session": {"output_modalities": ["text", "audio"]}}', "invalid_value",
     "session.output_modalities"),
    ('{"type": "session.update", "session": {"audio": {"input": {"turn_detection": {"type": "vad"}}}}}',
     "invalid_value", "session.audio.input.turn_detection.type"),
    ('{"type": "session.update", "session": {"audio": {"input": {"turn_detection": {"eagerness": "low"}}}}}',
     "invalid_value", "session.audio.input.turn_detection.type"),
    ('{"type": "session.update", "session": {"audio": {"input": {"turn_detection": {"type": "semantic_vad", '
     '"eagerness": "eager"}}}}}', "invalid_value", "session.audio.input.turn_detection.eagerness"),
    ('{"type": "conversation.item.truncate", "item_id": "x", "content_index": 0, "audio_end_ms": -1}',
     "invalid_value", "audio_end_ms"),
    # formats other than PCM16 at 24 kHz and G.711 at 8 kHz
    ('{"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}}}',
     "invalid_value", "session.audio.input.format.rate"),
    ('{"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/pcmu", "rate": 16000}}}}}',
     "invalid_value", "session.audio.input.format.rate"),
    ('{"type": "session.update", "session": {"audio": {"output": {"format": {"type": "audio/opus"}}}}}',
     "invalid_value", "session.audio.output.format.type"),
])
def test_bad_events_name_what_is_wrong(message, code, param):
    with pytest.raises(EventError) as e:
        parse(message)
    assert e.value.code == code and e.value.param == param
    event = e.value.event()
    assert event["type"] == "error" and event["error"]["type"] == "invalid_request_error"


def test_session_update_changes_only_what_it_sends_and_refuses_whole():
    cfg = SessionConfig("tiny", ["Chelsie", "Ethan"])
    assert cfg.voice == "Chelsie" and cfg.output_modalities == ["audio"] and cfg.turn_detection is not None
    cfg.update(parse('{"type": "session.update", "session": {"instructions": "Be brief.", "audio": {"input": '
                     '{"turn_detection": null}, "output": {"voice": "ethan"}}}}').session)
    assert (cfg.instructions, cfg.voice, cfg.turn_detection) == ("Be brief.", "Ethan", None)
    cfg.update(parse('{"type": "session.update", "session": {"audio": {"output": {"speed": 1.25}}}}').session)
    assert cfg.speed == 1.25 and cfg.as_json()["audio"]["output"] == {"format": {"type": "audio/pcm", "rate": 24000},
                                                                      "voice": "Ethan", "speed": 1.25}
    before = cfg.as_json()
    for session, param in [('{"output_modalities": ["text"], "audio": {"output": {"speed": 1.6}}}',
                            "session.audio.output.speed"),
                           ('{"instructions": "x", "audio": {"output": {"voice": "Nobody"}}}',
                            "session.audio.output.voice"),
                           ('{"model": "other"}', "session.model")]:
        with pytest.raises(EventError) as e:
            cfg.update(parse(f'{{"type": "session.update", "session": {session}}}').session)
        assert e.value.param == param
        assert cfg.as_json() == before  # a refused update changes nothing
    text_only = SessionConfig("tiny", [])
    assert text_only.output_modalities == ["text"] and text_only.voice is None
    with pytest.raises(EventError, match="no speech output"):
        text_only.update(parse('{"type": "session.update", "session": {"output_modalities": ["audio"]}}').session)


def test_a_transcription_session_has_only_input_settings():
    cfg = SessionConfig("tiny", ["Chelsie"])
    assert cfg.transcription_settings is None  # a realtime session transcribes only when asked
    cfg.update(parse('{"type": "session.update", "session": {"type": "transcription"}}').session)
    s = cfg.as_json()
    assert (s["type"], s["object"], set(s), set(s["audio"])) == (
        "transcription", "realtime.transcription_session", {"type", "object", "id", "audio", "include"}, {"input"})
    assert s["audio"]["input"]["transcription"]["model"] == "tiny"  # the served model, unless told
    for session, param in [('{"type": "transcription", "instructions": "x"}', "session.instructions"),
                           ('{"output_modalities": ["text"]}', "session.output_modalities"),
                           ('{"audio": {"output": {"voice": "Chelsie"}}}', "session.audio.output")]:
        with pytest.raises(EventError) as e:
            cfg.update(parse(f'{{"type": "session.update", "session": {session}}}').session)
        assert e.value.param == param
        assert cfg.as_json() == s  # a refused update changes nothing
    cfg.update(parse('{"type": "session.update", "session": {"type": "realtime", "instructions": "Hi."}}').session)
    assert cfg.as_json()["type"] == "realtime" and cfg.instructions == "Hi." and cfg.transcription_settings is None
    # Its conversation, which nothing answers, makes room for each new turn by forgetting the oldest.
    conv = Conversation(max_items=2)
    turns = [ConversationItem(f"item_{i}", "user", [Part("input_text", text=str(i))]) for i in range(3)]
    for turn in turns[:2]:
        assert conv.make_room() is None
        conv.add(turn)
    assert conv.make_room() == "item_0" and conv.make_room() is None
    conv.add(turns[2])
    assert [it.id for it in conv.items] == ["item_1", "item_2"]


def test_a_long_conversation_loses_its_oldest_turns_first():
    sys_, u1, a1, u2, a2, u3 = ({"role": r, "content": r + str(i)} for i, r in
                                enumerate(["system", "user", "assistant", "user", "assistant", "user"]))
    assert without_oldest_turn([sys_, u1, a1, u2, a2, u3]) == [sys_, u2, a2, u3]
    assert without_oldest_turn([sys_, u2, a2, u3]) == [sys_, u3]
    assert without_oldest_turn([sys_, u3]) is None and without_oldest_turn([a1, u3]) == [u3]


REALTIME_TOOLS = [
    {"type": "function", "name": "get_weather", "description": "The weather in a city",
     "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                    "properties": {"city": {"enum": ["Paris", "Lyon"]}}}},
    {"type": "function", "name": "now", "parameters": {"type": "object", "properties": {},
                                                       "additionalProperties": False}}]


def test_session_tools_are_kept_checked_and_refused_by_a_transcription_session():
    cfg = SessionConfig("tiny", ["Chelsie"])
    cfg.update(parse(json.dumps({"type": "session.update", "session": {
        "tools": REALTIME_TOOLS, "tool_choice": "required"}})).session)
    assert cfg.as_json()["tools"] == REALTIME_TOOLS and cfg.as_json()["tool_choice"] == "required"
    assert cfg.tool_use("response").constraint is not None
    before = cfg.as_json()
    for session, param in [({"tools": [{"type": "web_search"}]}, "session.tools[0].type"),
                           ({"tool_choice": {"type": "function", "name": "other"}}, "session.tool_choice"),
                           ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "nonsense"}}]},
                            "session.tools[0].function.parameters"),
                           ({"type": "transcription", "tools": REALTIME_TOOLS}, "session.tools")]:
        with pytest.raises(EventError) as e:
            cfg.update(parse(json.dumps({"type": "session.update", "session": session})).session)
        assert e.value.param == param, e.value.message
        assert cfg.as_json() == before


def test_function_calls_and_outputs_join_the_conversation_prompt():
    """A function call joins the assistant message before it (or makes one), an output is a tool
    message; a call item must have its fields."""
    from omni_jax.server.realtime.conversation import function_call_item, item_from_event
    from omni_jax.server.messages import MediaPolicy
    from omni_jax.server.realtime.events import Item

    conv = Conversation()
    conv.add(ConversationItem("u", "user", [Part("input_text", text="Weather?")]))
    conv.add(ConversationItem("a", "assistant", [Part("output_text", text="Sure.")]))
    conv.add(function_call_item("call_1", "get_weather", '{"city": "Paris"}'))
    conv.add(item_from_event(Item(type="function_call_output", call_id="call_1", output="20 C"), MediaPolicy(), 1))
    conv.add(function_call_item("call_2", "now", "{}"))
    call = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert conv.messages(None) == [
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "content": "Sure.", "tool_calls": [call]},
        {"role": "tool", "content": "20 C"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "now", "arguments": "{}"}}]}]
    assert conv.items[2].as_json()["type"] == "function_call" and conv.items[2].as_json()["call_id"] == "call_1"
    with pytest.raises(EventError) as e:
        item_from_event(Item(type="function_call", call_id="c", name="now"), MediaPolicy(), 1)
    assert e.value.param == "item.arguments"
    with pytest.raises(EventError) as e:
        item_from_event(Item(type="message", role="user", content=[]), MediaPolicy(), 1)
    assert e.value.param == "item.content"



def test_a_response_cancelled_as_it_starts_still_opens_with_response_created(monkeypatch):
    """A barge-in just as a response starts, while another event holds the socket: the client
    gets response.created, then response.done cancelled (it got response.done alone)."""
    from omni_jax.server.realtime import response as response_module

    async def slow_open(*args):  # the request still being opened when the cancel comes
        await asyncio.Event().wait()

    monkeypatch.setattr(response_module, "open_request", slow_open)

    async def go():
        socket, sent = asyncio.Lock(), []

        async def send(event):
            async with socket:
                sent.append(event["type"])

        item = ConversationItem("item_1", "assistant", [Part("output_audio")], status="in_progress")
        async with socket:  # speech_started on its way out
            response = response_module.Response(
                None, send, [], modalities=["audio"], voice="Chelsie", params=[], max_output_tokens="inf",
                conversation_id="conv_1", item=item, metadata=None, previous_item_id=None,
                on_finished=lambda out: None).start()
            await asyncio.sleep(0)
            barge_in = asyncio.ensure_future(response.cancel("turn_detected"))
            await asyncio.sleep(0)
        await asyncio.wait_for(barge_in, 10)
        return sent, response

    sent, response = asyncio.run(go())
    assert sent == ["response.created", "response.done"]
    assert (response.status, response.reason) == ("cancelled", "turn_detected")

# ---------------------------------------------------------------------------------------- helpers

@pytest.fixture(scope="module")
def pipeline_yaml(server_pipeline_yaml) -> str:
    """test_server's pipeline with an audio encoder bucket of 6.4 s: a spoken turn in one call."""
    return with_audio_buckets(server_pipeline_yaml, [1, 4, 32], "realtime")


def _until(conn, kind: str, seen: list | None = None, timeout_s: float = 120.0):
    """Events up to and including the first of type `kind` (appended to `seen`); that event."""
    timed_out = threading.Event()

    def give_up():  # a recv waiting on an event that never comes would hang the run
        timed_out.set()
        conn.close()

    watchdog = threading.Timer(timeout_s, give_up)
    watchdog.start()
    try:
        while True:
            try:
                ev = conn.recv()
            except ConnectionClosed:
                assert not timed_out.is_set(), f"no {kind} in {timeout_s} s; seen {[e.type for e in seen or []]}"
                raise
            if seen is not None:
                seen.append(ev)
            assert ev.type != "error" or kind == "error", ev.error
            if ev.type == kind:
                return ev
    finally:
        watchdog.cancel()


def _audio_of(events) -> np.ndarray:
    pcm = b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta")
    return np.frombuffer(pcm, "<i2") / 32767.0


def _text_of(events, kind: str) -> str:
    return "".join(e.delta for e in events if e.type == kind)


def _say_hello(conn, **response):
    conn.conversation.item.create(item={"type": "message", "role": "user",
                                        "content": [{"type": "input_text", "text": "Hello"}]})
    conn.response.create(response={"sampling_params_list": SPL} | response)


# ---------------------------------------------------------------------------------------- happy paths

def test_text_turn_speaks_as_the_library(client, library):
    want = library.generate({"messages": HELLO}, sampling_params_list=_lib_params(library, 8),
                            output_modalities=["text", "audio"], voice="Chelsie")[0]
    with client.realtime.connect(model=MODEL) as conn:
        created = _until(conn, "session.created")
        assert created.session.audio.output.voice == "Chelsie"
        assert created.session.output_modalities == ["audio"]
        assert created.session.audio.input.turn_detection.type == "server_vad"
        _say_hello(conn, max_output_tokens=8, temperature=0.0)
        seen = []
        done = _until(conn, "response.done", seen)
    kinds = [e.type for e in seen]
    # OpenAI's order: the response, its item and part, the deltas, then the .done events
    for a, b in [("response.created", "response.output_item.added"),
                 ("response.output_item.added", "response.content_part.added"),
                 ("response.content_part.added", "response.output_audio.delta"),
                 ("response.output_audio.delta", "response.output_audio.done"),
                 ("response.output_audio_transcript.done", "response.content_part.done"),
                 ("response.output_item.done", "response.done")]:
        assert kinds.index(a) < kinds.index(b), (a, b, kinds)
    transcript = _text_of(seen, "response.output_audio_transcript.delta")
    assert transcript == want.text and transcript
    assert next(e for e in seen if e.type == "response.output_audio_transcript.done").transcript == want.text
    _assert_same_audio(_audio_of(seen), want.audio)
    r = done.response
    assert r.status == "incomplete" and r.status_details.reason == "max_output_tokens"  # 8 tokens: cut short
    assert r.usage.output_tokens == len(want.token_ids) and r.usage.input_tokens == len(want.prompt_token_ids)
    assert r.output[0].content[0].transcript == want.text


def test_the_session_speed_paces_the_spoken_reply(client, library):
    """session.audio.output.speed: the reply's audio is the library's at that pace (server/tempo.py),
    its transcript unchanged."""
    from omni_jax.server.tempo import stretch

    want = library.generate({"messages": HELLO}, sampling_params_list=_lib_params(library, 8),
                            output_modalities=["text", "audio"], voice="Chelsie")[0]
    with client.realtime.connect(model=MODEL) as conn:
        _until(conn, "session.created")
        conn.session.update(session={"type": "realtime", "audio": {"output": {"speed": 1.5}}})
        assert _until(conn, "session.updated").session.audio.output.speed == 1.5
        _say_hello(conn, max_output_tokens=8, temperature=0.0)
        seen = []
        _until(conn, "response.done", seen)
    assert _text_of(seen, "response.output_audio_transcript.delta") == want.text
    _assert_same_audio(_audio_of(seen), stretch(want.audio, 1.5))


def _speak(conn, audio: np.ndarray, seen: list, before_s: float = 0.0):
    """Stream `audio` as a microphone would (100 ms appends); the VAD's turn events.
    `before_s`: the audio the session was sent before (the events' times count from its start)."""
    for i in range(0, len(audio), 2400):
        conn.input_audio_buffer.append(audio=_b64(audio[i:i + 2400]))
    started = _until(conn, "input_audio_buffer.speech_started", seen)
    stopped = _until(conn, "input_audio_buffer.speech_stopped", seen)
    committed = _until(conn, "input_audio_buffer.committed", seen)
    assert started.item_id == stopped.item_id == committed.item_id
    start, end = np.add(_voiced(audio), 1000 * before_s)
    assert abs(started.audio_start_ms - (start - 300)) <= 60 and stopped.audio_end_ms > end
    return committed


def test_spoken_turn_by_server_vad(client):
    audio = _speech("Hello there. What is the weather like today?")
    with client.realtime.connect(model=MODEL) as conn:
        _until(conn, "session.created")
        conn.session.update(session={"type": "realtime", "max_output_tokens": 6,
                                     "audio": {"input": {"transcription": {"model": MODEL}}}})
        _until(conn, "session.updated")
        seen = []
        committed = _speak(conn, audio, seen)
        done = _until(conn, "response.done", seen).response  # create_response: the VAD's turn is answered
        if not any(e.type == "conversation.item.input_audio_transcription.completed" for e in seen):
            _until(conn, "conversation.item.input_audio_transcription.completed", seen)
    assert done.status == "incomplete" and done.usage.input_tokens > 0
    assert _audio_of(seen).size > 0 and _text_of(seen, "response.output_audio_transcript.delta")
    transcribed = next(e for e in seen if e.type == "conversation.item.input_audio_transcription.completed")
    assert transcribed.item_id == committed.item_id and transcribed.transcript and transcribed.usage.input_tokens > 0
    deltas = [e for e in seen if e.type == "conversation.item.input_audio_transcription.delta"]
    assert {e.item_id for e in deltas} == {committed.item_id}
    assert "".join(e.delta for e in deltas) == transcribed.transcript  # streamed as the thinker writes it
    assert seen.index(deltas[-1]) < seen.index(transcribed)


def test_a_phone_session_in_g711(client, library):
    """audio/pcmu in and out (Twilio's media streams): a spoken turn in mu-law at 8 kHz is heard as
    its PCM16 twin is, the reply is the library's audio at 8 kHz in mu-law; a response may ask
    for another format (A-law)."""
    want = library.generate({"messages": HELLO}, sampling_params_list=_lib_params(library, 8),
                            output_modalities=["text", "audio"], voice="Chelsie")[0]
    speech = _speech("Hello there. What is the weather like today?")
    ulaw = g711.encode(np.round(soxr.resample(speech, SR, 8000) * 32767).astype(np.int16), "ulaw")
    with client.realtime.connect(model=MODEL) as conn:
        _until(conn, "session.created")
        conn.session.update(session={"type": "realtime", "audio": {"input": {"format": {"type": "audio/pcmu"}},
                                                                   "output": {"format": {"type": "audio/pcmu"}}}})
        audio = _until(conn, "session.updated").session.audio
        assert (audio.input.format.type, audio.output.format.type) == ("audio/pcmu", "audio/pcmu")
        _say_hello(conn, max_output_tokens=8, temperature=0.0)
        seen = []
        done = _until(conn, "response.done", seen).response
        got = np.concatenate([wire_audio.decode(e.delta, wire_audio.PCMU) for e in seen
                              if e.type == "response.output_audio.delta"])
        assert done.audio.output.format.type == "audio/pcmu"
        # (the random vocoder's full-scale noise overshoots [-1, 1] once resampled: the wire clips it)
        reference = np.clip(soxr.resample(want.audio, SR, 8000), -1, 1)
        assert len(got) == len(reference) and np.abs(got - reference).max() < 0.03
        assert done.output[0].content[0].transcript == want.text
        # the caller speaks: 100 ms appends of mu-law, as a phone line sends them
        turn = []
        for i in range(0, len(ulaw), 800):
            conn.input_audio_buffer.append(audio=base64.b64encode(ulaw[i:i + 800]).decode())
        started = _until(conn, "input_audio_buffer.speech_started", turn)
        stopped = _until(conn, "input_audio_buffer.speech_stopped", turn)
        start, end = _voiced(speech)
        assert abs(started.audio_start_ms - (start - 300)) <= 60 and end < stopped.audio_end_ms < end + 900
        conn.response.cancel()
        _until(conn, "response.done", turn)
        conn.response.create(response={"max_output_tokens": 2, "audio": {"output": {"format": {"type": "audio/pcma"}}}})
        alaw = _until(conn, "response.done").response
        assert alaw.audio.output.format.type == "audio/pcma"


def test_the_phone_example_bridges_a_call(server):
    """examples/phone_call.py between a fake Twilio media stream and the server: the TwiML points
    the call at the bridge; a caller's mu-law turn (20 ms media frames, as Twilio sends) is answered
    with mu-law media on the call's stream."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        from phone_call import build_app as bridge_app
    finally:
        sys.path.remove(str(EXAMPLES))
    realtime = server.url.replace("http://", "ws://") + f"/v1/realtime?model={MODEL}"
    port = _free_port()
    bridge = uvicorn.Server(uvicorn.Config(bridge_app(realtime, API_KEY, voice="Ethan"), host="127.0.0.1", port=port,
                                           log_level="warning", ws="websockets-sansio"))
    thread = threading.Thread(target=bridge.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not bridge.started and time.monotonic() < deadline:
            time.sleep(0.05)
        twiml = httpx.post(f"http://127.0.0.1:{port}/incoming-call", headers={"host": "calls.example.com"}).text
        assert '<Stream url="wss://calls.example.com/media-stream"/>' in twiml
        speech = _speech("Hello there. What is the weather like today?")
        ulaw = g711.encode(np.round(soxr.resample(speech, SR, 8000) * 32767).astype(np.int16), "ulaw")
        with ws_client.connect(f"ws://127.0.0.1:{port}/media-stream", open_timeout=30) as call:
            call.send(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
            call.send(json.dumps({"event": "start", "streamSid": "MZ1", "start": {"streamSid": "MZ1"}}))
            for i in range(0, len(ulaw), 160):
                call.send(json.dumps({"event": "media", "streamSid": "MZ1",
                                      "media": {"payload": base64.b64encode(ulaw[i:i + 160]).decode()}}))
            heard = []
            while sum(len(h) for h in heard) < 4000:  # half a second of the reply
                msg = json.loads(call.recv(timeout=120))
                assert msg["streamSid"] == "MZ1"
                if msg["event"] == "media":
                    heard.append(g711.decode(base64.b64decode(msg["media"]["payload"]), "ulaw"))
            call.send(json.dumps({"event": "stop", "streamSid": "MZ1"}))
        assert np.abs(np.concatenate(heard)).max() > 1000  # speech, not silence
    finally:
        bridge.should_exit = True
        thread.join(30)
    _idle(server)


def test_semantic_vad_session_answers_a_spoken_turn(client):
    """OpenAI's Agents SDK sets semantic_vad by default: taken, echoed, and a spoken turn answered."""
    audio = _speech("Hello there. What is the weather like today?", tail_s=1.5)
    with client.realtime.connect(model=MODEL) as conn:
        _until(conn, "session.created")
        conn.session.update(session={"type": "realtime", "max_output_tokens": 4, "audio": {"input": {
            "turn_detection": {"type": "semantic_vad", "eagerness": "auto", "interrupt_response": True}}}})
        td = _until(conn, "session.updated").session.audio.input.turn_detection
        assert (td.type, td.eagerness, td.create_response) == ("semantic_vad", "auto", True)
        seen = []
        _speak(conn, audio, seen)
        done = _until(conn, "response.done", seen).response
    stopped = next(e for e in seen if e.type == "input_audio_buffer.speech_stopped")
    assert stopped.audio_end_ms >= _voiced(audio)[1] + 1000 - 60  # auto: a second of silence ends the turn
    assert done.status == "incomplete" and _audio_of(seen).size > 0


def test_a_second_turn_computes_only_what_is_new(client, server):
    """Each turn's prompt extends the last: the thinker's prefix cache serves the old part, the
    first turn's audio included when the second is spoken too (each clip is a cache range of its
    own), and spoken replies too (the hidden rows the talker needs of it are kept with the cache)."""
    before = _metrics(server)
    with client.realtime.connect(model=MODEL) as conn:
        _until(conn, "session.created")
        conn.session.update(session={"type": "realtime", "max_output_tokens": 6})
        _until(conn, "session.updated")
        # Words no other test speaks: only this session can have cached the turn's audio blocks.
        turn = _speech("Good morning. Will it rain this afternoon?")
        _speak(conn, turn, [])
        first = _until(conn, "response.done").response
        _speak(conn, _speech("And tomorrow?"), [], before_s=len(turn) / SR)
        second = _until(conn, "response.done").response
    cached = second.usage.input_token_details.cached_tokens
    # (the first turn may hit too, on the instructions' blocks that other sessions cached)
    assert cached > first.usage.input_token_details.cached_tokens
    assert second.usage.input_tokens > first.usage.input_tokens
    assert cached >= first.usage.input_tokens // 16 * 16 - 16 and cached > 0, second.usage  # 16: the block size
    after = _metrics(server)
    key = 'omni_jax_prompt_tokens_total{source="cached"}'
    assert after[key] - before.get(key, 0) >= cached


def test_a_cached_turn_speaks_as_the_library(client, library):
    """The second turn's thinker takes the first turn's prompt from the prefix cache with its
    hidden rows (engine/hidden_cache.py): its speech equals the library's on the whole
    conversation computed afresh."""
    with client.realtime.connect(model=MODEL) as conn:
        _until(conn, "session.created")
        _say_hello(conn, max_output_tokens=8, temperature=0.0)
        first = _until(conn, "response.done").response
        conn.conversation.item.create(item={"type": "message", "role": "user",
                                            "content": [{"type": "input_text", "text": "And tomorrow?"}]})
        conn.response.create(response={"sampling_params_list": SPL, "max_output_tokens": 8, "temperature": 0.0})
        seen = []
        second = _until(conn, "response.done", seen).response
    said = first.output[0].content[0].transcript
    messages = HELLO + [{"role": "assistant", "content": said}, {"role": "user", "content": "And tomorrow?"}]
    want = library.generate({"messages": messages}, sampling_params_list=_lib_params(library, 8),
                            output_modalities=["text", "audio"], voice="Chelsie")[0]
    assert second.usage.input_tokens == len(want.prompt_token_ids)
    cached = second.usage.input_token_details.cached_tokens
    assert cached > 0 and cached >= first.usage.input_tokens // 16 * 16 - 16, second.usage  # 16: the block size
    assert _text_of(seen, "response.output_audio_transcript.delta") == want.text
    _assert_same_audio(_audio_of(seen), want.audio)


def test_barge_in_cancels_the_reply_and_frees_every_stage(client, server):
    speech = _speech("Stop, please.", lead_s=0.1, tail_s=0.1)
    with client.realtime.connect(model=MODEL) as conn:
        _until(conn, "session.created")
        _say_hello(conn, **LONG_REPLY)
        seen = []
        _until(conn, "response.output_audio.delta", seen)  # the reply is playing
        t0 = time.monotonic()
        for i in range(0, len(speech), 2400):
            conn.input_audio_buffer.append(audio=_b64(speech[i:i + 2400]))
        done = _until(conn, "response.done", seen)
        latency = time.monotonic() - t0
        assert "input_audio_buffer.speech_started" in [e.type for e in seen]
        assert done.response.status == "cancelled" and done.response.status_details.reason == "turn_detected"
        item = done.response.output[0]
        assert item.status == "incomplete"
        # the item keeps the audio that was sent before the cut
        assert _audio_of(seen).size > 0
    assert latency < 30
    _idle(server)


def test_a_silent_user_is_prompted_after_idle_timeout_ms(client):
    """turn_detection.idle_timeout_ms: once a reply has played (response.done plus its audio), that
    long without speech commits the silence as the user's turn (input_audio_buffer.timeout_triggered,
    then committed) and answers it; audio the microphone keeps sending (silence) changes nothing."""
    with client.realtime.connect(model=MODEL) as conn:
        _until(conn, "session.created")
        conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": {
            "type": "server_vad", "idle_timeout_ms": 1000}}}})
        _until(conn, "session.updated")
        seen = []
        _say_hello(conn, max_output_tokens=6)
        _until(conn, "response.done", seen)
        done_at = time.monotonic()
        conn.input_audio_buffer.append(audio=_b64(np.zeros(SR // 2, np.float32)))  # the mic, silent
        triggered = _until(conn, "input_audio_buffer.timeout_triggered", seen)
        waited_ms = (time.monotonic() - done_at) * 1000
        committed = _until(conn, "input_audio_buffer.committed", seen)
        answered = _until(conn, "response.done", seen).response
    played_ms = len(_audio_of(seen[:seen.index(triggered)])) * 1000 / SR
    assert played_ms > 0 and played_ms + 1000 - 100 <= waited_ms < played_ms + 1000 + 15000, (played_ms, waited_ms)
    assert committed.item_id == triggered.item_id and triggered.audio_end_ms >= triggered.audio_start_ms
    assert answered.status in ("completed", "incomplete") and answered.usage.input_tokens > 0


def test_manual_commit_with_vad_off_hears_the_audio(client, library):
    audio = _speech("Good morning.", lead_s=0.1, tail_s=0.1)
    with client.realtime.connect(model=MODEL) as conn:
        _until(conn, "session.created")
        conn.session.update(session={"type": "realtime", "output_modalities": ["text"],
                                     "audio": {"input": {"turn_detection": None}}})
        updated = _until(conn, "session.updated")
        assert updated.session.audio.input.turn_detection is None
        conn.input_audio_buffer.append(audio=_b64(audio))
        conn.input_audio_buffer.commit()
        committed = _until(conn, "input_audio_buffer.committed")
        conn.response.create(response={"max_output_tokens": 6, "temperature": 0.0,
                                       "sampling_params_list": [{"ignore_eos": True}]})
        seen = []
        _until(conn, "response.done", seen)
    assert committed.item_id
    assert not any(e.type.startswith("input_audio_buffer.speech") for e in seen)
    # the same 16 kHz samples the server's streamed resampler made from the appended audio
    heard = soxr.ResampleStream(SR, 16000, 1, dtype="float32").resample_chunk(audio.astype(np.float32))
    heard = np.round(np.clip(heard, -1, 1) * 32767) / 32768  # the wire's PCM16
    want = library.generate({"messages": [{"role": "user", "content": [{"type": "audio", "audio": (heard, 16000)}]}]},
                            SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), output_modalities=["text"])[0]
    assert _text_of(seen, "response.output_text.delta") == want.text and want.text


def test_text_only_session_and_an_image_item(client, library, media_dir):
    png = (media_dir / "cat.png").read_bytes()
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    want = library.generate({"messages": [{"role": "user", "content": [
        {"type": "image", "image": str(media_dir / "cat.png")}, {"type": "text", "text": "What is it?"}]}]},
        SamplingParams(temperature=0.0, max_tokens=5), output_modalities=["text"])[0]
    with client.realtime.connect(model=MODEL) as conn:
        _until(conn, "session.created")
        conn.session.update(session={"type": "realtime", "output_modalities": ["text"]})
        _until(conn, "session.updated")
        conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
            {"type": "input_image", "image_url": url}, {"type": "input_text", "text": "What is it?"}]})
        added = _until(conn, "conversation.item.added")
        assert [c.type for c in added.item.content] == ["input_image", "input_text"]
        conn.response.create(response={"max_output_tokens": 5, "temperature": 0.0})
        seen = []
        done = _until(conn, "response.done", seen)
    kinds = {e.type for e in seen}
    assert "response.output_audio.delta" not in kinds and "response.output_text.done" in kinds
    assert _text_of(seen, "response.output_text.delta") == want.text and want.text
    assert done.response.output[0].content[0].text == want.text


def test_a_conversation_longer_than_the_model_loses_its_oldest_turns(client, pipeline_yaml):
    """Spoken turns that fit one by one but not together (the thinker's 512 tokens of context hold
    about 20 s of speech, a turn lasts about 5 s): the reply is made from the newest turns that fit
    (OpenAI's truncation "auto"), their audio more than the largest audio bucket (6.4 s) takes in
    one encoder call."""
    turn = {"type": "message", "role": "user", "content": [
        {"type": "input_audio", "audio": _b64(_speech("Tell me about the weather by the sea tomorrow.", tail_s=2.5))}]}
    context = load_pipeline_config(pipeline_yaml).stage("thinker").max_model_len
    with client.realtime.connect(model=MODEL) as conn:
        _until(conn, "session.created")
        conn.session.update(session={"type": "realtime", "output_modalities": ["text"]})
        _until(conn, "session.updated")
        used = []  # input tokens of the instructions with one turn, and with two
        for n in (1, 2):
            conn.response.create(response={"max_output_tokens": 1, "conversation": "none", "input": [turn] * n})
            used.append(_until(conn, "response.done").response.usage.input_tokens)
        for _ in range(4):
            conn.conversation.item.create(item=turn)
            _until(conn, "conversation.item.added")
        conn.response.create(response={"max_output_tokens": 2})
        done = _until(conn, "response.done").response
    assert done.status == "incomplete" and done.status_details.reason == "max_output_tokens", done.status_details
    # the newest turns whose prompt leaves room for a token: fewer than the four
    fit = [k for k in range(1, 5) if used[0] + (k - 1) * (used[1] - used[0]) < context]
    assert 1 < fit[-1] < 4 and done.usage.input_tokens == used[0] + (fit[-1] - 1) * (used[1] - used[0]), (used, done.usage)


def test_cancel_and_conversation_edits(client, server):
    with client.realtime.connect(model=MODEL) as conn:
        _until(conn, "session.created")
        conn.response.cancel()
        err = _until(conn, "error")
        assert err.error.code == "response_cancel_not_active"
        # sent together, so the cancel reaches the reply while it runs however slow the machine
        # (waiting for its first audio first raced its end on a loaded one)
        _say_hello(conn, max_output_tokens=200)
        conn.response.create()  # one at a time
        conn.response.cancel()
        assert _until(conn, "error").error.code == "conversation_already_has_active_response"
        done = _until(conn, "response.done")
        assert done.response.status == "cancelled" and done.response.status_details.reason == "client_cancelled"
        _say_hello(conn, max_output_tokens=8)
        done = _until(conn, "response.done")
        item = done.response.output[0]
        assert item.content[0].transcript
        conn.conversation.item.truncate(item_id=item.id, content_index=0, audio_end_ms=0)
        truncated = _until(conn, "conversation.item.truncated")
        assert truncated.audio_end_ms == 0
        conn.conversation.item.retrieve(item_id=item.id)
        got = _until(conn, "conversation.item.retrieved")
        assert got.item.content[0].transcript == ""  # nothing of it was heard
        conn.conversation.item.delete(item_id=item.id)
        assert _until(conn, "conversation.item.deleted").item_id == item.id
        conn.conversation.item.delete(item_id=item.id)
        assert _until(conn, "error").error.code == "item_not_found"
    _idle(server)


@pytest.fixture(scope="module")
def qwen3_server(env):
    """An in-process server on the built-in tiny Qwen3-Omni (its prompts use the built-in Qwen
    tokenizer), with test_async_chunk_pipeline's pipeline (the same programs: their compiles are
    cached; code2wav is deterministic, the thinker greedy) and a greedy talker."""
    pipeline = pipeline_for("qwen3_omni").with_overrides(
        talker=dict(default_sampling={"temperature": 0.0, "max_tokens": 40}))
    engine = ServedEngine("tiny-qwen3_omni", "qwen3", pipeline, ["text", "audio"])
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine), host="127.0.0.1", port=port, log_level="warning",
                                           ws="websockets-sansio"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    engine.start()
    assert engine.wait(900) and engine.state == "ready", engine.reason
    yield engine, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(60)


def test_qwen3_spoken_turn_speaks_as_the_library(qwen3_server):
    """Qwen3-Omni through the official client: a turn found by server VAD, answered with the text
    and speech of the same prompt through AsyncOmniJax."""
    engine, url = qwen3_server
    audio = _speech("Hello there. How are you?")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    with client.realtime.connect(model="qwen3") as conn:
        created = _until(conn, "session.created")
        assert created.session.audio.output.voice == engine.omni.voices[0]
        conn.session.update(session={"type": "realtime", "max_output_tokens": 8, "temperature": 0.0})
        _until(conn, "session.updated")
        seen = []
        _speak(conn, audio, seen)
        done = _until(conn, "response.done", seen).response
    # The same turn, cut by the same VAD, through the library.
    turns = Turns(60, ServerVADConfig(type="server_vad"))
    turn = next(a for i in range(0, len(audio), 2400) for e, a in turns.append(audio[i:i + 2400]) if a is not None)
    params = engine.stage_defaults(engine.stage_names(["text", "audio"]))
    params[0] = params[0].updated(temperature=0.0, max_tokens=8)

    async def library():
        out = None
        async for out in engine.omni.generate({"messages": [{"role": "user", "content": [
                {"type": "audio", "audio": (turn, 16000)}]}]}, sampling_params_list=params,
                output_modalities=["text", "audio"]):
            pass
        return out

    want = asyncio.run(library())
    assert done.status == "incomplete" and done.usage.input_tokens == len(want.prompt_token_ids)
    assert _text_of(seen, "response.output_audio_transcript.delta") == want.text and want.text
    got = _audio_of(seen)
    assert got.shape == want.audio.shape
    # Not 1e-5: the vocoder's output depends on how many windows share its call (measured, whole
    # decode, all codes equal: one window alone vs the same window 4 times in a call, frame
    # states 2.2e-6 apart, float32 rounding of XLA's CPU kernels per batch size, which this random
    # model's loud convolutions raise to 1.8e-3 of a 27 peak before the clamp, 6.5e-5 of it); two
    # runs of one request need not share calls alike (through the library: up to 1.2e-3).
    np.testing.assert_allclose(got, np.clip(want.audio, -1, 1), atol=2e-3, rtol=0)


def test_qwen3_spoken_reply_with_a_call(qwen3_server):
    """Qwen3-Omni's talker and code2wav speak a reply stopped at a call's tag (the random model made
    to say "Sure." and call by a grammar); the call is written after, unspoken, and fits its tool."""
    engine, url = qwen3_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    with client.realtime.connect(model="qwen3") as conn:
        _until(conn, "session.created")
        conn.session.update(session={"type": "realtime", "tools": REALTIME_TOOLS[:1], "temperature": 0.0})
        _until(conn, "session.updated")
        conn.conversation.item.create(item={"type": "message", "role": "user",
                                            "content": [{"type": "input_text", "text": "Weather?"}]})
        _until(conn, "conversation.item.added")
        conn.response.create(response={"max_output_tokens": 40, "sampling_params_list": [
            _calls_grammar('\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n')]})
        seen = []
        done = _until(conn, "response.done", seen).response
    assert _text_of(seen, "response.output_audio_transcript.delta") == "Sure." and len(_audio_of(seen)) > 0
    assert [o.type for o in done.output[:2]] == ["message", "function_call"], done.status_details
    assert all(o.name == "get_weather" and json.loads(o.arguments)["city"] in ("Paris", "Lyon")
               for o in done.output[1:] if o.status == "completed")  # the last may be cut by max_output_tokens
    _idle(SimpleNamespace(url=url))  # the spoken request and the calls' both done in every stage


# ---------------------------------------------------------------------------------------- hostile clients

def _raw(server, key: str = API_KEY, query: str = ""):
    """A session's socket, entered as `with` would (websockets >= 17.1 warns about a connection
    used without): the caller closes it, or uses it in a `with`."""
    url = server.url.replace("http://", "ws://") + f"/v1/realtime?model={MODEL}{query}"
    return ws_client.connect(url, additional_headers={"Authorization": f"Bearer {key}"}, open_timeout=30,
                             max_size=None).__enter__()


def _next(ws, kind: str, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        ev = json.loads(ws.recv(timeout=max(deadline - time.monotonic(), 0.1)))
        if ev["type"] == kind:
            return ev


def test_bad_events_get_errors_and_the_session_goes_on(server):
    with _raw(server) as ws:
        _next(ws, "session.created")
        for message, code in [("{oops", "invalid_json"), ('{"type": "no.such.event", "event_id": "e1"}',
                                                           "unknown_event_type"),
                              ('{"type": "input_audio_buffer.append", "audio": "***"}', "invalid_value"),
                              ('{"type": "input_audio_buffer.append", "audio": "AAAA"}', "invalid_value"),
                              ('{"type": "input_audio_buffer.commit"}', "input_audio_buffer_commit_empty"),
                              ('{"type": "response.create"}', "invalid_value"),
                              ('{"type": "session.update", "session": {"audio": {"output": {"voice": "Nobody"}}}}',
                               "invalid_value")]:
            ws.send(message)
            err = _next(ws, "error")["error"]
            assert err["code"] == code, (message, err)
            assert err["type"] == "invalid_request_error" and err["message"]
        assert err["param"] == "session.audio.output.voice" and "Chelsie" in err["message"]
        ws.send('{"type": "session.update", "event_id": "e2", "session": {"instructions": "Be brief."}}')
        assert _next(ws, "session.updated")["session"]["instructions"] == "Be brief."


def test_an_image_item_that_cannot_be_used_is_refused_and_the_session_goes_on(server, media_dir):
    """An image past the server's limits (--media-limits here: 448 x 336 pixels) or one that cannot be
    read is an error for its conversation.item.create and never joins the conversation, whose next
    reply is made (kept, it would fail that reply and every one after it)."""
    from PIL import Image

    big = io.BytesIO()
    Image.new("RGB", (449, 336)).save(big, "PNG")
    png = (media_dir / "cat.png").read_bytes()
    refused = {f"449x336 = 150864 pixels, more than the limit of {MAX_IMAGE_PIXELS}": big.getvalue(),
               "cannot read": png[:60]}
    with _raw(server) as ws:
        _next(ws, "session.created")
        ws.send('{"type": "session.update", "session": {"output_modalities": ["text"]}}')
        _next(ws, "session.updated")
        for says, data in refused.items():
            url = "data:image/png;base64," + base64.b64encode(data).decode()
            ws.send(json.dumps({"type": "conversation.item.create", "event_id": "e1", "item": {
                "type": "message", "role": "user",
                "content": [{"type": "input_text", "text": "Look."}, {"type": "input_image", "image_url": url}]}}))
            err = _next(ws, "error")["error"]
            assert (err["code"], err["param"], err["event_id"]) == ("invalid_value", "item.content[1].image_url", "e1")
            assert says in err["message"], err
        ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello"}]}}))
        assert _next(ws, "conversation.item.added")["previous_item_id"] is None  # the first item there
        ws.send('{"type": "response.create", "response": {"max_output_tokens": 2}}')
        done = _next(ws, "response.done")["response"]
        assert done["status"] == "incomplete" and done["status_details"]["reason"] == "max_output_tokens", done


def test_appends_past_the_buffer_are_refused_unread_and_the_session_goes_on(server):
    """The buffer holds 60 s (--realtime-max-buffer-s): an append past it is an error, read from
    its length before it is decoded (a bad tail is never looked at), and a clear makes room."""
    silence = base64.b64encode(bytes(2 * 15 * SR)).decode()  # 15 s of PCM16, under the 1 MB message limit
    with _raw(server) as ws:
        _next(ws, "session.created")
        ws.send('{"type": "session.update", "session": {"audio": {"input": {"turn_detection": null}}}}')
        _next(ws, "session.updated")  # (with VAD on, silence between turns is not held)
        for _ in range(4):
            ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": silence}))
        ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": silence[:-8] + "!!!!!!!!"}))
        err = _next(ws, "error")["error"]
        assert (err["code"], err["param"]) == ("invalid_value", "audio") and "holds at most 60 s" in err["message"]
        ws.send('{"type": "input_audio_buffer.clear"}')
        _next(ws, "input_audio_buffer.cleared")
        ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": silence}))
        ws.send('{"type": "input_audio_buffer.commit"}')
        assert _next(ws, "input_audio_buffer.committed")["item_id"]


def test_an_idle_session_outlives_the_header_timeout(server):
    """The HTTP header deadline (--header-timeout-s, 10 s) ends at the WebSocket upgrade."""
    with _raw(server) as ws:
        _next(ws, "session.created")
        time.sleep(11)
        ws.send('{"type": "session.update", "session": {"instructions": "still here"}}')
        assert _next(ws, "session.updated")["session"]["instructions"] == "still here"


def test_a_huge_message_closes_with_1009_and_others_are_unaffected(server):
    with _raw(server) as ws, _raw(server) as other:
        _next(ws, "session.created"), _next(other, "session.created")
        ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": "A" * (MAX_BODY_MB << 21)}))
        with pytest.raises(ConnectionClosed) as e:
            ws.recv(timeout=30)
        assert e.value.rcvd.code == 1009
        other.send('{"type": "session.update", "session": {"instructions": "still here"}}')
        assert _next(other, "session.updated")["session"]["instructions"] == "still here"


def test_a_bad_key_is_refused_at_the_handshake(server):
    with pytest.raises(InvalidStatus) as e:
        _raw(server, key="wrong")
    assert e.value.response.status_code == 401


def test_another_sites_page_may_not_open_a_session(server):
    """Browsers apply no CORS to WebSockets: the handshake's Origin is checked instead. The
    server's own page (the voice chat page) and clients that send no Origin get in."""
    url = server.url.replace("http://", "ws://") + f"/v1/realtime?model={MODEL}"
    with pytest.raises(InvalidStatus) as e:
        ws_client.connect(url, additional_headers={"Authorization": f"Bearer {API_KEY}"},
                          origin="https://evil.example", open_timeout=30)
    assert e.value.response.status_code == 403
    assert json.loads(e.value.response.body)["error"]["code"] == "origin_not_allowed"
    for origin in (server.url, None):
        with ws_client.connect(url, additional_headers={"Authorization": f"Bearer {API_KEY}"}, origin=origin,
                               open_timeout=30) as ws:
            assert _next(ws, "session.created")


def test_a_client_secret_admits_sessions_with_its_settings(client, server):
    """A backend's key buys a browser a short-lived one (the subprotocol a browser sends it in):
    its sessions start with the secret's settings; it opens nothing but /v1/realtime."""
    secret = client.realtime.client_secrets.create(
        expires_after={"anchor": "created_at", "seconds": 60},
        session={"type": "realtime", "instructions": "Be brief.",
                 "audio": {"output": {"voice": "Ethan", "format": {"type": "audio/pcmu"}}}})
    assert secret.value.startswith("ek_") and abs(secret.expires_at - (time.time() + 60)) < 5
    assert secret.session.instructions == "Be brief." and secret.session.audio.output.voice == "Ethan"
    url = server.url.replace("http://", "ws://") + f"/v1/realtime?model={MODEL}"
    ids = set()
    for _ in range(2):  # a secret opens any number of sessions until it expires
        with ws_client.connect(url, subprotocols=["realtime", f"openai-insecure-api-key.{secret.value}"],
                               open_timeout=30) as ws:
            session = _next(ws, "session.created")["session"]
            assert session["instructions"] == "Be brief." and session["audio"]["output"]["voice"] == "Ethan"
            assert session["audio"]["output"]["format"] == {"type": "audio/pcmu"}
            ids.add(session["id"])
    assert len(ids) == 2
    with pytest.raises(openai.AuthenticationError):  # not the API key
        openai.OpenAI(base_url=f"{server.url}/v1", api_key=secret.value, max_retries=0).models.list()
    for body, param in [({"expires_after": {"seconds": 5}}, "expires_after.seconds"),
                        ({"session": {"audio": {"output": {"voice": "Nobody"}}}}, "session.audio.output.voice"),
                        ({"session": {"type": "realtime", "model": "other"}}, "session.model")]:
        r = httpx.post(f"{server.url}/v1/realtime/client_secrets", json=body, headers=_auth(), timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(f"{server.url}/v1/realtime/client_secrets", json={}, timeout=30)
    assert r.status_code == 401  # buying one takes the API key


def test_client_secrets_expire_and_are_bounded():
    now = [1000.0]
    engine = SimpleNamespace(check=lambda: (True, ""), served_name=MODEL, voices=["Chelsie", "Ethan"])
    secrets = ClientSecrets(engine, max_live=2, clock=lambda: now[0])
    first = secrets.create({"expires_after": {"seconds": 10}, "session": {"type": "transcription"}})
    assert first["expires_at"] == 1010 and first["session"]["type"] == "transcription"
    a, b = secrets.session(first["value"]), secrets.session(first["value"])
    assert a.type == "transcription" and a.id != b.id and secrets.session("ek_unknown") is None
    secrets.create({})
    with pytest.raises(APIError) as e:  # two live: the most it keeps
        secrets.create({})
    assert e.value.status == 429
    now[0] = 1010.0
    assert secrets.session(first["value"]) is None  # expired
    secrets.create({})  # and forgotten, making room


def test_sessions_past_the_limit_are_refused_and_all_are_freed(server):
    def open_one(_):
        ws = _raw(server)
        first = json.loads(ws.recv(timeout=60))
        return ws, first

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        opened = list(pool.map(open_one, range(64)))
    try:
        kinds = [first["type"] for _, first in opened]
        assert kinds.count("session.created") == 16  # --max-realtime-sessions' default
        refused = [(ws, first) for ws, first in opened if first["type"] == "error"]
        assert len(refused) == 48
        for ws, first in refused:
            assert first["error"]["code"] == "session_limit_reached"
            with pytest.raises(ConnectionClosed) as e:
                ws.recv(timeout=30)
            assert e.value.rcvd.code == 1008
    finally:
        for ws, _ in opened:
            ws.close()
    deadline = time.monotonic() + 30
    while _metrics(server).get("omni_jax_realtime_sessions", 0) != 0:
        assert time.monotonic() < deadline, "sessions still counted after their clients left"
        time.sleep(0.2)


def test_a_client_vanishing_mid_reply_aborts_it_everywhere(server):
    ws = _raw(server)
    _next(ws, "session.created")
    ws.send(json.dumps({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello"}]}}))
    ws.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": 200}}))
    _next(ws, "response.output_audio.delta")
    ws.socket.close()  # gone without a close frame
    _idle(server, timeout=30)
    r = httpx.get(f"{server.url}/health", timeout=10)
    assert r.status_code == 200


# ---------------------------------------------------------------------------------------- transcriptions, audio ids

def test_a_transcription_session_transcribes_each_turn_and_answers_none(client):
    """session.update to type "transcription": every turn the VAD commits is transcribed
    (streamed deltas with their tokens' logprobs, then completed), none is answered, and
    response.create is refused."""
    audio = _speech("Hello there. What is the weather like today?")
    with client.realtime.connect(model=MODEL) as conn:
        _until(conn, "session.created")
        conn.session.update(session={"type": "transcription", "include": ["item.input_audio_transcription.logprobs"],
                                     "audio": {"input": {"transcription": {"model": MODEL, "language": "English"}}}})
        updated = _until(conn, "session.updated").session
        assert updated.type == "transcription" and updated.include == ["item.input_audio_transcription.logprobs"]
        seen = []
        for i in range(0, 2 * len(audio), 2400):  # two turns, as a microphone sends them
            conn.input_audio_buffer.append(audio=_b64(np.tile(audio, 2)[i:i + 2400]))
        while sum(e.type == "input_audio_buffer.committed" for e in seen) < 2:
            _until(conn, "input_audio_buffer.committed", seen)
        items = [e.item_id for e in seen if e.type == "input_audio_buffer.committed"]
        while sum(e.type == "conversation.item.input_audio_transcription.completed" for e in seen) < 2:
            _until(conn, "conversation.item.input_audio_transcription.completed", seen)
        conn.response.create()
        refused = _until(conn, "error", seen).error
    assert refused.code == "invalid_request" and "transcription session" in refused.message
    assert not [e for e in seen if e.type.startswith("response.")]
    done = {e.item_id: e for e in seen if e.type == "conversation.item.input_audio_transcription.completed"}
    assert set(done) == set(items)
    for item in items:
        deltas = [e.delta for e in seen if e.type == "conversation.item.input_audio_transcription.delta"
                  and e.item_id == item]
        assert done[item].transcript and "".join(deltas) == done[item].transcript
        assert done[item].usage.input_tokens > 0
        logprobs = [x for e in seen if e.type == "conversation.item.input_audio_transcription.delta"
                    and e.item_id == item for x in e.logprobs]
        assert len(done[item].logprobs) == done[item].usage.output_tokens == len(logprobs)
        assert [x.logprob for x in logprobs] == [x.logprob for x in done[item].logprobs]
        assert all(x.logprob <= 0 for x in logprobs)


def test_intent_transcription_starts_a_transcription_session(server):
    with _raw(server, query="&intent=transcription") as ws:
        session = _next(ws, "session.created")["session"]
        assert session["type"] == "transcription" and session["audio"]["input"]["transcription"]["model"] == MODEL
        ws.send('{"type": "response.create", "event_id": "e1"}')
        err = _next(ws, "error")["error"]
        assert (err["code"], err["event_id"]) == ("invalid_request", "e1")
    with _raw(server, query="&intent=chat") as ws:
        err = _next(ws, "error")["error"]
        assert (err["code"], err["param"]) == ("invalid_value", "intent")
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=10)


def test_a_spoken_reply_comes_back_by_its_audio_id(client, library):
    first = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, temperature=0.0,
                                           modalities=["text", "audio"], audio={"voice": "Chelsie", "format": "wav"})
    audio = first.choices[0].message.audio
    assert audio.id and audio.expires_at > time.time() + 3000
    follow_up = {"role": "user", "content": "And then?"}
    r = client.chat.completions.create(model=MODEL, max_tokens=6, temperature=0.0, messages=[
        *HELLO, {"role": "assistant", "audio": {"id": audio.id}}, follow_up])
    want = library.generate({"messages": [*HELLO, {"role": "assistant", "content": audio.transcript}, follow_up]},
                            SamplingParams(temperature=0.0, max_tokens=6), output_modalities=["text"])[0]
    assert r.choices[0].message.content == want.text
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
            *HELLO, {"role": "assistant", "audio": {"id": "audio_nosuchreply"}}, follow_up])
    assert e.value.body["param"] == "messages[1].audio.id" and "audio_nosuchreply" in e.value.body["message"]


def test_realtime_bench_against_the_server(server, env):
    r = subprocess.run([sys.executable, "-m", "omni_jax.cli", "bench", "--backend", "realtime", "--base-url", server.url,
                        "--api-key", API_KEY, "--concurrency", "2", "--num-requests", "2", "--warmup", "0",
                        "--max-tokens", "30", "--prompt", "Hello there.", "--barge-in"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "realtime concurrency 2: 2 requests (0 failed)" in r.stdout, r.stdout
    assert "chat (same turns) concurrency 2: 2 requests (0 failed)" in r.stdout, r.stdout
    for name in ("ttft", "ttfa", "rtf", "barge_in"):
        assert re.search(rf"^\s+{name}\s+mean", r.stdout, re.M), r.stdout


# ---------------------------------------------------------------------------------------- function calling

def _calls_grammar(*calls: str) -> dict:
    """The thinker's sampling params making the random model say "Sure." and then make these
    calls (each a block's JSON with its newlines), tags as the tokens they are."""
    parts = ['"Sure."', *(f"<tool_call> {json.dumps(c)} </tool_call>" for c in calls)]
    return {"structured_outputs": {"grammar": "start: " + ' "\\n" '.join(parts)}}


CALLS = ['\n{"name": "now", "arguments": {}}\n', '\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n']


def test_a_text_session_calls_functions_and_hears_their_outputs(client, library):
    """Words and two calls (tool_choice auto): the message item, then a function_call item per call
    with OpenAI's events, in the conversation; the calls' outputs given back make the next reply's
    prompt the library's prompt of the whole conversation."""
    from omni_jax.server.tools import tool_use

    with client.realtime.connect(model=MODEL) as conn:
        _until(conn, "session.created")
        conn.session.update(session={"type": "realtime", "output_modalities": ["text"], "tools": REALTIME_TOOLS})
        _until(conn, "session.updated")
        conn.conversation.item.create(item={"type": "message", "role": "user",
                                            "content": [{"type": "input_text", "text": "Weather?"}]})
        _until(conn, "conversation.item.added")
        conn.response.create(response={"max_output_tokens": 200, "temperature": 0.0,
                                       "sampling_params_list": [_calls_grammar(*CALLS)]})
        seen = []
        done = _until(conn, "response.done", seen).response
        assert done.status == "completed", done.status_details
        assert [o.type for o in done.output] == ["message", "function_call", "function_call"]
        assert done.output[0].content[0].text == "Sure."
        assert [(o.name, o.arguments) for o in done.output[1:]] == [("now", "{}"), ("get_weather", '{"city": "Lyon"}')]
        kinds = [e.type for e in seen]  # the arguments in one delta or more, as they were written
        kinds = [k for i, k in enumerate(kinds) if k != kinds[i - 1]]
        at = kinds.index("response.function_call_arguments.done")
        assert kinds[at - 3:at + 3] == ["response.output_item.added", "conversation.item.added",
                                        "response.function_call_arguments.delta",
                                        "response.function_call_arguments.done", "response.output_item.done",
                                        "conversation.item.done"]
        deltas = [e.delta for e in seen if e.type == "response.function_call_arguments.delta"]
        assert "".join(deltas) == "{}" + '{"city": "Lyon"}'
        args = next(e for e in seen if e.type == "response.function_call_arguments.done")
        assert (args.name, args.arguments, args.call_id, args.output_index) == (
            "now", "{}", done.output[1].call_id, 1)
        for o, result in zip(done.output[1:], ["noon", "20 C"]):
            conn.conversation.item.create(item={"type": "function_call_output", "call_id": o.call_id, "output": result})
            assert _until(conn, "conversation.item.added").item.type == "function_call_output"
        conn.response.create(response={"max_output_tokens": 3, "temperature": 0.0})
        nxt = _until(conn, "response.done").response
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": "Sure.", "tool_calls": [
                   {"type": "function", "function": {"name": "now", "arguments": "{}"}},
                   {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}]},
               {"role": "tool", "content": "noon"}, {"role": "tool", "content": "20 C"}]
    want = library.generate({"messages": history, "tools": tool_use(REALTIME_TOOLS, None, flat=True).tools},
                            SamplingParams(temperature=0.0, max_tokens=3), output_modalities=["text"])[0]
    assert nxt.usage.input_tokens == len(want.prompt_token_ids)
    assert nxt.output[0].content[0].text == want.text


def test_a_spoken_reply_stops_where_a_call_opens_and_the_call_is_written_unspoken(client, server):
    """A spoken reply with tools: the words are spoken, the call is not (the reply stops at its tag)
    and is written by the thinker alone, held to the tools' schemas; with a named tool there is
    nothing to say: no audio, one call. Every stage is left idle."""
    with client.realtime.connect(model=MODEL) as conn:
        _until(conn, "session.created")
        conn.session.update(session={"type": "realtime", "tools": REALTIME_TOOLS})
        _until(conn, "session.updated")
        conn.conversation.item.create(item={"type": "message", "role": "user",
                                            "content": [{"type": "input_text", "text": "Weather?"}]})
        _until(conn, "conversation.item.added")
        conn.response.create(response={"max_output_tokens": 60, "temperature": 0.0,
                                       "sampling_params_list": [_calls_grammar(*CALLS), None, VOCODER_SEED]})
        seen = []
        done = _until(conn, "response.done", seen).response
        assert _text_of(seen, "response.output_audio_transcript.delta") == "Sure."
        assert len(_audio_of(seen)) > 0
        assert [o.type for o in done.output[:2]] == ["message", "function_call"]
        # The greedy random model calls on (a real one ends after its calls): cut by the response's
        # max_output_tokens, which counts the spoken words' tokens and the calls' together. The
        # call it was writing then is incomplete, with the arguments written.
        assert done.status == "incomplete" and done.usage.output_tokens == 60, done.status_details
        assert [o.status for o in done.output[1:-1]] == ["completed"] * (len(done.output) - 2)
        for o in done.output[1:]:
            if o.status == "completed":
                args = json.loads(o.arguments)
                assert (o.name, args) == ("now", {}) or (o.name == "get_weather" and args["city"] in ("Paris", "Lyon"))
        conn.response.create(response={"max_output_tokens": 60, "temperature": 0.0,
                                       "tool_choice": {"type": "function", "name": "get_weather"}})
        seen = []
        done = _until(conn, "response.done", seen).response
    assert done.status == "completed", done.status_details
    assert "response.output_audio.delta" not in {e.type for e in seen}
    assert [o.type for o in done.output] == ["message", "function_call"] and done.output[1].name == "get_weather"
    assert json.loads(done.output[1].arguments)["city"] in ("Paris", "Lyon")
    _idle(server)

