"""OneShotEngine: the engine of a stage without KV cache (vocoders).

Whole requests are batched by the `OneShotScheduler` and each finishes in the step
that runs it. The model side is a synthesizer: `synthesizer(requests) -> list[np.ndarray]`
(one waveform per request) that owns its jitted functions and buckets.
The same add_request / step / abort / has_unfinished interface as `AREngine`, so
the stage worker serves either. A step's requests may need several device calls
(more requests than the largest batch bucket); `CallPool` runs them side by side.

Streaming ("async chunk"): a request added with `stream=True` gets its codec tokens
piece by piece (`extend_request`) while the stage before it still generates them. Its
state is a `CodecStream` here (the scheduler only sees whole requests). Once enough new
frames can be made audio (`initial_chunk_frames` for the first chunk, then doubling up to
`chunk_frames`: `next_chunk_frames`; a synthesizer whose audio waits for look-ahead says by
how many frames it trails, its `stream_delay_frames`) or the codes are complete, the next
step hands it to `synthesizer.stream` as a `ChunkJob`; the ready chunks of all streams go
in one call and each audio piece is returned at once as a `StageOutput` (the last one
finished). The synthesizer decides which samples are final; concatenated, a request's
pieces equal its whole-request waveform.
"""

from __future__ import annotations

import dataclasses
import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import ErrorCode, RequestError, error_code
from .protocol import FINISH_REASON_TO_STATUS, Request, RequestStatus, StageOutput
from .runner import compilation_count
from .sampling_params import SamplingParams
from .scheduler import OneShotScheduler, SchedulerConfig

# Codec frames per streamed chunk, and of the first (smaller, so the first audio comes early):
# vLLM-Omni's defaults, also those of the stage config.
CHUNK_FRAMES = 25
INITIAL_CHUNK_FRAMES = 10
# The per-request override of the first chunk (SamplingParams.extra_args).
INITIAL_CHUNK_ARG = "initial_codec_chunk_frames"


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


@dataclasses.dataclass
class ChunkJob:
    """One streamed chunk to decode: a synthesizer's `stream` returns the samples [emitted, n)."""

    request: Request      # .request_id, .sampling_params (seed set), .data: OneShotRequestData (voice, noise)
    codes: np.ndarray     # every codec token received so far for this request, 1-D int32, engine format
    emitted: int          # waveform samples already returned for this request
    final: bool           # no more codes will come: return everything that is left


def next_chunk_frames(done: int, initial: int, steady: int) -> int:
    """Frames of audio the next chunk waits for, when `done` frames are audio already.

    The first chunk is `initial`; then each chunk is as long as the audio made so far,
    within [initial, steady]. A small first chunk alone would starve playback: the second,
    a whole steady chunk, takes longer to make than the first takes to play (sglang-omni
    measured such underruns). Doubling keeps every chunk shorter to make than what is
    already queued to play, as long as the stages run faster than real time.
    """
    return initial if done == 0 else min(steady, max(initial, done))


def chunk_sizes(initial: int, steady: int) -> list[int]:
    """Every chunk size `next_chunk_frames` gives a stream that keeps up (chunks can be
    longer when codes pile up): for compiling a call per size."""
    sizes, done = {next_chunk_frames(0, initial, steady)}, 0
    while steady not in sizes:
        done += next_chunk_frames(done, initial, steady)
        sizes.add(next_chunk_frames(done, initial, steady))
    return sorted(sizes)


