"""AREngine: the in-process engine of one autoregressive stage.

`add_request` -> `step()` (schedule, run, sample, update) -> `StageOutput`s, with
`abort` at any moment. The stage worker process wraps exactly this object; tests
drive it directly.

A request that cannot be served (empty or too long prompt, token id out of the
vocabulary, bad sampling parameters, unreadable media) is rejected by `add_request`
with a `RequestError` naming the problem (a `TooLongError` for a prompt or media longer
than the stage takes); nothing is queued and other requests are
unaffected. A failure inside a step fails the requests of that step with the error
text and the engine keeps serving.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from concurrent.futures import FIRST_COMPLETED, wait
from typing import Any, Callable

import jax
import numpy as np

from ..errors import RequestError
from .hidden_cache import HiddenRowCache
from .incremental_detokenizer import IncrementalDetokenizer
from .jitted import Jitted, compile_ahead
from .protocol import Request, StageInputs, StageOutput
from .runner import ModelRunner, RunnerConfig, compilation_count
from .sampling import sample, shape_logits
from .sampling_metadata import PAD_TOKEN_ID, SamplingFlags, SamplingMetadataBuilder, logit_bias_arrays
from .sampling_params import MAX_LOGPROBS, SamplingParams
from .scheduler import ARScheduler, SchedulerConfig
from .structured_output import Grammars, allow_all


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Scheduler + runner settings of one AR stage."""

    runner: RunnerConfig
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    eos_token_ids: tuple[int, ...] = ()
    vocab_size: int = 0
    banned_width: int = 64  # suppress + eos/stop ids per request covered by the compiled sampler
    # Schedule and launch the next decode step before this one's tokens reach the host, so
    # that the host work of a step runs while the device computes the next (see AREngine.step).
    async_scheduling: bool = True
    # Host memory for the hidden rows of cached KV blocks, so that requests returning hidden
    # states (a speech reply's thinker) take prefix-cache hits (engine/hidden_cache.py); 0: off.
    hidden_cache_bytes: int = 1 << 30


# Every batch runs one of four sampler variants, so warm-up can compile them all:
# greedy; temperature / min-p sampling (no vocabulary sort); and the full path
# (penalties, top-k / top-p) with and without logprobs. Rows with neutral settings
# pass any richer variant unchanged, so a batch may always take a richer one.
_GREEDY = SamplingFlags(all_greedy=True)
_RANDOM = SamplingFlags(all_greedy=False, any_min_p=True)
_FULL = SamplingFlags(all_greedy=False, any_penalties=True, any_top_k_top_p=True, any_min_p=True)
_FULL_LOGPROBS = _FULL._replace(top_logprobs=MAX_LOGPROBS)
_VARIANTS = (_GREEDY, _RANDOM, _FULL, _FULL_LOGPROBS)


def _canonical(flags: SamplingFlags) -> SamplingFlags:
    if flags.need_logprobs:
        return _FULL_LOGPROBS
    if flags.any_penalties or flags.any_top_k_top_p:
        return _FULL
    if flags.all_greedy:
        return _GREEDY
    return _RANDOM


class _StreamedRows:
    """The growing extra-embedding rows of a streamed request (amortised appends)."""

    def __init__(self, first: np.ndarray | None, proj: int):
        self.proj = proj  # projection of incoming rows (StageInputs.extra_proj), -1: none
        self._buf = np.zeros((0, 0), np.float32) if first is None else np.array(first, np.float32)
        self._n = len(self._buf)

    def extend(self, rows: np.ndarray) -> np.ndarray:
        """Append `rows`; the rows so far (a view)."""
        if not len(rows):  # e.g. the last message, rows all sent: its empty array is unprojected
            return self._buf[:self._n]
        end = self._n + len(rows)
        if end > len(self._buf) or self._buf.shape[1] != rows.shape[1]:
            grown = np.zeros((max(16, 2 * end), rows.shape[1]), np.float32)
            grown[:self._n] = self._buf[:self._n]
            self._buf = grown
        self._buf[self._n:end] = rows
        self._n = end
        return self._buf[:end]


def _needs_token_on_host(req: Request) -> bool:
    """Whether a request's next step needs its last sampled token on the host for its inputs:
    embedding inputs are packed there (an after-sample stage gives every request its feedback
    embeddings, so its steps never go ahead)."""
    d = req.data
    return d is not None and (d.is_rich or d.capture_hidden)


def _samples_from_host(req: Request) -> bool:
    """Whether a request's next sampling needs its last token on the host: penalty histories
    are built there, and structured outputs' masks computed there. Its next step's model call
    may still go ahead; the sampler waits for the token (AREngine._launch_deferred)."""
    return req.sampling_params.uses_penalties or _constrained(req)


def _constrained(req: Request) -> bool:
    """Whether a request's tokens may be masked: structured outputs, or a thinking budget until
    its thinking is over (then never again)."""
    return req.grammar is not None and req.grammar.constrains


