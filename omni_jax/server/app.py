"""The FastAPI app: routes, the API key and body-size gate, readiness and metrics endpoints."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from . import errors
from .chat import ChatHandler
from .engine import ServedEngine
from .errors import APIError, error_body
from .messages import MediaPolicy
from .metrics import Metrics
from .protocol import ChatCompletionRequest, SpeechRequest
from .speech import SpeechHandler

log = logging.getLogger("omni_jax.server")

# Paths anyone may call without the API key (load balancers probe it).
OPEN_PATHS = ("/health",)


class Gate:
    """ASGI middleware: API key check, request body size limit, and error counting.

    The body is read (up to the limit) before the app sees it, so an oversized body is
    refused with 413 whatever its transfer encoding; after the body, `receive` is the
    server's again, so the app still hears a client disconnect.
    """

    def __init__(self, app, api_key: str | None, max_body_bytes: int, metrics: Metrics):
        self.app, self.api_key, self.max_body, self.metrics = app, api_key, max_body_bytes, metrics

    async def _reject(self, send, status: int, message: str, code: str) -> None:
        self.metrics.error(status)
        body = json.dumps(error_body(status, message, None, code)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def _authorized(self, scope) -> bool:
        if self.api_key is None or scope["path"] in OPEN_PATHS:
            return True
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                                          self.api_key.encode())
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
        chunks, size, more = [], 0, scope["method"] in ("POST", "PUT", "PATCH")
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            size += len(msg.get("body", b""))
            if size > self.max_body:
                return await self._reject(send, 413, too_big, "request_too_large")
            chunks.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed and chunks:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        async def counting_send(msg):
            if msg["type"] == "http.response.start" and msg["status"] >= 400:
                self.metrics.error(msg["status"])
            await send(msg)

        await self.app(scope, replay, counting_send)


def build_app(engine: ServedEngine, *, api_key: str | None = None, max_body_bytes: int = 64 << 20,
              allowed_media_dir: str | None = None) -> FastAPI:
    """The server's app around an engine (started by the caller, shut down with the app)."""
    metrics = Metrics()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="OmniJax", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    errors.install(app)
    chat = ChatHandler(engine, MediaPolicy(allowed_media_dir), metrics)
    speech = SpeechHandler(engine, metrics)
    app.state.engine, app.state.metrics = engine, metrics

    @app.get("/health")
    async def health():
        ok, why = engine.check()
        if ok:
            return JSONResponse({"status": "ok"})
        return JSONResponse(error_body(503, why, None, "service_unavailable"), status_code=503)

    def model_card() -> dict:
        return {"id": engine.served_name, "object": "model", "created": int(engine.started), "owned_by": "omni-jax",
                "root": engine.model, "modalities": engine.output_modalities}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != engine.served_name:
            raise APIError(404, f"The model {model_id!r} does not exist", "model", "model_not_found")
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

    @app.post("/v1/audio/speech")
    async def audio_speech(req: SpeechRequest, request: Request):
        return await speech(req, request)

    return Gate(app, api_key, max_body_bytes, metrics)
