"""The engine's request: as the scheduler holds it (`Request`) and as it crosses processes.

`Request` is one request inside a stage (token ids, progress, how it ended); the
messages below carry it between the orchestrator and the stage workers, and its
`StageOutput`s back.

Every message is a tagged `msgspec.Struct` (the tag is the class name), so one typed
decoder per direction turns a frame into the right class and rejects anything else:

* orchestrator -> stage: `StageRequest` = `AddRequest | AbortRequests | HealthCheck | Shutdown`
* stage -> orchestrator: `StageReply` = `StageOutputs | Ready | StageFailure | HealthReply`
* stage -> next stage (direct, never through the orchestrator): `StageData`
* process 0 of a stage -> its other processes (a stage over several processes): `StageTick`

Fields typed `np.ndarray` (anywhere, including inside lists and dicts) do not go through
msgpack: `omni_jax.runtime.transport` sends each array as its own ZMQ frame and rebuilds it
on the other side without a copy. Nothing here is pickled.

Decoded arrays are views of the received frames: treat them as owned by the message, and
copy before keeping a slice of a large array around longer than the message (the view
keeps the whole frame alive). Arrays handed to `send` must not be mutated afterwards until
the message has left (ZMQ sends them without a copy).
"""

from __future__ import annotations

import enum
import hashlib
import time
from typing import Any, Optional, Sequence

import msgspec
import numpy as np

from omni_jax.engine.sampling_params import SamplingParams
from omni_jax.errors import ErrorCode

__all__ = [
    "Request",
    "RequestStatus",
    "StageInputs",
    "MultiModalPayload",
    "AddRequest",
    "AbortRequests",
    "HealthCheck",
    "Shutdown",
    "StageRequest",
    "StageOutput",
    "StageOutputs",
    "StageData",
    "StageTick",
    "Ready",
    "StageFailure",
    "HealthReply",
    "StageReply",
    "SamplingParams",
]


def _digest(arrays, tail: bytes = b"") -> str:
    """blake2b of arrays' shapes, dtypes and bytes (None skipped), then `tail`: a content key
    that is equal across processes for equal content."""
    h = hashlib.blake2b(digest_size=16)
    for a in arrays:
        if a is not None:
            a = np.ascontiguousarray(a)
            h.update(str((a.shape, a.dtype.str)).encode())
            h.update(a.reshape(-1).view(np.uint8))  # the bytes, not copied
    h.update(tail)
    return h.hexdigest()


def audio_digest(features: np.ndarray) -> str:
    """The digest of one audio clip's features (`MultiModalPayload.item_digests`)."""
    return _digest([features])


def image_digest(pixels: np.ndarray, grid: np.ndarray) -> str:
    """The digest of one image's patches and its [3] grid (`MultiModalPayload.item_digests`)."""
    return _digest([pixels, np.asarray(grid, np.int64)], b"-")


class _Message(msgspec.Struct, tag=True, kw_only=True, omit_defaults=True):
    """Base of all wire messages: tagged by class name, keyword-only, defaults omitted.

    `omit_defaults` keeps the common case small (a decode step's output is a request id
    and one token id); the tag lets a union of messages decode without a type field.
    """


# ---------------------------------------------------------------------------------------
# Request payloads
# ---------------------------------------------------------------------------------------


