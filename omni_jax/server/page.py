"""The voice chat page at `/`: plain HTML, CSS and JavaScript modules in server/ui/ (no build
step, nothing fetched from elsewhere), talking to /v1/realtime like any other client."""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import HTMLResponse
from starlette.staticfiles import StaticFiles

# The page loads only its own files; it may show images the user attaches (data:/blob: URLs).
HEADERS = {"content-security-policy": "default-src 'self'; img-src 'self' data: blob:; object-src 'none'; "
                                      "base-uri 'none'; frame-ancestors 'none'",
           "x-content-type-options": "nosniff", "cache-control": "no-cache"}


def mount(app: FastAPI) -> None:
    """Serve the page at / and its files under /ui/."""
    index = resources.files("omni_jax.server").joinpath("ui/index.html").read_text()
    app.mount("/ui", StaticFiles(packages=[("omni_jax.server", "ui")]), name="ui")

    @app.get("/", include_in_schema=False)
    async def voice_chat_page():
        return HTMLResponse(index, headers=HEADERS)
