"""Client events of OpenAI's Realtime API (GA), validated; and the `error` event.

Each client event type has a pydantic model; `parse` turns one WebSocket text message into
one of them or raises `EventError`, which the connection sends back as an `error` event
(OpenAI's shape: type, code, message, param, and the client's event_id) and goes on.
Fields OpenAI has that this server does not serve are refused by name rather than ignored;
unknown fields are ignored, as OpenAI does.
"""

from __future__ import annotations

import itertools
import json
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from ..vad import VADSettings
from . import wire_audio

MAX_TEXT = 1 << 20          # characters of one text part or of the instructions
MAX_ITEMS_PER_EVENT = 64
MAX_PARTS = 64
MAX_ID = 64
Id = Annotated[str, Field(min_length=1, max_length=MAX_ID)]

_ids = itertools.count()


def new_id(prefix: str) -> str:
    """An id in OpenAI's style (`event_...`, `item_...`, `resp_...`), unique in this process."""
    return f"{prefix}_{uuid.uuid4().hex[:16]}{next(_ids):x}"


class EventError(Exception):
    """A client event the server cannot act on: sent back as an `error` event."""

    def __init__(self, message: str, code: str = "invalid_value", param: str | None = None,
                 event_id: str | None = None, type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.code, self.param, self.event_id, self.type = message, code, param, event_id, type

    def event(self) -> dict:
        return {"type": "error", "event_id": new_id("event"),
                "error": {"type": self.type, "code": self.code, "message": self.message, "param": self.param,
                          "event_id": self.event_id}}


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class AudioFormat(_Model):
    """audio/pcm (PCM16 at 24 kHz), audio/pcmu or audio/pcma (G.711 at 8 kHz): wire_audio.py."""

    type: Literal[wire_audio.PCM, wire_audio.PCMU, wire_audio.PCMA] = wire_audio.PCM
    rate: int | None = None

    @field_validator("rate")
    @classmethod
    def _rate(cls, rate: int | None, info: ValidationInfo) -> int | None:
        kind = info.data.get("type", wire_audio.PCM)
        if rate is not None and rate != wire_audio.rate(kind):
            raise ValueError(f"{kind} is {wire_audio.rate(kind)} Hz here, not {rate}")
        return rate


class ServerVADConfig(VADSettings):
    """`turn_detection`: the VAD's turn rules and what a turn it ends sets off."""

    create_response: bool = True
    interrupt_response: bool = True
    # After a reply has played, this long without the user speaking makes a turn of the silence
    # and answers it (connection.py: RealtimeSession._on_idle).
    idle_timeout_ms: int | None = Field(default=None, ge=1000, le=600_000)


class SemanticVADConfig(_Model):
    """`turn_detection` of type semantic_vad. OpenAI ends such a turn when a model judges the
    words complete; this server has no such model, so the same silence-based VAD as server_vad
    ends it, `eagerness` picking how long a silence does (high: quicker, low: lets the user
    pause). Accepted rather than refused because OpenAI's Agents SDK sends it by default."""

    type: Literal["semantic_vad"]
    eagerness: Literal["low", "medium", "high", "auto"] = "auto"
    create_response: bool = True
    interrupt_response: bool = True

    # The silence (ms) that ends a turn at each eagerness; "auto" is "medium", as OpenAI's.
    SILENCE_MS: ClassVar[dict[str, int]] = {"high": 500, "medium": 1000, "auto": 1000, "low": 2000}
    # The rest of the VAD's rules are server_vad's defaults; semantic_vad has no idle timeout.
    threshold: ClassVar[float] = 0.5
    prefix_padding_ms: ClassVar[int] = 300
    idle_timeout_ms: ClassVar[None] = None

    @property
    def silence_duration_ms(self) -> int:
        return self.SILENCE_MS[self.eagerness]


TurnDetection = Annotated[ServerVADConfig | SemanticVADConfig, Field(discriminator="type")]


class TranscriptionConfig(_Model):
    model: Annotated[str, Field(max_length=256)] | None = None
    language: Annotated[str, Field(max_length=32)] | None = None
    prompt: Annotated[str, Field(max_length=4096)] | None = None


class AudioInput(_Model):
    format: AudioFormat | None = None
    transcription: TranscriptionConfig | None = None
    turn_detection: TurnDetection | None = None
    noise_reduction: dict | None = None   # accepted; the VAD works on the audio as sent


class AudioOutput(_Model):
    format: AudioFormat | None = None
    voice: Annotated[str, Field(max_length=64)] | None = None
    speed: float = Field(default=1.0, ge=0.25, le=1.5)


class SessionAudio(_Model):
    input: AudioInput | None = None
    output: AudioOutput | None = None


Modalities = Annotated[list[Literal["text", "audio"]], Field(min_length=1, max_length=1)]
MaxTokens = Annotated[int, Field(ge=1, le=1 << 20)] | Literal["inf"]


class SessionFields(_Model):
    """`session` of session.update (only the fields sent change anything): a realtime session's,
    or a transcription session's (type "transcription": audio input and include only)."""

    type: Literal["realtime", "transcription"] = "realtime"
    include: list[Literal["item.input_audio_transcription.logprobs"]] | None = None
    model: Annotated[str, Field(max_length=256)] | None = None
    instructions: Annotated[str, Field(max_length=MAX_TEXT)] | None = None
    output_modalities: Modalities | None = None
    audio: SessionAudio | None = None
    max_output_tokens: MaxTokens | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)


