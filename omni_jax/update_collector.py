"""One request's updates on their way from the orchestrator thread to an async reader.

Updates the reader has not taken yet are merged into one (`OmniRequestOutput.after`), as
vLLM's output collector does for streamed deltas: a reader slower than the engine (an HTTP
stream writing one event per update) gets fewer, larger deltas instead of a growing
backlog, and the event loop is woken once per read rather than once per engine step.
"""

from __future__ import annotations

import asyncio
import threading

from .runtime.outputs import OmniRequestOutput


class UpdateCollector:
    """`put` from any thread; `get` from the event loop it was made on."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: OmniRequestOutput | None = None
        self._ready = asyncio.Event()  # set on the loop only (asyncio.Event is not thread-safe)

    def put(self, out: OmniRequestOutput) -> None:
        with self._lock:
            wake = self._pending is None
            self._pending = out if wake else out.after(self._pending)
        if wake:
            self._loop.call_soon_threadsafe(self._ready.set)

    async def get(self) -> OmniRequestOutput:
        """The next update: everything put since the last get, as one."""
        while True:
            with self._lock:
                out, self._pending = self._pending, None
            if out is not None:
                return out
            # A put from here on schedules a set() that runs after this clear (both on the loop).
            self._ready.clear()
            await self._ready.wait()
