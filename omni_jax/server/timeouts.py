"""A deadline for request headers: uvicorn's h11 protocol with a header timeout.

uvicorn closes a connection that stays silent after a response (`timeout_keep_alive`), but
any byte cancels that timer, and a new connection has no timer at all: a client that sends its
headers a byte every few seconds holds a connection (and a socket, and a slot of any
connection limit) for ever. Here every request's headers must be complete within
`header_timeout_s` of the connection's opening or of the previous response's end, however
they trickle; past it the connection is closed. Bodies have their own idle timeout (the Gate);
a connection upgraded to a WebSocket has no deadline (its session has its own limits).
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class HeaderTimeoutH11(H11Protocol):
    """H11Protocol that closes a connection whose next request's headers do not complete in time."""

    header_timeout_s: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_deadline()

    def handle_websocket_upgrade(self, event) -> None:
        # The connection becomes a WebSocket (/v1/realtime): no more request headers will come.
        self._disarm_header_deadline()
        super().handle_websocket_upgrade(event)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._header_deadline_passed, self.cycle)

    def _disarm_header_deadline(self) -> None:
        deadline = getattr(self, "_header_deadline", None)
        if deadline is not None:
            deadline.cancel()
            self._header_deadline = None

    def _header_deadline_passed(self, cycle_at_arm) -> None:
        # A new request began (a new cycle) since the deadline was set, or one is still running: in time.
        if self.cycle is not cycle_at_arm or (cycle_at_arm is not None and not cycle_at_arm.response_complete):
            return
        if not self.transport.is_closing():
            self.logger.debug("closing a connection whose request headers did not arrive in %gs", self.header_timeout_s)
            try:
                self.conn.send(h11.ConnectionClosed())
            except h11.LocalProtocolError:
                pass
            self.transport.close()


def with_header_timeout(seconds: float) -> type[HeaderTimeoutH11]:
    """The protocol class for uvicorn's `http=` with this header deadline."""
    return type("HeaderTimeoutH11", (HeaderTimeoutH11,), {"header_timeout_s": float(seconds)})
