"""Request fields -> the reply's `StructuredOutputs`, or a 400 naming what is wrong.

OpenAI's response formats (chat and completions' `response_format`, the Responses API's
`text.format`: text, json_object, json_schema) and vLLM's `structured_outputs` extra (json,
json_object, regex, choice, grammar, disable_any_whitespace). The grammar is compiled here
once, without the tokenizer, so that a bad schema or regex is a 400 before any stage sees it.
"""

from __future__ import annotations

import re
from typing import Any

from omni_jax.engine.sampling_params import StructuredOutputs
from omni_jax.engine.structured_output import grammar_of

from .errors import bad_request, short

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a json_schema's name


def from_format(fmt: Any, param: str, nested: bool) -> StructuredOutputs | None:
    """An OpenAI response format; `nested`: the json_schema's fields sit under "json_schema"
    (chat completions), else beside "type" (the Responses API's text.format)."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request(f"{param} must be an object with a type", param)
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return _checked(StructuredOutputs(json_object=True), param)
    if kind != "json_schema":
        raise bad_request(f"{param}.type {short(kind)} is not supported; use text, json_object or json_schema",
                          f"{param}.type", "unsupported_parameter")
    where = f"{param}.json_schema" if nested else param
    body = fmt.get("json_schema") if nested else fmt
    if not isinstance(body, dict):
        raise bad_request(f"{where} must be an object with a name and a schema", where)
    name = body.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise bad_request(f"{where}.name must be 1 to 64 letters, digits, '_' or '-', got {short(name)}",
                          f"{where}.name")
    schema = body.get("schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise bad_request(f"{where}.schema must be a JSON schema object", f"{where}.schema")
    return _checked(StructuredOutputs(json=schema), f"{where}.schema")


def from_vllm(given: dict | None) -> StructuredOutputs | None:
    """vLLM's `structured_outputs` extra."""
    if given is None:
        return None
    try:
        spec = StructuredOutputs(**given)
    except (TypeError, ValueError) as e:
        raise bad_request(f"structured_outputs: {e}", "structured_outputs") from None
    return _checked(spec, "structured_outputs")


def structured_outputs(req, fmt: Any, param: str, nested: bool = True) -> StructuredOutputs | None:
    """The reply's constraint from `fmt` (the request's OpenAI response format) or the request's
    `structured_outputs`; both at once are a 400."""
    openai, vllm = from_format(fmt, param, nested), from_vllm(getattr(req, "structured_outputs", None))
    if openai is not None and vllm is not None:
        raise bad_request(f"give either {param} or structured_outputs, not both", "structured_outputs")
    return openai or vllm


def _checked(spec: StructuredOutputs, param: str) -> StructuredOutputs:
    try:
        grammar_of(spec)
    except ValueError as e:
        raise bad_request(f"{param}: {e}", param) from None
    return spec