def _prompt_embeds_salt(inputs: StageInputs | None, rich: bool) -> str | None:
    """The prefix-cache salt of a prompt-embeddings request (a digest of its embeddings, computed
    here so that it always matches them), None for any other request. Other embedding inputs
    (per-step rows, feedback) keep a request out of the prefix cache."""
    if not rich or not inputs.only_prompt_overlay:
        return None
    return inputs.content_hash()


def _sampler_inputs(reqs: list[Request]) -> tuple[list, list, list]:
    """The requests' sampling params, output and prompt id lists (the sampler builder's inputs)."""
    return [r.sampling_params for r in reqs], [r.output_token_ids for r in reqs], [r.prompt_token_ids for r in reqs]


class _Batch:
    """A step's requests in order and what they need, kept by the engine while the same requests
    come in the same order (the steady state of decoding), so that it is not worked out again
    request by request every step."""

    def __init__(self, requests: list[Request]):
        self.requests = requests
        self.token_on_host = any(map(_needs_token_on_host, requests))  # a sampled token needed for the inputs
        self.samples_from_host = any(map(_samples_from_host, requests))  # ... or for the sampler
        self.capture_hidden = any(r.data is not None and r.data.capture_hidden for r in requests)
        self.prompt_logprobs = any(r.num_prompt_logprobs is not None for r in requests)
        self.grammars = any(map(_constrained, requests))  # structured outputs, thinking budgets
        self.biased = any(r.sampling_params.logit_bias for r in requests)
        self.shaped = self.grammars or self.biased  # sampling.shape_logits runs before the sampler
        self._sampler_inputs = None

    def same(self, chunks) -> bool:
        """Whether `chunks` are a step of these requests, in this order."""
        reqs = self.requests
        return len(reqs) == len(chunks) and all(c.request is r for c, r in zip(chunks, reqs))

    @property
    def stale(self) -> bool:
        """Whether what the requests need changed: the last thinking budget among them is over."""
        return self.grammars and not any(map(_constrained, self.requests))

    @property
    def sampler_inputs(self) -> tuple[list, list, list]:
        """`_sampler_inputs` of these requests, made once."""
        if self._sampler_inputs is None:
            self._sampler_inputs = _sampler_inputs(self.requests)
        return self._sampler_inputs


@dataclasses.dataclass
class _Launched:
    """A step whose device work is launched and whose outputs are not applied yet."""

    sched: Any               # SchedulerOutput
    result: Any              # the runner's StepResult
    draw: Any                # (requests, device SampleResult) or None
    prompt_draw: Any         # (rows per request, device prompt LogprobsOutput) or None
    batch: _Batch            # its requests and what they need
    host_time: float         # seconds spent launching it
    replayed: dict = dataclasses.field(default_factory=dict)  # request id -> hidden rows of its prefix-cache hit
    deferred: bool = False   # its sampler waits for the tokens of the step before (_launch_deferred)


