"""The multipart form of `/v1/audio/transcriptions` and `/v1/audio/translations`, checked.

OpenAI's clients send lists as `key[]` and objects as `key[field]` (a JSON object in one field
is taken too). A field this server cannot honour (word timestamps, speaker names) is refused
by name with a 400, not ignored; fields no OpenAI endpoint has are ignored, as in the JSON bodies.
"""

from __future__ import annotations

import dataclasses
import json

from pydantic import ValidationError

from .errors import bad_request, short
from .vad import VADSettings

FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
MAX_TEXT = 4096        # characters of the prompt, a language or a keyword
MAX_LIST = 32          # keywords, languages


@dataclasses.dataclass(frozen=True)
class TranscriptionForm:
    """What a transcription (or translation) request asks for, checked; `file` is its bytes."""

    file: bytes
    model: str
    language: str | None = None
    prompt: str | None = None
    response_format: str = "json"
    temperature: float = 0.0
    stream: bool = False
    logprobs: bool = False                  # include[]=logprobs
    keywords: tuple[str, ...] = ()
    languages: tuple[str, ...] = ()
    chunking: VADSettings | None = None  # chunking_strategy: "auto" or server_vad settings


def _list(form, name: str) -> list[str]:
    return [*form.getlist(f"{name}[]"), *form.getlist(name)]


def _text(form, name: str, limit: int = MAX_TEXT) -> str | None:
    value = form.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise bad_request(f"{name} must be a text field, not a file", name)
    if len(value) > limit:
        raise bad_request(f"{name} may have at most {limit} characters", name)
    return value


def _texts(form, name: str) -> tuple[str, ...]:
    values = _list(form, name)
    if len(values) > MAX_LIST:
        raise bad_request(f"{name} may have at most {MAX_LIST} entries", name)
    if any(not isinstance(v, str) or len(v) > MAX_TEXT for v in values):
        raise bad_request(f"each of {name} must be a text of at most {MAX_TEXT} characters", name)
    return tuple(v for v in values if v)


def _chunking(form) -> VADSettings | None:
    fields = {k[len("chunking_strategy["):-1]: v for k, v in form.multi_items()
              if k.startswith("chunking_strategy[") and k.endswith("]")}
    raw = _text(form, "chunking_strategy")
    if raw is None and not fields:
        return None
    if raw == "auto":
        return VADSettings(type="server_vad")
    if raw is not None:
        try:
            fields = json.loads(raw)
        except ValueError:
            fields = None
        if not isinstance(fields, dict):
            raise bad_request(f"chunking_strategy must be 'auto' or a server_vad object, got {short(raw)}",
                              "chunking_strategy")
    try:
        return VADSettings.model_validate(fields)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise bad_request(f"chunking_strategy.{where}: {err['msg']}", f"chunking_strategy.{where}") from None


async def read_form(request, translate: bool) -> TranscriptionForm:
    """The request's form, checked (400 naming the field at fault), with its file read."""
    async with request.form(max_files=1, max_fields=256) as form:
        return await _checked(form, translate)


async def _checked(form, translate: bool) -> TranscriptionForm:
    file = form.get("file")
    if file is None or isinstance(file, str):
        raise bad_request("file is required: the audio as a multipart file", "file")
    model = _text(form, "model", 256)
    if not model:
        raise bad_request("model is required", "model")
    fmt = _text(form, "response_format") or "json"
    if fmt not in FORMATS:
        raise bad_request(f"response_format must be one of {list(FORMATS)}", "response_format")
    try:
        temperature = float(_text(form, "temperature") or 0.0)
    except ValueError:
        raise bad_request("temperature must be a number", "temperature") from None
    if not 0.0 <= temperature <= 2.0:
        raise bad_request("temperature must be in [0, 2]", "temperature")
    stream = (_text(form, "stream") or "false").lower()
    if stream not in ("true", "false", "1", "0"):
        raise bad_request("stream must be true or false", "stream")
    stream = stream in ("true", "1")
    if stream and fmt not in ("json", "text"):
        raise bad_request("stream=true gives transcript.text events; use response_format json or text", "stream")
    include = _list(form, "include")
    if any(v != "logprobs" for v in include):
        raise bad_request(f"include may only hold 'logprobs', got {short(include)}", "include")
    if include and fmt != "json":
        raise bad_request("include=logprobs needs response_format json", "include")
    granularities = _list(form, "timestamp_granularities")
    if any(v not in ("word", "segment") for v in granularities):
        raise bad_request("timestamp_granularities may hold 'word' and 'segment'", "timestamp_granularities")
    if granularities and fmt != "verbose_json":
        raise bad_request("timestamp_granularities needs response_format verbose_json", "timestamp_granularities")
    if "word" in granularities:
        raise bad_request("word timestamps are not supported: the model gives none; segment timestamps are the "
                          "pieces chunking_strategy cuts the audio into", "timestamp_granularities",
                          "unsupported_parameter")
    for name in ("known_speaker_names", "known_speaker_references"):
        if _list(form, name):
            raise bad_request("speaker diarization is not supported by this server", name, "unsupported_parameter")
    asked = dict(language=None if translate else _text(form, "language", 64), prompt=_text(form, "prompt"),
                 keywords=() if translate else _texts(form, "keywords"),
                 languages=() if translate else _texts(form, "languages"), chunking=_chunking(form))
    return TranscriptionForm(file=await file.read(), model=model, response_format=fmt, temperature=temperature,
                             stream=stream, logprobs=bool(include), **asked)
