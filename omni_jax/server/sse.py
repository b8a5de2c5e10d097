"""Server-sent events as OpenAI streams them: one `data: <json>` event per payload, `data: [DONE]` last."""

from __future__ import annotations

import msgspec

# The end of a chat completion stream.
DONE = b"data: [DONE]\n\n"

_encoder = msgspec.json.Encoder()


def event(body: dict) -> bytes:
    """One event, compact JSON. msgspec rather than json.dumps: a stream sends one per token."""
    return b"data: " + _encoder.encode(body) + b"\n\n"
