"""OpenAI chat messages -> an OmniJax prompt, with the server's media access rules.

Media parts may be `data:` URLs (base64 inline) or local files under the directory the
server was allowed to read (`--allowed-local-media-path`, as vLLM); http(s) URLs are refused
(the server does not fetch remote media), as is every local path when no directory is allowed.
"""

from __future__ import annotations

import os
from typing import Any

from ..inputs.media import parse_source
from ..errors import MediaError
from .errors import bad_request, short
from .schemas import ChatMessage
from .reply_audio import ReplyAudio

_URL_PARTS = {"image_url": "image", "video_url": "video", "audio_url": "audio"}
_INPUT_AUDIO_FORMATS = ("wav", "mp3")


class MediaPolicy:
    """Which local files a request may name: those under `allowed_dir` (None: no local file)."""

    def __init__(self, allowed_dir: str | None = None):
        self.allowed_dir = os.path.realpath(allowed_dir) if allowed_dir else None

    def source(self, url: Any, param: str) -> str:
        """The source to hand the processor for a media URL, or a 400 naming `param`.

        The URL is read by the loader's own parser (`parse_source`), so what is judged here is
        what would be opened; a path outside the allowed directory gets the same reply whether
        it exists or not."""
        if not isinstance(url, str) or not url:
            raise bad_request(f"{param} must be a non-empty string", param)
        try:
            src = parse_source(url, "the media")
        except MediaError as e:
            raise bad_request(f"{param}: {e}", param) from None
        if src.kind == "data":
            if "," not in url:
                raise bad_request(f"{param}: malformed data: URL (no ',' after the media type)", param)
            return url
        if src.kind == "remote":
            if src.scheme in ("http", "https"):
                raise bad_request(f"{param}: remote URLs are not fetched by this server; send the media inline as a "
                                  f"data: URL (base64) or as a local path under --allowed-local-media-path", param)
            raise bad_request(f"{param}: unsupported URL scheme {src.scheme[:16]!r}; use a data: URL or a local path",
                              param)
        if self.allowed_dir is None:
            raise bad_request(f"{param}: local files are not allowed; start the server with "
                              f"--allowed-local-media-path DIR, or send the media as a data: URL", param)
        real = os.path.realpath(src.value)
        if os.path.commonpath([real, self.allowed_dir]) != self.allowed_dir or not os.path.isfile(real):
            raise bad_request(f"{param}: {short(src.value)} is not a file in the allowed media directory", param)
        return real


def message_part(part: Any, where: str, policy: MediaPolicy) -> dict:
    """One OpenAI content part -> the processor's part."""
    if not isinstance(part, dict):
        raise bad_request(f"{where} must be an object with a 'type'", where)
    ptype = part.get("type")
    if ptype == "text":
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{where}.text must be a string", f"{where}.text")
        return {"type": "text", "text": part["text"]}
    if ptype in _URL_PARTS:
        obj = part.get(ptype)
        url = obj.get("url") if isinstance(obj, dict) else obj
        kind = _URL_PARTS[ptype]
        return {"type": kind, kind: policy.source(url, f"{where}.{ptype}.url")}
    if ptype == "input_audio":
        obj = part.get("input_audio")
        if not isinstance(obj, dict) or not isinstance(obj.get("data"), str):
            raise bad_request(f"{where}.input_audio must be {{'data': base64, 'format': 'wav'|'mp3'}}",
                              f"{where}.input_audio")
        if obj.get("format", "wav") not in _INPUT_AUDIO_FORMATS:
            raise bad_request(f"{where}.input_audio.format must be one of {list(_INPUT_AUDIO_FORMATS)}",
                              f"{where}.input_audio.format")
        return {"type": "input_audio", "input_audio": {"data": obj["data"], "format": obj.get("format", "wav")}}
    raise bad_request(f"{where}.type {ptype!r} is not supported; use text, image_url, input_audio, audio_url or "
                      f"video_url", f"{where}.type")


def to_prompt(messages: list[ChatMessage], policy: MediaPolicy, replies: ReplyAudio | None = None,
              template_kwargs: dict | None = None) -> dict:
    """The OmniJax chat prompt for OpenAI messages (400 naming the first bad part), with vLLM's
    chat_template_kwargs if given. An assistant message with `audio.id` stands for that earlier
    spoken reply (`replies` keeps them)."""
    out = []
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        content = m.content
        if m.audio is not None:
            if role != "assistant":
                raise bad_request(f"messages[{i}].audio is only allowed in assistant messages", f"messages[{i}].audio")
            said = replies.transcript(m.audio.id) if replies is not None else None
            if said is None:
                raise bad_request(f"messages[{i}].audio.id: no spoken reply {short(m.audio.id)} is kept here (unknown or "
                                  f"expired)", f"messages[{i}].audio.id")
            content = said if not content else content
        if content is None:
            content = ""
        if isinstance(content, list):
            content = [message_part(p, f"messages[{i}].content[{j}]", policy) for j, p in enumerate(content)]
        message = {"role": role, "content": content}
        thought = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if thought is not None:
            if role != "assistant":
                raise bad_request(f"messages[{i}].reasoning_content is only allowed in assistant messages",
                                  f"messages[{i}].reasoning_content")
            message["reasoning_content"] = thought
        if m.tool_calls:
            if role != "assistant":
                raise bad_request(f"messages[{i}].tool_calls is only allowed in assistant messages",
                                  f"messages[{i}].tool_calls")
            message["tool_calls"] = [_tool_call(c, f"messages[{i}].tool_calls[{j}]")
                                     for j, c in enumerate(m.tool_calls)]
        out.append(message)
    return {"messages": out, **({"chat_template_kwargs": template_kwargs} if template_kwargs is not None else {})}


def _tool_call(call: Any, where: str) -> dict:
    """An assistant message's earlier call: {"id", "type": "function", "function": {"name",
    "arguments": JSON text}}."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
        raise bad_request(f"{where} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments': "
                          f"JSON text}}}}", where)
    return {"type": "function", "function": {"name": fn["name"], "arguments": fn["arguments"]}}
