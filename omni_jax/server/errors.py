"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

# HTTP status -> OpenAI error type (the types OpenAI's API and clients use).
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
          500: "server_error", 503: "server_error"}


class APIError(Exception):
    """An error a handler raises to answer with `status` and OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """The JSON body of an error response (also sent as an SSE event when a stream fails)."""
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param,
                      "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    """An error response with OpenAI's body."""
    return JSONResponse(error_body(status, message, param, code), status_code=status)


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
    return JSONResponse(exc.body(), status_code=exc.status)


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


def install(app) -> None:
    """Register the handlers that turn every error into OpenAI's shape."""
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(StarletteHTTPException, _on_http)
