"""Continuous-batching schedulers of one stage (the KV blocks they hand out: `kv_cache`).

`ARScheduler` (autoregressive stages with a paged KV cache): per step, running requests
first (decodes and continuing chunked prefills, oldest first), then waiting requests while
the token budget, `max_num_seqs` and free KV blocks allow. When a running request needs a
block and none is free, the latest-arrived running request is preempted by recompute.
`OneShotScheduler` (vocoder-like stages, no KV): whole requests in batches, done in one step.

The engine loop is: `schedule()` -> run the model -> `update_from_output()`; aborts and
stop-string finishes may come in between. With async scheduling, `schedule_ahead()` may
schedule the next decode step while the previous one is still pending (its tokens not yet
known); outputs are then applied in the order the steps were scheduled.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from omni_jax.engine.kv_cache import KVCacheManager
from omni_jax.engine.protocol import FINISH_REASON_TO_STATUS, Request, RequestStatus, StageOutput
from omni_jax.engine.runner import DUMMY_BLOCK_ID, RunnerConfig, ScheduledChunk, cdiv
from omni_jax.errors import TooLongError


@dataclass
class SchedulerConfig:
    """Scheduler knobs of one stage (any object with these attribute names works too)."""

    max_num_seqs: int = RunnerConfig.max_num_seqs
    max_num_batched_tokens: int = RunnerConfig.max_num_batched_tokens  # token budget of one step
    max_model_len: int = RunnerConfig.max_model_len
    block_size: int = RunnerConfig.block_size
    num_blocks: int = 1024  # block 0 is the dummy block
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # >0: cap on one request's prefill chunk per step
    eos_token_ids: tuple[int, ...] = ()


def _cfg(config: Any, name: str, default: Any) -> Any:
    value = getattr(config, name, default)
    return default if value is None else value


def _eos_ids(config: Any) -> frozenset[int]:
    ids = _cfg(config, "eos_token_ids", None)
    if ids is None:
        ids = _cfg(config, "eos_token_id", ())
    if isinstance(ids, (int, np.integer)):
        ids = (ids,)
    return frozenset(int(t) for t in ids)


# -- step description ---------------------------------------------------------------------------
_NO_TOKENS = np.empty(0, np.int32)  # the token ids of a step scheduled ahead: still on the device
_NO_TOKENS.flags.writeable = False

@dataclass(slots=True, kw_only=True)
class ScheduledRequest(ScheduledChunk):
    """One request's share of a step (`ScheduledChunk`: tokens [start, start + num_tokens)), with
    what the scheduler keeps besides."""

    request_id: str
    is_new: bool  # first time scheduled: the runner sets up its per-request state
    is_resumed: bool  # re-admitted after preemption: its KV is recomputed from position 0
    block_ids: list[int]  # the whole block table after this step's allocation
    new_block_ids: list[int]  # blocks appended this step (all of them if new or resumed)
    token_ids: np.ndarray  # int32 ids of the scheduled positions (empty when fed_by_row >= 0)

    @property
    def is_prefill(self) -> bool:
        """More than one token, or still inside the prompt (prompt embeddings apply)."""
        return self.num_tokens > 1 or self.start < self.request.num_prompt_tokens

    @property
    def positions(self) -> np.ndarray:
        return np.arange(self.start, self.start + self.num_tokens, dtype=np.int32)

    @property
    def kv_len(self) -> int:
        """Tokens in the KV cache once this chunk is written (cached + new)."""
        return self.start + self.num_tokens


@dataclass
class SchedulerOutput:
    """What to run this step, in order (running requests first, then newly admitted ones)."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    finished_request_ids: list[str] = field(default_factory=list)  # since the last step: drop their state
    preempted_request_ids: list[str] = field(default_factory=list)  # this step: drop their state
    # Scheduled ahead with every request of the step before it, in the same rows, each fed by
    # the token sampled in its own row: that step's batch one position on (the steady state of
    # decoding, which the engine and runner need not check request by request).
    fed_in_place: bool = False

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def request_ids(self) -> list[str]:
        return [s.request_id for s in self.scheduled]

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {s.request_id: s.num_tokens for s in self.scheduled}

    @property
    def logits_request_ids(self) -> list[str]:
        """Scheduled requests that get a sampled token (a non-final prefill chunk gets none)."""
        return [s.request_id for s in self.scheduled if s.needs_logits]

    def block_table_array(self, width: Optional[int] = None, like: Optional[tuple["SchedulerOutput", np.ndarray]] = None
                          ) -> np.ndarray:
        """int32 `[num_scheduled, width]` block tables padded with the dummy block id.

        like: (an earlier output, its table): rows whose block list is the very list that
        output's same row had are copied from its table, not rebuilt (a decode step scheduled
        ahead shares the lists of the requests that gained no block)."""
        width = max((len(s.block_ids) for s in self.scheduled), default=0) if width is None else width
        rows = range(len(self.scheduled))
        if like is not None and len(like[0].scheduled) == len(self.scheduled) and like[1].shape[1] == width:
            table = like[1].copy()
            rows = [row for row, (s, t) in enumerate(zip(self.scheduled, like[0].scheduled))
                    if s.block_ids is not t.block_ids]
        else:
            table = np.full((len(self.scheduled), width), DUMMY_BLOCK_ID, dtype=np.int32)
        for row in rows:
            s = self.scheduled[row]
            if len(s.block_ids) > width:
                raise ValueError(f"request {s.request_id!r} holds {len(s.block_ids)} blocks > width {width}")
            table[row, : len(s.block_ids)] = s.block_ids
            table[row, len(s.block_ids):] = DUMMY_BLOCK_ID  # a copied row may have held more
        return table


