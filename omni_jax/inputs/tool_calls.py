"""Function calling in Qwen's format, on the reply side: the tools a prompt may carry, the calls
read back out of a reply's text, and the grammar that makes a reply call a tool.

A Qwen model told of tools (inputs/chat_template.py) calls one by writing
`<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>`, one block
per call, after any text of its own. `ToolCallReader` takes the reply's text as it comes and
gives back its content (the text outside the blocks) and its calls, each as it is written (its
name, then its arguments' text as it comes), so a streamed reply and a whole one read the same.
A call's arguments are the text the model wrote. A block that is not a call stays content.
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
    """One call a reply made: the function's name and its arguments as JSON text (OpenAI's shape);
    `cut`: the reply ended (its length) before the call did, its arguments are what was written."""

    name: str
    arguments: str
    cut: bool = False


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


# The start of a call's block as Qwen writes it, up to the first character of its arguments
# object: from there on the arguments can be given out as they are written. (Arguments written as
# a JSON string, or keys in another order, are read when the block closes.)
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=[^\s"])')


@dataclasses.dataclass(frozen=True)
class CallPiece:
    """A piece of a call as the reply writes it: the call's number in the reply, its name (on its
    first piece only), more of its arguments' text, whether it is the call's last piece, and
    whether the reply ended before the call did (`ToolCall.cut`)."""

    index: int
    name: str | None
    arguments: str
    done: bool
    cut: bool = False


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


def _head(block: str) -> tuple[str, int] | None:
    """The name a block's head gives and where its arguments start, if it is Qwen's head."""
    m = _HEAD.match(block)
    if m is None:
        return None
    try:
        return json.loads(f'"{m.group(1)}"'), m.end()
    except ValueError:  # not a JSON string after all: the block is read when it closes
        return None


def _final_arguments(body: str) -> str:
    """A call's arguments from the text after its head: without the call object's closing brace,
    or whole when there is none (a reply cut before it)."""
    text = body[:len(body) - _tag_prefix(body, CLOSE)].strip()
    try:
        json.loads(text)
        return text
    except ValueError:
        return text[:-1].rstrip() if text.endswith("}") else text


def _sure_arguments(args: str) -> int:
    """How much of an open call's arguments text is surely arguments: not the last "}" (it may
    close the call object), trailing whitespace, or the start of a closing tag."""
    text = args[:len(args) - _tag_prefix(args, CLOSE)].rstrip()
    return len(text[:-1].rstrip() if text.endswith("}") else text)


class ToolCallReader:
    """A reply's content and calls, read from its text piece by piece (module docstring).

    Text is given out as content as soon as it cannot be the start of a block; whitespace right
    before a block (Qwen writes a newline after its own words), or after the calls of a reply that
    said nothing before them, is not content. A call is given out as it is written: its name once
    its block's head is read, then its arguments as they come (`CallPiece`s); a block whose
    head is not Qwen's is read when it closes. `calls` holds the calls whose blocks ended."""

    def __init__(self):
        self._held = ""
        self._said = False  # content given out so far
        self.calls: list[ToolCall] = []
        self._name: str | None = None  # the open call's name (None: no call open)
        self._args = ""  # the open call's text after its head
        self._sent = 0  # how much of it was given out

    @property
    def count(self) -> int:
        """Calls begun so far."""
        return len(self.calls) + (self._name is not None)

    def feed(self, text: str) -> tuple[str, list[CallPiece]]:
        """The content and the pieces of calls that `text` completes."""
        content, pieces = self._read(self._held + text)
        self._said = self._said or bool(content)
        return content, pieces

    def _read(self, buf: str) -> tuple[str, list[CallPiece]]:
        self._held = ""
        content, pieces = [], []
        while True:
            if self._name is not None:
                buf = self._in_call(buf, pieces)
                if self._name is not None:  # still open: everything went to it
                    return "".join(content), pieces
            if self.count and not (self._said or any(content)):
                buf = buf.lstrip()
            start = buf.find(OPEN)
            if start < 0:
                break
            content.append(buf[:start].rstrip() if buf[:start].strip() else "")
            block = buf[start + len(OPEN):]
            head = _head(block)
            if head is not None:
                self._name, self._args, self._sent = head[0], "", 0
                pieces.append(CallPiece(len(self.calls), self._name, "", False))
                buf = block[head[1]:]
                continue
            end = block.find(CLOSE)
            if end < 0:  # an open block: wait for its head or its end
                self._held = buf[start:]
                return "".join(content), pieces
            call = _call(block[:end])
            if call is None:
                content.append(buf[start:start + len(OPEN) + end + len(CLOSE)])
            else:
                pieces += whole_pieces([call], len(self.calls))
                self.calls.append(call)
            buf = block[end + len(CLOSE):]
        keep = _tag_prefix(buf)
        body = buf[:len(buf) - keep]
        cut = len(body.rstrip())
        content.append(body[:cut])
        self._held = buf[cut:]
        return "".join(content), pieces

    def _in_call(self, text: str, pieces: list[CallPiece]) -> str:
        """Take `text` into the open call: its arguments so far, or its end; the text after it."""
        seen = max(len(self._args) - len(CLOSE) + 1, 0)  # the text before was searched already
        self._args += text
        end = self._args.find(CLOSE, seen)
        if end < 0:
            sure = self._sent + _sure_arguments(self._args[self._sent:])  # only the unsent end can be held
            if sure > self._sent:
                pieces.append(CallPiece(len(self.calls), None, self._args[self._sent:sure], False))
                self._sent = sure
            return ""
        rest = self._args[end + len(CLOSE):]
        self._end_call(self._args[:end], pieces)
        return rest

    def _end_call(self, body: str, pieces: list[CallPiece], cut: bool = False) -> None:
        args = _final_arguments(body)
        pieces.append(CallPiece(len(self.calls), None, args[self._sent:], True, cut))
        self.calls.append(ToolCall(self._name, args, cut))
        self._name, self._args, self._sent = None, "", 0

    def finish(self) -> tuple[str, list[CallPiece]]:
        """What the held text ends as when the reply ends: the end of a call begun (its block cut
        by the reply's length: the arguments written so far), a block whose JSON is a call, else
        content (whitespace after a call is none)."""
        pieces = []
        if self._name is not None:
            self._end_call(self._args, pieces, cut=True)
            return "", pieces
        held, self._held = self._held, ""
        if held.startswith(OPEN):
            call = _call(held[len(OPEN):])
            if call is not None:
                pieces += whole_pieces([call], len(self.calls))
                self.calls.append(call)
                return "", pieces
        return ("" if self.calls and not held.strip() else held), pieces


def _tag_prefix(text: str, tag: str = OPEN) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def whole_pieces(calls: list[ToolCall], first: int) -> list[CallPiece]:
    """Calls read whole (a block read when it closed, a spoken reply's calls written after it) as
    the pieces of calls read as they are written, numbered from `first`: the name, the rest."""
    return [p for i, c in enumerate(calls)
            for p in (CallPiece(first + i, c.name, "", False), CallPiece(first + i, None, c.arguments, True, c.cut))]


def gather(pieces: list[CallPiece]) -> list[ToolCall]:
    """The calls that pieces of calls make, in order."""
    names, args, cut = {}, {}, set()
    for p in pieces:
        if p.name is not None:
            names[p.index] = p.name
        args[p.index] = args.get(p.index, "") + p.arguments
        if p.cut:
            cut.add(p.index)
    return [ToolCall(names[i], args[i], i in cut) for i in sorted(names)]


def read_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """A whole reply's content and calls."""
    reader = ToolCallReader()
    content, _ = reader.feed(text)
    rest, _ = reader.finish()
    return content + rest, reader.calls
