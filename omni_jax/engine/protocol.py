"""Messages that cross process boundaries between the orchestrator and the stage workers.

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

import hashlib

import msgspec
import numpy as np

from omni_jax.engine.sampling import SamplingParams

__all__ = [
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
            h.update(a.tobytes())
    h.update(tail)
    return h.hexdigest()


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
                and not self.capture_hidden and self.feedback_embeds is None and self.deepstack_rows is None
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
    track with its frames.
    """

    audio_features: list[np.ndarray] = []
    pixel_values: np.ndarray | None = None
    image_grid_thw: np.ndarray | None = None
    pixel_values_videos: np.ndarray | None = None
    video_grid_thw: np.ndarray | None = None
    video_second_per_grid: np.ndarray | None = None
    use_audio_in_video: bool = False

    def content_hash(self) -> str:
        """Digest of all media bytes: the prefix-cache key of the placeholder blocks."""
        return _digest([*self.audio_features, self.pixel_values, self.image_grid_thw, self.pixel_values_videos,
                        self.video_grid_thw, self.video_second_per_grid],
                       b"aiv" if self.use_audio_in_video else b"-")


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
    stop token id or string that ended it. hidden_states maps a layer index to the
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
    """A request rejected at add time (`request_id` set), or a fatal stage error (None)."""

    stage: str
    message: str
    request_id: str | None = None


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
