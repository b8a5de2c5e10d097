"""Prompt processing off the event loop: a thread pool with a time budget per prompt.

Processing a prompt (chat template, tokenizer, image / audio / video decoding and feature
extraction) is blocking work of any length a caller can provoke. On an asyncio event loop it
would stall every other stream of the process; here each prompt runs on a worker thread and
only its own request waits for it. A prompt whose processing outlasts the budget fails with
a `PromptError`; one whose caller leaves is cancelled too. Python cannot stop a thread, so the
work is cancelled cooperatively (inputs/cancel.py): the worker stops at the next step of the
processing (a tokenizer chunk, a decoded audio or video frame, a media item), and whatever
it was in the middle of (one tokenizer call on a bounded text, one frame) is its whole cost.
At most `max_queued` prompts wait for a worker; more are refused at once with `Overloaded`
(a server answers 503 with Retry-After), so a burst of uploads cannot pile up in memory.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

from .inputs import cancel
from .errors import Overloaded, PromptError

T = TypeVar("T")


class PromptWorkers:
    """Run prompt processing on `num_workers` threads, each prompt within `timeout_s` seconds.

    The budget counts from when a worker starts on the prompt, not while it waits for a free
    worker, so a burst of prompts does not fail for the queue's sake; at most `max_queued`
    prompts wait (None: no bound).
    """

    def __init__(self, num_workers: int = 4, timeout_s: float = 30.0, max_queued: int | None = None):
        self.check(num_workers, timeout_s, max_queued)
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.max_queued = max_queued
        self._inflight = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(num_workers, thread_name_prefix="omni-prompt")

    @staticmethod
    def check(num_workers, timeout_s, max_queued=None) -> None:
        """ValueError naming a bad worker count, budget or queue bound."""
        if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 1:
            raise ValueError(f"prompt_workers must be a positive integer, got {num_workers!r}")
        if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or not 0 < timeout_s < float("inf"):
            raise ValueError(f"prompt_timeout_s must be a positive number of seconds, got {timeout_s!r}")
        if max_queued is not None and (not isinstance(max_queued, int) or isinstance(max_queued, bool)
                                       or max_queued < 0):
            raise ValueError(f"max_queued_prompts must be an integer >= 0, got {max_queued!r}")

    async def run(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) on a worker thread; PromptError if it runs longer than the budget, Overloaded
        if too many prompts are in the workers' hands already. A caller that leaves (is cancelled)
        cancels the work too."""
        with self._lock:
            if self.max_queued is not None and self._inflight >= self.num_workers + self.max_queued:
                raise Overloaded(f"{self._inflight} prompts are being processed or waiting for the "
                                 f"{self.num_workers} prompt workers (at most {self.max_queued} may wait: "
                                 f"max_queued_prompts); try again shortly")
            self._inflight += 1
        loop = asyncio.get_running_loop()
        started = asyncio.Event()
        token = cancel.Token()

        def timed():
            try:
                loop.call_soon_threadsafe(started.set)
                with cancel.running(token):
                    cancel.check()  # cancelled while it waited for a worker
                    return fn(*args)
            finally:
                self._release()

        try:
            work = loop.run_in_executor(self._pool, timed)
        except BaseException:
            self._release()
            raise
        try:
            await started.wait()
        except asyncio.CancelledError:
            # The caller left while the prompt waited for a worker: it stops before it starts (the
            # thread's check), and its slot is released by the thread as for any other prompt.
            token.cancel("the caller left")
            work.add_done_callback(_drop_result)
            raise
        t0 = time.monotonic()
        try:
            # shield: a timeout must not cancel `work`'s wrapper while the thread still runs it.
            return await asyncio.wait_for(asyncio.shield(work), self.timeout_s)
        except TimeoutError:
            token.cancel("prompt_timeout_s passed")
            raise PromptError(f"processing the prompt took longer than {self.timeout_s:g} s "
                              f"(prompt_timeout_s; stopped waiting after {time.monotonic() - t0:.1f} s)") from None
        except asyncio.CancelledError:
            token.cancel("the caller left")
            raise
        finally:
            if not work.done():  # abandoned (over budget, or the caller left): its outcome goes nowhere
                work.add_done_callback(_drop_result)

    @property
    def inflight(self) -> int:
        """Prompts being processed (abandoned ones until their worker stops) or waiting for a worker."""
        return self._inflight

    def _release(self) -> None:
        with self._lock:
            self._inflight -= 1

    def shutdown(self) -> None:
        """Stop taking prompts; queued ones are cancelled, running ones finish in the background."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def _drop_result(work: asyncio.Future) -> None:
    # Read the abandoned work's exception so asyncio does not log it as never retrieved.
    if not work.cancelled():
        work.exception()