class CodecStream:
    """A streaming request inside the engine: its codes so far and how far its audio got."""

    def __init__(self, request: Request, initial_chunk_frames: int):
        self.request = request
        self.initial_chunk_frames = initial_chunk_frames
        self._buf = np.empty(max(64, 2 * request.num_prompt_tokens), np.int32)
        self.num_tokens = 0
        self.emitted = 0             # samples returned so far
        self.decoded_frames = 0      # frames the last chunk was decoded from (0: none yet)
        self.complete = False        # no more codes will come
        self.append(request.prompt_token_ids)

    @property
    def codes(self) -> np.ndarray:
        return self._buf[:self.num_tokens]

    def append(self, ids: np.ndarray) -> None:
        """Add codes; the buffer doubles when full, so a long stream costs O(n) copies in all."""
        end = self.num_tokens + len(ids)
        if end > len(self._buf):
            grown = np.empty(max(end, 2 * len(self._buf)), np.int32)
            grown[:self.num_tokens] = self.codes
            self._buf = grown
        self._buf[self.num_tokens:end] = ids
        self.num_tokens = end
        # The request's prompt is what has arrived, so `validate` sees every code so far.
        self.request.prompt_token_ids = self.codes

    def is_ready(self, tokens_per_frame: int, chunk_frames: int, delay_frames: int = 0) -> bool:
        """Whether a chunk is due: enough new frames of audio can be made, or the end (the last
        piece, maybe empty). The audio of a synthesizer that waits for look-ahead trails the
        frames received by `delay_frames`: chunks count the frames it can turn into audio."""
        if self.complete:
            return True
        done = max(self.decoded_frames - delay_frames, 0)
        return self.num_tokens // tokens_per_frame - delay_frames - done >= next_chunk_frames(
            done, self.initial_chunk_frames, chunk_frames)

    def job(self, tokens_per_frame: int, delay_frames: int = 0) -> ChunkJob:
        """The chunk to decode now. A first chunk takes only the codes its audio needs even when
        more have piled up (the stage was busy): its window is the smallest, so the first audio
        comes as early as it can; the codes past it go in the next chunk."""
        codes = self.codes
        if self.decoded_frames == 0 and not self.complete:
            codes = codes[:(self.initial_chunk_frames + delay_frames) * tokens_per_frame]
        return ChunkJob(self.request, codes, self.emitted, self.complete)


