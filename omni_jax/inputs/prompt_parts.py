"""The parts of a prompt, read and checked before anything is tokenized or loaded: its keys,
chat message parts (text, image, audio, video in their OpenAI and vLLM spellings), the media
of `multi_modal_data`, token ids, `prompt_embeds` and `use_audio_in_video`. Every problem
raises `PromptError` naming where it is (`InputProcessor` does the rest, inputs/processor.py)."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import os
from typing import Any

import numpy as np

from ..errors import PromptError, PromptTooLongError

# A content part's type -> the kind of what it holds.
_PART_KINDS = {
    "text": "text", "image": "image", "image_url": "image", "audio": "audio", "input_audio": "audio",
    "audio_url": "audio", "video": "video", "video_url": "video",
}
# The keys a prompt dict may have.
PROMPT_KEYS = {"prompt", "prompt_token_ids", "prompt_embeds", "messages", "multi_modal_data",
                "use_audio_in_video", "mm_processor_kwargs", "tools", "continue_final_message", "chat_template_kwargs"}


@dataclasses.dataclass
class MediaItem:
    """One media item of a prompt before loading: its kind, source, options and where it came from."""

    kind: str
    src: Any
    where: str
    fps: float | None = None
    audio: Any = None


def message_texts(messages: Any, tools: Any = None, template_kwargs: Any = None):
    """The strings a chat's messages hold (roles, contents, text parts, tool calls) and its tools'
    and template arguments' JSON; malformed ones are skipped here and named by
    `chat_messages.canonical`."""
    for extra in (tools, template_kwargs):
        if extra is not None:
            yield json.dumps(extra, default=str)
    if not isinstance(messages, list):
        return
    for m in messages:
        if not isinstance(m, dict):
            continue
        yield m.get("role")
        yield m.get("reasoning_content")
        if isinstance(m.get("tool_calls"), list):
            yield json.dumps(m["tool_calls"], default=str)
        content = m.get("content")
        if isinstance(content, list):
            for part in content:
                yield part if isinstance(part, str) else (part.get("text") if isinstance(part, dict) else None)
        else:
            yield content


def token_ids(raw: Any) -> np.ndarray:
    try:
        ids = np.asarray(raw)
    except Exception:
        raise PromptError("'prompt_token_ids' must be a list of ints") from None
    if ids.size and (ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer)):
        raise PromptError("'prompt_token_ids' must be a flat list of ints")
    if not ids.size:
        return np.zeros(0, np.int32)
    # Range-check the values given, before the int32 cast could wrap them to valid ids.
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi > np.iinfo(np.int32).max:
        raise PromptError(f"token id {lo if lo < 0 else hi} is out of range")
    return ids.astype(np.int32)


def prompt_embeds(raw: Any, hidden_size: int, max_len: int | None) -> np.ndarray:
    """`prompt_embeds` as float32 [T, hidden_size], or PromptError naming what is wrong."""
    try:
        rows = np.asarray(raw)  # numpy, JAX (copied to the host) or nested lists
    except Exception as e:
        raise PromptError(f"'prompt_embeds' must be an array: {type(e).__name__}: {e}") from None
    # Booleans, complex numbers, strings and objects are not embeddings (bfloat16 is kind "V").
    if rows.dtype.kind in "bcOSUMm":
        raise PromptError(f"'prompt_embeds' must hold real numbers, got dtype {rows.dtype}")
    if rows.ndim != 2:
        raise PromptError(f"'prompt_embeds' must be [num_tokens, hidden_size], got shape {rows.shape}")
    if rows.shape[0] == 0:
        raise PromptError("empty prompt: 'prompt_embeds' has no rows")
    if rows.shape[1] != hidden_size:
        raise PromptError(f"'prompt_embeds' rows have size {rows.shape[1]}, but the thinker's hidden size "
                          f"is {hidden_size}")
    if max_len is not None and rows.shape[0] > max_len:
        raise PromptTooLongError(f"'prompt_embeds' has {rows.shape[0]} rows, more than the {max_len} a prompt may "
                          f"have (the thinker's max_model_len - 1)")
    try:
        rows = np.ascontiguousarray(rows, np.float32)
    except (TypeError, ValueError) as e:
        raise PromptError(f"'prompt_embeds' cannot be cast to float32: {e}") from None
    finite = np.isfinite(rows)
    if not finite.all():
        r = int(np.flatnonzero(~finite.all(axis=1))[0])
        raise PromptError(f"'prompt_embeds' holds NaN or inf (first in row {r})")
    return rows


def use_audio_in_video(prompt: dict, default: bool) -> bool:
    value = prompt.get("use_audio_in_video")
    kw = prompt.get("mm_processor_kwargs")
    if kw is not None:
        if not isinstance(kw, dict):
            raise PromptError("'mm_processor_kwargs' must be a dict")
        unknown = set(kw) - {"use_audio_in_video"}
        if unknown:
            raise PromptError(f"unknown mm_processor_kwargs {sorted(unknown)}; supported: 'use_audio_in_video'")
        if value is None:
            value = kw.get("use_audio_in_video")
    if value is None:
        return default
    if not isinstance(value, (bool, np.bool_)):
        raise PromptError(f"'use_audio_in_video' must be true or false, got {value!r}")
    return bool(value)


def _url_of(value: Any, where: str, key: str) -> Any:
    """The `url` of an OpenAI `{"url": ...}` object (or the value itself when it is a plain string)."""
    if isinstance(value, dict):
        if "url" not in value:
            raise PromptError(f"{where}: '{key}' must be {{'url': ...}}")
        return value["url"]
    return value


def parse_part(part: Any, where: str, need_source: bool = True) -> tuple[str, Any]:
    """('text', str) or (kind, MediaItem) for one content part (a media part may lack its source
    only when just rendering the template)."""
    if isinstance(part, str):
        return "text", part
    if not isinstance(part, dict):
        raise PromptError(f"{where}: a content part must be a dict, got {type(part).__name__}")
    ptype = part.get("type")
    if ptype is None:  # as the chat template: a part is known by its key
        ptype = next((k for k in _PART_KINDS if k in part), None)
    kind = _PART_KINDS.get(ptype)
    if kind is None:
        raise PromptError(f"{where}: unknown part type {ptype!r}; expected one of {sorted(_PART_KINDS)}")
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise PromptError(f"{where}: a text part needs a string 'text'")
        return "text", text
    if ptype == "input_audio":
        payload = part.get("input_audio")
        if not isinstance(payload, dict) or not isinstance(payload.get("data"), str):
            raise PromptError(f"{where}: 'input_audio' must be {{'data': base64 string, 'format': ...}}")
        try:
            src = base64.b64decode(payload["data"], validate=False)
        except (binascii.Error, ValueError) as e:
            raise PromptError(f"{where}: 'input_audio' data is not valid base64 ({e})") from None
    elif ptype.endswith("_url"):
        src = _url_of(part.get(ptype), where, ptype)
    else:
        src = next((part[k] for k in (kind, "url", "path") if part.get(k) is not None), None)
    if src is None and need_source:
        raise PromptError(f"{where}: the {kind} part has no source (expected key {kind!r})")
    fps = part.get("fps")
    if fps is not None and (kind != "video" or not isinstance(fps, (int, float)) or fps <= 0):
        raise PromptError(f"{where}: 'fps' must be a positive number on a video part")
    audio = part.get("audio") if kind == "video" else None
    return kind, MediaItem(kind, src, where, fps=fps, audio=audio)


def _is_video_source(x: Any) -> bool:
    """A whole video (file, URL, bytes, frame list / 4-D array, options dict), as opposed to one frame."""
    if isinstance(x, (str, os.PathLike, bytes, bytearray, dict, list, tuple)):
        return True
    return isinstance(x, np.ndarray) and x.ndim == 4


def media_items(mm: dict) -> list[MediaItem]:
    """The items of a raw multi_modal_data dict, per kind in order."""
    unknown = set(mm) - {"image", "audio", "video"}
    if unknown:
        raise PromptError(f"unknown multi_modal_data key(s) {sorted(unknown)}; use 'image', 'audio', 'video'")
    items: list[MediaItem] = []
    for kind in ("image", "audio", "video"):
        if kind not in mm or mm[kind] is None:
            continue
        value = mm[kind]
        if kind == "image":
            many = isinstance(value, (list, tuple))
        elif kind == "audio":
            # (waveform, rate) and {"array", "sampling_rate"} are one audio; a list holds several.
            many = isinstance(value, list)
        else:
            # A list of files / frame lists is several videos; a list of frames is one.
            many = isinstance(value, (list, tuple)) and len(value) > 0 and all(_is_video_source(v) for v in value)
        for n, v in enumerate(value if many else [value]):
            where = f"multi_modal_data[{kind!r}]" + (f"[{n}]" if many else "")
            fps = audio = None
            if kind == "video" and isinstance(v, dict):
                src = v.get("video", v.get("frames"))
                fps, audio = v.get("fps"), v.get("audio")
                if src is None:
                    raise PromptError(f"{where}: a video dict needs 'video' (or 'frames')")
                v = src
            items.append(MediaItem(kind, v, where, fps=fps, audio=audio))
    return items
