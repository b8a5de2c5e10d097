"""Prompt processing off the event loop: a thread pool with a time budget per prompt.

Processing a prompt (chat template, tokenizer, image / audio / video decoding and feature
extraction) is blocking work of any length a caller can provoke. On an asyncio event loop it
would stall every other stream of the process; here each prompt runs on a worker thread and
only its own request waits for it. A prompt whose processing outlasts the budget fails with
a `PromptError`; Python cannot stop a thread, so its worker finishes the abandoned work in the
background (the media limits bound how long that is) and the result is dropped.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

from .inputs.processor import PromptError

T = TypeVar("T")


class PromptWorkers:
    """Run prompt processing on `num_workers` threads, each prompt within `timeout_s` seconds.

    The budget counts from when a worker starts on the prompt, not while it waits for a free
    worker, so a burst of prompts does not fail for the queue's sake.
    """

    def __init__(self, num_workers: int = 4, timeout_s: float = 30.0):
        self.check(num_workers, timeout_s)
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self._pool = ThreadPoolExecutor(num_workers, thread_name_prefix="omni-prompt")

    @staticmethod
    def check(num_workers, timeout_s) -> None:
        """ValueError naming a bad worker count or budget."""
        if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 1:
            raise ValueError(f"prompt_workers must be a positive integer, got {num_workers!r}")
        if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or not 0 < timeout_s < float("inf"):
            raise ValueError(f"prompt_timeout_s must be a positive number of seconds, got {timeout_s!r}")

    async def run(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) on a worker thread; PromptError if it runs longer than the budget."""
        loop = asyncio.get_running_loop()
        started = asyncio.Event()

        def timed():
            loop.call_soon_threadsafe(started.set)
            return fn(*args)

        work = loop.run_in_executor(self._pool, timed)
        try:
            await started.wait()
        except asyncio.CancelledError:
            work.cancel()  # the caller left while the prompt waited for a worker: never start it
            raise
        t0 = time.monotonic()
        try:
            # shield: a timeout must not cancel `work`'s wrapper while the thread still runs it.
            return await asyncio.wait_for(asyncio.shield(work), self.timeout_s)
        except TimeoutError:
            raise PromptError(f"processing the prompt took longer than {self.timeout_s:g} s "
                              f"(prompt_timeout_s; stopped waiting after {time.monotonic() - t0:.1f} s)") from None
        finally:
            if not work.done():  # abandoned (over budget, or the caller left): its outcome goes nowhere
                work.add_done_callback(_drop_result)

    def shutdown(self) -> None:
        """Stop taking prompts; queued ones are cancelled, running ones finish in the background."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def _drop_result(work: asyncio.Future) -> None:
    # Read the abandoned work's exception so asyncio does not log it as never retrieved.
    if not work.cancelled():
        work.exception()