class ContentPart(_Model):
    type: Literal["input_text", "input_audio", "input_image", "text", "output_text", "output_audio"]
    text: Annotated[str, Field(max_length=MAX_TEXT)] | None = None
    audio: str | None = None
    transcript: Annotated[str, Field(max_length=MAX_TEXT)] | None = None
    image_url: str | None = None
    detail: Literal["auto", "low", "high"] | None = None


class Item(_Model):
    """A message (role, content), a function call (call_id, name, arguments) or a call's output
    (call_id, output); conversation.py checks that each has its fields."""

    id: Id | None = None
    type: Literal["message", "function_call", "function_call_output"]
    role: Literal["user", "assistant", "system"] | None = None
    content: Annotated[list[ContentPart], Field(max_length=MAX_PARTS)] | None = None
    status: Literal["completed", "incomplete", "in_progress"] | None = None
    call_id: Id | None = None
    name: Annotated[str, Field(max_length=64)] | None = None
    arguments: Annotated[str, Field(max_length=MAX_TEXT)] | None = None
    output: Annotated[str, Field(max_length=MAX_TEXT)] | None = None


class ResponseAudio(_Model):
    output: AudioOutput | None = None


class ResponseFields(_Model):
    """`response` of response.create: overrides for this response only."""

    instructions: Annotated[str, Field(max_length=MAX_TEXT)] | None = None
    output_modalities: Modalities | None = None
    audio: ResponseAudio | None = None
    max_output_tokens: MaxTokens | None = None
    conversation: Literal["auto", "none"] | None = None
    input: Annotated[list[Item], Field(max_length=MAX_ITEMS_PER_EVENT)] | None = None
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    # vLLM-Omni's extra, as in chat completions: one dict of SamplingParams fields per stage.
    sampling_params_list: Annotated[list[dict[str, Any] | None], Field(max_length=8)] | None = None


class _Event(_Model):
    event_id: Annotated[str, Field(max_length=MAX_ID)] | None = None


class SessionUpdate(_Event):
    type: Literal["session.update"]
    session: SessionFields


class InputAudioBufferAppend(_Event):
    type: Literal["input_audio_buffer.append"]
    audio: str


class InputAudioBufferCommit(_Event):
    type: Literal["input_audio_buffer.commit"]


class InputAudioBufferClear(_Event):
    type: Literal["input_audio_buffer.clear"]


class ConversationItemCreate(_Event):
    type: Literal["conversation.item.create"]
    item: Item
    previous_item_id: Id | None = None


class ConversationItemDelete(_Event):
    type: Literal["conversation.item.delete"]
    item_id: Id


class ConversationItemRetrieve(_Event):
    type: Literal["conversation.item.retrieve"]
    item_id: Id


class ConversationItemTruncate(_Event):
    type: Literal["conversation.item.truncate"]
    item_id: Id
    content_index: int = Field(ge=0)
    audio_end_ms: int = Field(ge=0)


class ResponseCreate(_Event):
    type: Literal["response.create"]
    response: ResponseFields | None = None


class ResponseCancel(_Event):
    type: Literal["response.cancel"]
    response_id: Id | None = None


class OutputAudioBufferClear(_Event):
    type: Literal["output_audio_buffer.clear"]


CLIENT_EVENTS: dict[str, type[_Event]] = {
    cls.model_fields["type"].annotation.__args__[0]: cls
    for cls in (SessionUpdate, InputAudioBufferAppend, InputAudioBufferCommit, InputAudioBufferClear,
                ConversationItemCreate, ConversationItemDelete, ConversationItemRetrieve, ConversationItemTruncate,
                ResponseCreate, ResponseCancel, OutputAudioBufferClear)
}


def param_of(error: dict, data) -> str:
    """A validation error's place in the event, as OpenAI names params ("session.audio.input...");
    the tag pydantic adds for a union told apart by `type` is not a place in the event."""
    out, at = "", data
    for p in error["loc"]:
        if isinstance(at, dict) and p not in at and at.get("type") == p:
            continue
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
        inside = isinstance(at, dict) and p in at or isinstance(at, list) and isinstance(p, int) and p < len(at)
        at = at[p] if inside else None
    if error["type"] in ("union_tag_invalid", "union_tag_not_found"):
        out += ".type"  # the union's tag itself is what is wrong
    return out


def parse(text: str | bytes) -> _Event:
    """One client message -> its event model (EventError naming what is wrong)."""
    try:
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise EventError(f"the message is not valid JSON: {e}", "invalid_json") from None
    if not isinstance(data, dict):
        raise EventError("a client event must be a JSON object with a 'type'", "invalid_event")
    event_id = data.get("event_id") if isinstance(data.get("event_id"), str) else None
    kind = data.get("type")
    cls = CLIENT_EVENTS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        shown = repr(kind)[:80]
        raise EventError(f"unknown event type {shown}; this server takes {sorted(CLIENT_EVENTS)}",
                         "unknown_event_type", "type", event_id)
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        param = param_of(first, data)
        raise EventError(f"{kind}: {param}: {first['msg']}", "invalid_value", param, event_id) from None
