"""Request bodies, shaped like OpenAI's API (pydantic validates; a bad field is a 400 naming it).

Fields OpenAI has and OmniJax does not serve yet are accepted here and refused by the
handlers with a 400 that says so, rather than silently ignored. Unknown fields are
ignored, as vLLM does (clients send vendor extras through `extra_body`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..engine.sampling_params import INT32_MAX, MAX_LOGPROBS

# Per-field bounds: fields with a natural size are refused (400 naming them) past it, so that no
# value costs more than it can be worth. A message's text is bounded by the model's context (the
# prompt processor refuses a text that cannot fit, without tokenizing it), media by the body limit.
MAX_NAME = 256          # model, user, a message's name
MAX_VOICE = 64
MAX_MESSAGES = 4096
MAX_PARTS = 4096        # content parts of one message
MAX_STOP = 16
MAX_STOP_CHARS = 1024
MAX_STAGES = 8          # entries of sampling_params_list
MAX_DETOKENIZE = 1 << 17  # token ids one /detokenize may decode
MAX_CHOICES = 64        # choices of one request: n, times the prompts of a completions batch
Name = Annotated[str, Field(max_length=MAX_NAME)]
# vLLM's: a reasoning model's thinking ends with its end tag after this many tokens (reasoning.py)
ThinkingBudget = Annotated[int, Field(ge=0, le=INT32_MAX)]

CHAT_AUDIO_FORMATS = ("wav", "mp3", "flac", "opus", "pcm16")
SPEECH_FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class AudioReference(_Body):
    """An earlier spoken reply by its `message.audio.id` (OpenAI's multi-turn audio)."""

    id: Name


class ChatMessage(_Body):
    """One chat message; `content` parts are checked in messages.py (which knows the media rules)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[Any], Field(max_length=MAX_PARTS)] | None = None
    name: Name | None = None
    audio: AudioReference | None = None
    tool_calls: Annotated[list[Any], Field(max_length=MAX_PARTS)] | None = None  # an assistant's (messages.py)
    tool_call_id: Name | None = None  # a tool message's: the call it answers
    # an assistant's thinking, as a reasoning model's reply gave it (vLLM's name, and the newer one)
    reasoning_content: str | None = None
    reasoning: str | None = None


class AudioOptions(_Body):
    """`audio`: the voice and the encoding of a spoken reply."""

    voice: Annotated[str, Field(max_length=MAX_VOICE)] | None = None
    format: Literal["wav", "mp3", "flac", "opus", "pcm16"] = "wav"


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """The thinker's sampling fields every text-reply API takes: OpenAI's, and vLLM's extras (sent
    through the client's extra_body)."""

    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    top_k: int | None = Field(default=None, ge=-1)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool | None = None
    # the reply's constraint: json, json_object, regex, choice or grammar (server/structured.py)
    structured_outputs: dict[str, Any] | None = None


class _Stops(_Sampling):
    """`stop`, as both completions APIs bound it."""

    stop: str | list[str] | None = None

    @field_validator("stop")
    @classmethod
    def _short_stops(cls, stop):
        # Checked here, not by a constrained type: an error inside the union would be named
        # `stop.constrained-str`, and the text's own checks (UTF-8) come later, naming `stop`.
        if isinstance(stop, list) and len(stop) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        for s in [stop] if isinstance(stop, str) else stop or []:
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters")
        return stop


class ChatCompletionRequest(_Stops):
    """POST /v1/chat/completions."""

    model: Name
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    modalities: list[Literal["text", "audio"]] | None = None
    audio: AudioOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Name | None = None
    response_format: dict[str, Any] | None = None  # text, json_object or json_schema (server/structured.py)
    logit_bias: dict[str, Any] | None = None  # token id -> bias (SamplingParams checks it)
    # Function calling (server/tools.py).
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # vLLM's: more variables for the chat template; whether a reasoning model's thinking is shown
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True
    thinking_token_budget: ThinkingBudget | None = None
    # OpenAI's, not served: a request that sets them is refused by name (chat.py), since
    # ignoring them would answer a different question than the one asked.
    functions: list[Any] | None = None
    function_call: Any = None
    prediction: Any = None
    web_search_options: Any = None
    # vLLM-Omni: one dict of SamplingParams fields per stage (thinker, talker, vocoder); null keeps a default.
    sampling_params_list: Annotated[list[dict[str, Any] | None], Field(max_length=MAX_STAGES)] | None = None


class CompletionRequest(_Stops):
    """POST /v1/completions (OpenAI's legacy text completions). `prompt` is a text, a list of
    texts, a list of token ids or a list of lists of them; its shape is checked by the handler."""

    model: Name
    prompt: str | list[Any]
    max_tokens: int | None = Field(default=16, ge=0)  # OpenAI's default; 0 only with echo
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    best_of: int | None = None
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Name | None = None
    logit_bias: dict[str, Any] | None = None  # token id -> bias (SamplingParams checks it)
    response_format: dict[str, Any] | None = None  # vLLM's: text, json_object or json_schema
    # OpenAI's, not served (completions.py refuses it by name).
    suffix: str | None = None


class SpeechRequest(_Body):
    """POST /v1/audio/speech."""

    model: Name
    input: str = Field(min_length=1, max_length=4096)
    voice: Annotated[str, Field(max_length=MAX_VOICE)] | None = None
    response_format: Literal["mp3", "opus", "aac", "flac", "wav", "pcm"] = "mp3"
    speed: float = Field(default=1.0, ge=0.25, le=4.0)
    stream_format: Literal["audio", "sse"] = "audio"
    instructions: Annotated[str, Field(max_length=4096)] | None = None
    sampling_params_list: Annotated[list[dict[str, Any] | None], Field(max_length=MAX_STAGES)] | None = None


class TokenizeRequest(_Body):
    """POST /tokenize (vLLM's): a text (`prompt`, no chat template) or chat `messages`."""

    model: Name
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    tools: list[Any] | None = None  # a chat's function tools, written into its prompt
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None  # Qwen's tokenizers add no special tokens to a text either way
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    """POST /detokenize (vLLM's)."""

    model: Name
    tokens: Annotated[list[int], Field(max_length=MAX_DETOKENIZE)]


class ResponseRequest(_Sampling):
    """POST /v1/responses (OpenAI's Responses API; text replies). `input` items are checked by the
    handler (responses.py), which knows the media rules."""

    model: Name
    input: str | Annotated[list[Any], Field(max_length=MAX_MESSAGES)]
    instructions: str | None = None
    previous_response_id: Name | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    include: Annotated[list[str], Field(max_length=16)] | None = None
    stream: bool = False
    store: bool = True
    metadata: dict[str, str] | None = None
    user: Name | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    thinking_token_budget: ThinkingBudget | None = None
    # OpenAI's, not served: refused by name (responses.py) when set to anything but their off value.
    tools: list[Any] | None = None
    tool_choice: Any = None
    reasoning: Any = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None

    @field_validator("metadata")
    @classmethod
    def _small_metadata(cls, metadata):
        # OpenAI's bounds: 16 pairs, keys of 64 characters, values of 512.
        if metadata is not None and (len(metadata) > 16 or any(len(k) > 64 or len(v) > 512
                                                                for k, v in metadata.items())):
            raise ValueError("at most 16 pairs, keys of at most 64 characters and values of at most 512")
        return metadata
