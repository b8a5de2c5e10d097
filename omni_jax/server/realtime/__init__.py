"""OpenAI's Realtime API over WebSocket (`/v1/realtime`): spoken turns in, streamed speech out.

connection.py    the endpoint (handshake, session limit) and one session's event loop
events.py        client events, validated; the `error` event
session.py       the session's settings (`session.update`)
conversation.py  the conversation's items and the chat prompt they make
audio_buffer.py  input audio: PCM16 24 kHz in, 16 kHz out, bounded
vad.py           server VAD: where turns start and stop
response.py      one response: an AsyncOmniJax request as response events
"""

from .connection import RealtimeEndpoint, RealtimeLimits

__all__ = ["RealtimeEndpoint", "RealtimeLimits"]
