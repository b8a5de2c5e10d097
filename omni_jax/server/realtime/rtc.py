"""A WebRTC call (calls.py answers the offer): its peer connection and session (`Call`), media and
events, as a realtime session sees them.

`Speaker` is the call's outgoing audio track: the replies' 24 kHz audio queued and played out in
real time, silence between them (aiortc's Opus encoder takes it from there). It says when a
response's audio starts and stops playing (OpenAI's `output_audio_buffer.started`/`.stopped`)
and how much of it has played when it is cleared (a barge-in, `output_audio_buffer.clear`).
`listen` feeds the caller's audio track to the session's input buffer; `CallEvents` is the
`oai-events` data channel as the session's event channel. aiortc does ICE, DTLS-SRTP, SCTP and
Opus (through PyAV).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fractions
import logging
import time
from typing import Awaitable, Callable

import av
import numpy as np
from aiortc import (MediaStreamTrack, RTCConfiguration, RTCIceServer, RTCPeerConnection,
                    RTCSessionDescription)
from aiortc.mediastreams import MediaStreamError

from ..audio import to_pcm16
from .connection import RealtimeSession
from .events import new_id
from .wire_audio import OUTPUT_RATE

log = logging.getLogger("omni_jax.server")

FRAME = OUTPUT_RATE // 50      # 20 ms, an Opus frame
LISTEN_BATCH_S = 0.1           # the caller's audio reaches the VAD in pieces this long
EVENTS_LABEL = "oai-events"    # the data channel OpenAI's clients open for events


class Speaker(MediaStreamTrack):
    """The call's outgoing audio: `play` queues a response's audio, `finish` says it has no more,
    `clear` drops what is queued. `on_event` gets the output_audio_buffer events."""

    kind = "audio"

    def __init__(self, on_event: Callable[[dict], None]):
        super().__init__()
        self.on_event = on_event
        self._queue: collections.deque[tuple[str, np.ndarray]] = collections.deque()
        self._finished: set[str] = set()    # responses queued or playing that made all their audio
        self.playing: str | None = None     # the response whose audio is playing
        self.played = 0                     # its samples played so far
        self._t = 0                         # samples sent since the first frame
        self._start: float | None = None

    def play(self, response_id: str, wave: np.ndarray) -> None:
        if len(wave):
            self._queue.append((response_id, np.asarray(wave, np.float32)))

    def finish(self, response_id: str) -> None:
        if response_id == self.playing or any(rid == response_id for rid, _ in self._queue):
            self._finished.add(response_id)

    def clear(self) -> tuple[str, int] | None:
        """Drop the queued audio: (the response cut, its ms played), or None if nothing was queued."""
        cut = self.playing or (self._queue[0][0] if self._queue else None)
        if cut is None:
            return None
        played_ms = self.played * 1000 // OUTPUT_RATE if cut == self.playing else 0
        self._queue.clear()
        self._finished.clear()
        self.playing, self.played = None, 0
        self._event("output_audio_buffer.cleared", cut)
        return cut, played_ms

    async def recv(self) -> av.AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        if self._start is None:
            self._start = time.monotonic()
        wait = self._start + self._t / OUTPUT_RATE - time.monotonic()
        if wait > 0:  # real time: the peer plays what it gets as it comes
            await asyncio.sleep(wait)
        frame = av.AudioFrame.from_ndarray(np.frombuffer(to_pcm16(self._take(FRAME)), "<i2")[None],
                                           format="s16", layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = OUTPUT_RATE, self._t, fractions.Fraction(1, OUTPUT_RATE)
        self._t += FRAME
        return frame

    def _take(self, n: int) -> np.ndarray:
        out, filled = np.zeros(n, np.float32), 0
        while filled < n and self._queue:
            rid, wave = self._queue[0]
            if rid != self.playing:
                self._stopped()
                self.playing, self.played = rid, 0
                self._event("output_audio_buffer.started", rid)
            k = min(n - filled, len(wave))
            out[filled:filled + k] = wave[:k]
            filled += k
            self.played += k
            if k == len(wave):
                self._queue.popleft()
            else:
                self._queue[0] = (rid, wave[k:])
        if not self._queue and self.playing in self._finished:
            self._stopped()
        return out

    def _stopped(self) -> None:
        if self.playing is not None:
            self._finished.discard(self.playing)
            self._event("output_audio_buffer.stopped", self.playing)
            self.playing = None

    def _event(self, kind: str, response_id: str) -> None:
        self.on_event({"type": kind, "event_id": new_id("event"), "response_id": response_id})


async def listen(track: MediaStreamTrack, rate: Callable[[], int],
                 hear: Callable[[np.ndarray], Awaitable[None]]) -> None:
    """Feed the caller's audio to `hear` in pieces of LISTEN_BATCH_S, mono at `rate()` (the
    session's input rate, read as it goes), until the track ends."""
    resampler, at, held = None, 0, []
    while True:
        try:
            frame = await track.recv()
        except MediaStreamError:
            return
        if rate() != at:
            at, held = rate(), []
            resampler = av.AudioResampler(format="flt", layout="mono", rate=at)
        held += [f.to_ndarray()[0] for f in resampler.resample(frame)]
        if sum(map(len, held)) >= at * LISTEN_BATCH_S:
            wave, held = np.concatenate(held), []
            await hear(wave)


