"""The FastAPI app: routes, the API key and body-size gate, readiness and metrics endpoints."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.middleware.cors import CORSMiddleware

from . import errors, page
from .chat import ChatHandler
from .completions import CompletionsHandler
from .kept import Kept
from .engine import ServedEngine
from .errors import RETRY_AFTER_S, APIError, error_body, short
from .messages import MediaPolicy
from .metrics import Metrics
from .schemas import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ResponseRequest, SpeechRequest,
                      TokenizeRequest)
from .realtime import ClientSecrets, RealtimeCalls, RealtimeEndpoint, RealtimeLimits
from .reply_audio import ReplyAudio
from .responses import ResponsesHandler
from .speech import SpeechHandler
from .tokenize import TokenizeHandler, max_model_len
from .transcription import TranscriptionHandler

log = logging.getLogger("omni_jax.server")

# Paths anyone may call without the API key (load balancers probe it).
OPEN_PATHS = ("/health", "/")
UI_PATH = "/ui/"  # the voice chat page's files: the page asks for the key itself
SECRET_PATH = "/v1/realtime/calls"  # where a client secret does for the API key (as on /v1/realtime)
STORED_RESPONSE_TTL_S = 3600.0  # how long /v1/responses keeps a stored response


class Gate:
    """ASGI middleware: API key check, request body limits, and error counting.

    The body is read (up to the limit) before the app sees it, so an oversized body is
    refused with 413 whatever its transfer encoding; after the body, `receive` is the
    server's again, so the app still hears a client disconnect. Bodies count against a
    budget of bytes held by all requests at once (`max_inflight_body_bytes`) from their first
    byte until their reply ends: past it a request gets 503 with Retry-After, so a burst of
    big uploads cannot grow the process without bound. A body that stops arriving for
    `body_timeout_s` gets 408. A JSON body with more than `max_json_items` arrays, objects and
    separators is refused before it is parsed (parsed, each item costs ~100 bytes of Python objects).
    """

    def __init__(self, app, api_key: str | None, max_body_bytes: int, metrics: Metrics,
                 max_inflight_body_bytes: int | None = None, body_timeout_s: float = 30.0,
                 max_json_items: int = 1 << 18, secrets: ClientSecrets | None = None):
        self.app, self.api_key, self.max_body, self.metrics = app, api_key, max_body_bytes, metrics
        self.secrets = secrets
        self.budget = max_inflight_body_bytes if max_inflight_body_bytes is not None else 4 * max_body_bytes
        self.body_timeout_s, self.max_json_items = body_timeout_s, max_json_items
        self.inflight_bytes = 0

    async def _reject(self, send, status: int, message: str, code: str, headers=()) -> None:
        self.metrics.error(status)
        body = json.dumps(error_body(status, message, None, code)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   *headers]
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        if status == 408:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _busy(self, send) -> None:
        await self._reject(send, 503, f"the server holds {self.inflight_bytes} bytes of request bodies, its budget "
                                      f"is {self.budget} (--max-inflight-body-mb); try again shortly",
                           "server_overloaded", [(b"retry-after", str(RETRY_AFTER_S).encode())])

    def _authorized(self, scope) -> bool:
        if self.api_key is None or scope["path"] in OPEN_PATHS or scope["path"].startswith(UI_PATH):
            return True
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                token = token.strip()
                if scheme.lower() != "bearer":
                    return False
                if scope["path"] == SECRET_PATH and self.secrets is not None and self.secrets.session(token):
                    return True
                return hmac.compare_digest(token.encode(), self.api_key.encode())
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if not self._authorized(scope):
            return await self._reject(send, 401, "Invalid or missing API key: send 'Authorization: Bearer KEY'",
                                      "invalid_api_key")
        too_big = f"the request body is larger than the server's limit of {self.max_body} bytes"
        length = dict(scope.get("headers", ())).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return await self._reject(send, 413, too_big, "request_too_large")
        held = 0
        try:
            # A declared length is reserved at once: a client is refused before it uploads.
            if length is not None and length.isdigit():
                held = int(length)
                if self.inflight_bytes + held > self.budget:
                    held = 0
                    return await self._busy(send)
                self.inflight_bytes += held
            chunks, size, more = [], 0, scope["method"] in ("POST", "PUT", "PATCH")
            while more:
                try:
                    msg = await asyncio.wait_for(receive(), self.body_timeout_s)
                except TimeoutError:
                    return await self._reject(send, 408, f"no part of the request body came for {self.body_timeout_s:g} s",
                                              "request_timeout")
                if msg["type"] == "http.disconnect":
                    return
                piece = msg.get("body", b"")
                size += len(piece)
                if size > self.max_body:
                    return await self._reject(send, 413, too_big, "request_too_large")
                if size > held:  # a chunked body (or one longer than it said): counted as it comes
                    if self.inflight_bytes + size - held > self.budget:
                        return await self._busy(send)
                    self.inflight_bytes += size - held
                    held = size
                chunks.append(piece)
                more = msg.get("more_body", False)
            body = b"".join(chunks)
            del chunks
            items = body.count(b"{") + body.count(b"[") + body.count(b",")
            if items > self.max_json_items:
                return await self._reject(send, 413, f"the request body holds {items} JSON objects, arrays and "
                                                     f"separators, more than the limit of {self.max_json_items}",
                                          "request_too_large")
            replayed = False

            async def replay():
                nonlocal replayed, body
                if not replayed:  # (an empty body too: the app waits for its one message)
                    replayed = True
                    out, body = body, b""  # the app's copy is the only one kept
                    return {"type": "http.request", "body": out, "more_body": False}
                return await receive()

            async def counting_send(msg):
                if msg["type"] == "http.response.start" and msg["status"] >= 400:
                    self.metrics.error(msg["status"])
                await send(msg)

            await self.app(scope, replay, counting_send)
        finally:
            self.inflight_bytes -= held


def build_app(engine: ServedEngine, *, api_key: str | None = None, max_body_bytes: int = 64 << 20,
              allowed_media_dir: str | None = None, max_inflight_body_bytes: int | None = None,
              body_timeout_s: float = 30.0, realtime: RealtimeLimits = RealtimeLimits(),
              reply_audio_ttl_s: float = 3600.0, stored_responses_bytes: int = 256 << 20,
              ui: bool = True, ice_servers: tuple[str, ...] = (), allowed_origins: tuple[str, ...] = ()):
    """The server's app around an engine (started by the caller, shut down with the app).
    `max_inflight_body_bytes`: the budget of bytes all request bodies may hold at once (None:
    four times `max_body_bytes`). `realtime`: the limits of /v1/realtime sessions. `reply_audio_ttl_s`: how
    long a spoken chat reply can be referred to by its audio id. `stored_responses_bytes`: what
    /v1/responses keeps of stored responses (each an hour at most). `ui`: serve the voice chat page at /.
    `ice_servers`: STUN/TURN URLs for WebRTC calls (/v1/realtime/calls). `allowed_origins`: the
    web origins whose pages may call the API from a browser besides the server's own (CORS, and the
    realtime WebSocket's Origin check; "*" for any)."""
    metrics = Metrics()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="OmniJax", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    errors.install(app)
    policy = MediaPolicy(allowed_media_dir)
    chat = ChatHandler(engine, policy, metrics, ReplyAudio(reply_audio_ttl_s))
    complete = CompletionsHandler(engine, metrics)
    responses = ResponsesHandler(engine, policy, metrics, Kept(STORED_RESPONSE_TTL_S, max_bytes=stored_responses_bytes))
    speech = SpeechHandler(engine, metrics)
    tokens = TokenizeHandler(engine, policy)
    transcribe, translate = TranscriptionHandler(engine, metrics), TranscriptionHandler(engine, metrics, translate=True)
    app.state.engine, app.state.metrics = engine, metrics

    @app.get("/health")
    async def health():
        ok, why = engine.check()
        if ok:
            return JSONResponse({"status": "ok"})
        return JSONResponse(error_body(503, why, None, "service_unavailable"), status_code=503)

    def model_card() -> dict:
        # `root` names the model as served, never the checkpoint's path on this machine.
        card = {"id": engine.served_name, "object": "model", "created": int(engine.started), "owned_by": "omni-jax",
                "root": engine.served_name, "modalities": engine.output_modalities}
        if engine.check()[0]:  # vLLM's: the longest prompt + reply
            card["max_model_len"] = max_model_len(engine)
        return card

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != engine.served_name:
            raise APIError(404, f"The model {short(model_id)} does not exist", "model", "model_not_found")
        return model_card()

    @app.get("/metrics")
    async def prometheus():
        stats = None
        if engine.check()[0]:
            try:
                stats = await asyncio.to_thread(engine.omni.stage_stats, 2.0)
            except Exception as e:  # metrics must not fail because a stage is slow to answer
                log.warning("stage stats unavailable: %s", e)
        return Response(metrics.render(stats), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return await chat(req, request)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await complete(req, request)

    @app.post("/v1/responses")
    async def create_response(req: ResponseRequest, request: Request):
        return await responses.create(req, request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        return responses.retrieve(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        return responses.delete(response_id)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest, request: Request):
        return await tokens.tokenize(req, request)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        return await tokens.detokenize(req)

    @app.post("/v1/audio/speech")
    async def audio_speech(req: SpeechRequest, request: Request):
        return await speech(req, request)

    # Multipart forms, read by the handlers (transcription_form.py): OpenAI's clients send lists
    # as `key[]` and objects as `key[field]`, which declared Form parameters cannot name.
    @app.post("/v1/audio/transcriptions")
    async def audio_transcriptions(request: Request):
        return await transcribe(request)

    @app.post("/v1/audio/translations")
    async def audio_translations(request: Request):
        return await translate(request)

    @app.get("/v1/audio/voices")
    async def audio_voices():
        # vLLM-Omni's listing: what `voice` accepts on /v1/audio/speech, chat audio and realtime
        ok, why = engine.check()
        if not ok:
            raise APIError(503, why, None, "service_unavailable")
        return {"voices": engine.voices}

    client_secrets = ClientSecrets(engine)

    @app.post("/v1/realtime/client_secrets")
    async def realtime_client_secrets(request: Request):
        try:
            body = json.loads(await request.body() or b"{}")
        except ValueError as e:
            raise APIError(400, f"the body is not valid JSON: {e}", None, "invalid_json") from None
        return client_secrets.create(body)

    realtime_endpoint = RealtimeEndpoint(engine, policy, metrics, api_key, realtime, client_secrets,
                                         allowed_origins)
    app.add_api_websocket_route("/v1/realtime", realtime_endpoint)
    calls = RealtimeCalls(realtime_endpoint, ice_servers)

    @app.post("/v1/realtime/calls")
    async def realtime_calls(request: Request):
        return await calls.create(request)

    @app.post("/v1/realtime/calls/{call_id}/hangup")
    async def realtime_call_hangup(call_id: str):
        return await calls.hangup(call_id)
    if ui:
        page.mount(app)

    gated = Gate(app, api_key, max_body_bytes, metrics, max_inflight_body_bytes, body_timeout_s,
                 secrets=client_secrets)
    if not allowed_origins:
        return gated
    # Outside the gate: a browser's preflight carries no key. Keys travel in a header, not cookies,
    # so credentials stay off; Location is a created call's address.
    return CORSMiddleware(gated, allow_origins=list(allowed_origins), allow_methods=["*"], allow_headers=["*"],
                          expose_headers=["Location"])
