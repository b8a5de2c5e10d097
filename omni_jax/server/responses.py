"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API, text replies.

`input` is a text or a list of messages (roles user, system, developer and assistant; content
a text or parts: input_text, input_image, input_audio, and an assistant's output_text), after
`instructions` as a system message. A stored response (`store`, on by default) is kept with the
conversation that made it, for `ttl_s` and within a byte budget: GET returns it, DELETE forgets
it, and `previous_response_id` continues its conversation (without its instructions, as
OpenAI's: each request gives its own). Streamed, the events are OpenAI's, each `event: <type>`
and `data: <json>` with a `sequence_number`: response.created and .in_progress, the message's
output_item.added and content_part.added, output_text.delta per piece of text, then
output_text.done, content_part.done, output_item.done and response.completed (.incomplete
when max_output_tokens ended it, .failed when the request failed).

Function tools (`tools`, `tool_choice`: server/tools.py) work as in chat completions: a call the
model makes is a `function_call` output item (after the message item when the reply has words,
which is then only added once they come), streamed as output_item.added once its name is
written, function_call_arguments.delta as its arguments are, then .done and output_item.done;
`function_call` and `function_call_output` input items give earlier calls and their results back.

A reasoning model's thinking (server/reasoning.py) is a `reasoning` output item before the
message, its text a `reasoning_text` content part (streamed as its output_item.added and
content_part.added, reasoning_text.delta, .done, content_part.done and output_item.done, the
message's events after them); `reasoning` input items give it back.
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any, AsyncIterator

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse

from ..inputs.reasoning import ThinkTags
from ..inputs.tool_calls import CLOSE, CallPiece
from .engine import ServedEngine
from .errors import APIError, bad_request, error_body, short
from .generation import Generation, check_model, failure, finished_outputs, open_request
from .kept import Kept
from .logprobs import token_logprobs
from .messages import MediaPolicy, message_part
from .metrics import Metrics
from .reasoning import ReplyReasoning, thinking_fields
from .schemas import ResponseRequest
from .sse import event_stream
from .stage_params import stage_params
from .structured import structured_outputs
from .tools import NO_TOOLS, ToolUse, call_id, combined, join_call, tool_use

MODALITIES = ["text"]
REASONING, MESSAGE = "reasoning", "message"  # the text output items
LOGPROBS = "message.output_text.logprobs"
# A reasoning item's `encrypted_content`, for clients that keep no server state (store: false) and
# give items back: here the thinking's text, opaque to them but not encrypted (it is theirs).
ENCRYPTED = "reasoning.encrypted_content"
_OPAQUE = "omnijax1."
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
# Responses' content parts -> chat's (messages.py checks them, and the media rules).
_TEXT_PARTS = ("input_text", "output_text")
# OpenAI's fields not served here, with their off values.
_UNSERVED = {"reasoning": (None,), "background": (None, False), "conversation": (None,), "prompt": (None,)}
_encoder = msgspec.json.Encoder()


def _part(part: Any, where: str, policy: MediaPolicy) -> dict:
    """One Responses content part -> the processor's part (400 naming it)."""
    ptype = part.get("type") if isinstance(part, dict) else None
    if ptype in _TEXT_PARTS:
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{where}.text must be a string", f"{where}.text")
        return {"type": "text", "text": part["text"]}
    if ptype == "input_image":
        if part.get("image_url") is None:
            raise bad_request(f"{where}: images by file_id are not supported; send image_url (a data: URL or an "
                              f"allowed local path)", f"{where}.image_url", "unsupported_parameter")
        return message_part({"type": "image_url", "image_url": {"url": part["image_url"]}}, where, policy)
    if ptype == "input_audio":
        return message_part({"type": "input_audio", "input_audio": part.get("input_audio")}, where, policy)
    raise bad_request(f"{where}.type {short(ptype)} is not supported; use input_text, input_image, input_audio or "
                      f"(an assistant's) output_text", f"{where}.type")


def input_messages(items: str | list, policy: MediaPolicy) -> list[dict]:
    """The request's `input` as the processor's chat messages (400 naming the first bad item)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be a message object", where)
        kind = item.get("type", "message")
        if kind in ("function_call", "function_call_output"):
            _tool_item(item, where, out)
            continue
        if kind == "reasoning":
            _reasoning_item(item, where, out)
            continue
        if kind != "message":
            raise bad_request(f"{where}.type {short(item.get('type'))} is not supported: only messages, reasoning, "
                              f"function calls and their outputs (no item references)", f"{where}.type",
                              "unsupported_parameter")
        role = _ROLES.get(item.get("role"))
        if role is None:
            raise bad_request(f"{where}.role must be one of {sorted(_ROLES)}", f"{where}.role")
        content = item.get("content")
        if isinstance(content, list):
            content = [_part(p, f"{where}.content[{j}]", policy) for j, p in enumerate(content)]
        elif not isinstance(content, str):
            raise bad_request(f"{where}.content must be a string or a list of parts", f"{where}.content")
        last = out[-1] if out else None
        if role == "assistant" and last is not None and _thought_alone(last):
            last["content"] = content  # the words after the reasoning item before them
        else:
            out.append({"role": role, "content": content})
    return out


def _reasoning_item(item: dict, where: str, out: list[dict]) -> None:
    """A reply's thinking, given back (its reasoning_text parts, or else its encrypted_content): an
    assistant turn of its own, which the words and calls after it join."""
    parts = item.get("content") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) and p.get("type") == "reasoning_text"
                                              and isinstance(p.get("text"), str) for p in parts):
        raise bad_request(f"{where}.content must be a list of reasoning_text parts", f"{where}.content")
    text = "".join(p["text"] for p in parts)
    if not parts and item.get("encrypted_content") is not None:
        text = _unsealed(item["encrypted_content"], f"{where}.encrypted_content")
    out.append({"role": "assistant", "content": "", "reasoning_content": text})


def _sealed(text: str) -> str:
    return _OPAQUE + base64.urlsafe_b64encode(text.encode()).decode()


def _unsealed(given, where: str) -> str:
    try:
        if isinstance(given, str) and given.startswith(_OPAQUE):
            return base64.urlsafe_b64decode(given[len(_OPAQUE):].encode()).decode()
    except (ValueError, UnicodeDecodeError):
        pass
    raise bad_request(f"{where} is not one this server gave (include {ENCRYPTED!r} gives it)", where)


def _thought_alone(message: dict) -> bool:
    """Whether a chat message is a reasoning item's turn that nothing has joined yet."""
    return (message["role"] == "assistant" and "reasoning_content" in message and message["content"] == ""
            and "tool_calls" not in message)


def _tool_item(item: dict, where: str, out: list[dict]) -> None:
    """An earlier call (into the assistant turn before it, or one of its own) or its output (a
    tool message), appended to the chat messages `out`."""
    fields = ("name", "arguments") if item["type"] == "function_call" else ("output",)
    for name in fields:
        if not isinstance(item.get(name), str):
            raise bad_request(f"{where}.{name} must be a string", f"{where}.{name}")
    if item["type"] == "function_call_output":
        out.append({"role": "tool", "content": item["output"]})
        return
    join_call(out, item["name"], item["arguments"])


def _validate(req: ResponseRequest) -> None:
    for name, off in _UNSERVED.items():
        if getattr(req, name) not in off:
            raise bad_request(f"{name} is not supported by this server", name, "unsupported_parameter")
    if req.truncation == "auto":
        raise bad_request("truncation 'auto' is not supported: a conversation past the context is refused",
                          "truncation", "unsupported_parameter")
    unknown = sorted(set(req.include or ()) - {LOGPROBS, ENCRYPTED})
    if unknown:
        raise bad_request(f"include {unknown[:4]} is not supported; only {LOGPROBS!r} and {ENCRYPTED!r}", "include",
                          "unsupported_parameter")


class _Reply:
    """One response as it is made: its body in OpenAI's shape, its output items in the order they
    came (its thinking, its message, its calls), and its reasoning, text and logprobs so far."""

    def __init__(self, req: ResponseRequest, rid: str, tokenizer, top_logprobs: int | None, tools: ToolUse = NO_TOOLS,
                 tags: ThinkTags | None = None, sealed: bool = False):
        """`sealed`: reasoning items carry their text as encrypted_content too (include ENCRYPTED)."""
        self.req, self.rid, self.tokenizer, self.top_logprobs = req, rid, tokenizer, top_logprobs
        self.sealed = sealed
        self.tools, self.reader, self.thinking = tools, tools.reader(), ReplyReasoning(tags)
        self.item_id, self.reasoning_id = f"msg_{uuid.uuid4().hex}", f"rs_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.reasoning, self.text, self.logprobs = "", "", []
        self.calls: list[dict] = []  # function_call output items, in order
        self.reasoning_tokens = 0
        # The output items as they came: REASONING, MESSAGE and the calls. The message comes first
        # unless a reply may think or call tools: then it is added with its first words.
        self.order: list = [] if self.reader is not None or self.thinking.on else [MESSAGE]

    def _logprobs(self, token_ids, logprobs) -> list:
        if self.top_logprobs is None or not token_ids or not logprobs:
            return []
        return token_logprobs(self.tokenizer, token_ids, logprobs[-len(token_ids):], self.top_logprobs)

    def add(self, out) -> tuple[str, str, list, list[CallPiece]]:
        """The reasoning, text, logprobs and pieces of calls this update adds (the logprobs are the
        message's: none for an update that is all thinking)."""
        thought, text = self.thinking.feed(out)
        self._thought(thought, out)
        lps = self._logprobs(out.new_token_ids, out.logprobs) if text or not self.thinking.thought else []
        text, pieces = self._read(text, out.finished)
        self.text += text
        self.logprobs += lps
        return thought, text, lps, pieces

    def whole(self, out) -> None:
        """Take the finished request's reasoning, text, logprobs and calls at once."""
        thought, text = self.thinking.feed(out, out.text)
        self._thought(thought, out)
        # Block by block, so that the items come in the order the streamed reply gives them (the
        # message where its first words are: after the calls that come before them).
        pieces = text.split(CLOSE) if self.reader is not None else [text]
        said = [self._read(p + CLOSE * (i < len(pieces) - 1), i == len(pieces) - 1)[0] for i, p in enumerate(pieces)]
        self.text = "".join(said)
        self.logprobs = self._logprobs(list(out.token_ids)[self.reasoning_tokens:], out.logprobs)  # the message's

    def _thought(self, thought: str, out) -> None:
        if self.thinking.thought and REASONING not in self.order:
            self.order.insert(0, REASONING)
        self.reasoning += thought
        if out.finished:
            self.reasoning_tokens = self.thinking.tokens(out)

    def _read(self, text: str, finished: bool) -> tuple[str, list[CallPiece]]:
        pieces = []
        if self.reader is not None:
            text, pieces = self.reader.feed(text)
            if finished:
                rest, closing = self.reader.finish()
                text, pieces = text + rest, pieces + closing
        if MESSAGE not in self.order and (text or (finished and not pieces and not self.calls)):
            self.order.append(MESSAGE)  # with its first words, or empty for a reply of neither words nor calls
        for p in pieces:  # a call's item is added with its name and filled in as its arguments come
            if p.name is not None:
                item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress",
                        "call_id": call_id(), "name": p.name, "arguments": ""}
                self.calls.append(item)
                self.order.append(item)
            item = self.calls[p.index]
            item["arguments"] += p.arguments
            if p.done:
                item["status"] = "incomplete" if p.cut else "completed"
        return text, pieces

    def output(self, status: str) -> list[dict]:
        """The output items, in the order they came."""
        made = {REASONING: lambda: self.reasoning_item(status), MESSAGE: lambda: self.item(status)}
        return [made[entry]() if isinstance(entry, str) else entry for entry in self.order]

    def index(self, entry) -> int:
        """An output item's index (REASONING, MESSAGE or a function_call item)."""
        return self.order.index(entry)

    def assistant(self) -> dict:
        """The reply as the conversation's next chat message (stored for previous_response_id)."""
        said = [{"role": "assistant", "content": self.text,
                 **({"reasoning_content": self.reasoning} if self.thinking.thought else {})}]
        for c in self.calls:
            join_call(said, c["name"], c["arguments"])
        return said[0]

    def part(self) -> dict:
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": self.logprobs}

    def item(self, status: str) -> dict:
        content = [self.part()] if status != "in_progress" else []
        return {"id": self.item_id, "type": "message", "status": status, "role": "assistant", "content": content}

    def reasoning_part(self) -> dict:
        return {"type": "reasoning_text", "text": self.reasoning}

    def reasoning_item(self, status: str) -> dict:
        """The reasoning item; its status the response's until its thinking is over."""
        content = [self.reasoning_part()] if status != "in_progress" else []
        sealed = _sealed(self.reasoning) if self.sealed and status != "in_progress" else None
        return {"id": self.reasoning_id, "type": "reasoning", "summary": [], "content": content,
                "encrypted_content": sealed, "status": "completed" if self.thinking.ended else status}

    def body(self, status: str, out=None, error: dict | None = None) -> dict:
        req = self.req
        done = status in ("completed", "incomplete")
        usage = None
        if out is not None:
            p, c = len(out.prompt_token_ids), len(out.token_ids)
            usage = {"input_tokens": p, "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
                     "output_tokens": c, "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                     "total_tokens": p + c}
        return {"id": self.rid, "object": "response", "created_at": self.created_at, "status": status,
                "completed_at": int(time.time()) if done else None, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": req.model,
                "output": self.output(status) if done else [],
                "parallel_tool_calls": req.parallel_tool_calls is not False,
                "previous_response_id": req.previous_response_id, "temperature": req.temperature,
                "top_p": req.top_p, "top_logprobs": req.top_logprobs,
                "tool_choice": req.tool_choice if req.tool_choice is not None else "auto", "tools": req.tools or [],
                "text": {"format": _format(req) or {"type": "text"}}, "truncation": "disabled", "store": req.store,
                "metadata": req.metadata or {}, "user": req.user, "usage": usage}


def _format(req: ResponseRequest):
    return (req.text or {}).get("format") if isinstance(req.text, dict) else None


def _status(out) -> str:
    return "incomplete" if out.finish_reason == "length" else "completed"


class ResponsesHandler:
    """Serves /v1/responses on one engine, keeping stored responses in `kept`."""

    def __init__(self, engine: ServedEngine, policy: MediaPolicy, metrics: Metrics, kept: Kept):
        self.engine, self.policy, self.metrics, self.kept = engine, policy, metrics, kept

    async def create(self, req: ResponseRequest, request: Request):
        check_model(self.engine, req.model)
        _validate(req)
        history = []
        if req.previous_response_id is not None:
            stored = self.kept.get(req.previous_response_id)
            if stored is None:
                raise bad_request(f"no response {short(req.previous_response_id)} is stored here (unknown, expired, "
                                  f"deleted, or made with store: false)", "previous_response_id",
                                  "previous_response_not_found")
            history = stored["messages"]
        messages = [*history, *input_messages(req.input, self.policy)]
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        # the logprobs come with `include` or `top_logprobs` (OpenAI: either asks for them)
        logprobs = (req.top_logprobs or 0) if LOGPROBS in (req.include or ()) or req.top_logprobs is not None else None
        tools = tool_use(req.tools, req.tool_choice, req.parallel_tool_calls, flat=True)
        constraint = combined(tools, structured_outputs(req, _format(req), "text.format", nested=False), "text.format")
        params = stage_params(self.engine.stage_defaults(self.engine.stage_names(MODALITIES)), req,
                              max_tokens=req.max_output_tokens, logprobs=logprobs,
                              **thinking_fields(self.engine, constraint, req.thinking_token_budget))
        rid = f"resp_{uuid.uuid4().hex}"
        prompt = {"messages": [*system, *messages], **({"tools": tools.tools} if tools.tools is not None else {})}
        gen = await open_request(self.engine, prompt, params, MODALITIES, None, rid, request=request,
                                 prompt_param="input")
        reply = _Reply(req, rid, self.engine.omni.tokenizer, logprobs, tools, self.engine.reasoning,
                       sealed=ENCRYPTED in (req.include or ()))
        self.metrics.in_flight.inc()
        if req.stream:
            return event_stream(self._stream(reply, gen, messages))
        outs = await finished_outputs([gen], request, self.metrics, "responses")
        if outs is None:
            return JSONResponse({}, status_code=499)
        out = outs[0]
        if out.error:
            raise failure(self.engine, out, "input")
        reply.whole(out)
        body = reply.body(_status(out), out)
        self._store(reply, body, messages)
        return JSONResponse(body)

    def _store(self, reply: _Reply, body: dict, messages: list[dict]) -> None:
        if reply.req.store:
            conversation = [*messages, reply.assistant()]
            # sized by its JSON (the media in it are data: URLs or paths)
            size = len(_encoder.encode(conversation)) + len(_encoder.encode(body))
            self.kept.put(reply.rid, {"response": body, "messages": conversation}, size)

    def retrieve(self, response_id: str) -> dict:
        stored = self.kept.get(response_id)
        if stored is None:
            raise APIError(404, f"no response {short(response_id)} is stored here", "response_id", "not_found")
        return stored["response"]

    def delete(self, response_id: str) -> dict:
        if not self.kept.pop(response_id):
            raise APIError(404, f"no response {short(response_id)} is stored here", "response_id", "not_found")
        return {"id": response_id, "object": "response", "deleted": True}

    @staticmethod
    def _call_events(emit, reply: _Reply, piece: CallPiece) -> list[bytes]:
        """A piece of a function call's events: its item added (with its name), its arguments as
        they come, the arguments and the item done."""
        item = reply.calls[piece.index]
        index = reply.index(item)
        where = {"item_id": item["id"], "output_index": index}
        events = []
        if piece.name is not None:
            events.append(emit("response.output_item.added", output_index=index,
                               item={**item, "status": "in_progress", "arguments": ""}))
        if piece.arguments:
            events.append(emit("response.function_call_arguments.delta", delta=piece.arguments, **where))
        if piece.done:
            events += [emit("response.function_call_arguments.done", name=item["name"], arguments=item["arguments"],
                            **where),
                       emit("response.output_item.done", output_index=index, item=item)]
        return events

    async def _stream(self, reply: _Reply, gen: Generation, messages: list[dict]) -> AsyncIterator[bytes]:
        seq = 0

        def emit(kind: str, **fields) -> bytes:
            nonlocal seq
            body = {"type": kind, "sequence_number": seq, **fields}
            seq += 1
            return b"event: " + kind.encode() + b"\ndata: " + _encoder.encode(body) + b"\n\n"

        def where(entry: str) -> dict:
            item_id = reply.item_id if entry == MESSAGE else reply.reasoning_id
            return {"item_id": item_id, "output_index": reply.index(entry), "content_index": 0}

        def opening(entry: str) -> list[bytes]:
            """An item's output_item.added and content_part.added (its text empty)."""
            if entry == MESSAGE:
                item, part = reply.item("in_progress"), {"type": "output_text", "text": "", "annotations": []}
            else:
                item, part = reply.reasoning_item("in_progress"), {"type": "reasoning_text", "text": ""}
            return [emit("response.output_item.added", output_index=reply.index(entry), item=item),
                    emit("response.content_part.added", part=part, **where(entry))]

        def closing(entry: str, status: str) -> list[bytes]:
            """An item's text .done, content_part.done and output_item.done."""
            if entry == MESSAGE:
                text = emit("response.output_text.done", text=reply.text, logprobs=reply.logprobs, **where(entry))
                part, item = reply.part(), reply.item(status)
            else:
                text = emit("response.reasoning_text.done", text=reply.reasoning, **where(entry))
                part, item = reply.reasoning_part(), reply.reasoning_item(status)
            return [text, emit("response.content_part.done", part=part, **where(entry)),
                    emit("response.output_item.done", output_index=reply.index(entry), item=item)]

        out, opened = None, []  # the text items added so far; the last one is still open
        try:
            yield emit("response.created", response=reply.body("in_progress"))
            yield emit("response.in_progress", response=reply.body("in_progress"))
            for e in opening(MESSAGE) if MESSAGE in reply.order else []:
                opened.append(MESSAGE)
                yield e
            async for out in gen.updates():
                thought, text, lps, pieces = reply.add(out)
                if REASONING in reply.order and REASONING not in opened:
                    opened.append(REASONING)
                    for e in opening(REASONING):
                        yield e
                if thought:
                    yield emit("response.reasoning_text.delta", delta=thought, **where(REASONING))
                if (text or pieces or MESSAGE in reply.order) and opened == [REASONING]:
                    opened.append(None)  # the thinking is over (or the reply ended in it): its item is done
                    for e in closing(REASONING, _status(out) if out.finished else "completed"):
                        yield e
                if MESSAGE in reply.order and MESSAGE not in opened:
                    opened.append(MESSAGE)
                    for e in opening(MESSAGE):
                        yield e
                if MESSAGE in opened and (text or lps):
                    yield emit("response.output_text.delta", delta=text, logprobs=lps, **where(MESSAGE))
                for piece in pieces:
                    for e in self._call_events(emit, reply, piece):
                        yield e
            self.metrics.finished("responses", out)
            if out.error:
                err = failure(self.engine, out, "input")
                self.metrics.error(err.status)
                yield emit("response.failed", response=reply.body("failed", out, {"code": err.code,
                                                                                  "message": err.message}))
                return
            status = _status(out)
            for entry in (e for e in opened[-1:] if e is not None):  # the item still open
                for e in closing(entry, status):
                    yield e
            body = reply.body(status, out)
            self._store(reply, body, messages)
            yield emit(f"response.{status}", response=body)
        except Exception as e:  # a bug must end the stream visibly, not hang it
            self.metrics.error(500)
            err = error_body(500, f"internal error: {type(e).__name__}: {e}")["error"]
            yield emit("error", code=err["code"], message=err["message"], param=None)
        finally:
            self.metrics.in_flight.dec()
            if out is None or not out.finished:  # the client left mid-stream
                self.metrics.aborted("responses")
            await gen.close()
