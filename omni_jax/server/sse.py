"""Server-sent events as OpenAI streams them: one `data: <json>` event per payload, `data: [DONE]` last."""

from __future__ import annotations

from typing import AsyncIterator

import msgspec
from fastapi.responses import StreamingResponse

# The end of a chat completion stream.
DONE = b"data: [DONE]\n\n"

_encoder = msgspec.json.Encoder()


def event(body: dict) -> bytes:
    """One event, compact JSON. msgspec rather than json.dumps: a stream sends one per token."""
    return b"data: " + _encoder.encode(body) + b"\n\n"


def event_stream(events: AsyncIterator[bytes]) -> StreamingResponse:
    """A streamed reply of these events, kept from caches and from proxies' buffering (nginx
    would otherwise hold the events back)."""
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