def _step_output(req: Request, new_token_ids: list[int]) -> StageOutput:
    """What one step did for one request: the tokens it produced and whether it is done (the
    engine adds text, logprobs, hidden states, codes or audio to the same object)."""
    return StageOutput(
        request_id=req.request_id,
        new_token_ids=new_token_ids,
        finished=req.is_finished,
        finish_reason=req.finish_reason,
        stop_reason=req.stop_reason,
        num_cached_tokens=req.num_cached_tokens,
        error=req.error,
    )


# -- common queue handling ----------------------------------------------------------------------
class _QueueScheduler:
    """Waiting/running queues, finishing and aborting: what both schedulers share."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.max_num_seqs = int(_cfg(config, "max_num_seqs", RunnerConfig.max_num_seqs))
        self.max_num_batched_tokens = int(_cfg(config, "max_num_batched_tokens", RunnerConfig.max_num_batched_tokens))
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_seqs ({self.max_num_seqs}) and max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be positive"
            )
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_ids: list[str] = []
        self._arrivals = itertools.count()
        self._pending: deque[SchedulerOutput] = deque()  # scheduled, output not applied yet

    def _validate_common(self, request: Request) -> None:
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        if request.status != RequestStatus.WAITING or request.num_computed_tokens or request.output_token_ids:
            raise ValueError(f"request {rid!r} was already scheduled once; add a fresh Request")
        if request.num_prompt_tokens == 0:
            raise ValueError(f"request {rid!r}: empty prompt (0 tokens)")

    def _enqueue(self, request: Request) -> None:
        request.priority = (request.arrival_time, next(self._arrivals))
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def _check_not_pending(self) -> None:
        if self._pending:
            raise RuntimeError("schedule() called again before update_from_output() of the previous step")

    def _check_is_pending(self, scheduler_output: SchedulerOutput) -> None:
        # Tokens are appended on update: applying an output twice, a stale one or one out of
        # order would corrupt requests.
        if scheduler_output.scheduled and not (self._pending and scheduler_output is self._pending[0]):
            raise RuntimeError("update_from_output() got a SchedulerOutput that is not the oldest pending "
                               "step (already updated, failed, or out of order)")

    def _pop_pending(self, scheduler_output: SchedulerOutput) -> None:
        if self._pending and self._pending[0] is scheduler_output:
            self._pending.popleft()

    def _take_finished_ids(self) -> list[str]:
        ids, self._finished_ids = self._finished_ids, []
        return ids

    def _release(self, request: Request) -> None:
        """Free what a finished request holds (subclasses add their resources)."""
        self.requests.pop(request.request_id, None)
        self._finished_ids.append(request.request_id)

    def finish_request(
        self,
        request_id: str,
        reason: str = "stop",
        stop_reason: Optional[int | str] = None,
        error: Optional[str] = None,
    ) -> bool:
        """Finish a request from outside (abort, error) wherever it is.

        Frees its resources at once. False if the id is unknown or already finished.
        """
        status = FINISH_REASON_TO_STATUS.get(reason)
        if status is None:
            raise ValueError(f"unknown finish reason {reason!r}; expected one of {sorted(FINISH_REASON_TO_STATUS)}")
        req = self.requests.get(request_id)
        if req is None:
            return False
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = status
        req.stop_reason = stop_reason
        req.error = error
        self._release(req)
        return True

    def abort_request(self, request_id: str) -> bool:
        """Abort a waiting, running or partially prefilled request; frees its blocks."""
        return self.finish_request(request_id, reason="abort")

    def fail_scheduled(self, scheduler_output: SchedulerOutput, error: str) -> list[StageOutput]:
        """The model step of `scheduler_output` raised: fail its requests with the error text."""
        # By identity: outputs compare by value, and their token arrays do not compare as bools.
        self._pending = deque(p for p in self._pending if p is not scheduler_output)
        outputs = []
        for s in scheduler_output.scheduled:
            if self.finish_request(s.request_id, reason="error", error=error):
                outputs.append(_step_output(s.request, []))
                outputs[-1].error_code = "internal"
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def has_ready_requests(self) -> bool:
        """True when a step could make progress: some unfinished request is not waiting for input."""
        return any(not r.waiting_for_chunk for r in itertools.chain(self.waiting, self.running))

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def get_request(self, request_id: str) -> Optional[Request]:
        return self.requests.get(request_id)


# -- autoregressive stages ----------------------------------------------------------------------
class ARScheduler(_QueueScheduler):
    """Continuous batching over a paged KV cache: chunked prefill, prefix caching, preemption."""

    def __init__(self, config: Any, hidden_rows: Any = None) -> None:
        """`hidden_rows`: the engine's HiddenRowCache, if it keeps hidden rows (see KVCacheManager)."""
        super().__init__(config)
        self.max_model_len = int(_cfg(config, "max_model_len", RunnerConfig.max_model_len))
        self.block_size = int(_cfg(config, "block_size", RunnerConfig.block_size))
        self.num_blocks = int(_cfg(config, "num_blocks", 1024))
        self.enable_chunked_prefill = bool(_cfg(config, "enable_chunked_prefill", True))
        self.long_prefill_token_threshold = int(_cfg(config, "long_prefill_token_threshold", 0))
        self.eos_token_ids = _eos_ids(config)
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # Without chunking a whole (re)computed prompt must fit one step's budget.
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len})"
            )
        self.kv_cache_manager = KVCacheManager(
            self.num_blocks, self.block_size, bool(_cfg(config, "enable_prefix_caching", True)), hidden_rows
        )
        # A request stops growing when its next token would not fit the model or the whole pool
        # (otherwise it could never be scheduled again).
        self.max_len = min(self.max_model_len, self.kv_cache_manager.max_num_tokens + 1)

    # -- intake --------------------------------------------------------------------------------
    def check_prompt_length(self, rid: str, n: int) -> None:
        """TooLongError if a prompt of `n` tokens can never run here."""
        if n + 1 > self.max_model_len:
            raise TooLongError(
                f"request {rid!r}: prompt of {n} tokens leaves no room to generate: "
                f"prompt + 1 must be <= max_model_len ({self.max_model_len})"
            )
        num_blocks = cdiv(n, self.block_size)
        if num_blocks > self.kv_cache_manager.num_usable_blocks:
            raise TooLongError(
                f"request {rid!r}: prompt of {n} tokens needs {num_blocks} KV blocks of {self.block_size} "
                f"tokens, more than the whole pool ({self.kv_cache_manager.num_usable_blocks} usable blocks)"
            )

    def add_request(self, request: Request) -> None:
        """Queue a request; ValueError naming the problem if it can never run (TooLongError
        if it is too long for this stage)."""
        self._validate_common(request)
        rid, n = request.request_id, request.num_prompt_tokens
        self.check_prompt_length(rid, n)
        if request.max_tokens is not None and request.max_tokens < 1:
            raise ValueError(f"request {rid!r}: max_tokens must be >= 1, got {request.max_tokens}")
        request.admit(self.eos_token_ids, self.max_len)
        self._enqueue(request)

    # -- scheduling ----------------------------------------------------------------------------
    def _chunk_len(self, request: Request, num_computed: int) -> int:
        n = request.tokens_ready(num_computed)
        if self.enable_chunked_prefill and 0 < self.long_prefill_token_threshold < n:
            n = self.long_prefill_token_threshold
        return n

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        # Recompute: its outputs so far stay and are prefilled again together with the prompt.
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def _schedule_one(
        self, request: Request, n: int, held_before: int, is_new: bool, is_resumed: bool
    ) -> ScheduledRequest:
        start = request.num_computed_tokens
        block_ids = self.kv_cache_manager.get_block_table(request.request_id)
        scheduled = ScheduledRequest(
            request_id=request.request_id,
            request=request,
            num_tokens=n,
            start=start,
            is_new=is_new,
            is_resumed=is_resumed,
            needs_logits=start + n >= request.num_tokens,
            block_ids=block_ids,
            new_block_ids=block_ids[held_before:],
            token_ids=request.all_token_ids[start : start + n],
        )
        # Advanced now, like vLLM: the step's tokens count as computed once scheduled.
        request.num_computed_tokens = start + n
        return scheduled

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts, allocating their KV slots."""
        self._check_not_pending()
        kv = self.kv_cache_manager
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []

        # Running requests, oldest first; `running` is kept sorted by arrival so that its tail
        # is always the lowest-priority request, and is never one already scheduled this step.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(self._chunk_len(req, req.num_computed_tokens), budget)
            if n == 0:  # waiting for its next input chunk: keeps its blocks, blocks nobody
                i += 1
                continue
            held = kv.num_held_blocks(req.request_id)
            while kv.allocate_slots(req, n) is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                break  # it preempted itself: everything behind it is preempted too
            scheduled.append(self._schedule_one(req, n, held, is_new=False, is_resumed=False))
            budget -= n
            i += 1

        # Waiting requests, FCFS; none after a preemption, as blocks are short.
        skipped: list[Request] = []  # preempted requests whose inputs to recompute have not all arrived
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hits, num_hit_tokens = kv.get_computed_blocks(req)
            n = self._chunk_len(req, num_hit_tokens)
            if n == 0:
                skipped.append(self.waiting.popleft())
                continue
            if n > budget:
                if not self.enable_chunked_prefill:
                    break
                n = budget
            if kv.allocate_slots(req, n, hits) is None:
                break
            self.waiting.popleft()
            is_resumed = req.status == RequestStatus.PREEMPTED
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit_tokens
            if not is_resumed:
                req.num_cached_tokens = num_hit_tokens
            bisect.insort(self.running, req, key=lambda r: r.priority)
            scheduled.append(self._schedule_one(req, n, 0, is_new=not is_resumed, is_resumed=is_resumed))
            budget -= n
        self.waiting.extendleft(reversed(skipped))

        out = SchedulerOutput(
            scheduled=scheduled,
            total_num_scheduled_tokens=self.max_num_batched_tokens - budget,
            finished_request_ids=self._take_finished_ids(),
            preempted_request_ids=preempted,
        )
        if scheduled:
            self._pending.append(out)
        return out

    def schedule_ahead(self, prev: SchedulerOutput) -> Optional[SchedulerOutput]:
        """Schedule the decode step that follows `prev` before `prev`'s tokens are known.

        Async scheduling, as in vLLM: the engine runs this step on the device right behind
        `prev` and applies `prev`'s output meanwhile. Possible only when `prev` is the one
        pending step, nobody waits, and `prev` ran every running request with logits: then
        each request's next step is one token at a known position, the token `prev` samples
        for it (`fed_by_row`: the request's index in `prev.scheduled`). A request whose `prev`
        token is its last by length is left out; one that `prev` finishes by eos or a stop
        is skipped when this step's output is applied (its token is thrown away). Returns
        None, changing nothing, when a condition fails or the free blocks are too few.
        """
        if len(self._pending) != 1 or self._pending[0] is not prev or self.waiting:
            return None
        steps = prev.scheduled
        if len(steps) != len(self.running):
            return None
        # One pass of plain attribute reads per request: this runs every decode step, and
        # its host time is what the device waits for on a small model.
        kv, bs, running = self.kv_cache_manager, self.block_size, RequestStatus.RUNNING
        held_ids = kv.req_to_block_ids
        nexts = []  # (prev's entry, its index in prev.scheduled, blocks held if one more is needed)
        need = 0
        for row, s in enumerate(steps):
            req = s.request
            if not s.needs_logits or req.status is not running:
                return None
            n = req.num_tokens
            if req.input_limit is not None and n >= req.input_limit:
                return None  # its next token's input (async chunk) has not arrived
            if n + 1 >= req.length_limit:
                continue  # prev's token is its last by length
            if req.num_computed_tokens < len(held_ids[req.request_id]) * bs:
                nexts.append((s, row, -1))
            else:
                need += 1
                nexts.append((s, row, len(held_ids[req.request_id])))
        if not nexts or need > kv.num_free_blocks:
            return None
        scheduled = []
        for s, row, held in nexts:
            req = s.request
            start = req.num_computed_tokens
            if held < 0:  # prev's table, unchanged: shared, as tables are never mutated once made
                block_ids, new_block_ids = s.block_ids, []
            else:
                kv.allocate_slots(req, 1)  # cannot fail: counted above
                block_ids = kv.get_block_table(req.request_id)
                new_block_ids = block_ids[held:]
            scheduled.append(ScheduledRequest(
                request_id=req.request_id, request=req, num_tokens=1, start=start, is_new=False, is_resumed=False,
                needs_logits=True, block_ids=block_ids, new_block_ids=new_block_ids, token_ids=_NO_TOKENS,
                fed_by_row=row))
            req.num_computed_tokens = start + 1
        out = SchedulerOutput(scheduled=scheduled, total_num_scheduled_tokens=len(scheduled),
                              finished_request_ids=self._take_finished_ids(),
                              fed_in_place=len(scheduled) == len(steps))
        self._pending.append(out)
        return out

    # -- results -------------------------------------------------------------------------------
    def _check_stop(self, req: Request, token: int) -> bool:
        """Apply the finish conditions after `token` was appended; True if it finished.

        The one place a request's own end is decided: end ids, stop ids, stop strings (found by
        its detokenizer, which takes every token), lengths. Aborts and errors come from outside
        (finish_request)."""
        num_out = len(req.output_token_ids)
        may_stop = num_out >= req.min_tokens
        stop_string = None
        if req.detokenizer is not None:
            stop_string = req.detokenizer.update([token], check_stops=may_stop)
        if may_stop:
            if not req.ignore_eos and token in req.eos_token_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                return True
            if token in req.stop_token_ids or stop_string is not None:
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = token if stop_string is None else stop_string
                return True
        if req.num_tokens >= req.length_limit:
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def _release(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        super()._release(request)

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        sampled_token_ids: Mapping[str, Any] | Sequence[Any] | np.ndarray | None = None,
    ) -> list[StageOutput]:
        """Take the step's sampled tokens, check finish conditions, free finished requests.

        `sampled_token_ids` is a dict request_id -> token id(s), or a sequence/array aligned
        with `scheduler_output.scheduled` (entries of requests without logits are ignored) or
        with `logits_request_ids`. Returns one output per request that got tokens or finished.
        """
        self._check_is_pending(scheduler_output)
        # Validate every entry before touching any request, so a bad call changes nothing.
        sampled = self._sampled_per_request(scheduler_output, sampled_token_ids)
        self._pop_pending(scheduler_output)
        outputs: list[StageOutput] = []
        any_finished = False
        requests, cache_blocks, running = self.requests, self.kv_cache_manager.cache_blocks, RequestStatus.RUNNING
        for s, tokens in zip(scheduler_output.scheduled, sampled):
            req = requests.get(s.request_id)
            if req is not s.request or req.status is not running:
                continue  # aborted or finished from outside since schedule()
            if type(tokens) is int:  # one token: the usual case
                req.append_token(tokens)
                new_token_ids = [tokens]
                # Most tokens end nothing: the whole check only for one that may.
                if tokens in req.end_ids or req.num_tokens >= req.length_limit or req.detokenizer is not None:
                    self._check_stop(req, tokens)
            else:
                new_token_ids = []
                for token in tokens:
                    req.append_token(token)
                    new_token_ids.append(token)
                    if self._check_stop(req, token):
                        break
            # Only now is the chunk's KV written, so only now may others hit its full blocks.
            cache_blocks(req, s.kv_len)
            if req.status is not running:
                self._release(req)
                any_finished = True
                outputs.append(_step_output(req, new_token_ids))
            elif new_token_ids:
                outputs.append(StageOutput(request_id=req.request_id, new_token_ids=new_token_ids,
                                           num_cached_tokens=req.num_cached_tokens))
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        return outputs

    @staticmethod
    def _sampled_per_request(out: SchedulerOutput, sampled: Any) -> list[int | list[int]]:
        """The sampled token id(s) of each scheduled request: an int for one token, else a list
        (empty where no logits were due)."""

        def tokens_of(value: Any, rid: str) -> int | list[int]:
            if type(value) is int:  # the usual case, first: one token, kept as it is
                return value
            if value is None:
                raise ValueError(f"update_from_output: no sampled token for request {rid!r}")
            if isinstance(value, (int, np.integer)):
                return int(value)
            tokens = [int(t) for t in value]
            if not tokens:
                raise ValueError(f"update_from_output: no sampled token for request {rid!r}")
            return tokens

        if isinstance(sampled, Mapping):
            return [tokens_of(sampled.get(s.request_id), s.request_id) if s.needs_logits else []
                    for s in out.scheduled]
        if sampled is None:
            values: list[Any] = []
        elif isinstance(sampled, np.ndarray) and sampled.ndim == 1 and sampled.dtype.kind in "iu":
            values = sampled.tolist()  # ints, one per entry: no need to look at each
            if len(values) == len(out.scheduled) and (out.fed_in_place or all(s.needs_logits for s in out.scheduled)):
                return values  # one token each: the usual step
        else:
            values = sampled.tolist() if isinstance(sampled, np.ndarray) else list(sampled)
        needs = [s.needs_logits for s in out.scheduled]
        if len(values) == len(out.scheduled):
            return [tokens_of(v, s.request_id) if need else []
                    for v, s, need in zip(values, out.scheduled, needs)]
        if len(values) == sum(needs):
            rows = iter(values)
            return [tokens_of(next(rows), s.request_id) if need else [] for s, need in zip(out.scheduled, needs)]
        raise ValueError(
            f"update_from_output: {len(values)} sampled entries for {len(out.scheduled)} scheduled "
            f"requests ({sum(needs)} needing logits)"
        )

    # -- maintenance ---------------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        """Drop cached prefixes (e.g. after a weight update); False while blocks are in use."""
        return self.kv_cache_manager.reset_prefix_cache()

    def make_stats(self) -> dict[str, float]:
        """Queue lengths, KV usage and the prefix-cache hit rate, for metrics."""
        kv = self.kv_cache_manager
        return {
            "num_running": len(self.running),
            "num_waiting_for_chunk": sum(r.waiting_for_chunk for r in self.running),
            "num_waiting": len(self.waiting),
            "kv_cache_usage": kv.usage,
            "prefix_cache_queries": kv.prefix_cache_stats.queries,
            "prefix_cache_hits": kv.prefix_cache_stats.hits,
            "prefix_cache_hit_rate": kv.prefix_cache_stats.hit_rate,
        }


# -- one-shot stages ----------------------------------------------------------------------------
class OneShotScheduler(_QueueScheduler):
    """Batches whole waiting requests (up to max_num_seqs and max_num_batched_tokens) for
    stages without KV cache (vocoders); each request finishes after the step that ran it."""

    def add_request(self, request: Request) -> None:
        """Queue a request; ValueError if it could never fit a batch."""
        self._validate_common(request)
        if request.num_prompt_tokens > self.max_num_batched_tokens:
            raise ValueError(
                f"request {request.request_id!r}: {request.num_prompt_tokens} tokens exceed "
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) of a one-shot batch"
            )
        self._enqueue(request)

    def schedule(self) -> SchedulerOutput:
        """The next batch of whole requests, FCFS."""
        self._check_not_pending()
        scheduled: list[ScheduledRequest] = []
        total = 0
        while self.waiting and len(scheduled) < self.max_num_seqs:
            req = self.waiting[0]
            n = req.num_tokens
            if total + n > self.max_num_batched_tokens:
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append(ScheduledRequest(
                request_id=req.request_id, request=req, num_tokens=n, start=0,
                is_new=True, is_resumed=False, needs_logits=False, block_ids=[], new_block_ids=[],
                token_ids=req.all_token_ids,
            ))
            req.num_computed_tokens = n
            total += n
        out = SchedulerOutput(scheduled, total, self._take_finished_ids(), [])
        if scheduled:
            self._pending.append(out)
        return out

    def update_from_output(self, scheduler_output: SchedulerOutput, results: Any = None) -> list[StageOutput]:
        """Finish every request of the step ("stop"); `results` is the engine's and ignored here."""
        self._check_is_pending(scheduler_output)
        self._pop_pending(scheduler_output)
        outputs = []
        for s in scheduler_output.scheduled:
            req = self.requests.get(s.request_id)
            if req is not s.request or req.status != RequestStatus.RUNNING:
                continue
            req.status = RequestStatus.FINISHED_STOPPED
            self._release(req)
            outputs.append(_step_output(req, []))
        if outputs:
            self.running = [r for r in self.running if not r.is_finished]
        return outputs