class OneShotEngine:
    """add_request -> step() runs whole batches through `synthesize` and streamed chunks
    through `synthesize.stream` (see module docstring)."""

    def __init__(self, synthesize: Callable[[Sequence[Request]], list[np.ndarray]], *, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, vocab_size: int = 0,
                 validate: Callable[[Request], None] | None = None, warmup_fn: Callable[[], None] | None = None,
                 chunk_frames: int = CHUNK_FRAMES, initial_chunk_frames: int = INITIAL_CHUNK_FRAMES):
        for name, v in (("chunk_frames", chunk_frames), ("initial_chunk_frames", initial_chunk_frames)):
            if not _is_positive_int(v):
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        self.synthesize = synthesize
        self.vocab_size = vocab_size
        self.validate = validate
        self._warmup_fn = warmup_fn
        self.chunk_frames, self.initial_chunk_frames = chunk_frames, initial_chunk_frames
        self.tokens_per_frame = int(getattr(synthesize, "tokens_per_frame", 1))
        self.delay_frames = int(getattr(synthesize, "stream_delay_frames", 0))
        self.scheduler = OneShotScheduler(SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            num_blocks=2, enable_prefix_caching=False))
        self.streams: dict[str, CodecStream] = {}  # in decode order: a decoded stream moves to the back
        self._pending: list[StageOutput] = []
        self._counters = {"steps": 0, "step_time": 0.0, "requests": 0, "chunks": 0}

    @property
    def stats(self) -> dict[str, float]:
        """Counters plus the streams now waiting for codes (for health replies)."""
        waiting = sum(not s.is_ready(self.tokens_per_frame, self.chunk_frames, self.delay_frames) for s in self.streams.values())
        return self._counters | {"num_streams": len(self.streams), "num_streams_waiting_for_codes": waiting}

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_token_ids, sampling_params: SamplingParams | None = None, *,
                    voice: str | None = None, noise: np.ndarray | None = None, arrival_time: float | None = None,
                    stream: bool = False, **unused: Any) -> None:
        """Queue a request (codec tokens); RequestError says why one cannot be served.

        `stream=True`: more codes follow through `extend_request` (there may be none yet);
        what is there is validated now, the rest as it arrives.
        """
        ids = self._codec_tokens(request_id, prompt_token_ids)
        if ids.size == 0 and not stream:
            raise RequestError(f"request {request_id!r}: no codec tokens")
        params = (sampling_params or SamplingParams()).with_seed()
        first_chunk = self._initial_chunk_frames(request_id, params)
        if stream and not callable(getattr(self.synthesize, "stream", None)):
            raise RequestError(f"request {request_id!r}: this stage's vocoder cannot stream")
        if request_id in self.streams or self.scheduler.get_request(request_id) is not None:
            raise RequestError(f"request {request_id!r}: request id is already in use")
        req = Request(request_id, ids, params, arrival_time=arrival_time,
                      data=OneShotRequestData(voice=voice, noise=noise))
        try:
            if self.validate is not None:
                self.validate(req)
            if not stream:
                self.scheduler.add_request(req)
        except ValueError as e:
            raise RequestError.of(request_id, e) from None
        if stream:
            req.status = RequestStatus.RUNNING
            self.streams[request_id] = CodecStream(req, first_chunk)

    def extend_request(self, request_id: str, token_ids, complete: bool) -> bool:
        """Append codes to a streaming request; `complete`: no more will come.

        False (and nothing done) for an unknown, finished or already complete request: an
        abort may race with late data. Bad codes fail that request (an error output).
        `validate` sees the request with every code so far (a vectorised check, cheap
        next to a chunk's decode).
        """
        s = self.streams.get(request_id)
        if s is None or s.complete:
            return False
        try:
            ids = self._codec_tokens(request_id, token_ids)
            if ids.size % self.tokens_per_frame:
                raise RequestError(f"request {request_id!r}: {ids.size} codec tokens are not whole frames "
                                   f"of {self.tokens_per_frame}")
            s.append(ids)
            if self.validate is not None:
                self.validate(s.request)
        except ValueError as e:
            refused = RequestError.of(request_id, e)
            self._pending.append(self._end_stream(s, "error", str(refused), error_code(refused)))
            return True
        s.complete = complete
        if complete and s.num_tokens == 0:
            self._pending.append(self._end_stream(
                s, "error", f"request {request_id!r}: the talker produced no codec frames before its end token",
                "invalid_request"))  # as a talker max_tokens too small for one frame would
        return True

    def abort(self, request_id: str) -> bool:
        s = self.streams.get(request_id)
        if s is not None:
            self._end_stream(s, "abort")
            return True
        return self.scheduler.abort_request(request_id)

    def has_unfinished(self) -> bool:
        """Whether `step()` has work now: whole requests, outputs to return, or a chunk that is due.

        A stream that only waits for more codes does not count: the stage loop sleeps in
        poll until its data arrives instead of stepping in a busy loop.
        """
        return (self.scheduler.has_unfinished_requests() or bool(self._pending)
                or any(s.is_ready(self.tokens_per_frame, self.chunk_frames, self.delay_frames) for s in self.streams.values()))

    # ------------------------------------------------------------------ step
    def step(self) -> list[StageOutput]:
        """The due chunks of streaming requests in one `stream` call, then the next batch of whole requests."""
        out, self._pending = self._pending, []
        t0 = time.perf_counter()
        streams, sched = self._schedule_chunks(), self.scheduler.schedule()
        if not streams and sched.is_empty:
            return out
        out += self._run_chunks(streams) + self._run_whole(sched)
        self._counters["steps"] += 1
        self._counters["step_time"] += time.perf_counter() - t0
        return out

    def _schedule_chunks(self) -> list[CodecStream]:
        """The streams with a chunk due, oldest-served first, at most max_num_seqs."""
        ready = [s for s in self.streams.values() if s.is_ready(self.tokens_per_frame, self.chunk_frames, self.delay_frames)]
        return ready[:self.scheduler.max_num_seqs]

    def _run_chunks(self, streams: list[CodecStream]) -> list[StageOutput]:
        if not streams:
            return []
        jobs = [s.job(self.tokens_per_frame, self.delay_frames) for s in streams]
        try:
            pieces = self.synthesize.stream(jobs)
            if len(pieces) != len(jobs):
                raise RuntimeError(f"stream returned {len(pieces)} pieces for {len(jobs)} chunks")
        except Exception as e:  # fail this step's streams, keep serving
            return [self._end_stream(s, "error", f"{type(e).__name__}: {e}") for s in streams]
        self._counters["chunks"] += len(jobs)
        out = []
        for s, job, piece in zip(streams, jobs, pieces):
            o = self._chunk_done(s, job, np.asarray(piece, np.float32))
            if o is not None:
                out.append(o)
        return out

    def _chunk_done(self, s: CodecStream, job: ChunkJob, piece: np.ndarray) -> StageOutput | None:
        """Account one decoded piece; its output (None for an empty piece of an unfinished stream)."""
        s.emitted += len(piece)
        s.decoded_frames = len(job.codes) // self.tokens_per_frame
        if job.final:
            return self._end_stream(s, "stop", audio=piece)
        # Round robin: with more streams due than max_num_seqs, the others go first next step.
        self.streams[s.request.request_id] = self.streams.pop(s.request.request_id)
        return StageOutput(request_id=s.request.request_id, audio=piece) if len(piece) else None

    def _end_stream(self, s: CodecStream, reason: str, error: str | None = None, code: ErrorCode = "internal",
                    audio: np.ndarray | None = None) -> StageOutput:
        """Finish a stream, free its state (here and in the synthesizer), and say so (with the
        error and its code if it failed)."""
        rid = s.request.request_id
        self.streams.pop(rid, None)
        release = getattr(self.synthesize, "release", None)
        if release is not None:
            release(rid)
        s.request.status = FINISH_REASON_TO_STATUS[reason]
        s.request.error = error
        return StageOutput(request_id=rid, finished=True, finish_reason=reason, error=error,
                           error_code=code if error is not None else None, audio=audio)

    def _run_whole(self, sched) -> list[StageOutput]:
        if sched.is_empty:
            return []
        reqs = [s.request for s in sched.scheduled]
        try:
            waves = self.synthesize(reqs)
        except Exception as e:  # fail this batch, keep serving
            return self.scheduler.fail_scheduled(sched, f"{type(e).__name__}: {e}")
        by_id = {r.request_id: w for r, w in zip(reqs, waves)}
        out = []
        for o in self.scheduler.update_from_output(sched):
            o.audio = np.asarray(by_id[o.request_id], np.float32)
            out.append(o)
        self._counters["requests"] += len(reqs)
        return out

    # ------------------------------------------------------------------ checks
    def _codec_tokens(self, request_id: str, token_ids) -> np.ndarray:
        """1-D int32 codec tokens, in range when the vocabulary is known; RequestError otherwise."""
        ids = np.asarray(token_ids)
        if ids.size == 0:
            return np.zeros(0, np.int32)  # an empty list is float64 to numpy
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise RequestError(f"request {request_id!r}: codec tokens must be a 1-D list of ints")
        if self.vocab_size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise RequestError(f"request {request_id!r}: codec token out of range [0, {self.vocab_size})")
        return ids.astype(np.int32, copy=False)

    def _initial_chunk_frames(self, request_id: str, params: SamplingParams) -> int:
        """The request's first chunk: extra_args["initial_codec_chunk_frames"] or the stage's."""
        value = (params.extra_args or {}).get(INITIAL_CHUNK_ARG, self.initial_chunk_frames)
        if not _is_positive_int(value):
            raise RequestError(f"request {request_id!r}: extra_args[{INITIAL_CHUNK_ARG!r}] must be a positive "
                               f"int (codec frames), got {value!r}")
        return int(value)

    # ------------------------------------------------------------------ warm-up
    def warmup(self, progress: bool = True) -> float:
        t0 = time.perf_counter()
        if self._warmup_fn is not None:
            self._warmup_fn()
        return time.perf_counter() - t0

    @property
    def num_compilations(self) -> int:
        return compilation_count()


def _is_positive_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v > 0
