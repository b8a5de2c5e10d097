"""OpenAI's Realtime API over WebSocket (`/v1/realtime`) and WebRTC (`/v1/realtime/calls`): spoken
turns in, streamed speech out.

endpoint.py        the WebSocket endpoint: handshake, API key, session limit
calls.py           WebRTC calls: the SDP offer answered, the call's session run, hangup
rtc.py             a call's media and events: the reply's audio track, the caller's audio, the data channel
client_secrets.py  short-lived keys for browsers (POST /v1/realtime/client_secrets), with their session settings
connection.py      one session's event loop (turns, transcriptions, the idle timeout, its response), on either
events.py          client events, validated; the `error` event
session.py         the session's settings (`session.update`): a realtime or a transcription session
conversation.py    the conversation's items and the chat prompt they make
wire_audio.py      the audio formats on the wire (PCM16 24 kHz, G.711 8 kHz: ../g711.py), decoded and encoded
audio_buffer.py    input audio: at the input format's rate in, 16 kHz out, bounded
turns.py           the input buffer with its turn detection (the server VAD: ../vad.py)
response.py        one response: an AsyncOmniJax request as response events
"""

from .calls import RealtimeCalls
from .client_secrets import ClientSecrets
from .connection import RealtimeLimits
from .endpoint import RealtimeEndpoint

__all__ = ["ClientSecrets", "RealtimeCalls", "RealtimeEndpoint", "RealtimeLimits"]
