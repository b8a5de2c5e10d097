"""The package's errors, in one place: each names what is wrong. (The server's are in
server/errors.py, with the OpenAI error shape it answers in, but for the realtime API's error
event, `server/realtime/events.py: EventError`; the CPU kernels' build error is in
kernels_cpu, a layer below.)"""

from __future__ import annotations

from typing import Any, Literal, Mapping


# -- a checkpoint (checkpoint.py, conversion)
class CheckpointError(ValueError):
    """A checkpoint (HF or converted) is missing, damaged, or does not match the model."""


class ConfigKeyError(CheckpointError):
    """A value the model needs is missing from the checkpoint's config (never replaced by a built-in number)."""


def require(d: Mapping[str, Any], *keys: str, section: str) -> Any:
    """`d[key]` for the first of `keys` present (HF renamed some between versions), else
    ConfigKeyError naming the keys and the config section; the loader adds the file."""
    for key in keys:
        if key in d and d[key] is not None:
            return d[key]
    names = " or ".join(repr(k) for k in keys)
    raise ConfigKeyError(f"{section}: missing {names}")


# -- a pipeline configuration (config/)
class ConfigError(ValueError):
    """An invalid or unknown pipeline configuration.

    `field` is the path of the offending field relative to the object that raised it
    (e.g. "stages[0].max_num_seqs"), or None when the error is not about one field;
    `problem` is the message without its location.
    """

    def __init__(self, message: str, *, field: str | None = None, problem: str | None = None):
        super().__init__(message)
        self.field = field
        self.problem = problem if problem is not None else message


class UnknownStageError(ConfigError, KeyError):
    """`PipelineConfig.stage(name)` for a name the pipeline does not have.

    Also a KeyError, so `except KeyError` around a lookup works as for a dict.
    """

    __str__ = BaseException.__str__  # KeyError's __str__ would print the message's repr


# -- a model or a request (registry, inputs, engine)
class UnknownModelError(ValueError):
    """The checkpoint's architecture is not one OmniJax serves."""


class PromptError(ValueError):
    """A prompt cannot be turned into model inputs: the message says why."""


class PromptTooLongError(PromptError):
    """A prompt has more tokens than the first stage takes (OpenAI's `context_length_exceeded`)."""


class MediaError(ValueError):
    """A media item cannot be loaded; the message names the source and the reason."""


class Overloaded(RuntimeError):
    """Too many prompts wait for a worker: try again later (a server's 503 with Retry-After)."""


class RequestError(ValueError):
    """A request was rejected: the message says what is wrong with it."""

    @classmethod
    def of(cls, request_id: str, e: ValueError) -> "RequestError":
        """`e` as the request's error, its id said once (a step below, as the scheduler, may have said it)."""
        text = str(e)
        if isinstance(e, RequestError) and repr(request_id) in text:
            return e
        kind = type(e) if isinstance(e, RequestError) else cls  # a TooLongError stays one
        return kind(text if repr(request_id) in text else f"request {request_id!r}: {text}")


class TooLongError(RequestError):
    """A request is larger than the stage was sized for: its tokens past max_model_len or the
    KV pool, one image or video frame past the vision encoder's largest bucket (OpenAI's
    `context_length_exceeded`)."""


# -- why a request failed: OmniRequestOutput.error_code, carried from the stages as a word so that
# a caller (the server) never has to read the message.
ErrorCode = Literal["invalid_request", "context_length_exceeded", "unavailable", "internal"]
"""invalid_request: the request as given cannot be served (the caller's doing);
context_length_exceeded: it is longer than this deployment takes (PromptTooLongError, TooLongError);
unavailable: a stage it needs died, restarts or stopped answering, or the engine was shut down;
internal: anything else (a failed model step, a family's input function that raised)."""


def error_code(e: BaseException) -> ErrorCode:
    """The ErrorCode of a request refused with `e`."""
    if isinstance(e, (TooLongError, PromptTooLongError)):
        return "context_length_exceeded"
    return "invalid_request" if isinstance(e, ValueError) else "internal"


# -- the stage processes (runtime)
class ProtocolError(ValueError):
    """A message could not be encoded, or frames received do not form a valid message.

    `request_id`: the request a malformed message was about, when it could still be read,
    so the receiver can fail that request instead of leaving it unanswered.
    """

    def __init__(self, message: str, request_id: str | None = None):
        super().__init__(message)
        self.request_id = request_id


class StageStartupError(RuntimeError):
    """A stage process did not come up: the message names the stage and why."""


class OutOfStep(RuntimeError):
    """A follower's outputs differ from process 0's at the same step (a stage over several hosts)."""


class EngineDeadError(RuntimeError):
    """A stage process died and was not (or could not be) started again: the pipeline cannot
    serve until the engine is restarted."""
