"""`/v1/realtime/calls`: the realtime API over WebRTC, as OpenAI's browser and Python clients
call it. A caller here is an aiortc peer (the offer posted with the official `openai` client, or
raw), with a microphone track playing espeak speech and the `oai-events` data channel; one test
calls from a real Chromium with the snippet of OpenAI's WebRTC guide. The call's parts (the
reply's audio track, the event channel) are tested on their own first.
"""

from __future__ import annotations

import asyncio
import fractions
import json
import time
import wave
from types import SimpleNamespace

import av
import httpx
import numpy as np
import openai
import websockets
import pytest
from aiortc import MediaStreamTrack, RTCPeerConnection, RTCSessionDescription

from omni_jax.server.realtime.connection import RealtimeLimits, RealtimeSession
from omni_jax.server.realtime.events import InputAudioBufferClear
from omni_jax.server.realtime.rtc import FRAME, CallEvents, Speaker
from test_realtime import LONG_REPLY, SPL, SR, _speech, pipeline_yaml  # noqa: F401
from test_server import (API_KEY, HELLO, MODEL, _idle, _lib_params, _metrics, env, library, media_dir,  # noqa: F401
                         server)
from test_server import pipeline_yaml as server_pipeline_yaml  # noqa: F401

pytestmark = pytest.mark.server


# ---------------------------------------------------------------------------------------- the call's parts

def _frames(speaker: Speaker, n: int) -> np.ndarray:
    async def pull():
        return [await speaker.recv() for _ in range(n)]
    frames = asyncio.run(pull())
    assert all(f.sample_rate == SR and f.samples == FRAME and f.layout.name == "mono" for f in frames)
    return np.concatenate([f.to_ndarray()[0] for f in frames]) / 32768.0


