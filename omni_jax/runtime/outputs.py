"""What callers get back: `OmniRequestOutput` (text, audio, tokens, logprobs) and its
`RequestMetrics`, built by the orchestrator as stage outputs arrive."""

from __future__ import annotations

import dataclasses
import wave

import numpy as np

from ..errors import ErrorCode


@dataclasses.dataclass
class RequestMetrics:
    """Timings (seconds, time.monotonic clock) and transfer sizes of one request.

    ttft: arrival -> first text token; tpot: mean time per output token after the
    first; stage_time: busy time of the steps that served it, per stage;
    bytes_moved: array bytes sent to and received from stage processes;
    time_to_first_audio and rtf (processing time / audio duration) once speech lands.
    """

    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    num_output_tokens: int = 0
    stage_time: dict[str, float] = dataclasses.field(default_factory=dict)
    bytes_moved: int = 0
    first_audio_time: float | None = None
    audio_seconds: float = 0.0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        if self.finish_time is None or self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    @property
    def time_to_first_audio(self) -> float | None:
        return None if self.first_audio_time is None else self.first_audio_time - self.arrival_time

    @property
    def rtf(self) -> float | None:
        if self.finish_time is None or self.audio_seconds <= 0:
            return None
        return (self.finish_time - self.arrival_time) / self.audio_seconds


@dataclasses.dataclass(frozen=True)
class Logprob:
    """A token's log-probability and its rank in the distribution (1: the most likely), as vLLM's."""

    logprob: float
    rank: int


def logprobs_of(entry: dict) -> dict[int, Logprob]:
    """The engine's logprobs of one position -> {token id: Logprob}: the sampled (or prompt) token
    first, then the top ones (an element of vLLM's `SampleLogprobs` / `PromptLogprobs`)."""
    out = {entry["token_id"]: Logprob(entry["logprob"], entry["rank"])}
    for rank, (token, logprob) in enumerate(entry["top"], start=1):
        out.setdefault(token, Logprob(logprob, rank))
    return out


@dataclasses.dataclass
class OmniRequestOutput:
    """The state of one request: cumulative text/tokens/audio, plus this update's deltas.

    `generate()` returns finished outputs; the async generator yields one per update,
    with `text_delta`, `new_token_ids` and `audio_delta` holding what is new.
    A failed request has finish_reason "error", the message in `error` and why in `error_code`
    (`errors.ErrorCode`: invalid_request, context_length_exceeded, unavailable or internal).
    `logprobs` (when the thinker's SamplingParams ask for them): one {token id: Logprob} per
    output token, aligned with `token_ids`. `prompt_logprobs` (when they ask for them, from the
    first update on): one per prompt position, None for the first, else {token id: Logprob} with the
    prompt token and the top ones. `hidden_states` (when `generate(output_hidden_states=
    [...])` asks, set once finished): layer -> [T, H] float32, the prompt's rows first if asked,
    then one row per generated token fed back (all but the last). `num_cached_tokens`: as
    vLLM's RequestOutput, the prompt tokens of the first stage that came from its prefix cache.
    """

    request_id: str
    prompt_token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    error_code: ErrorCode | None = None
    audio: np.ndarray | None = None
    sample_rate: int = 24000
    metrics: RequestMetrics = dataclasses.field(default_factory=RequestMetrics)
    text_delta: str = ""
    new_token_ids: list[int] = dataclasses.field(default_factory=list)
    audio_delta: np.ndarray | None = None
    stage_token_ids: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # e.g. the talker's codec ids
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    hidden_states: dict[int, np.ndarray] | None = None
    num_cached_tokens: int = 0  # prompt tokens the first stage found in its prefix cache (not computed)

    def save_audio(self, path: str) -> None:
        """Write the reply's speech as a 16-bit PCM mono WAV file."""
        if self.audio is None or len(self.audio) == 0:
            raise ValueError(f"request {self.request_id!r} has no audio (ask for output_modalities=['text', 'audio'])")
        pcm = np.clip(np.asarray(self.audio, np.float32), -1.0, 1.0)
        with wave.open(path, "wb") as f:
            f.setnchannels(1)
            f.setsampwidth(2)
            f.setframerate(self.sample_rate)
            f.writeframes((pcm * 32767.0).astype("<i2").tobytes())

    def after(self, earlier: "OmniRequestOutput") -> "OmniRequestOutput":
        """This update with the deltas of an earlier one of the same request folded in:
        one update that says what both said (the cumulative fields are already this one's)."""
        if earlier.audio_delta is None or self.audio_delta is None:
            audio = self.audio_delta if earlier.audio_delta is None else earlier.audio_delta
        else:
            audio = np.concatenate([earlier.audio_delta, self.audio_delta])
        return dataclasses.replace(self, text_delta=earlier.text_delta + self.text_delta,
                                   new_token_ids=earlier.new_token_ids + self.new_token_ids, audio_delta=audio)

    def snapshot(self) -> "OmniRequestOutput":
        """A copy safe to hand to another thread."""
        return dataclasses.replace(self, token_ids=list(self.token_ids), new_token_ids=list(self.new_token_ids),
                                   logprobs=None if self.logprobs is None else list(self.logprobs),
                                   stage_token_ids={k: list(v) for k, v in self.stage_token_ids.items()},
                                   metrics=dataclasses.replace(self.metrics,
                                                               stage_time=dict(self.metrics.stage_time)))