class StageInputs(_Message):
    """What the runner needs of a request beyond its token ids (kept in `Request.data`).

    Positions: `mrope_positions [3, P]` for the prompt (None: 0..P-1 on all rows);
    generated token j (absolute index >= P) sits at j + mrope_delta on all rows.
    Overlay: prompt token i takes `overlay_rows[overlay_index[i]]` instead of its token
    embedding when overlay_index[i] >= 0 (encoder features, prompt embeddings, the
    thinker's hidden states fed to the talker).
    Extra: the input of the token at absolute index P + k gets `extra_embeds[k]` added
    (`extra_embeds_pad` past the end), as the talker's per-step reply part.
    capture_hidden: return this request's hidden states (the stage config says which layers).
    Projection: when `overlay_proj` [N] int8 is set, the overlay rows (and, with `extra_proj`
    >= 0, the extra rows) are in the previous stage's space; the stage's input projector
    maps row i with its projection `overlay_proj[i]` (Qwen3-Omni talker: 0 text, 1 hidden)
    and adds the embedding of the stage's own token `overlay_add_ids[i]` (-1: none) when the
    request is added.
    Set inside the stage, never sent: DeepStack `deepstack_rows [K, N, H]` follow the overlay
    rows (prompt token i with overlay row r gets `deepstack_rows[k, r]` added after decoder
    layer k); feedback `feedback_embeds[k]` (first `num_feedback` rows) is what the model's
    after_sample hook returned when output token k was sampled, added to that token's input
    too (Qwen3-Omni talker: the residual code groups' embeddings) and kept so a recompute
    after preemption rebuilds the same inputs.
    """

    mrope_positions: np.ndarray | None = None
    mrope_delta: int = 0
    overlay_rows: np.ndarray | None = None
    overlay_index: np.ndarray | None = None
    extra_embeds: np.ndarray | None = None
    extra_embeds_pad: np.ndarray | None = None
    capture_hidden: bool = False
    overlay_proj: np.ndarray | None = None
    overlay_add_ids: np.ndarray | None = None
    extra_proj: int = -1
    deepstack_rows: np.ndarray | None = None
    feedback_embeds: np.ndarray | None = None
    num_feedback: int = 0

    @property
    def is_rich(self) -> bool:
        """True when the inputs change the embeddings (the runner's overlay/extra variants)."""
        return (self.overlay_rows is not None or self.extra_embeds is not None or self.extra_embeds_pad is not None
                or self.feedback_embeds is not None)

    @property
    def needs_projection(self) -> bool:
        return self.overlay_proj is not None or self.extra_proj >= 0

    @property
    def only_prompt_overlay(self) -> bool:
        """True when the overlay rows (prompt embeddings) and positions are all these inputs add
        to the token ids: the request's KV is then a function of them and its ids."""
        return (self.overlay_rows is not None and self.extra_embeds is None and self.extra_embeds_pad is None
                and self.feedback_embeds is None and self.deepstack_rows is None
                and not self.needs_projection)

    def content_hash(self) -> str:
        """Digest of the overlay rows (as float32), their index and the positions: the prefix-cache
        salt of a prompt-embeddings request (equal embeddings share KV blocks; a token-id prompt
        of the same ids never hits them)."""
        rows = None if self.overlay_rows is None else np.asarray(self.overlay_rows, np.float32)
        return _digest([rows, self.overlay_index, self.mrope_positions], str(self.mrope_delta).encode())

    def set_feedback(self, k: int, row: np.ndarray) -> None:
        """Store the after-sample embedding of output token k (grows the buffer)."""
        buf = self.feedback_embeds
        if buf is None or k >= len(buf):
            grown = np.zeros((max(16, 2 * (k + 1)), row.shape[-1]), np.float32)
            if buf is not None:
                grown[:len(buf)] = buf
            self.feedback_embeds = buf = grown
        buf[k] = row
        self.num_feedback = max(self.num_feedback, k + 1)


