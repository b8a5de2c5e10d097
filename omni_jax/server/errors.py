"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

A reply never carries more of a client's value than `short` keeps, nor a heap address (an
object's repr from a library's error text), and its message is at most MAX_MESSAGE characters.
"""

from __future__ import annotations

import logging
import re

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

# HTTP status -> OpenAI error type (the types OpenAI's API and clients use).
log = logging.getLogger("omni_jax.server")

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
          422: "invalid_request_error", 499: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}
MAX_MESSAGE = 2000
# Seconds a client is told to wait when the server is saturated (prompt queue, body budget).
RETRY_AFTER_S = 1
_OBJECT_REPR = re.compile(r"<[^<>]*\bat 0x[0-9a-fA-F]+>")


def short(value, limit: int = 80) -> str:
    """A client's value as it may appear in a reply: its repr, cut to about `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class APIError(Exception):
    """An error a handler raises to answer with `status` and OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def headers(self) -> dict | None:
        return None if self.retry_after is None else {"Retry-After": str(self.retry_after)}


# -- the realtime API (/v1/realtime): its error events are `realtime.events.EventError`
class InputAudioError(ValueError):
    """An audio append the input buffer refuses (the message says why and names the limit)."""


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """The JSON body of an error response (also sent as an SSE event when a stream fails)."""
    message = _OBJECT_REPR.sub("<object>", message)
    if len(message) > MAX_MESSAGE:
        message = message[:MAX_MESSAGE] + "..."
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param,
                      "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    """An error response with OpenAI's body."""
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def overloaded(message: str) -> APIError:
    """503 with Retry-After: the server is saturated, not broken."""
    return APIError(503, message, None, "server_overloaded", retry_after=RETRY_AFTER_S)


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    """400 naming the field at fault."""
    return APIError(400, message, param, code)


def _param_of(loc) -> str | None:
    """pydantic's error location ("body", "messages", 0, "content") as `messages[0].content`."""
    parts = [p for p in loc if p != "body"]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


async def _on_api_error(request: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())


async def _on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    # FastAPI answers 422; OpenAI answers 400 and names the field.
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    param = _param_of(first.get("loc", ()))
    msg = first.get("msg", "invalid value")
    if first.get("type") == "json_invalid":
        return error_response(400, f"the body is not valid JSON: {msg}", None, "invalid_json")
    return error_response(400, f"{param}: {msg}" if param else msg, param, "invalid_value")


async def _on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return error_response(exc.status_code, str(exc.detail), None, code)


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    # A bug, not the client's fault: still OpenAI's shape, and no more detail than the type.
    log.exception("unhandled error on %s", request.url.path)
    return error_response(500, f"internal error: {type(exc).__name__}", None, "internal_error")


def install(app) -> None:
    """Register the handlers that turn every error into OpenAI's shape."""
    app.add_exception_handler(Exception, _on_unexpected)
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(StarletteHTTPException, _on_http)
