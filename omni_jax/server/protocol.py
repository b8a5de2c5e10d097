"""Request bodies, shaped like OpenAI's API (pydantic validates; a bad field is a 400 naming it).

Fields OpenAI has and OmniJax does not serve yet are accepted here and refused by the
handlers with a 400 that says so, rather than silently ignored. Unknown fields are
ignored, as vLLM does (clients send vendor extras through `extra_body`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

CHAT_AUDIO_FORMATS = ("wav", "mp3", "flac", "opus", "pcm16")
SPEECH_FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ChatMessage(_Body):
    """One chat message; `content` parts are checked in messages.py (which knows the media rules)."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[Any] | None = None
    name: str | None = None


class AudioOptions(_Body):
    """`audio`: the voice and the encoding of a spoken reply."""

    voice: str | None = None
    format: Literal["wav", "mp3", "flac", "opus", "pcm16"] = "wav"


class StreamOptions(_Body):
    include_usage: bool = False


class ChatCompletionRequest(_Body):
    """POST /v1/chat/completions."""

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    modalities: list[Literal["text", "audio"]] | None = None
    audio: AudioOptions | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = 1
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras (sent through the client's extra_body).
    top_k: int | None = Field(default=None, ge=-1)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool | None = None
    # vLLM-Omni: one dict of SamplingParams fields per stage (thinker, talker, vocoder); null keeps a default.
    sampling_params_list: list[dict[str, Any] | None] | None = None


class SpeechRequest(_Body):
    """POST /v1/audio/speech."""

    model: str
    input: str = Field(min_length=1, max_length=4096)
    voice: str | None = None
    response_format: Literal["mp3", "opus", "aac", "flac", "wav", "pcm"] = "mp3"
    speed: float = Field(default=1.0, ge=0.25, le=4.0)
    stream_format: Literal["audio", "sse"] = "audio"
    instructions: str | None = None
    sampling_params_list: list[dict[str, Any] | None] | None = None
