"""`/v1/realtime`: the WebSocket endpoint, which admits sessions (connection.py runs each).

It checks the API key at the handshake (a wrong one is refused there, 401), or a client secret
(client_secrets.py: the session starts with its settings), and a browser's page's origin (403 for
another site's page, unless `allowed_origins` has it: browsers apply no CORS to WebSockets, so
without this any page a user opens could talk to a server that has no API key), then admits at
most `max_sessions` sessions (WebRTC calls included); past that a session gets an `error` event
and close code 1008.
`?intent=transcription` starts a transcription session (session.py). `?call_id=...` joins a WebRTC
call's session instead (calls.py), as OpenAI's server-side controls do: the socket gets every event
of the call's session and may send it events (to set its instructions and tools, answer its
function calls), with the API key.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import urllib.parse

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from ..errors import error_response
from ..messages import MediaPolicy
from ..metrics import Metrics
from .client_secrets import ClientSecrets
from .connection import POLICY_VIOLATION, RealtimeLimits, RealtimeSession
from .events import EventError

KEY_PROTOCOL = "openai-insecure-api-key."   # how a browser, which cannot set headers, sends the key


class RealtimeEndpoint:
    """The `/v1/realtime` WebSocket route on one engine."""

    def __init__(self, engine, policy: MediaPolicy, metrics: Metrics, api_key: str | None,
                 limits: RealtimeLimits = RealtimeLimits(), secrets: ClientSecrets | None = None,
                 allowed_origins: tuple[str, ...] = ()):
        self.engine, self.policy, self.metrics, self.api_key, self.limits = engine, policy, metrics, api_key, limits
        self.allowed_origins = allowed_origins
        self.secrets = secrets or ClientSecrets(engine)
        self.active = 0
        self.calls: dict = {}  # the WebRTC calls in progress: call id -> rtc.Call (calls.py keeps it)

    def _key(self, ws: WebSocket) -> str | None:
        auth = ws.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer":
            return token.strip()
        for proto in _protocols(ws):
            if proto.startswith(KEY_PROTOCOL):
                return proto[len(KEY_PROTOCOL):]
        return None

    def _foreign(self, ws: WebSocket) -> str | None:
        """The origin of another site's page opening this socket (None: this server's page, or not a
        browser, which sends no Origin), unless it is allowed."""
        origin = ws.headers.get("origin")
        if origin is None or "*" in self.allowed_origins or origin in self.allowed_origins:
            return None
        return None if urllib.parse.urlsplit(origin).netloc == ws.headers.get("host") else origin

    async def __call__(self, ws: WebSocket) -> None:
        foreign = self._foreign(ws)
        if foreign is not None:
            self.metrics.error(403)
            await ws.send_denial_response(error_response(
                403, f"pages from {foreign[:100]} may not open realtime sessions here; the server allows its own "
                     f"and those of --allowed-origins", None, "origin_not_allowed"))
            return
        key = self._key(ws)
        config = self.secrets.session(key) if key else None
        if self.api_key is not None and config is None:
            if key is None or not hmac.compare_digest(key.encode(), self.api_key.encode()):
                self.metrics.error(401)
                await ws.send_denial_response(error_response(
                    401, "Invalid or missing API key: send 'Authorization: Bearer KEY' (the API key, or a live client "
                    "secret)", None, "invalid_api_key"))
                return
        await ws.accept(subprotocol="realtime" if "realtime" in _protocols(ws) else None)
        if "call_id" in ws.query_params:
            await self._join(ws, ws.query_params["call_id"], secret=config is not None)
            return
        intent = ws.query_params.get("intent")
        refusal = self.refusal(ws.query_params.get("model"), intent)
        if refusal is not None:
            await _send_and_close(ws, refusal)
            return
        with self.seat():
            await RealtimeSession(WebSocketChannel(ws), self.engine, self.policy, self.metrics, self.limits,
                                  "transcription" if intent == "transcription" else "realtime", config).run()

    async def _join(self, ws: WebSocket, call_id: str, secret: bool) -> None:
        """The server-side controls of a call: this socket joins its session's events until it or
        the call ends (it holds no place of its own)."""
        call = self.calls.get(call_id)
        if secret:
            await _send_and_close(ws, EventError("a client secret cannot join a call; its server joins it with the "
                                                 "API key", "invalid_api_key", "call_id"))
        elif call is None:
            await _send_and_close(ws, EventError(f"no call {call_id[:64]!r} is in progress", "call_not_found",
                                                 "call_id"))
        else:
            await call.events.join(WebSocketChannel(ws))

    @contextlib.contextmanager
    def seat(self):
        """One of the `max_sessions` held (by a WebSocket session or a WebRTC call) while it runs."""
        self.active += 1
        self.metrics.realtime_sessions.inc()
        try:
            yield
        finally:
            self.active -= 1
            self.metrics.realtime_sessions.dec()

    def refusal(self, model: str | None, intent: str | None) -> EventError | None:
        """Why a new session cannot start (a model not served, an unknown intent, the engine down,
        the session limit held), or None."""
        if model is not None and model != self.engine.served_name:
            return EventError(f"The model {model[:64]!r} does not exist; this server serves "
                              f"{self.engine.served_name!r}", "model_not_found", "model")
        if intent not in (None, "transcription"):
            return EventError(f"unknown intent {intent[:64]!r}; leave it out, or 'transcription' for a session "
                              f"that only transcribes", "invalid_value", "intent")
        ok, why = self.engine.check()
        if not ok:
            return EventError(why, "service_unavailable", type="server_error")
        if self.active >= self.limits.max_sessions:
            self.metrics.error(429)
            return EventError(f"the server holds its limit of {self.limits.max_sessions} realtime sessions "
                              f"(--max-realtime-sessions); try again later", "session_limit_reached",
                              type="rate_limit_error")
        return None


class WebSocketChannel:
    """A WebSocket as a session's event channel (connection.Channel)."""

    def __init__(self, ws: WebSocket):
        self.ws = ws

    async def receive(self) -> str | bytes | None:
        try:
            msg = await self.ws.receive()
        except WebSocketDisconnect:
            return None
        if msg["type"] == "websocket.disconnect":
            return None
        return msg.get("text") if msg.get("text") is not None else msg.get("bytes")

    async def send_text(self, text: str) -> None:
        await self.ws.send_text(text)

    async def close(self, code: int, reason: str) -> None:
        if self.ws.application_state == WebSocketState.CONNECTED:
            try:
                await self.ws.close(code, reason)
            except Exception:  # the client left first
                pass


def _protocols(ws: WebSocket) -> list[str]:
    return [p.strip() for p in ws.headers.get("sec-websocket-protocol", "").split(",") if p.strip()]


async def _send_and_close(ws: WebSocket, error: EventError) -> None:
    try:
        await ws.send_text(json.dumps(error.event()))
        await ws.close(POLICY_VIOLATION, error.message[:120])
    except Exception:  # the client left first
        pass