def test_the_speaker_plays_replies_in_turn_in_real_time_and_says_when():
    events = []
    speaker = Speaker(events.append)
    one, two = np.full(3 * FRAME // 2, 0.5, np.float32), np.full(FRAME, -0.25, np.float32)
    speaker.play("resp_1", one)
    speaker.play("resp_2", two)
    speaker.finish("resp_1")
    t0 = time.monotonic()
    out = _frames(speaker, 4)
    took = time.monotonic() - t0
    assert 0.05 <= took <= 0.5  # 4 frames of 20 ms: paced, the first at once
    np.testing.assert_allclose(out[:len(one)], 0.5, atol=1e-4)
    np.testing.assert_allclose(out[len(one):len(one) + len(two)], -0.25, atol=1e-4)
    np.testing.assert_allclose(out[len(one) + len(two):], 0.0)  # silence between replies
    assert [(e["type"], e["response_id"]) for e in events] == [
        ("output_audio_buffer.started", "resp_1"), ("output_audio_buffer.stopped", "resp_1"),
        ("output_audio_buffer.started", "resp_2")]  # resp_2 may make more: not stopped
    speaker.finish("resp_2")
    _frames(speaker, 1)
    assert events[-1]["type"] == "output_audio_buffer.stopped" and events[-1]["response_id"] == "resp_2"
    speaker.finish("resp_3")  # a reply with no audio says nothing
    _frames(speaker, 1)
    assert len(events) == 4


def test_clearing_the_speaker_says_how_much_of_the_reply_played():
    events = []
    speaker = Speaker(events.append)
    assert speaker.clear() is None and not events
    speaker.play("resp_1", np.full(10 * FRAME, 0.5, np.float32))
    _frames(speaker, 3)
    assert speaker.clear() == ("resp_1", 60)  # 3 frames of 20 ms played
    assert events[-1]["type"] == "output_audio_buffer.cleared" and events[-1]["response_id"] == "resp_1"
    np.testing.assert_allclose(_frames(speaker, 2), 0.0)  # the rest is gone
    speaker.play("resp_2", np.full(FRAME, 0.5, np.float32))  # queued, not yet playing: nothing played
    assert speaker.clear() == ("resp_2", 0)


class _FakeChannel:
    def __init__(self, label="oai-events"):
        self.label, self.readyState, self.sent, self.bufferedAmount = label, "connecting", [], 0
        self.handlers = {}

    def on(self, name, fn):
        self.handlers[name] = fn

    def send(self, text):
        self.sent.append(text)


def test_events_wait_for_the_clients_channel_and_end_with_it():
    async def go():
        events = CallEvents(max_pending=2)
        for i in range(3):
            await events.send_text(f"e{i}")
        other = _FakeChannel("chat")
        events.attach(other)
        assert events.channel is None  # only oai-events carries events
        ch = _FakeChannel()
        events.attach(ch)
        assert ch.sent == []
        ch.readyState = "open"
        ch.handlers["open"]()
        assert ch.sent == ["e1", "e2"]  # the newest kept
        await events.send_text("e3")
        assert ch.sent[-1] == "e3"
        ch.handlers["message"]('{"type": "response.create"}')
        assert await events.receive() == '{"type": "response.create"}'
        ch.handlers["close"]()
        assert await events.receive() is None
        ch.handlers["message"]('{"type": "response.create"}')  # after the end: nothing more
        ch.handlers["close"]()
        assert events._inbox.empty()
    asyncio.run(go())


def test_a_calls_audio_past_a_full_buffer_is_refused_once_then_heard_again():
    """Turn detection off and no commit: the caller's audio stops at the buffer's bound with one
    error event (not one per 100 ms piece), and is heard again once a clear makes room."""
    class Sent:
        def __init__(self):
            self.events = []

        async def send_text(self, text):
            self.events.append(json.loads(text))

    async def go():
        channel = Sent()
        engine = SimpleNamespace(served_name=MODEL, voices=["Chelsie"])
        session = RealtimeSession(channel, engine, None, None, RealtimeLimits(max_buffer_s=0.5))
        session.config.turn_detection = None
        session.turns.configure(None)
        piece = np.zeros(SR // 5, np.float32)  # 0.2 s
        for _ in range(5):
            await session.hear(piece)
        errors = [e for e in channel.events if e["type"] == "error"]
        assert len(errors) == 1 and errors[0]["error"]["code"] == "input_audio_buffer_full"
        assert 350 <= session.turns.buffer.ms <= 400  # two pieces (the resampler holds a few ms back)
        await session.handle(InputAudioBufferClear(type="input_audio_buffer.clear"))
        await session.hear(piece)
        assert 150 <= session.turns.buffer.ms <= 250  # one piece (and what the resampler held)
        await session.hear(piece)
        await session.hear(piece)
        assert len([e for e in channel.events if e["type"] == "error"]) == 2  # a new episode, told again
    asyncio.run(go())


# ---------------------------------------------------------------------------------------- a caller

class Mic(MediaStreamTrack):
    """A microphone that is silent until it is given something to say."""

    kind = "audio"

    def __init__(self):
        super().__init__()
        self.queue, self.t, self.start = np.zeros(0, np.float32), 0, None

    def say(self, audio: np.ndarray) -> None:
        self.queue = np.concatenate([self.queue, audio.astype(np.float32)])

    async def recv(self):
        if self.start is None:
            self.start = time.monotonic()
        wait = self.start + self.t / SR - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        x, self.queue = self.queue[:FRAME], self.queue[FRAME:]
        x = np.pad(x, (0, FRAME - len(x)))
        f = av.AudioFrame.from_ndarray((np.clip(x, -1, 1) * 32767).astype(np.int16)[None], format="s16", layout="mono")
        f.sample_rate, f.pts, f.time_base = SR, self.t, fractions.Fraction(1, SR)
        self.t += FRAME
        return f


class Caller:
    """An aiortc peer calling the server as OpenAI's clients do: a microphone, the `oai-events`
    channel, and the reply's audio heard (at 24 kHz, the times it came)."""

    made: list[Caller] = []  # closed by _run whatever the test's outcome

    def __init__(self):
        Caller.made.append(self)
        self.pc = RTCPeerConnection()
        self.mic = Mic()
        self.pc.addTrack(self.mic)
        self.channel = self.pc.createDataChannel("oai-events")
        self.events: list[dict] = []
        self.heard: list[tuple[float, np.ndarray]] = []
        self.closed = asyncio.Event()
        self.channel.on("message", lambda m: self.events.append(json.loads(m)))
        self.channel.on("close", self.closed.set)
        self.pc.on("track", lambda track: asyncio.ensure_future(self._hear(track)))
        self.location = None

    async def _hear(self, track):
        resampler = av.AudioResampler(format="flt", layout="mono", rate=SR)
        while True:
            try:
                frame = await track.recv()
            except Exception:
                return
            for f in resampler.resample(frame):
                self.heard.append((time.monotonic(), f.to_ndarray()[0]))

    async def offer(self) -> str:
        await self.pc.setLocalDescription(await self.pc.createOffer())
        return self.pc.localDescription.sdp

    async def call(self, server, session: dict | None = None, key: str = API_KEY):
        """Post the offer with the openai client (`client.realtime.calls.create`) and answer it."""
        api = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)
        kw = {"session": session} if session is not None else {}
        raw = await api.realtime.calls.with_raw_response.create(sdp=await self.offer(), **kw)
        assert raw.status_code == 201 and raw.headers["content-type"].startswith("application/sdp")
        self.location = raw.headers["location"]
        await self.answered(raw.http_response.text)

    async def answered(self, sdp: str):
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp, "answer"))

    def send(self, event: dict) -> None:
        self.channel.send(json.dumps(event))

    async def until(self, kind: str, since: int = 0, timeout_s: float = 120.0) -> dict:
        """The first event of type `kind` from the `since`th on (waiting for it); errors fail the test."""
        deadline = time.monotonic() + timeout_s
        while True:
            for e in self.events[since:]:
                assert e["type"] != "error" or kind == "error", e
                if e["type"] == kind:
                    return e
            assert time.monotonic() < deadline, f"no {kind} in {timeout_s} s; seen {[e['type'] for e in self.events]}"
            await asyncio.sleep(0.05)

    def audio(self, since: float = 0.0) -> np.ndarray:
        parts = [a for t, a in self.heard if t >= since]
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    async def close(self):
        await self.pc.close()