class CallEvents:
    """The call's `oai-events` data channel as the session's event channel. Events sent before
    the client opens it wait for it (the newest `max_pending`); `end` ends the session. Joined
    channels (the server-side controls' WebSockets) get every event too, and send their own."""

    def __init__(self, max_pending: int = 256, max_inbox: int = 1024, high_water: int = 1 << 20):
        self._inbox: asyncio.Queue = asyncio.Queue()
        self._pending: collections.deque[str] = collections.deque(maxlen=max_pending)
        self.max_inbox, self.high_water = max_inbox, high_water
        self.channel = None
        self.joined: list = []
        self.over = False

    def attach(self, channel) -> None:
        """A data channel the client opened: the first `oai-events` one carries the events."""
        if channel.label != EVENTS_LABEL or self.channel is not None:
            return
        self.channel = channel
        channel.on("message", self._received)
        channel.on("close", self.end)
        if channel.readyState == "open":
            self._flush()
        else:
            channel.on("open", self._flush)

    def _received(self, message) -> None:
        if self.over:
            return
        if self._inbox.qsize() >= self.max_inbox:  # a client sending faster than events are handled
            self.end()
        else:
            self._inbox.put_nowait(message)

    def _flush(self) -> None:
        while self._pending and self.channel.readyState == "open":
            self.channel.send(self._pending.popleft())

    def end(self) -> None:
        if not self.over:
            self.over = True
            self._inbox.put_nowait(None)

    async def receive(self) -> str | bytes | None:
        """The next client event, or None once the call is over."""
        return await self._inbox.get()

    async def join(self, channel) -> None:
        """Another channel's events into the session, and the session's to it, until it ends."""
        self.joined.append(channel)
        try:
            while (message := await channel.receive()) is not None:
                self._received(message)
        finally:
            if channel in self.joined:
                self.joined.remove(channel)

    async def send_text(self, text: str) -> None:
        for other in list(self.joined):
            try:
                await other.send_text(text)
            except Exception:  # gone: its join ends when its receive says so; the call goes on
                if other in self.joined:
                    self.joined.remove(other)
        channel = self.channel
        if channel is None or channel.readyState != "open":
            self._pending.append(text)
            return
        channel.send(text)
        while channel.bufferedAmount > self.high_water and channel.readyState == "open":
            await asyncio.sleep(0.01)  # a slow reader slows its own session (the send timeout ends it)

    async def close(self, code: int, reason: str) -> None:
        self.end()
        for other in list(self.joined):
            await other.close(code, reason)


class Call:
    """One call: its peer connection, its session, and the task that runs them. `seat` is its
    place among the realtime sessions (released when it ends); `ended` runs then too."""

    def __init__(self, call_id: str, endpoint, config, seat: contextlib.ExitStack, ice_servers: list[str],
                 connect_timeout_s: float, ended: Callable[[], None]):
        self.id, self.seat, self.connect_timeout_s, self.ended = call_id, seat, connect_timeout_s, ended
        self.events = CallEvents()
        self.speaker = Speaker(lambda event: self.session.post(event))
        self.session = RealtimeSession(self.events, endpoint.engine, endpoint.policy, endpoint.metrics,
                                       endpoint.limits, "realtime", config, speaker=self.speaker)
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[RTCIceServer(u) for u in ice_servers]))
        self.connected = asyncio.Event()
        self.listening: asyncio.Task | None = None
        self.task: asyncio.Task | None = None
        self.pc.on("datachannel", self.events.attach)
        self.pc.on("track", self._track)
        self.pc.on("connectionstatechange", self._state)

    async def answer(self, sdp: str) -> str:
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp, "offer"))
        audio = [t for t in self.pc.getTransceivers() if t.kind == "audio"]
        if not audio:
            raise ValueError("it has no audio (an m=audio section carries the caller's voice and the reply's)")
        audio[0].sender.replaceTrack(self.speaker)
        audio[0].direction = "sendrecv"
        await self.pc.setLocalDescription(await self.pc.createAnswer())
        return self.pc.localDescription.sdp

    def _track(self, track) -> None:
        if track.kind == "audio" and self.listening is None:
            self.listening = asyncio.ensure_future(listen(
                track, lambda: self.session.turns.buffer.rate, self.session.hear))

    def _state(self) -> None:
        if self.pc.connectionState == "connected":
            self.connected.set()
        elif self.pc.connectionState in ("failed", "closed"):
            self.events.end()

    def start(self) -> None:
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        with self.seat:
            try:
                await asyncio.wait_for(self.connected.wait(), self.connect_timeout_s)
                await self.session.run()
            except TimeoutError:
                log.info("realtime call %s: the peer did not connect in %gs", self.id, self.connect_timeout_s)
            finally:
                if self.listening is not None:
                    self.listening.cancel()
                self.speaker.stop()
                await self.pc.close()
                self.ended()

    async def hangup(self) -> None:
        self.events.end()
        self.connected.set()  # (a call hung up before it connected ends too)
        if self.task is not None:
            await asyncio.wait({self.task})