class AREngine:
    """One AR stage in this process: scheduler + runner + sampler (see module docstring)."""

    def __init__(self, model, cfg: EngineConfig, *, num_layers: int, num_kv_heads: int, head_dim: int,
                 hidden_size: int, tokenizer=None,
                 prepare_inputs: Callable[[np.ndarray, Any], tuple[StageInputs, list]] | None = None,
                 project_inputs: Callable[[StageInputs], StageInputs] | None = None):
        self.cfg = cfg
        self.runner = ModelRunner(model, cfg.runner, num_layers=num_layers, num_kv_heads=num_kv_heads,
                                  head_dim=head_dim, hidden_size=hidden_size)
        rc = self.runner.cfg
        self.vocab_size = cfg.vocab_size
        self.hidden_cache = None
        if rc.capture_layers and cfg.enable_prefix_caching and cfg.hidden_cache_bytes > 0:
            self.hidden_cache = HiddenRowCache(rc.block_size, rc.capture_layers, cfg.hidden_cache_bytes)
        self.scheduler = ARScheduler(SchedulerConfig(
            max_num_seqs=rc.max_num_seqs, max_num_batched_tokens=rc.max_num_batched_tokens,
            max_model_len=rc.max_model_len, block_size=rc.block_size, num_blocks=rc.num_blocks,
            enable_prefix_caching=cfg.enable_prefix_caching, enable_chunked_prefill=cfg.enable_chunked_prefill,
            eos_token_ids=tuple(cfg.eos_token_ids)), hidden_rows=self.hidden_cache)
        self.tokenizer = tokenizer
        self.prepare_inputs = prepare_inputs
        self.project_inputs = project_inputs
        history = 1 << max(6, (rc.max_model_len - 1).bit_length())
        self.sampling_builder = SamplingMetadataBuilder(banned_min_width=cfg.banned_width,
                                                        history_min_width=history)
        self._history_width = history
        self._empty_histories: dict[int, jax.Array] = {}
        self._unshaped: dict[tuple, Any] = {}  # (what, rows): shape_logits' no-op inputs on the device
        self.jitted = Jitted(sample=jax.jit(sample, static_argnames=("flags",)), shape=jax.jit(shape_logits))
        self.grammars = None  # structured outputs: a stage that detokenizes its replies can constrain them
        if tokenizer is not None and cfg.vocab_size:
            self.grammars = Grammars(tokenizer, cfg.vocab_size, cfg.eos_token_ids)
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._pending: list[StageOutput] = []
        self._streamed: dict[str, _StreamedRows] = {}  # requests whose extra rows are still coming
        self._building: dict[str, Any] = {}  # request id -> Future of its structured-output Grammar
        self._in_flight: _Launched | None = None  # launched, outputs not applied yet
        self._batch = _Batch([])  # the last step's requests
        self._last_tables: tuple[Any, np.ndarray] | None = None  # the last step's (SchedulerOutput, block tables)
        self.stats = {"steps": 0, "prefill_steps": 0, "decode_steps": 0, "ahead_steps": 0, "step_time": 0.0,
                      "preemptions": 0, "failed_steps": 0}

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_token_ids, sampling_params: SamplingParams | None = None,
                    *, inputs: StageInputs | None = None, multi_modal_data: Any = None,
                    arrival_time: float | None = None, stream: bool = False) -> None:
        """Queue a request, or raise RequestError saying why it cannot be served.

        stream: its `extra_embeds` are the first of more rows (async chunk): output token k
        waits until row k arrived through `extend_request` (or the rows are complete).
        """
        params = sampling_params or SamplingParams()
        ids = np.asarray(prompt_token_ids)
        if ids.size == 0:
            raise RequestError(f"request {request_id!r}: empty prompt")
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise RequestError(f"request {request_id!r}: prompt_token_ids must be a 1-D list of ints")
        if self.vocab_size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            bad = int(ids[(ids < 0) | (ids >= self.vocab_size)][0])
            raise RequestError(f"request {request_id!r}: token id {bad} is out of range [0, {self.vocab_size})")
        try:
            params.validate()
            if self.vocab_size:
                params.validate_for_vocab(self.vocab_size)
        except ValueError as e:
            raise RequestError.of(request_id, e) from None
        if params.stop and self.tokenizer is None:
            raise RequestError(f"request {request_id!r}: stop strings need a tokenizer, and this stage has none")
        if len(params.suppress_token_ids) + len(params.stop_token_ids) + len(self.cfg.eos_token_ids) > self.cfg.banned_width:
            raise RequestError(f"request {request_id!r}: more than {self.cfg.banned_width} suppressed/stop ids")
        if params.seed is None and not params.is_greedy:
            params = params.with_seed()
        grammar = None  # a Future of the request's structured_output.Grammar
        if params.structured_outputs is not None or params.thinking_token_budget is not None:
            if self.grammars is None:
                what = "structured outputs" if params.structured_outputs is not None else "a thinking budget"
                raise RequestError(f"request {request_id!r}: {what} needs a stage with a tokenizer")
            try:
                grammar = self.grammars.build(params, ids)
            except ValueError as e:
                raise RequestError(f"request {request_id!r}: structured_outputs: {e}") from None
        mm_hashes = []
        if multi_modal_data is not None:
            if self.prepare_inputs is None:
                raise RequestError(f"request {request_id!r}: this stage takes no multimodal data")
            # Before its media are encoded (long audio takes several encoder calls).
            self.scheduler.check_prompt_length(request_id, len(ids))
            capture = inputs is not None and inputs.capture_hidden
            try:
                inputs, mm_hashes = self.prepare_inputs(ids, multi_modal_data)
            except ValueError as e:
                raise RequestError.of(request_id, e) from None
            inputs.capture_hidden = capture  # a speech request's thinker feeds the talker
        if inputs is not None and inputs.overlay_rows is not None and self.runner.cfg.rich_inputs is False:
            raise RequestError(f"request {request_id!r}: this stage was not built for embedding inputs")
        if stream and (inputs is None or inputs.extra_embeds_pad is None):
            raise RequestError(f"request {request_id!r}: a streamed request needs extra_embeds_pad, the row "
                               f"used once its rows are used up")
        extra_proj = inputs.extra_proj if inputs is not None else -1
        if inputs is not None and inputs.needs_projection:
            if self.project_inputs is None:
                raise RequestError(f"request {request_id!r}: this stage has no input projection")
            try:
                inputs = self.project_inputs(inputs)
            except ValueError as e:
                raise RequestError.of(request_id, e) from None
        if inputs is not None:
            self._check_rows(request_id, inputs, len(ids))
        # Token ids alone do not determine the KV of embedding inputs. (Returning hidden states
        # does not change the KV: a hit replays the rows, see engine/hidden_cache.py.)
        if self.runner.cfg.after_sample:
            inputs = inputs if inputs is not None else StageInputs()
            # Each output token's input gets its after-sample embedding: the KV is not a
            # function of the token ids, so the request is never prefix-cached.
            inputs.feedback_embeds = np.zeros((16, self.runner.hidden_size), np.float32)
        rich = inputs is not None and (inputs.extra_embeds is not None or inputs.extra_embeds_pad is not None
                                       or (inputs.overlay_rows is not None and not mm_hashes)
                                       or inputs.feedback_embeds is not None)
        req = Request(request_id, ids, params, arrival_time=arrival_time, mm_hashes=mm_hashes,
                      has_prompt_embeds=rich, cache_salt=_prompt_embeds_salt(inputs, rich),
                      eos_token_ids=self.cfg.eos_token_ids, data=inputs,
                      captures_hidden=inputs is not None and inputs.capture_hidden)
        if grammar is not None:
            req.input_limit = 0  # no step until its grammar is built (_admit_grammars)
            self._building[request_id] = grammar
        if self.tokenizer is not None:
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop, params.include_stop_str_in_output)
        if stream:
            req.input_limit = len(ids) + (0 if inputs.extra_embeds is None else len(inputs.extra_embeds))
            self._streamed[request_id] = _StreamedRows(inputs.extra_embeds, extra_proj)
        try:
            self.scheduler.add_request(req)
        except ValueError as e:
            self._streamed.pop(request_id, None)
            self._building.pop(request_id, None)
            raise RequestError.of(request_id, e) from None
        if req.detokenizer is not None:  # kept past the request's release, for its last text
            self._detok[request_id] = req.detokenizer

    def _check_rows(self, request_id: str, inputs: StageInputs, num_prompt: int) -> None:
        """RequestError unless the embedding rows fit the model and the overlay index fits the
        prompt (a bad shape would fail the whole step it lands in, not just this request)."""
        h = self.runner.hidden_size
        rows, index = inputs.overlay_rows, inputs.overlay_index
        if rows is not None:
            if rows.ndim != 2 or rows.shape[1] != h:
                raise RequestError(f"request {request_id!r}: overlay rows must be [N, {h}], got {rows.shape}")
            if index is None or np.shape(index) != (num_prompt,) or np.max(index) >= len(rows):
                raise RequestError(f"request {request_id!r}: overlay_index must give each of the {num_prompt} "
                                   f"prompt tokens a row below {len(rows)} (or -1)")
        extra, pad = inputs.extra_embeds, inputs.extra_embeds_pad
        if extra is not None and (np.ndim(extra) != 2 or np.shape(extra)[1] != h):
            raise RequestError(f"request {request_id!r}: extra_embeds must be [N, {h}], got {np.shape(extra)}")
        if pad is not None and np.shape(pad) != (h,):
            raise RequestError(f"request {request_id!r}: extra_embeds_pad must be [{h}], got {np.shape(pad)}")

    def extend_request(self, request_id: str, rows: np.ndarray, complete: bool) -> bool:
        """Append extra-embedding rows to a streamed request (async chunk); `complete`: no more
        come (later tokens get extra_embeds_pad). False, changing nothing, for an unknown or
        finished request (an abort may cross late data)."""
        req, streamed = self.scheduler.get_request(request_id), self._streamed.get(request_id)
        if req is None or streamed is None:
            return False
        rows = np.asarray(rows, np.float32)
        if len(rows) and streamed.proj >= 0:
            # In the previous stage's space, as the first rows were: project them the same way.
            try:
                rows = self.project_inputs(StageInputs(extra_embeds=rows, extra_proj=streamed.proj)).extra_embeds
            except ValueError as e:
                raise RequestError.of(request_id, e) from None
        if len(rows):
            self._check_rows(request_id, StageInputs(extra_embeds=rows), req.num_prompt_tokens)
        req.data.extra_embeds = streamed.extend(rows)
        if complete:
            del self._streamed[request_id]
            req.input_limit = None
        else:
            req.input_limit = req.num_prompt_tokens + len(req.data.extra_embeds)
        return True

    def abort(self, request_id: str) -> bool:
        """Abort a request wherever it is; its blocks return to the pool."""
        self._detok.pop(request_id, None)
        self._streamed.pop(request_id, None)
        self._building.pop(request_id, None)
        if self.hidden_cache is not None:
            self.hidden_cache.release(request_id)
        return self.scheduler.abort_request(request_id)

    def has_unfinished(self) -> bool:
        """True while a step would make progress (requests waiting for input chunks do not count)."""
        return (self.scheduler.has_ready_requests() or bool(self._pending) or self._in_flight is not None
                or bool(self._building))

    # ------------------------------------------------------------------ the step
    def step(self) -> list[StageOutput]:
        """Run one scheduling step; returns outputs of the requests that made progress.

        With async scheduling a step launches the next decode step on the device before
        it applies its own tokens (stop checks, outputs): the host work then overlaps the
        device work, and each call returns the outputs of the step launched before it.
        """
        out, self._pending = self._pending, []
        if self._building:
            out += self._admit_grammars()
        if self._in_flight is None:
            sched = self.scheduler.schedule()
            if sched.is_empty:
                self.scheduler.update_from_output(sched, {})
                if self._building:  # only grammars being built: wait a little for one, not spin
                    wait(list(self._building.values()), timeout=0.01, return_when=FIRST_COMPLETED)
                return out
            launched = self._launch(sched)
            if isinstance(launched, list):  # the step failed
                return out + launched
            self._in_flight = launched
        current, self._in_flight = self._in_flight, None
        ahead = self._launch_ahead(current)
        if isinstance(ahead, list):
            out += ahead
        else:
            self._in_flight = ahead
        out += self._finish(current)
        if self._in_flight is not None and self._in_flight.deferred:
            out += self._launch_deferred()
        return out

    def _launch(self, sched, fed=None, output_offset: int = 0,
                defer: bool = False) -> "_Launched | list[StageOutput]":
        """Run a scheduled step's model calls and sampler on the device, without waiting.

        `fed`/`output_offset`: a step scheduled ahead takes its tokens from the previous
        step's sampled tokens on the device, and each of its requests has `output_offset`
        more output tokens than the host knows yet. `defer`: only the model calls; the
        sampler follows once the previous step's tokens are applied (`_launch_deferred`).
        A failure fails the step's requests.
        """
        t0 = time.perf_counter()
        chunks = sched.scheduled
        # A step fed in place has the batch of the step launched before it: this one's.
        if self._batch.stale or not (sched.fed_in_place or self._batch.same(chunks)):
            self._batch = _Batch([c.request for c in chunks])
        batch = self._batch
        try:
            tables = sched.block_table_array(self.runner.cfg.max_blocks_per_seq, like=self._last_tables)
            self._last_tables = (sched, tables)
            result = self.runner.execute(chunks, tables, want_hidden=batch.capture_hidden, fed=fed)
            draw = None if defer else self._launch_sampler(result, chunks, batch, output_offset)
            prompt_draw = self._launch_prompt_logprobs(result, chunks) if batch.prompt_logprobs else None
            replayed = self._replayed_rows(chunks) if batch.capture_hidden else {}
        except Exception as e:  # fail this step's requests, keep serving
            return self._fail(sched, e)
        return _Launched(sched, result, draw, prompt_draw, batch, time.perf_counter() - t0, replayed, defer)

    def _launch_deferred(self) -> list[StageOutput]:
        """Launch the sampler of the step launched ahead now that the tokens before it are
        applied (penalty histories and grammars are up to date: the host knows every output
        token, as if the step had not gone ahead)."""
        launched = self._in_flight
        t0 = time.perf_counter()
        try:
            launched.draw = self._launch_sampler(launched.result, launched.sched.scheduled, launched.batch)
        except Exception as e:  # fail this step's requests, keep serving
            self._in_flight = None
            return self._fail(launched.sched, e)
        launched.deferred = False
        launched.host_time += time.perf_counter() - t0
        return []

    def _replayed_rows(self, chunks) -> dict[str, dict[int, np.ndarray]]:
        """The kept hidden rows of the prefix-cache hits of the step's just admitted requests that
        return hidden states (taken now: recording later steps' rows may drop them)."""
        replayed = {}
        for c in chunks:
            r = c.request
            if r.captures_hidden and (c.is_new or c.is_resumed) and c.start > 0:
                replayed[r.request_id] = self.hidden_cache.replay(r.block_hashes[:c.start // self.runner.cfg.block_size])
        return replayed

    def _launch_ahead(self, current: "_Launched") -> "_Launched | list[StageOutput] | None":
        """Launch the decode step after `current`, fed by its tokens on the device, if the
        step allows (see ARScheduler.schedule_ahead); None if not."""
        if not self.cfg.async_scheduling:
            return None
        result, draw = current.result, current.draw
        # Only plain decodes: whatever needs the sampled token on the host for the next step's
        # inputs (embedding inputs such as after-sample feedback, hidden states) waits; what needs
        # it for the next sampling (penalty histories, grammars) goes ahead without its sampler.
        if result.kind != "decode" or draw is None or not result.rows_in_order or current.batch.token_on_host:
            return None
        nxt = self.scheduler.schedule_ahead(current.sched)
        if nxt is None:
            return None
        # Its sampler and prompt logprobs are launched (this needs `draw`), and a stage that reads
        # its sampled rows' hidden states (after_sample) never goes ahead: its outputs are free.
        self.runner.release(result)
        launched = self._launch(nxt, fed=draw[1].token_ids, output_offset=1,
                                defer=current.batch.samples_from_host)
        if not isinstance(launched, list):
            self.stats["ahead_steps"] += 1
        return launched

    def _fail(self, sched, error: Exception) -> list[StageOutput]:
        self.stats["failed_steps"] += 1
        out = []
        for o in self.scheduler.fail_scheduled(sched, f"{type(error).__name__}: {error}"):
            out.append(o)
            self._detok.pop(o.request_id, None)
            self._streamed.pop(o.request_id, None)
            if self.hidden_cache is not None:
                self.hidden_cache.release(o.request_id)
        return out

    def _finish(self, launched: "_Launched") -> list[StageOutput]:
        """Wait for a launched step's tokens and apply them: finish checks, outputs."""
        t0 = time.perf_counter()
        sched, result = launched.sched, launched.result
        chunks = sched.scheduled
        try:
            sampled, logprobs, codes = self._collect(result, launched.draw)
            embeds = self._sampled_embeddings(launched.draw)
            self._collect_prompt(launched.prompt_draw)
        except Exception as e:
            return self._fail(sched, e)
        self.runner.release(result)
        step_outputs = self.scheduler.update_from_output(sched, sampled)
        if launched.batch.grammars:
            self._advance_grammars(step_outputs)
        self.stats["steps"] += 1
        self.stats["preemptions"] += len(sched.preempted_request_ids)
        self.stats[f"{result.kind}_steps"] += 1
        self.stats["step_time"] += launched.host_time + time.perf_counter() - t0

        hidden_of = {}  # request id -> (first position, {layer: [tokens of this step, H]})
        if result.hidden:
            for j, ci in enumerate(result.chunk_indices):
                c = chunks[ci]
                if c.request.data is not None and c.request.data.capture_hidden:
                    a, b = result.token_offsets[j], result.token_offsets[j + 1]
                    hidden_of[c.request_id] = (c.start, {k: v[a:b] for k, v in result.hidden.items()})
        wants_prompt_lp = {}
        if launched.batch.prompt_logprobs:
            wants_prompt_lp = {c.request_id: c.request for c in chunks if c.request.num_prompt_logprobs is not None}
        if not (hidden_of or wants_prompt_lp or logprobs or codes or self._detok or self._streamed):
            return step_outputs  # plain tokens: nothing to add (the steady state of a text stage)
        # A request going on sends its new token's layer-0 row now, one step before the token is
        # fed back (the same values again then): a stage reading embeddings need not wait for it.
        for o in step_outputs:
            if o.request_id in embeds and o.request_id in hidden_of and o.new_token_ids and not o.finished:
                hidden = hidden_of[o.request_id][1]
                hidden[0] = np.concatenate([hidden[0], embeds[o.request_id][None]])
        if self.hidden_cache is not None:
            self._keep_hidden_rows(hidden_of, launched.replayed, chunks)
        out = []
        for o in step_outputs:
            # Prompt logprobs go out whole with a request's first token (as vLLM's first output).
            r = wants_prompt_lp.get(o.request_id)
            if r is not None and o.new_token_ids and r.num_output_tokens == len(o.new_token_ids):
                o.prompt_logprobs = r.prompt_logprobs
            if o.request_id in hidden_of:
                o.hidden_offset, o.hidden_states = hidden_of[o.request_id]
            if o.request_id in logprobs:
                o.logprobs = [logprobs[o.request_id]] if o.new_token_ids else None
            if o.request_id in codes and o.new_token_ids:
                o.codes = codes[o.request_id][None]
            self._detokenize(o)
            if o.finished:
                self._streamed.pop(o.request_id, None)
            out.append(o)
        # A prefill chunk that ends mid-prompt samples nothing but still has hidden states.
        emitted = {o.request_id for o in step_outputs}
        for rid, (offset, hidden) in hidden_of.items():
            if rid not in emitted:
                out.append(StageOutput(request_id=rid, hidden_states=hidden, hidden_offset=offset))
        return out

    def _admit_grammars(self) -> list[StageOutput]:
        """Let the requests whose grammars are built be scheduled; fail those whose grammars do not
        compile (a reason only the tokenizer shows), alone."""
        out = []
        for rid, built in list(self._building.items()):
            if not built.done():
                continue
            del self._building[rid]
            req = self.scheduler.get_request(rid)
            if req is None:
                continue
            try:
                req.grammar, req.input_limit = built.result(), None
            except ValueError as e:
                error = f"request {rid!r}: structured_outputs: {e}"
                self.scheduler.finish_request(rid, reason="error", error=error)
                self._detok.pop(rid, None)
                out.append(StageOutput(request_id=rid, finished=True, finish_reason="error", error=error,
                                       error_code="invalid_request"))
        return out

    def _advance_grammars(self, step_outputs: list[StageOutput]) -> None:
        """Move each going-on request's grammar over its new tokens; a request whose tokens do
        not fit (a grammar past llguidance's limits, or one that spells an added token) fails alone."""
        for o in step_outputs:
            r = None if o.finished or not o.new_token_ids else self.scheduler.get_request(o.request_id)
            if r is None or r.grammar is None:
                continue
            refused = r.grammar.accept(o.new_token_ids)
            if refused is None:
                continue
            error, code = refused
            if self.scheduler.finish_request(o.request_id, reason="error", error=error):
                o.finished, o.finish_reason, o.error, o.error_code = True, "error", error, code
                self._detok.pop(o.request_id, None)

    def _keep_hidden_rows(self, hidden_of: dict, replayed: dict, chunks) -> None:
        """Record the step's hidden rows of prefix-cached requests in the hidden cache, and put a
        hit's kept rows before its first computed ones (`hidden_of` is changed in place)."""
        requests = {c.request_id: c.request for c in chunks}
        for rid, (offset, hidden) in hidden_of.items():
            r = requests[rid]
            if r.use_prefix_cache:
                self.hidden_cache.record(r, offset, hidden)
                if r.is_finished:  # this step ended it, or an abort came while it ran
                    self.hidden_cache.release(rid)
            if rid in replayed:
                kept = replayed[rid]
                hidden_of[rid] = (0, {k: np.concatenate([kept[k], v]) for k, v in hidden.items()})

    def _launch_sampler(self, result, chunks, batch: _Batch, output_offset: int = 0):
        """Launch the sampler on the step's logits rows: (requests, device result), or None."""
        rows = result.sample_rows
        if not rows:
            return None
        if result.rows_in_order:  # each in its own row, in order
            reqs, (params, outputs, prompts) = batch.requests, batch.sampler_inputs
        else:
            reqs = [chunks[i].request for i in rows]
            params, outputs, prompts = _sampler_inputs(reqs)
        bucket = result.logits.shape[0]
        md, flags = self.sampling_builder.build(
            params, outputs, prompts, bucket, result.logits.shape[1], eos_token_ids=self.cfg.eos_token_ids,
            output_offset=output_offset)
        flags = _canonical(flags)
        if flags.any_penalties and md.history_ids is None:
            md = md.replace(history_ids=self._empty_history(bucket))
        logits = result.logits
        if batch.shaped:
            logits = self.jitted.shape(logits, *self._shaping(batch, reqs, params, bucket, logits.shape[1]))
        return reqs, self.jitted.sample(logits, md, flags=flags)

    def _shaping(self, batch: _Batch | None, reqs, params, rows: int, vocab: int) -> tuple:
        """`shape_logits`' inputs where the stage runs: the rows' logit biases and allowed tokens
        (what no row of the batch sets: kept on the device, not sent every step; batch None: none)."""
        if batch is not None and batch.biased:
            bias = self.runner.on_stage(logit_bias_arrays(params, rows))
        else:
            bias = self._unshaped_input("bias", rows, lambda: logit_bias_arrays([], rows))
        if batch is not None and batch.grammars:
            bits = self.runner.on_stage(self.grammars.bitmask([r.grammar for r in reqs], rows))
        else:
            bits = self._unshaped_input("bits", rows, lambda: allow_all(rows, vocab))
        return (*bias, bits)

    def _unshaped_input(self, what: str, rows: int, make):
        key = (what, rows)
        if key not in self._unshaped:
            self._unshaped[key] = self.runner.on_stage(jax.device_put(make()))
        return self._unshaped[key]

    def _launch_prompt_logprobs(self, result, chunks):
        """Launch the prompt logprobs of the step's chunks that ask for them and still have
        prompt positions to score: ({request id: (request, positions, rows)}, device result) or None.

        Row q of a chunk scores prompt token q + 1; positions already scored (a preempted
        request computes its prompt again) are skipped. The prompt's last row predicts the
        first output token, which `logprobs` covers."""
        jobs, targets = [], []
        for j, ci in enumerate(result.chunk_indices):
            c = chunks[ci]
            r = c.request
            if r.num_prompt_logprobs is None:
                continue
            first = max(c.start, len(r.prompt_logprobs))
            q = np.arange(first, min(c.start + c.num_tokens, r.num_prompt_tokens - 1))
            if q.size:
                jobs.append((r, q, result.token_offsets[j] + q - c.start))
                targets.append(r.all_token_ids[q + 1])
        if not jobs:
            return None
        padded = np.zeros(result.final_hidden.shape[0], np.int32)
        rows = np.concatenate([rows for _, _, rows in jobs])
        padded[rows] = np.concatenate(targets)
        return jobs, self.runner.prompt_logprobs(result.final_hidden, padded)

    @staticmethod
    def _collect_prompt(draw) -> None:
        """Append the step's prompt logprobs to their requests, in prompt order."""
        if draw is None:
            return
        jobs, res = draw
        host = jax.tree.map(np.asarray, res)
        for r, qs, rows in jobs:
            n = r.num_prompt_logprobs
            for q, row in zip(qs.tolist(), rows.tolist()):
                if q != len(r.prompt_logprobs):
                    continue
                r.prompt_logprobs.append({
                    "token_id": int(r.all_token_ids[q + 1]), "logprob": float(host.sampled_logprob[row]),
                    "rank": int(host.sampled_rank[row]),
                    "top": list(zip(host.top_token_ids[row, :n].tolist(), host.top_logprobs[row, :n].tolist()))})

    def _collect(self, result, draw):
        """The step's sampled tokens on the host (as update_from_output takes them: an array in
        the order of the scheduled requests when each has a row in turn, else by request id),
        {request_id: logprobs}, {request_id: after-sample codes}."""
        if draw is None:
            return {}, {}, {}
        reqs, res = draw
        tokens = np.asarray(res.token_ids)
        if result.rows_in_order:  # a row per scheduled request, in order
            sampled = tokens[:len(reqs)]
        else:
            sampled = dict(zip([r.request_id for r in reqs], tokens[:len(reqs)].tolist()))
        codes = self._after_sample(result, res.token_ids, reqs) if self.runner.cfg.after_sample else {}
        lp = {}
        if res.logprobs is not None:
            host = jax.tree.map(np.asarray, res.logprobs)
            for j, r in enumerate(reqs):
                n = r.sampling_params.logprobs
                if n is None:
                    continue
                lp[r.request_id] = {
                    "token_id": int(tokens[j]), "logprob": float(host.sampled_logprob[j]),
                    "rank": int(host.sampled_rank[j]),
                    "top": list(zip(host.top_token_ids[j, :n].tolist(), host.top_logprobs[j, :n].tolist()))}
        return sampled, lp, codes

    def _sampled_embeddings(self, draw) -> dict[str, np.ndarray]:
        """{request id: input embedding of its sampled token} for the requests that capture hidden
        states, when the stage sends them (RunnerConfig.sampled_embeddings)."""
        if draw is None or not self.runner.cfg.sampled_embeddings:
            return {}
        reqs, res = draw
        want = [j for j, r in enumerate(reqs) if r.data is not None and r.data.capture_hidden]
        if not want:
            return {}
        rows = self.runner.embed_tokens(res.token_ids)
        return {reqs[j].request_id: rows[j] for j in want}

    def _after_sample(self, result, token_ids, reqs) -> dict[str, np.ndarray]:
        """Run the model's after-sample hook on the sampled rows; keep each row's feedback
        embedding for the token's next input and return its codes."""
        bucket = result.logits.shape[0]
        greedy = np.ones(bucket, bool)
        seeds = np.zeros(bucket, np.int32)
        steps = np.zeros(bucket, np.int32)
        for j, r in enumerate(reqs):
            p = r.sampling_params
            greedy[j] = p.is_greedy
            seeds[j] = (p.seed or 0) & 0x7FFFFFFF
            steps[j] = len(r.output_token_ids)
        codes, embeds = self.runner.after_sample(result.sample_hidden, token_ids, greedy, seeds, steps)
        out = {}
        for j, r in enumerate(reqs):
            r.data.set_feedback(len(r.output_token_ids), embeds[j])
            out[r.request_id] = codes[j]
        return out

    def _empty_history(self, bucket: int):
        """An all-padding penalty history on the device, made once per batch bucket: the full
        sampler variant needs one even when no request of the batch has penalties."""
        if bucket not in self._empty_histories:
            self._empty_histories[bucket] = jax.device_put(
                np.full((bucket, self._history_width), PAD_TOKEN_ID, np.int32))
        return self._empty_histories[bucket]

    def _detokenize(self, eo: StageOutput) -> None:
        det = self._detok.get(eo.request_id)
        if det is None:
            return
        eo.text_delta = det.take()  # the scheduler fed it this step's tokens
        if eo.finished:
            if not isinstance(eo.stop_reason, str):
                eo.text_delta += det.flush()
            self._detok.pop(eo.request_id, None)

    # ------------------------------------------------------------------ warm-up
    def warmup(self, progress: bool = True) -> float:
        """Compile every runner bucket and sampler variant, side by side (`compile_ahead`), then
        run each once; returns seconds spent."""
        t0 = time.perf_counter()
        compile_ahead(itertools.chain(self.runner.warmup_programs(), self._sampler_programs()),
                      desc="compiling programs" if progress else None)
        self.runner.warmup(progress)
        for fn, args, kwargs in self._sampler_programs():
            jax.block_until_ready(fn(*args, **kwargs))
        return time.perf_counter() - t0

    def _sampler_programs(self):
        """(jitted fn, args, kwargs) of every sampler variant, the pre-sampler and after-sample
        programs at every sampler batch, on the arguments warm-up runs them with, one after the other."""
        sizes = sorted(set(self.runner.cfg.decode_buckets) | {self.runner.cfg.max_num_seqs})
        vocab = self.vocab_size
        for b in sizes:
            logits = self.runner.on_stage(jax.numpy.zeros((b, vocab), jax.numpy.float32))  # as a step's
            for flags in _VARIANTS:
                params = [SamplingParams(temperature=0.0)] if flags is _GREEDY else [SamplingParams(seed=0, logprobs=1)]
                md, _ = self.sampling_builder.build(params, [[]], [[0]], b, vocab,
                                                    eos_token_ids=self.cfg.eos_token_ids)
                if flags.any_penalties and md.history_ids is None:
                    md = md.replace(history_ids=self._empty_history(b))
                yield self.jitted.sample, (logits, md), dict(flags=flags)
            if self.grammars is not None:  # a text stage; the others compile it if a logit_bias comes
                yield self.jitted.shape, (logits, *self._shaping(None, [], [], b, vocab)), {}
            if self.runner.cfg.after_sample:
                z = np.zeros(b, np.int32)
                yield self.runner.after_sample_call(
                    jax.numpy.zeros((b, self.runner.hidden_size), self.runner.dtype), z, np.ones(b, bool), z, z)

    @property
    def num_compilations(self) -> int:
        """XLA compilations so far in this process (constant after warm-up)."""
        return compilation_count()
