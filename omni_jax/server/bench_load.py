"""The load machinery `omni-jax bench` shares between its backends: one request's measures
(`Result`), a closed loop of concurrent clients, a streamed chat completion over HTTP, and
the summary (req/s and mean / p50 / p90 / p99 of each measure)."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import time

import aiohttp
import msgspec
import numpy as np

SAMPLE_RATE = 24000
_decode = msgspec.json.Decoder().decode


@dataclasses.dataclass
class Result:
    """What one request measured (seconds from its start)."""

    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    latency: float | None = None
    tokens: int = 0
    ttfa: float | None = None
    audio_seconds: float = 0.0
    barge_in: float | None = None  # realtime: speech over the reply -> response.done (cancelled)

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.latency is None or self.tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.tokens - 1)

    @property
    def rtf(self) -> float | None:
        return self.latency / self.audio_seconds if self.audio_seconds > 0 else None


async def _sse_events(response: aiohttp.ClientResponse):
    """The JSON payloads of a server-sent event stream, then None for `[DONE]`."""
    buf = b""
    async for raw in response.content.iter_any():
        buf += raw
        *events, buf = buf.split(b"\n\n")
        for event in events:
            if not event.startswith(b"data: "):
                continue
            if event == b"data: [DONE]":
                yield None
                return
            yield _decode(event[6:])


async def http_one(session: aiohttp.ClientSession, url: str, body: dict, headers: dict) -> Result:
    res, t0 = Result(), time.perf_counter()
    try:
        async with session.post(url, json=body, headers=headers) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.read())[:200]!r}"
                return res
            audio_bytes = 0
            async for event in _sse_events(r):
                if event is None:  # [DONE]
                    break
                if "error" in event:
                    res.error = event["error"].get("message")
                    return res
                if event.get("usage"):
                    res.tokens = event["usage"]["completion_tokens"]
                for choice in event.get("choices", ()):
                    delta = choice.get("delta", {})
                    # a reasoning model's first token is its thinking's (as vLLM's bench counts it)
                    if (delta.get("content") or delta.get("reasoning_content")) and res.ttft is None:
                        res.ttft = time.perf_counter() - t0
                    data = (delta.get("audio") or {}).get("data")
                    if data:
                        if res.ttfa is None:
                            res.ttfa = time.perf_counter() - t0
                        audio_bytes += len(base64.b64decode(data))
            res.audio_seconds = audio_bytes / 2 / SAMPLE_RATE
    except aiohttp.ClientError as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.latency, res.ok = time.perf_counter() - t0, True
    return res


async def closed_loop(send, n: int, concurrency: int) -> tuple[list[Result], float]:
    """`concurrency` workers sending `n` requests in all; (results, wall seconds)."""
    results: list[Result] = []
    counter = iter(range(n))

    async def worker():
        for i in counter:
            results.append(await send(i))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results, time.perf_counter() - t0


def summarize(results: list[Result], wall: float) -> dict:
    """req/s and mean / p50 / p90 / p99 of each latency measure over the successful requests."""
    ok = [r for r in results if r.ok]
    out = {"requests": len(results), "failed": len(results) - len(ok), "wall_s": wall,
           "req_per_s": len(ok) / wall if wall > 0 else 0.0,
           "output_tok_per_s": sum(r.tokens for r in ok) / wall if wall > 0 else 0.0,
           "errors": sorted({r.error for r in results if r.error})[:5]}
    for name in ("ttft", "tpot", "ttfa", "rtf", "latency", "barge_in"):
        values = [v for v in (getattr(r, name) for r in ok) if v is not None]
        if values:
            a = np.asarray(values)
            out[name] = {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
                         "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99))}
    return out
