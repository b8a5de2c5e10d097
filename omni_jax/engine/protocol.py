"""Messages that cross process boundaries between the orchestrator and the stage workers.

Every message is a tagged `msgspec.Struct` (the tag is the class name), so one typed
decoder per direction turns a frame into the right class and rejects anything else:

* orchestrator -> stage: `StageRequest` = `AddRequest | AbortRequests | HealthCheck | Shutdown`
* stage -> orchestrator: `StageReply` = `StageOutputs | Ready | StageFailure | HealthReply`

Fields typed `np.ndarray` (anywhere, including inside lists and dicts) do not go through
msgpack: `omni_jax.runtime.transport` sends each array as its own ZMQ frame and rebuilds it
on the other side without a copy. Nothing here is pickled.

Decoded arrays are views of the received frames: treat them as owned by the message, and
copy before keeping a slice of a large array around longer than the message (the view
keeps the whole frame alive). Arrays handed to `send` must not be mutated afterwards until
the message has left (ZMQ sends them without a copy).
"""

from __future__ import annotations

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
    "Ready",
    "StageFailure",
    "HealthReply",
    "StageReply",
    "SamplingParams",
]


class _Message(msgspec.Struct, tag=True, kw_only=True, omit_defaults=True):
    """Base of all wire messages: tagged by class name, keyword-only, defaults omitted.

    `omit_defaults` keeps the common case small (a decode step's output is a request id
    and one token id); the tag lets a union of messages decode without a type field.
    """


# ---------------------------------------------------------------------------------------
# Request payloads
# ---------------------------------------------------------------------------------------


class StageInputs(_Message):
    """Per-request model inputs beyond the token ids, prepared by the orchestrator.

    mrope_positions [3, T] int and mrope_delta: M-RoPE position ids of the prompt and the
    offset decode positions continue from. overlay_rows [N, H] + overlay_index [N] int:
    embedding rows that replace the token embeddings at those prompt positions (e.g. the
    thinker's hidden states fed to the talker). extra_embeds [S, H] + extra_embeds_pad [H]:
    per-decode-step additive embeddings, and the row used once they run out.
    capture_hidden: return this request's hidden states (the stage config says which layers).
    overlay_proj [N] int8: the overlay rows are in the previous stage's space and row i goes
    through the stage's input projection overlay_proj[i] (stage-defined; Qwen3-Omni talker:
    0 text, 1 hidden), then gets the embedding of the stage's token overlay_add_ids[i]
    added (-1: none); extra_proj >= 0 projects the extra rows the same way.
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


# ---------------------------------------------------------------------------------------
# Orchestrator -> stage
# ---------------------------------------------------------------------------------------


class AddRequest(_Message):
    """Start generating for a new request on this stage.

    A stage that cannot take it (bad params, prompt too long) answers with a
    `StageFailure` carrying the request id.
    """

    request_id: str
    prompt_token_ids: np.ndarray
    sampling_params: SamplingParams
    inputs: StageInputs | None = None
    multi_modal: MultiModalPayload | None = None
    arrival_time: float = 0.0
    voice: str | None = None  # speaker of a speech request (vocoder stages)


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
    logprobs: one dict per new token. audio: a waveform chunk (vocoder stages).
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