def _run(scenario, timeout_s: float = 240.0):
    async def go():
        try:
            return await asyncio.wait_for(scenario(), timeout_s)
        finally:  # a failed test leaves no call holding a place for the next
            while Caller.made:
                await Caller.made.pop().close()
    return asyncio.run(go())


def _loud(audio: np.ndarray, frame: int = 480) -> np.ndarray:
    """Which 20 ms frames of `audio` are not silence."""
    n = len(audio) // frame
    return np.abs(audio[:n * frame].reshape(n, frame)).max(axis=1) > 1e-3


def _seats(server) -> float:
    return _metrics(server).get("omni_jax_realtime_sessions", 0)


def _until_free(server, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _seats(server) != 0:
        assert time.monotonic() < deadline, "a call still holds its place"
        time.sleep(0.2)


# ---------------------------------------------------------------------------------------- served calls

def test_a_call_speaks_the_reply_on_its_track_as_the_library(server, library):
    want = library.generate({"messages": HELLO}, sampling_params_list=_lib_params(library, 8),
                            output_modalities=["text", "audio"], voice="Chelsie")[0]

    async def scenario():
        caller = Caller()
        await caller.call(server, session={"type": "realtime", "instructions": "Be brief.",
                                           "audio": {"output": {"voice": "Chelsie"}}})
        created = await caller.until("session.created")
        assert created["session"]["instructions"] == "Be brief."
        caller.send({"type": "session.update", "session": {"type": "realtime", "instructions": None}})
        await caller.until("session.updated")
        caller.send({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello"}]}})
        caller.send({"type": "response.create", "response": {"max_output_tokens": 8, "temperature": 0.0,
                                                             "sampling_params_list": SPL}})
        done = await caller.until("response.done")
        started = await caller.until("output_audio_buffer.started")
        await caller.until("output_audio_buffer.stopped")
        await asyncio.sleep(0.3)  # the last packets on their way
        await caller.close()
        return caller, done, started

    caller, done, started = _run(scenario)
    kinds = [e["type"] for e in caller.events]
    assert "response.output_audio.delta" not in kinds  # the audio is on the track
    response = done["response"]
    assert started["response_id"] == response["id"]
    assert kinds.index("output_audio_buffer.started") < kinds.index("output_audio_buffer.stopped")
    part = response["output"][0]["content"][0]
    assert part["transcript"] == want.text and part["transcript"]
    # what was heard: the library's audio through Opus (which delays it a few ms), in real time
    heard = caller.audio()
    loud = np.flatnonzero(_loud(heard))
    assert len(loud) > 0
    got = heard[loud[0] * 480:(loud[-1] + 1) * 480]
    assert abs(len(got) - len(want.audio)) <= 3 * 480, (len(got), len(want.audio))
    shown = want.audio[:SR // 2]
    match, lag = max((np.corrcoef(got[lag:lag + len(shown)], shown)[0, 1], lag) for lag in range(0, 960))
    assert match > 0.9, (match, lag)
    rms = lambda a: float(np.sqrt(np.mean(a ** 2)))  # noqa: E731
    assert 0.7 < rms(got[lag:lag + len(want.audio)]) / rms(want.audio) < 1.3
    _until_free(server)
    _idle(server)


def test_a_spoken_turn_on_a_call_is_answered_and_a_barge_in_clears_the_reply(server):
    async def scenario():
        caller = Caller()
        await caller.call(server)
        await caller.until("session.created")
        # slow speech: a reply still playing when it is spoken over (the test talker's is short)
        caller.send({"type": "session.update", "session": {
            "type": "realtime", "max_output_tokens": LONG_REPLY["max_output_tokens"],
            "audio": {"input": {"transcription": {"model": MODEL}}, "output": {"speed": 0.25}}}})
        await caller.until("session.updated")
        caller.mic.say(_speech("Hello there. What is the weather like today?"))
        committed = await caller.until("input_audio_buffer.committed")
        transcribed = await caller.until("conversation.item.input_audio_transcription.completed")
        assert transcribed["item_id"] == committed["item_id"] and transcribed["transcript"]
        reply = (await caller.until("response.created"))["response"]["id"]
        await caller.until("output_audio_buffer.started")
        await asyncio.sleep(0.5)
        spoken_over = len(caller.events)
        caller.mic.say(_speech("Stop, please.", lead_s=0.0, tail_s=1.0))  # over the reply as it plays
        cleared = await caller.until("output_audio_buffer.cleared", spoken_over)
        cleared_at = time.monotonic()
        await caller.until("response.done")
        await asyncio.sleep(1.0)
        after = caller.audio(since=cleared_at + 0.3)
        item_id = (await caller.until("response.output_item.added"))["item"]["id"]
        caller.send({"type": "conversation.item.retrieve", "item_id": item_id})
        item = (await caller.until("conversation.item.retrieved"))["item"]
        await caller.close()
        return caller.events, reply, cleared, after, item

    events, reply, cleared, after, item = _run(scenario)
    kinds = [e["type"] for e in events]
    assert kinds.index("output_audio_buffer.started") < kinds.index("output_audio_buffer.cleared")
    assert "output_audio_buffer.stopped" not in kinds  # cut, not played out
    started = [e for e in events if e["type"] == "input_audio_buffer.speech_started"]
    assert len(started) == 2 and kinds.index("output_audio_buffer.started") < events.index(started[1]) \
        < kinds.index("output_audio_buffer.cleared")
    assert cleared["response_id"] == reply
    assert not _loud(after).any()  # the reply's audio stopped where it was
    assert item["status"] == "incomplete"  # it keeps what was played
    _until_free(server)
    _idle(server)


def test_a_client_secret_calls_with_a_raw_offer_and_a_hangup_ends_the_call(server):
    secret = httpx.post(f"{server.url}/v1/realtime/client_secrets", headers={"Authorization": f"Bearer {API_KEY}"},
                        json={"session": {"type": "realtime", "instructions": "You are a ship's cat."}}, timeout=30)
    assert secret.status_code == 200
    key = secret.json()["value"]

    async def scenario():
        caller = Caller()
        async with httpx.AsyncClient(timeout=60) as http:
            r = await http.post(f"{server.url}/v1/realtime/calls", content=await caller.offer(),
                                headers={"Authorization": f"Bearer {key}", "Content-Type": "application/sdp"})
            assert r.status_code == 201, r.text
            await caller.answered(r.text)
            created = await caller.until("session.created")
            assert created["session"]["instructions"] == "You are a ship's cat."
            assert _seats(server) == 1
            hung = await http.post(f"{server.url}{r.headers['location']}/hangup", headers={"Authorization": f"Bearer {key}"})
            assert hung.status_code == 401  # a client secret opens calls; the API key ends them
            hung = await http.post(f"{server.url}{r.headers['location']}/hangup",
                                   headers={"Authorization": f"Bearer {API_KEY}"})
            assert hung.status_code == 200 and hung.json() == {}
            await asyncio.wait_for(caller.closed.wait(), 30)  # the server closed the call
            again = await http.post(f"{server.url}{r.headers['location']}/hangup",
                                    headers={"Authorization": f"Bearer {API_KEY}"})
            assert again.status_code == 404 and again.json()["error"]["code"] == "call_not_found"
        await caller.close()

    _run(scenario)
    _until_free(server)


def test_a_call_hung_up_before_it_connects_frees_its_place(server):
    async def scenario():
        caller = Caller()
        async with httpx.AsyncClient(timeout=60) as http:
            r = await http.post(f"{server.url}/v1/realtime/calls", content=await caller.offer(),
                                headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/sdp"})
            assert r.status_code == 201
            await caller.close()  # the answer never taken
            assert _seats(server) == 1
            hung = await http.post(f"{server.url}{r.headers['location']}/hangup",
                                   headers={"Authorization": f"Bearer {API_KEY}"})
            assert hung.status_code == 200

    _run(scenario)
    _until_free(server, 5)


@pytest.mark.parametrize("headers, body, status, code, param", [
    ({"Authorization": "Bearer wrong"}, "offer", 401, "invalid_api_key", None),
    ({"Content-Type": "application/json"}, "offer", 415, "unsupported_media_type", None),
    ({"Content-Type": "application/sdp"}, "hello", 400, "invalid_sdp", "sdp"),
    ({"Content-Type": "application/sdp"}, "", 400, "missing_required_parameter", "sdp"),
    ({"Content-Type": "application/sdp"}, "no audio", 400, "invalid_sdp", "sdp"),
    (None, {"voice": "nobody"}, 400, "invalid_value", "session.audio.output.voice"),
    (None, {"temperature": 9}, 400, None, "session.temperature"),
    (None, {"model": "gpt-realtime"}, 400, "invalid_value", "session.model"),
])
def test_bad_offers_are_refused_and_hold_nothing(server, headers, body, status, code, param):
    async def offer(audio: bool = True) -> str:
        pc = RTCPeerConnection()
        if audio:
            pc.addTransceiver("audio")
        pc.createDataChannel("oai-events")
        await pc.setLocalDescription(await pc.createOffer())
        sdp = pc.localDescription.sdp
        await pc.close()
        return sdp

    if isinstance(body, dict):  # a session object in the multipart form
        session = {"type": "realtime", "audio": {"output": {"voice": body["voice"]}}} if "voice" in body \
            else {"type": "realtime", **body}
        r = httpx.post(f"{server.url}/v1/realtime/calls", headers={"Authorization": f"Bearer {API_KEY}"},
                       files={"sdp": (None, asyncio.run(offer()), "application/sdp"),
                              "session": (None, json.dumps(session), "application/json")}, timeout=30)
    else:
        content = {"offer": lambda: asyncio.run(offer()), "no audio": lambda: asyncio.run(offer(False))}.get(
            body, lambda: body)()
        r = httpx.post(f"{server.url}/v1/realtime/calls", content=content,
                       headers={"Authorization": f"Bearer {API_KEY}", **headers}, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and (code is None or error["code"] == code), error
    assert _seats(server) == 0


def test_a_browser_calls_with_the_webrtc_guides_snippet(server, tmp_path):
    """Chromium, its fake microphone saying a turn: the offer posted as OpenAI's WebRTC guide
    does (with a client secret, before ICE gathering ends), the reply heard on the track."""
    from browser import Browser

    audio = _speech("Hello, what can you hear?", lead_s=0.5, tail_s=20.0)
    mic = str(tmp_path / "mic.wav")
    with wave.open(mic, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SR)
        w.writeframes((np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes())
    secret = httpx.post(f"{server.url}/v1/realtime/client_secrets", headers={"Authorization": f"Bearer {API_KEY}"},
                        json={"session": {"type": "realtime", "max_output_tokens": 40}}, timeout=30).json()["value"]
    b = Browser(mic)
    try:
        b.open(f"{server.url}/health")  # the server's origin
        b.js("""(async () => {
          window.events = [];
          window.loud = 0;
          const pc = window.pc = new RTCPeerConnection();
          pc.ontrack = (e) => {
            const ctx = new AudioContext();
            const meter = ctx.createAnalyser();
            ctx.createMediaStreamSource(e.streams[0]).connect(meter);
            const el = new Audio();
            el.srcObject = e.streams[0];
            el.muted = true;
            el.play();
            const buf = new Float32Array(meter.fftSize);
            setInterval(() => {
              meter.getFloatTimeDomainData(buf);
              if (buf.some((v) => Math.abs(v) > 0.05)) window.loud++;
            }, 20);
          };
          const ms = await navigator.mediaDevices.getUserMedia({audio: true});
          pc.addTrack(ms.getTracks()[0]);
          const dc = pc.createDataChannel("oai-events");
          dc.addEventListener("message", (e) => events.push(JSON.parse(e.data)));
          const offer = await pc.createOffer();
          await pc.setLocalDescription(offer);
          const r = await fetch("/v1/realtime/calls", {method: "POST", body: offer.sdp,
            headers: {Authorization: "Bearer %s", "Content-Type": "application/sdp"}});
          window.answerStatus = r.status;
          await pc.setRemoteDescription({type: "answer", sdp: await r.text()});
        })()""" % secret)
        assert b.js("window.answerStatus") == 201
        b.wait_for("events.some((e) => e.type === 'output_audio_buffer.stopped')", 180, "the reply played")
        kinds = b.js("events.map((e) => e.type)")
        assert b.js("pc.connectionState") == "connected"
        assert b.js("window.loud") > 10  # the reply was heard, > 200 ms of it
        b.js("pc.close()")
    finally:
        b.close()
    for a, c in [("session.created", "input_audio_buffer.speech_started"),
                 ("input_audio_buffer.committed", "response.created"),
                 ("output_audio_buffer.started", "output_audio_buffer.stopped")]:
        assert kinds.index(a) < kinds.index(c), (a, c, kinds)
    assert "error" not in kinds
    _until_free(server)
    _idle(server)


def test_the_apps_server_joins_a_call_to_steer_it(server):
    """OpenAI's server-side controls: with the call's id and the API key, a WebSocket
    (`client.realtime.connect(call_id=...)`) gets the call's events and sets its session."""
    async def scenario():
        caller = Caller()
        await caller.call(server)
        await caller.until("session.created")
        call_id = caller.location.rsplit("/", 1)[1]
        api = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
        async with api.realtime.connect(call_id=call_id) as controls:
            await controls.session.update(session={"type": "realtime", "instructions": "You are a ship's cat.",
                                                   "output_modalities": ["text"], "max_output_tokens": 5})
            seen = []
            async for event in controls:
                seen.append(event.type)
                if event.type == "session.updated":
                    assert event.session.instructions == "You are a ship's cat."
                    caller.send({"type": "conversation.item.create", "item": {  # the browser's turn
                        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}})
                    caller.send({"type": "response.create"})
                if event.type == "response.done":
                    break
        done = await caller.until("response.done")  # the caller saw it too
        assert (await caller.until("session.updated"))["session"]["instructions"] == "You are a ship's cat."
        assert done["response"]["output_modalities"] == ["text"]
        assert "conversation.item.added" in seen and "response.output_text.delta" in seen
        # the call goes on without its controls
        caller.send({"type": "response.create"})
        await caller.until("response.done", caller.events.index(done) + 1)
        # a client secret cannot join it, nor can anyone join a call that is not there
        secret = httpx.post(f"{server.url}/v1/realtime/client_secrets", headers={"Authorization": f"Bearer {API_KEY}"},
                            json={}, timeout=30).json()["value"]
        for key, query, code in [(secret, f"call_id={call_id}", "invalid_api_key"),
                                 (API_KEY, "call_id=rtc_none", "call_not_found")]:
            async with websockets.connect(f"{server.url.replace('http', 'ws')}/v1/realtime?{query}",
                                          additional_headers={"Authorization": f"Bearer {key}"}) as ws:
                first = json.loads(await ws.recv())
                assert first["type"] == "error" and first["error"]["code"] == code, first
        await caller.close()

    _run(scenario)
    _until_free(server)


def test_calls_past_the_session_limit_are_refused_and_all_are_freed(server):
    async def scenario():
        async def offer() -> str:
            pc = RTCPeerConnection()
            pc.addTransceiver("audio")
            pc.createDataChannel("oai-events")
            await pc.setLocalDescription(await pc.createOffer())
            await pc.close()  # never connects: each call holds its place until hung up
            return pc.localDescription.sdp

        headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/sdp"}
        async with httpx.AsyncClient(timeout=60) as http:
            offers = await asyncio.gather(*(offer() for _ in range(20)))
            replies = await asyncio.gather(*(http.post(f"{server.url}/v1/realtime/calls", content=o, headers=headers)
                                             for o in offers))
            codes = sorted(r.status_code for r in replies)
            assert codes == [201] * 16 + [429] * 4, codes  # --max-realtime-sessions' default
            refused = next(r for r in replies if r.status_code == 429).json()["error"]
            assert refused["code"] == "session_limit_reached" and refused["type"] == "rate_limit_error"
            for r in replies:
                if r.status_code == 201:
                    assert (await http.post(f"{server.url}{r.headers['location']}/hangup",
                                            headers=headers)).status_code == 200

    _run(scenario)
    _until_free(server, 5)