class MultiModalPayload(_Message):
    """Encoder inputs of one request (the feature extractors' output, numpy).

    audio_features: one [mel_bins, frames] array per audio clip. pixel_values /
    image_grid_thw and pixel_values_videos / video_grid_thw / video_second_per_grid: the
    vision processor's patches and grids. use_audio_in_video: interleave a video's audio
    track with its frames. digests: per kind, each item's `audio_digest` / `image_digest` in
    order, as the prompt processor computed them once (it keeps them with the processed media):
    a stage then need not hash those arrays again each turn; a kind left out (videos, a payload
    built by hand) is hashed from its arrays.
    """

    audio_features: list[np.ndarray] = []
    pixel_values: np.ndarray | None = None
    image_grid_thw: np.ndarray | None = None
    pixel_values_videos: np.ndarray | None = None
    video_grid_thw: np.ndarray | None = None
    video_second_per_grid: np.ndarray | None = None
    use_audio_in_video: bool = False
    digests: dict[str, list[str]] = {}

    def _vision_items(self, kind: str) -> tuple[np.ndarray, np.ndarray, list[slice]]:
        """(patches, grids [N, 3], each item's rows of the patches) of the images or videos."""
        pixels, grids = (self.pixel_values, self.image_grid_thw) if kind == "image" else \
            (self.pixel_values_videos, self.video_grid_thw)
        grids = np.asarray(grids, np.int64).reshape(-1, 3)
        ends = np.cumsum(np.prod(grids, axis=1))
        return pixels, grids, [slice(int(end - n), int(end)) for n, end in zip(np.prod(grids, axis=1), ends)]

    def _timing(self) -> list:
        """Each video's seconds per grid step (None where not given)."""
        n = len(np.asarray(self.video_grid_thw).reshape(-1, 3))
        return [None] * n if self.video_second_per_grid is None else \
            list(np.asarray(self.video_second_per_grid, np.float64).reshape(-1))

    def item_digests(self) -> dict[str, list[str]]:
        """Digest of each media item's inputs, per kind present ("audio", "image", "video"), in
        prompt order (`digests` where given)."""
        out = {}
        if self.audio_features:
            out["audio"] = self._given("audio", len(self.audio_features)) or [
                audio_digest(f) for f in self.audio_features]
        if self.pixel_values is not None:
            pixels, grids, rows = self._vision_items("image")
            out["image"] = self._given("image", len(rows)) or [
                image_digest(pixels[r], g) for r, g in zip(rows, grids)]
        if self.pixel_values_videos is not None:
            pixels, grids, rows = self._vision_items("video")
            # a video's positions depend on its timing, and its audio track's on being interleaved
            tail = b"aiv" if self.use_audio_in_video else b"-"
            out["video"] = [_digest([pixels[r], g, t], tail) for r, g, t in zip(rows, grids, self._timing())]
        return out

    def _given(self, kind: str, items: int) -> list[str] | None:
        given = self.digests.get(kind)
        if given is not None and len(given) != items:
            raise ValueError(f"the payload has {items} {kind} item(s) but {len(given)} {kind} digest(s)")
        return given

    def item_hashes(self, audio_tail: bytes = b"") -> dict[str, list[str]]:
        """Each media item's key, per kind present, in prompt order: its prefix-cache range's key
        and its encoder rows'. `audio_tail`: what else an audio clip's encoder rows depend on
        (Qwen3's: the padding of the request's longest chunk)."""
        out = self.item_digests()
        if audio_tail and "audio" in out:
            out["audio"] = [_digest([], key.encode() + audio_tail) for key in out["audio"]]
        return out

    def select(self, kind: str, items: Sequence[int]) -> "MultiModalPayload":
        """A payload of only these items of one kind (for an encoder call over part of a request)."""
        if kind == "audio":
            return MultiModalPayload(audio_features=[self.audio_features[i] for i in items])
        pixels, grids, rows = self._vision_items(kind)
        patches = np.concatenate([pixels[rows[i]] for i in items])
        if kind == "image":
            return MultiModalPayload(pixel_values=patches, image_grid_thw=grids[list(items)])
        timing = self._timing()
        return MultiModalPayload(pixel_values_videos=patches, video_grid_thw=grids[list(items)],
                                 video_second_per_grid=None if self.video_second_per_grid is None
                                 else np.array([timing[i] for i in items]),
                                 use_audio_in_video=self.use_audio_in_video)


# ---------------------------------------------------------------------------------------
# Orchestrator -> stage
# ---------------------------------------------------------------------------------------


class AddRequest(_Message):
    """Start generating for a new request on this stage.

    A stage that cannot take it (bad params, prompt too long) answers with a
    `StageFailure` carrying the request id.

    inputs_from: this stage's input is another stage's output (a talker's is the thinker's):
    the message carries the user's prompt, media and this stage's sampling params, and the
    stage builds its own request with its family's stage-input function once the `StageData`
    of `inputs_from` for this request is complete. forward_to: send this request's outputs
    (tokens, hidden states, codes) as `StageData` to that stage. async_chunk: start as soon as
    enough of that input has arrived and take the rest as it is produced (see models/handoff.py).
    output_hidden_states: the caller wants these captured layers of this request's hidden states
    (its inputs then have capture_hidden), from the first prompt row when
    `hidden_states_include_prompt`, else from the first generated token fed back.
    """

    request_id: str
    prompt_token_ids: np.ndarray
    sampling_params: SamplingParams
    inputs: StageInputs | None = None
    multi_modal: MultiModalPayload | None = None
    arrival_time: float = 0.0
    voice: str | None = None  # speaker of a speech request (talker and vocoder stages)
    inputs_from: str | None = None
    forward_to: str | None = None
    async_chunk: bool = False
    output_hidden_states: list[int] | None = None
    hidden_states_include_prompt: bool = False


class AbortRequests(_Message):
    """Stop these requests and free their KV blocks; unknown ids are ignored."""

    request_ids: list[str]


