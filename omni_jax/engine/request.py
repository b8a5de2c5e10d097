"""A request as the scheduler sees it: token ids, progress, and how it ended."""

from __future__ import annotations

import enum
import time
from typing import Any, Optional, Sequence

import numpy as np


class RequestStatus(enum.IntEnum):
    """Where a request is in its life. Every status from FINISHED_STOPPED on is final."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # back in the waiting queue, its KV freed, to be recomputed
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> Optional[str]:
        """The OpenAI-style finish reason ("stop", "length", "abort", "error"), None if not finished."""
        return _STATUS_TO_REASON.get(self)


_STATUS_TO_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}
FINISH_REASON_TO_STATUS = {reason: status for status, reason in _STATUS_TO_REASON.items()}


def _sampling_attr(sampling_params: Any, name: str, default: Any) -> Any:
    # Duck-typed: SamplingParams lives in engine/sampling.py and may be any object with these names.
    if sampling_params is None:
        return default
    value = getattr(sampling_params, name, default)
    return default if value is None else value


class Request:
    """One generation request inside a stage: prompt, generated tokens and scheduling state.

    `mm_hashes` lists the multimodal placeholder ranges of the prompt as
    `(offset, length, content_hash)`; the content hashes are extra keys of the prefix-cache
    block hashes, so equal placeholder token ids with different media never share KV blocks.
    A request carrying `prompt_embeds` (`has_prompt_embeds=True`) is not prefix-cached unless
    `cache_salt` is given (e.g. a hash of those embeddings): token ids alone do not determine
    its KV. `data` is an opaque payload for the engine (embeddings, M-RoPE positions...);
    the scheduler never reads it.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int] | np.ndarray,
        sampling_params: Any = None,
        *,
        arrival_time: Optional[float] = None,
        mm_hashes: Optional[Sequence[tuple[int, int, Any]]] = None,
        has_prompt_embeds: bool = False,
        cache_salt: Optional[str | bytes] = None,
        eos_token_ids: Optional[Sequence[int]] = None,
        data: Any = None,
    ) -> None:
        self.request_id = request_id
        prompt = np.asarray(prompt_token_ids)
        if prompt.ndim != 1:
            raise ValueError(f"request {request_id!r}: prompt_token_ids must be 1-D, got shape {prompt.shape}")
        self.prompt_token_ids = prompt.astype(np.int32, copy=True)
        self.sampling_params = sampling_params
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.mm_hashes: tuple[tuple[int, int, Any], ...] = tuple(
            sorted((int(o), int(n), h) for o, n, h in (mm_hashes or ()))
        )
        self.has_prompt_embeds = has_prompt_embeds
        self.cache_salt = cache_salt
        self.eos_token_ids = None if eos_token_ids is None else frozenset(int(t) for t in eos_token_ids)
        self.data = data

        # Stop conditions, read once from the sampling params.
        self.max_tokens: Optional[int] = _sampling_attr(sampling_params, "max_tokens", None)
        self.min_tokens: int = int(_sampling_attr(sampling_params, "min_tokens", 0))
        self.ignore_eos: bool = bool(_sampling_attr(sampling_params, "ignore_eos", False))
        self.stop_token_ids = frozenset(int(t) for t in _sampling_attr(sampling_params, "stop_token_ids", ()))
        # Resolved against the scheduler's defaults at admission (`admit`): the ids that may end
        # the request, and the length at which it is capped.
        self.end_ids: frozenset[int] = frozenset()
        self.length_limit = 0
        # Top-n of the prompt logprobs asked for (None: none); the engine appends one entry per
        # prompt position from 1 on as prefill chunks compute them.
        self.num_prompt_logprobs: Optional[int] = getattr(sampling_params, "prompt_logprobs", None)
        self.prompt_logprobs: list[dict] = []

        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0  # tokens whose KV is written (or scheduled to be this step)
        self.num_cached_tokens = 0  # prefix-cache hit at first admission
        self.num_preemptions = 0
        # Async chunk: tokens [0, input_limit) have their inputs; None: all of them. A request
        # whose next token is past the limit waits for its stage-before's next chunk
        # (vLLM-Omni's WAITING_FOR_CHUNK) and is skipped, keeping its KV, until it arrives.
        self.input_limit: Optional[int] = None
        self.stop_reason: Optional[int | str] = None  # the stop token id or stop string that ended it
        # The engine's incremental detokenizer (None in a stage without a tokenizer): the
        # scheduler hands it each appended token, and it names the stop string that ends the text.
        self.detokenizer: Any = None
        self.error: Optional[str] = None
        # Chained prefix-cache hashes of the full blocks, filled incrementally by the KV cache manager.
        self.block_hashes: list[bytes] = []
        # (arrival_time, sequence number): set by the scheduler, lower runs first and is preempted last.
        self.priority: tuple[float, int] = (self.arrival_time, 0)

        # All token ids (prompt then outputs) in one growing buffer, so block hashing and the
        # runner slice numpy arrays instead of concatenating lists.
        self._num_tokens = len(self.prompt_token_ids)
        self._token_buf = np.empty(max(16, 2 * self._num_tokens), dtype=np.int32)
        self._token_buf[: self._num_tokens] = self.prompt_token_ids

    def admit(self, default_eos_token_ids: frozenset[int], max_len: int) -> None:
        """Resolve the stop conditions against the scheduler's: its end ids if the request has
        none, and its length limit (`max_len` tokens, the model's or the KV pool's)."""
        if self.eos_token_ids is None:
            self.eos_token_ids = default_eos_token_ids
        self.end_ids = self.stop_token_ids if self.ignore_eos else self.stop_token_ids | self.eos_token_ids
        self.length_limit = max_len if self.max_tokens is None else min(
            max_len, self.num_prompt_tokens + self.max_tokens)

    # -- sizes --------------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return self._num_tokens

    @property
    def all_token_ids(self) -> np.ndarray:
        """Prompt then output token ids, int32, read-only view."""
        view = self._token_buf[: self._num_tokens]
        view.flags.writeable = False
        return view

    # -- state ------------------------------------------------------------------------------
    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> Optional[str]:
        return self.status.finish_reason

    def tokens_ready(self, num_computed: int) -> int:
        """How many tokens from `num_computed` on have their inputs (all of them unless streamed)."""
        n = self.num_tokens - num_computed
        return n if self.input_limit is None else max(0, min(n, self.input_limit - num_computed))

    @property
    def waiting_for_chunk(self) -> bool:
        """True while the next token to compute waits for more input (async chunk)."""
        return self.tokens_ready(self.num_computed_tokens) == 0 and not self.is_finished

    @property
    def use_prefix_cache(self) -> bool:
        """Whether this request's KV is a function of its token ids (plus extra keys) alone."""
        return not self.has_prompt_embeds or self.cache_salt is not None

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether a prefix-cache hit may skip computing this request's prompt: not when it asks
        for prompt logprobs, which need the logits of every prompt position (as vLLM v1)."""
        return self.use_prefix_cache and self.num_prompt_logprobs is None

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        """Append generated token(s)."""
        if isinstance(token_ids, (int, np.integer)):
            token_ids = [int(token_ids)]
        else:
            token_ids = [int(t) for t in token_ids]
        n = len(token_ids)
        end = self._num_tokens + n
        if end > len(self._token_buf):
            grown = np.empty(max(end, 2 * len(self._token_buf)), dtype=np.int32)
            grown[: self._num_tokens] = self._token_buf[: self._num_tokens]
            self._token_buf = grown
        self._token_buf[self._num_tokens : end] = token_ids
        self._num_tokens = end
        self.output_token_ids.extend(token_ids)

    def token_id(self, index: int) -> int:
        """The token at `index` of all_token_ids."""
        return int(self._token_buf[index])

    def append_token(self, token_id: int) -> None:
        """Append one generated token (the per-step path of append_output_token_ids)."""
        end = self._num_tokens
        if end == len(self._token_buf):
            self.append_output_token_ids(token_id)
            return
        self._token_buf[end] = token_id
        self._num_tokens = end + 1
        self.output_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
