"""OneShotEngine: the engine of a stage without KV cache (vocoders).

Whole requests are batched by the `OneShotScheduler` and each finishes in the step
that runs it. The model side is a `synthesize(requests) -> list[np.ndarray]`
callable (one waveform per request) that owns its jitted functions and buckets.
The same add_request / step / abort / has_unfinished interface as `AREngine`, so
the stage worker serves either. A step's requests may need several device calls
(more requests than the largest batch bucket); `CallPool` runs them side by side.
"""

from __future__ import annotations

import dataclasses
import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import numpy as np

from .ar_engine import RequestError
from .protocol import StageOutput
from .request import Request
from .runner import compilation_count
from .sampling import SamplingParams
from .scheduler import OneShotScheduler, SchedulerConfig


class CallPool:
    """Runs one step's independent device calls in parallel threads (JAX releases the GIL).

    On CPU, XLA runs the many small ops of a vocoder call (the DiT's above all) on one
    core, so calls in separate threads use the others: two Qwen2.5 DiT batches of 8
    took 0.38 s side by side against 0.76 s one after the other (2 cores).
    """

    def __init__(self, max_num_seqs: int, max_batch: int):
        self.workers = max(1, math.ceil(max_num_seqs / max_batch))
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="call") if self.workers > 1 else None

    def map(self, fn: Callable[[Any], Any], jobs: Sequence[Any]) -> list:
        if self._pool is None or len(jobs) < 2:
            return [fn(j) for j in jobs]
        return list(self._pool.map(fn, jobs))


@dataclasses.dataclass
class OneShotRequestData:
    """What a one-shot request carries besides its tokens."""

    voice: str | None = None
    noise: np.ndarray | None = None  # explicit initial noise (parity tests); else drawn from the seed


class OneShotEngine:
    """add_request -> step() runs whole batches through `synthesize` (see module docstring)."""

    def __init__(self, synthesize: Callable[[Sequence[Request]], list[np.ndarray]], *, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, vocab_size: int = 0,
                 validate: Callable[[Request], None] | None = None, warmup_fn: Callable[[], None] | None = None):
        self.synthesize = synthesize
        self.vocab_size = vocab_size
        self.validate = validate
        self._warmup_fn = warmup_fn
        self.scheduler = OneShotScheduler(SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            num_blocks=2, enable_prefix_caching=False))
        self._pending: list[StageOutput] = []
        self.stats = {"steps": 0, "step_time": 0.0, "requests": 0}

    def add_request(self, request_id: str, prompt_token_ids, sampling_params: SamplingParams | None = None, *,
                    voice: str | None = None, noise: np.ndarray | None = None, arrival_time: float | None = None,
                    **unused: Any) -> None:
        """Queue a request (codec tokens); RequestError says why one cannot be served."""
        ids = np.asarray(prompt_token_ids)
        if ids.size == 0:
            raise RequestError(f"request {request_id!r}: no codec tokens")
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise RequestError(f"request {request_id!r}: codec tokens must be a 1-D list of ints")
        if self.vocab_size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise RequestError(f"request {request_id!r}: codec token out of range [0, {self.vocab_size})")
        params = sampling_params or SamplingParams()
        if params.seed is None:
            params = params.with_seed()
        req = Request(request_id, ids, params, arrival_time=arrival_time,
                      data=OneShotRequestData(voice=voice, noise=noise))
        try:
            if self.validate is not None:
                self.validate(req)
            self.scheduler.add_request(req)
        except ValueError as e:
            raise RequestError(f"request {request_id!r}: {e}") from None

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort_request(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._pending)

    def step(self) -> list[StageOutput]:
        """Run the next batch of whole requests; one finished output (with audio) each."""
        out, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return out
        t0 = time.perf_counter()
        reqs = [s.request for s in sched.scheduled]
        try:
            waves = self.synthesize(reqs)
        except Exception as e:  # fail this batch, keep serving
            return out + self.scheduler.fail_scheduled(sched, f"{type(e).__name__}: {e}")
        by_id = {r.request_id: w for r, w in zip(reqs, waves)}
        for o in self.scheduler.update_from_output(sched):
            o.audio = np.asarray(by_id[o.request_id], np.float32)
            out.append(o)
        self.stats["steps"] += 1
        self.stats["requests"] += len(reqs)
        self.stats["step_time"] += time.perf_counter() - t0
        return out

    def warmup(self, progress: bool = True) -> float:
        t0 = time.perf_counter()
        if self._warmup_fn is not None:
            self._warmup_fn()
        return time.perf_counter() - t0

    @property
    def num_compilations(self) -> int:
        return compilation_count()
