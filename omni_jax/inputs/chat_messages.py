"""A chat prompt's parts as the chat template reads them, checked: its messages, tools and
template variables. Every problem is a PromptError naming the part.

`canonical` reduces OpenAI-style messages to what a template reads (media parts to {"type": kind},
their sources kept apart as the prompt's media items, an assistant's `tool_calls` and
`reasoning_content`), passing every string the user typed through `hide` (chat_text.py: so that a
special token's text stays text). The processor (processor.py) renders and tokenizes the result.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

from ..errors import PromptError
from . import prompt_parts
from .tool_calls import check_tools

Hide = Callable[[str], str]


def canonical(messages: Any, hide: Hide | None = None,
              need_source: bool = True) -> tuple[list[dict], list[prompt_parts.MediaItem]]:
    """The messages with media parts reduced to {"type": kind}, and the media items in order.
    `hide`: applied to roles, text, tool calls and reasoning (None: left as typed)."""
    if not isinstance(messages, list) or not messages:
        raise PromptError("'messages' must be a non-empty list of {'role', 'content'} dicts")

    def typed(text: str, where: str) -> str:
        check_unicode(text, where)
        return text if hide is None else hide(text)

    out, items = [], []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if not isinstance(m, dict) or "role" not in m or ("content" not in m and not calls):
            raise PromptError(f"messages[{i}] must be a dict with 'role' and 'content'")
        if not isinstance(m["role"], str) or not m["role"]:
            raise PromptError(f"messages[{i}].role must be a non-empty string, got {m['role']!r}")
        role, content = typed(m["role"], f"messages[{i}].role"), m.get("content")
        if content is None and calls:
            content = ""
        extra = {}
        if calls:
            if role != "assistant":
                raise PromptError(f"messages[{i}].tool_calls: only an assistant message makes tool calls")
            extra["tool_calls"] = [_tool_call(c, f"messages[{i}].tool_calls[{j}]", typed) for j, c in enumerate(calls)]
        thought = m.get("reasoning_content")
        if thought is not None:
            if role != "assistant" or not isinstance(thought, str):
                raise PromptError(f"messages[{i}].reasoning_content must be a string, in an assistant message")
            extra["reasoning_content"] = typed(thought, f"messages[{i}].reasoning_content")
        if isinstance(content, str):
            out.append({"role": role, "content": typed(content, f"messages[{i}].content"), **extra})
            continue
        if not isinstance(content, list):
            raise PromptError(f"messages[{i}].content must be a string or a list of parts")
        parts = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind, item = prompt_parts.parse_part(part, where, need_source)
            if kind == "text":
                parts.append({"type": "text", "text": typed(item, where)})
            else:
                parts.append({"type": kind})
                items.append(item)
        out.append({"role": role, "content": parts, **extra})
    return out, items


def _tool_call(call: Any, where: str, typed) -> dict:
    """An assistant message's tool call as the template reads it: OpenAI's {"id"?, "type":
    "function", "function": {"name", "arguments": JSON text or object}}."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise PromptError(f"{where} must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}")
    args = fn.get("arguments", {})
    if isinstance(args, dict):  # as the template's tojson would write it, with its strings hidden too
        args = json.dumps(_json(args, f"{where}.function.arguments", None), ensure_ascii=False)
    if not isinstance(args, str):
        raise PromptError(f"{where}.function.arguments must be JSON text or an object")
    args = typed(args, f"{where}.function.arguments")
    return {"type": "function", "function": {"name": typed(fn["name"], f"{where}.function.name"), "arguments": args}}


def tools(given: Any, hide: Hide | None = None) -> list | None:
    """A prompt's tools, checked, their strings passed through `hide`."""
    if given is None:
        return None
    check_tools(given)
    return _json(given, "tools", hide)


# chat_template_kwargs may not set what the template is given otherwise (the messages, the tools,
# apply_chat_template's own arguments, its helpers and the special tokens it is told of).
_TEMPLATE_VARIABLE = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")
_TEMPLATE_OWN = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "raise_exception", "strftime_now", "bos_token",
    "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token", "additional_special_tokens"})


def template_kwargs(given: Any, hide: Hide | None = None) -> dict | None:
    """A prompt's chat_template_kwargs, checked, their strings passed through `hide`."""
    if given is None:
        return None
    if not isinstance(given, dict):
        raise PromptError("'chat_template_kwargs' must be a dict of template variables")
    for key in given:
        if not isinstance(key, str) or not _TEMPLATE_VARIABLE.fullmatch(key):
            raise PromptError(f"chat_template_kwargs: {key!r:.80} is not a template variable's name (letters, "
                              f"digits and '_', at most 64)")
        if key in _TEMPLATE_OWN:
            raise PromptError(f"chat_template_kwargs: {key!r} cannot be set: the template is given it otherwise")
    return _json(given, "chat_template_kwargs", hide)


# How deep a prompt's tools or template variables may nest (a real schema is a few levels deep; a
# deeper one would take the recursion of JSON encoders, Jinja and llguidance to their limits).
MAX_JSON_DEPTH = 64


def _json(value: Any, name: str, hide: Hide | None) -> Any:
    stack = [(value, 1)]
    while stack:  # iterative: a value nested past Python's recursion limit is named, not a RecursionError
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise PromptError(f"'{name}' nests deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(item, dict):
            stack += [(v, depth + 1) for v in item.values()]
        elif isinstance(item, (list, tuple)):
            stack += [(v, depth + 1) for v in item]
    try:
        json.dumps(value)
    except (TypeError, ValueError) as e:
        raise PromptError(f"'{name}' must be JSON: {e}") from None
    return value if hide is None else _hidden(value, hide)


def _hidden(value: Any, hide: Hide) -> Any:
    """`value` (JSON) with its keys and strings passed through `hide`."""
    if isinstance(value, str):
        return hide(value)
    if isinstance(value, list):
        return [_hidden(v, hide) for v in value]
    if isinstance(value, dict):
        return {hide(k): _hidden(v, hide) for k, v in value.items()}
    return value


def check_unicode(text: str, where: str = "the prompt") -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate, e.g. from a bad JSON escape
        raise PromptError(f"{where} is not valid Unicode text: {e.reason} "
                          f"({text[e.start]!r} at character {e.start})") from None
