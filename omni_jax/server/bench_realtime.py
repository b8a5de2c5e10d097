"""`omni-jax bench --backend realtime`: spoken turns over `/v1/realtime`, beside the same turns
through chat completions.

Each of `--concurrency` sessions streams a recorded utterance (`--utterance WAV`, or espeak-ng
saying `--prompt`) at real-time pace in 100 ms appends, lets the server's VAD end the turn and
waits for the spoken reply. Measured per turn: time from the end of speech (the
`speech_stopped` event) to the first transcript delta (ttft) and to the first audio delta
(ttfa), to `response.done` (latency), and RTF (that time / seconds of speech out). With
`--barge-in` each session then speaks again while its second reply plays and measures the
time from sending the first voiced audio to `response.done` (cancelled). The chat run sends
the same utterance as an `input_audio` part (streamed, audio out), timed from the request.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import shutil
import subprocess
import time
import wave

import aiohttp
import numpy as np
import soxr
from websockets.asyncio.client import connect

from .bench_load import SAMPLE_RATE, Result, closed_loop, http_one, summarize

CHUNK = SAMPLE_RATE // 10          # 100 ms per append, as a microphone sends it


def utterance(path: str | None, text: str) -> np.ndarray:
    """24 kHz float speech: the WAV file's, or espeak-ng saying `text`."""
    if path is not None:
        with open(path, "rb") as f:
            data = f.read()
    else:
        if not shutil.which("espeak-ng"):
            raise SystemExit("omni-jax bench: error: give --utterance WAV (espeak-ng, which would speak --prompt, "
                             "is not installed)")
        data = subprocess.run(["espeak-ng", "--stdout", text], capture_output=True, check=True).stdout
    with wave.open(io.BytesIO(data)) as w:
        rate, ch = w.getframerate(), w.getnchannels()
        x = np.frombuffer(w.readframes(w.getnframes()), "<i2").reshape(-1, ch).mean(axis=1) / 32768.0
    return soxr.resample(x, rate, SAMPLE_RATE).astype(np.float32)


def _pcm(x: np.ndarray) -> bytes:
    return (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()


def _wav(x: np.ndarray) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(SAMPLE_RATE)
        w.writeframes(_pcm(x))
    return buf.getvalue()


async def _stream_speech(ws, audio: np.ndarray, marks: dict) -> None:
    """Append `audio` at real-time pace (after 300 ms of silence, then 800 ms of it: the VAD's
    turn end); marks["voiced"]: when the first voiced chunk was sent."""
    lead, tail = np.zeros(SAMPLE_RATE * 3 // 10, np.float32), np.zeros(SAMPLE_RATE * 8 // 10, np.float32)
    signal = np.concatenate([lead, audio, tail])
    t0 = time.perf_counter()
    for k, i in enumerate(range(0, len(signal), CHUNK)):
        await asyncio.sleep(max(0.0, t0 + k * 0.1 - time.perf_counter()))  # chunk k leaves at k x 100 ms
        await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                  "audio": base64.b64encode(_pcm(signal[i:i + CHUNK])).decode()}))
        if "voiced" not in marks and i + CHUNK > len(lead):
            marks["voiced"] = time.perf_counter()


async def _reply(ws, res: Result, t0: float | None = None) -> dict:
    """Read events until response.done, filling `res` (times from the speech_stopped event, or t0)."""
    audio_bytes = 0
    while True:
        ev = json.loads(await ws.recv())
        kind, now = ev["type"], time.perf_counter()
        if kind == "input_audio_buffer.speech_stopped" and t0 is None:
            t0 = now
        elif kind == "response.output_audio_transcript.delta" and res.ttft is None and t0 is not None:
            res.ttft = now - t0
        elif kind == "response.output_audio.delta":
            if res.ttfa is None and t0 is not None:
                res.ttfa = now - t0
            audio_bytes += len(base64.b64decode(ev["delta"]))
        elif kind == "error":
            res.error = ev["error"]["message"]
        elif kind == "response.done":
            r = ev["response"]
            res.tokens = (r.get("usage") or {}).get("output_tokens") or 0
            res.audio_seconds = audio_bytes / 2 / SAMPLE_RATE
            if t0 is not None:
                res.latency = now - t0
            res.ok = r["status"] in ("completed", "incomplete") and res.error is None
            return r


async def _session(url: str, headers: dict, audio: np.ndarray, max_tokens: int, barge_in: bool) -> Result:
    res = Result()
    try:
        async with connect(url, additional_headers=headers, max_size=None) as ws:
            json.loads(await ws.recv())  # session.created
            await ws.send(json.dumps({"type": "session.update", "session": {
                "type": "realtime", "max_output_tokens": max_tokens}}))
            reply = asyncio.ensure_future(_reply(ws, res))  # read while speaking: events are timed as they come
            await _stream_speech(ws, audio, {})
            await reply
            if barge_in and res.ok:
                res.barge_in = await _barge_in(ws, audio)
    except Exception as e:  # a failed session is a failed result, not a failed run
        res.ok, res.error = False, f"{type(e).__name__}: {e}"
    return res


async def _barge_in(ws, audio: np.ndarray) -> float | None:
    """A long second reply, spoken over once it plays: seconds from the first voiced audio sent to
    response.done (None if the reply ended first)."""
    await ws.send(json.dumps({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Go on."}]}}))
    await ws.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": 4096}}))
    while json.loads(await ws.recv())["type"] != "response.output_audio.delta":
        pass
    marks: dict = {}
    speaking = asyncio.ensure_future(_stream_speech(ws, audio, marks))
    try:
        while True:
            ev = json.loads(await ws.recv())
            if ev["type"] == "response.done":
                cancelled = ev["response"]["status"] == "cancelled" and "voiced" in marks
                return time.perf_counter() - marks["voiced"] if cancelled else None
    finally:
        speaking.cancel()


async def run_levels(args, levels: list[int]) -> list[tuple[str, dict]]:
    """(label, summary) for realtime and chat at each concurrency level."""
    audio = utterance(args.utterance, args.prompt)
    base = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        model = args.model
        if model is None:
            async with session.get(f"{base}/v1/models", headers=headers) as r:
                r.raise_for_status()
                model = (await r.json())["data"][0]["id"]
        url = base.replace("http", "ws", 1) + f"/v1/realtime?model={model}"
        chat = {"model": model, "modalities": ["text", "audio"], "audio": {"format": "pcm16"}, "stream": True,
                "max_tokens": args.max_tokens, "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {
                    "data": base64.b64encode(_wav(audio)).decode(), "format": "wav"}}]}]}
        for _ in range(args.warmup):
            await _session(url, headers, audio, args.max_tokens, False)
        out = []
        for level in levels:
            results, wall = await closed_loop(
                lambda i: _session(url, headers, audio, args.max_tokens, args.barge_in), args.num_requests, level)
            summary = summarize(results, wall)
            out.append((f"realtime concurrency {level}", summary))
            results, wall = await closed_loop(
                lambda i: http_one(session, f"{base}/v1/chat/completions", chat, headers), args.num_requests, level)
            out.append((f"chat (same turns) concurrency {level}", summarize(results, wall)))
    return out