class HealthCheck(_Message):
    """Ask the stage to answer with a `HealthReply` echoing `nonce`."""

    nonce: int


class Shutdown(_Message):
    """Ask the stage to finish its loop, release its sockets and exit."""


StageRequest = AddRequest | AbortRequests | HealthCheck | Shutdown
"""Everything an orchestrator sends to a stage (the stage worker's decode type)."""


# ---------------------------------------------------------------------------------------
# Stage -> orchestrator
# ---------------------------------------------------------------------------------------


class StageOutput(_Message):
    """One request's progress in one step: the tokens it produced since the last output.

    finish_reason is "stop", "length", "abort" or "error" once `finished`; stop_reason the
    stop token id or string that ended it; error (with its `errors.ErrorCode` as error_code) why
    the request failed here. hidden_states maps a layer index to the
    [num_new_tokens, H] hidden states of the new tokens (requests with capture_hidden).
    logprobs: one dict per new token; prompt_logprobs (with the first token, when asked): one
    per prompt position from 1 on. audio: a waveform chunk (vocoder stages).
    codes [num_new_tokens, K]: the residual code groups of each new token (Qwen3-Omni talker).
    """

    request_id: str
    new_token_ids: list[int] = []
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    error_code: ErrorCode | None = None
    text_delta: str = ""
    hidden_states: dict[int, np.ndarray] | None = None
    hidden_offset: int = 0  # absolute position of the first hidden-state row (recomputes resend rows)
    num_cached_tokens: int = 0
    logprobs: list[dict] | None = None
    prompt_logprobs: list[dict] | None = None
    audio: np.ndarray | None = None
    codes: np.ndarray | None = None


class StageOutputs(_Message):
    """All request outputs of one scheduler step of `stage`, and how long the step took."""

    stage: str
    outputs: list[StageOutput]
    step_time: float = 0.0


class Ready(_Message):
    """Sent once, after the stage loaded its weights and compiled every bucket."""

    stage: str
    pid: int
    warmup_seconds: float
    num_compilations: int
    info: dict = {}


class StageFailure(_Message):
    """A request rejected at add time (`request_id` set, with the `errors.ErrorCode` of why), or
    a fatal stage error (None)."""

    stage: str
    message: str
    request_id: str | None = None
    error_code: ErrorCode = "internal"


class HealthReply(_Message):
    """The answer to `HealthCheck`: the echoed nonce and a few scheduler statistics."""

    stage: str
    nonce: int
    stats: dict = {}


StageReply = StageOutputs | Ready | StageFailure | HealthReply
"""Everything a stage sends to the orchestrator (the orchestrator's decode type)."""


# ---------------------------------------------------------------------------------------
# Stage -> next stage
# ---------------------------------------------------------------------------------------


class StageData(_Message):
    """A request's new outputs in one step, sent by a stage to the stage that takes them as input.

    token_ids, hidden_states (layer -> [n, H], first row at absolute position hidden_offset;
    a recompute after preemption sends the same positions again) and codes [n, K] as in
    `StageOutput`; finished with finish_reason once the sending stage is done with it
    ("abort" / "error": the receiver drops what it holds for the request).
    """

    request_id: str
    token_ids: list[int] = []
    hidden_states: dict[int, np.ndarray] | None = None
    hidden_offset: int = 0
    codes: np.ndarray | None = None
    finished: bool = False
    finish_reason: str | None = None


# ---------------------------------------------------------------------------------------
# Process 0 of a stage -> its other processes
# ---------------------------------------------------------------------------------------


class StageTick(_Message):
    """One turn of a multi-process stage's loop (runtime/spmd.py): the messages process 0
    handled, in order, and whether it then stepped the engine. The other processes do the same
    with theirs, so that every process runs the same device programs. `last_step`: a digest of
    process 0's outputs at its last step, which each process checks against its own."""

    messages: list[AddRequest | AbortRequests | HealthCheck | Shutdown | StageData] = []
    step: bool = False
    last_step: str = ""


# ============================================================ the request inside a stage's scheduler
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
    # Duck-typed: any object with these names (SamplingParams, or a test's stand-in) or None.
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
        captures_hidden: bool = False,
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
        # Its hidden states are returned: a prefix-cache hit must replay the cached blocks' rows.
        self.captures_hidden = captures_hidden
        self.data = data
        # The engine's structured-output matcher (structured_output.Grammar), if the reply has one.
        self.grammar: Any = None

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
