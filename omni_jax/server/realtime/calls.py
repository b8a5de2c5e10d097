"""`POST /v1/realtime/calls`: a realtime session over WebRTC, as OpenAI's browser clients open it.

The client posts its SDP offer (the body as `application/sdp`, or a multipart form with `sdp`
and a `session` object of the settings to start with, as `client.realtime.calls.create` sends
it), with the API key or a client secret, and gets the SDP answer (201, `Location:
/v1/realtime/calls/{call_id}`). Then the call carries the caller's voice in (its audio track, to
the server VAD), the reply's voice out (an Opus track, rtc.Speaker) and the events both ways on
the `oai-events` data channel, with the same session as `/v1/realtime` (connection.py): no
`input_audio_buffer.append` or `response.output_audio.delta` needed. A WebSocket may join the
call's session with the API key (`/v1/realtime?call_id=...`, endpoint.py): OpenAI's server-side
controls, where the app's server keeps its instructions and tools. `POST
/v1/realtime/calls/{call_id}/hangup` ends it; so do the peer closing, the session's limits, or
a peer that does not connect within `connect_timeout_s`. A call holds one of the realtime
sessions' places (`--max-realtime-sessions`) from its offer to its end.

The media go over UDP between the host's addresses and the caller's (ICE, DTLS-SRTP): the
caller must reach one of this host's addresses, or go through the ICE servers given
(`--ice-server`, STUN or TURN URLs; none by default, so nothing is asked of a third party).
aiortc is imported when the first call comes.
"""

from __future__ import annotations

import contextlib
import json

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import Response

from ..errors import APIError, bad_request
from .client_secrets import session_config, validated
from .endpoint import RealtimeEndpoint
from .events import SessionFields, new_id

MAX_SDP_BYTES = 64 << 10


class RealtimeCalls:
    """The WebRTC calls of one server, sharing the realtime endpoint's sessions, limits and secrets."""

    def __init__(self, endpoint: RealtimeEndpoint, ice_servers: list[str] = (), connect_timeout_s: float = 30.0):
        self.endpoint, self.ice_servers, self.connect_timeout_s = endpoint, list(ice_servers), connect_timeout_s
        self.calls = endpoint.calls  # (where `/v1/realtime?call_id=` finds them too)

    async def create(self, request: Request) -> Response:
        sdp, fields = await _offer(request)
        ep = self.endpoint
        key = request.headers.get("authorization", "").partition(" ")[2].strip()
        config = ep.secrets.session(key) if key.startswith("ek_") else None
        refusal = ep.refusal(None, None)
        if refusal is not None:
            raise APIError({"rate_limit_error": 429, "server_error": 503}.get(refusal.type, 400), refusal.message,
                           refusal.param, refusal.code)
        if fields is not None:
            config = session_config(ep.engine, fields)  # (which refuses another model)
        # aiortc and PyAV load with the first call (the GPU check's wheel set has neither)
        from .rtc import Call

        seat = contextlib.ExitStack()
        seat.enter_context(ep.seat())  # held from the offer on: offers cannot pass the limit together
        call = Call(new_id("rtc"), ep, config, seat, self.ice_servers, self.connect_timeout_s,
                    lambda: self.calls.pop(call.id, None))
        try:
            answer = await call.answer(sdp)
        except Exception as e:  # aiortc's word for an offer it cannot take (ValueError, mostly)
            await call.pc.close()
            seat.close()
            raise bad_request(f"sdp: the offer cannot be answered: {e}", "sdp", "invalid_sdp") from None
        self.calls[call.id] = call
        call.start()
        return Response(answer, 201, media_type="application/sdp",
                        headers={"Location": f"/v1/realtime/calls/{call.id}"})

    async def hangup(self, call_id: str) -> dict:
        call = self.calls.get(call_id)
        if call is None:
            raise APIError(404, f"no call {call_id[:64]!r} is in progress", "call_id", "call_not_found")
        await call.hangup()
        return {}


async def _offer(request: Request) -> tuple[str, SessionFields | None]:
    """The SDP offer and the session settings (None: not given) of a create-call request."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind == "multipart/form-data":
        form = await request.form()
        sdp, session = form.get("sdp"), form.get("session")
        sdp = (await sdp.read()).decode("utf-8", "replace") if hasattr(sdp, "read") else sdp
        session = (await session.read()).decode("utf-8", "replace") if hasattr(session, "read") else session
    elif kind in ("application/sdp", "text/plain", ""):
        sdp, session = (await request.body()).decode("utf-8", "replace"), None
    else:
        raise APIError(415, f"the body is {kind!r}: send the SDP offer as application/sdp, or a multipart form with "
                            f"'sdp' and 'session'", None, "unsupported_media_type")
    if not sdp or not sdp.strip():
        raise bad_request("sdp: the SDP offer is missing", "sdp", "missing_required_parameter")
    if len(sdp) > MAX_SDP_BYTES or not sdp.lstrip().startswith("v=0"):
        raise bad_request("sdp: this is not an SDP offer (it starts with 'v=0', and is at most 64 kB)", "sdp",
                          "invalid_sdp")
    fields = None
    if session is not None:
        try:
            body = json.loads(session)
        except ValueError as e:
            raise bad_request(f"session: not valid JSON: {e}", "session", "invalid_json") from None
        fields = validated(_CallRequest, {"session": body}).session
    return sdp, fields


class _CallRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    session: SessionFields
