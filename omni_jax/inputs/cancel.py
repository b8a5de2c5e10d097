"""Cooperative cancellation of prompt processing.

Python cannot stop a thread, so a prompt whose caller left (or whose time budget passed) would
otherwise be processed to its end, costing CPU and memory nobody wants. The thread that runs a
prompt installs a token (`running`); the long steps of prompt processing (tokenizer chunks, each
decoded audio or video frame, each media item) call `check()`, which raises `Cancelled` once the
token is set. Code run outside such a thread (plain `OmniJax`) sees no token and is never cancelled.
"""

from __future__ import annotations

import contextlib
import threading

_local = threading.local()


class Cancelled(Exception):
    """The prompt's processing was cancelled (its caller left or its budget passed)."""


class Token:
    """Set once to stop the processing that holds it; says why."""

    def __init__(self):
        self.reason: str | None = None

    def cancel(self, reason: str) -> None:
        self.reason = reason


@contextlib.contextmanager
def running(token: Token):
    """Run the block with `token` as this thread's cancellation token."""
    _local.token = token
    try:
        yield
    finally:
        _local.token = None


def check() -> None:
    """Raise Cancelled if this thread's prompt was cancelled."""
    token = getattr(_local, "token", None)
    if token is not None and token.reason is not None:
        raise Cancelled(token.reason)
