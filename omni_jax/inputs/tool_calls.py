"""Function calling in Qwen's format, on the reply side: the tools a prompt may carry, the calls
read back out of a reply's text, and the grammar that makes a reply call a tool.

A Qwen model told of tools (inputs/chat_template.py) calls one by writing
`<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>`, one block
per call, after any text of its own. `ToolCallReader` takes the reply's text as it comes and
gives back its content (the text outside the blocks) and each call once its block closes, so a
streamed reply and a whole one read the same. A block whose JSON is not a call stays content.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from ..errors import PromptError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# OpenAI's rule for a function's name; it also keeps the name a plain string in the grammar.
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_TOOLS = 128


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call a reply made: the function's name and its arguments as JSON text (OpenAI's shape)."""

    name: str
    arguments: str


def check_tools(tools: Any, where: str = "tools") -> list[dict]:
    """`tools` as a prompt carries them: OpenAI's [{"type": "function", "function": {"name",
    "description"?, "parameters"?}}]; PromptError naming the first bad one."""
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise PromptError(f"'{where}' must be a list of at most {MAX_TOOLS} tools")
    names = set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict):
            raise PromptError(f"{where}[{i}] must be {{'type': 'function', 'function': {{'name', 'description', "
                              f"'parameters'}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise PromptError(f"{where}[{i}].function.name must be 1 to 64 letters, digits, '_' or '-', got {name!r:.80}")
        if name in names:
            raise PromptError(f"{where}[{i}].function.name {name!r} is given twice")
        names.add(name)
        if not isinstance(fn.get("description", ""), str):
            raise PromptError(f"{where}[{i}].function.description must be a string")
        if not isinstance(fn.get("parameters", {}), dict):
            raise PromptError(f"{where}[{i}].function.parameters must be a JSON schema object")
    return tools


def call_grammar(tools: list[dict], parallel: bool = True, opened: bool = False) -> str:
    """A Lark grammar (llguidance's) for replies that are only calls of these tools, written as
    Qwen writes them, each call's arguments held to its tool's parameter schema; one call, or
    one or more with `parallel`. `opened`: the reply's prompt already ends with the first call's
    `<tool_call>` tag (the reply is the rest)."""
    rules, names = [], []
    for i, tool in enumerate(tools):
        fn = tool["function"]
        schema = dict(fn.get("parameters") or {"type": "object"})
        # Qwen's own spacing (", " and ": "), and no whitespace a model could pad without end.
        schema["x-guidance"] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        head = json.dumps(f'\n{{"name": "{fn["name"]}", "arguments": ')
        rules.append(f'body_{i}: {head} args_{i} "}}\\n" {CLOSE}')
        rules.append(f"args_{i}: %json {json.dumps(schema)}")
        names.append(f"body_{i}")
    # The tags are single tokens of Qwen's vocabularies, named as such (llguidance's <...>).
    first = "body" if opened else "call"
    start = f'start: {first} ("\\n" call)*' if parallel else f"start: {first}"
    return "\n".join([start, f"call: {OPEN} body", "body: " + " | ".join(names), *rules])


def _call(body: str) -> ToolCall | None:
    """The call a block's text holds, or None if it holds none."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


class ToolCallReader:
    """A reply's content and calls, read from its text piece by piece (module docstring).

    Text is given out as content as soon as it cannot be the start of a block; whitespace right
    before a block (Qwen writes a newline after its own words), or after the calls of a reply that
    said nothing before them, is not content."""

    def __init__(self):
        self._held = ""
        self._said = False  # content given out so far
        self.calls = 0  # calls read so far

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """The content and the calls that `text` completes."""
        content, calls = self._read(self._held + text)
        self._said = self._said or bool(content)
        return content, calls

    def _read(self, buf: str) -> tuple[str, list[ToolCall]]:
        content, calls = [], []
        while True:
            if self.calls and not (self._said or any(content)):
                buf = buf.lstrip()
            start = buf.find(OPEN)
            if start < 0:
                break
            end = buf.find(CLOSE, start + len(OPEN))
            if end < 0:  # an open block: wait for its end
                content.append(buf[:start].rstrip() if buf[:start].strip() else "")
                self._held = buf[start:]
                return "".join(content), calls
            content.append(buf[:start].rstrip() if buf[:start].strip() else "")
            call = _call(buf[start + len(OPEN):end])
            if call is None:
                content.append(buf[start:end + len(CLOSE)])
            else:
                calls.append(call)
                self.calls += 1
            buf = buf[end + len(CLOSE):]
        keep = _tag_prefix(buf)
        body = buf[:len(buf) - keep]
        cut = len(body.rstrip())
        content.append(body[:cut])
        self._held = buf[cut:]
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What the held text ends as when the reply ends: a call whose block the reply did not
        close (cut by its length), else content (whitespace after a call is none)."""
        held, self._held = self._held, ""
        if held.startswith(OPEN):
            call = _call(held[len(OPEN):])
            if call is not None:
                self.calls += 1
                return "", [call]
        return ("" if self.calls and not held.strip() else held), []


def _tag_prefix(text: str) -> int:
    """The length of the longest end of `text` that begins `OPEN`."""
    for n in range(min(len(text), len(OPEN) - 1), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


def read_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """A whole reply's content and calls."""
    reader = ToolCallReader()
    content, calls = reader.feed(text)
    rest, last = reader.finish()
    return content + rest, calls + last
