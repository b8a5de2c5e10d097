"""Function calling on the server: a request's `tools` and `tool_choice` -> what the prompt carries
and the reply's constraint, or a 400 naming what is wrong; a reply's calls in OpenAI's shape.

`tool_choice`: "auto" (the default with tools: the model decides, its calls are read out of its
reply), "none" (the tools are left out of the prompt), "required" (the reply is one or more calls,
held to the tools' parameter schemas by a grammar) or {"type": "function", "function": {"name"}}
(one call of that tool). Qwen's format: inputs/chat_template.py and inputs/tool_calls.py.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from omni_jax.engine.sampling_params import StructuredOutputs
from omni_jax.engine.structured_output import grammar_of
from omni_jax.errors import PromptError
from omni_jax.inputs.tool_calls import ToolCall, ToolCallReader, call_grammar, check_tools

from .errors import bad_request, short


@dataclasses.dataclass(frozen=True)
class ToolUse:
    """What a request's tools do: the tools its prompt carries (None: none), the constraint a
    required call puts on the reply, and whether calls are read out of the reply."""

    tools: list | None = None
    constraint: StructuredOutputs | None = None
    parallel: bool = True

    @property
    def reads_calls(self) -> bool:
        return self.tools is not None

    def reader(self) -> ToolCallReader | None:
        return ToolCallReader() if self.reads_calls else None

    def call_constraint(self) -> StructuredOutputs:
        """What holds the rest of a reply whose prompt ends with a call's opening tag to calls of
        these tools (a spoken reply's calls, server/spoken_calls.py)."""
        return _grammar(self.tools, self.parallel, opened=True)


NO_TOOLS = ToolUse()


def tool_use(tools: list | None, choice: Any, parallel: bool | None = None, *, flat: bool = False) -> ToolUse:
    """The request's ToolUse; `flat`: tools and a named choice in the Responses API's shape
    ({"type": "function", "name", ...} rather than {"type": "function", "function": {...}})."""
    if flat and tools:
        tools = [_nested(t, f"tools[{i}]") for i, t in enumerate(tools)]
    if choice is None:
        choice = "auto"
    if not tools:
        if choice not in ("none", "auto"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return NO_TOOLS
    try:
        check_tools(tools)
    except PromptError as e:
        raise bad_request(str(e), "tools") from None
    names = [t["function"]["name"] for t in tools]
    if choice == "none":
        return NO_TOOLS
    for i, tool in enumerate(tools):  # a schema that does not compile is named by its place
        params = tool["function"].get("parameters")
        if params:
            try:
                grammar_of(StructuredOutputs(json=params))
            except ValueError as e:
                raise bad_request(f"tools[{i}] parameters: {e}", f"tools[{i}].function.parameters") from None
    parallel = parallel is not False
    if choice == "auto":
        return ToolUse(tools, parallel=parallel)
    if choice == "required":
        chosen = tools
    else:
        name = _chosen_name(choice, flat)
        if name not in names:
            raise bad_request(f"tool_choice names {short(name)}, which is not one of the tools", "tool_choice")
        chosen, parallel = [tools[names.index(name)]], False
    return ToolUse(tools, _grammar(chosen, parallel), parallel)


def _grammar(tools: list, parallel: bool, opened: bool = False) -> StructuredOutputs:
    try:  # each schema compiles; together they may still be more than a grammar may hold
        return StructuredOutputs(grammar=call_grammar(tools, parallel=parallel, opened=opened))
    except ValueError as e:
        raise bad_request(f"tools: {e}", "tools") from None


def _chosen_name(choice: Any, flat: bool) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice if flat else choice.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            return fn["name"]
    shape = "{'type': 'function', 'name'}" if flat else "{'type': 'function', 'function': {'name'}}"
    raise bad_request(f"tool_choice must be 'none', 'auto', 'required' or {shape}", "tool_choice")


def _nested(tool: Any, where: str) -> dict:
    """A Responses API function tool in the chat completions' shape the prompt carries."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise bad_request(f"{where}.type {short(kind)} is not supported; only function tools are", f"{where}.type",
                          "unsupported_parameter")
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters") if k in tool}}


def combined(use: ToolUse, constraint: StructuredOutputs | None, param: str) -> StructuredOutputs | None:
    """The reply's one constraint: a required call's or the response format's (`param`), not both."""
    if use.constraint is not None and constraint is not None:
        raise bad_request(f"tool_choice 'required' or a named function constrains the reply; it cannot also "
                          f"follow {param}", param)
    return use.constraint or constraint


def join_call(messages: list[dict], name: str, arguments: str) -> None:
    """An earlier call into chat `messages`: into the assistant turn it follows, else a turn of its own."""
    if not messages or messages[-1]["role"] != "assistant":
        messages.append({"role": "assistant", "content": ""})
    messages[-1].setdefault("tool_calls", []).append(
        {"type": "function", "function": {"name": name, "arguments": arguments}})


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def chat_tool_call(call: ToolCall, cid: str) -> dict:
    """A call as a chat completion message's `tool_calls` entry."""
    return {"id": cid, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
