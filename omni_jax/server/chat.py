"""POST /v1/chat/completions: `n` choices with `content` (each its own sample of the prompt, run
side by side), or one with `content` and `audio` when audio is asked for.

Streamed replies are OpenAI chat.completion.chunk events: text in `delta.content` (and in
`delta.audio.transcript` when audio is asked for), audio in `delta.audio.data` as base64
pcm16 (24 kHz mono, little-endian), passed on as the library delivers it (`audio_delta`:
today the whole waveform at the end, chunk by chunk once stages stream to each other),
a last chunk with `finish_reason` (each chunk names its choice's `index`), `usage` when
`stream_options.include_usage`, `[DONE]`.

With `tools`, calls the model makes are read out of its reply (server/tools.py) into
`message.tool_calls` (finish_reason "tool_calls"); streamed, a call's first `delta.tool_calls`
entry names it once the model has written its name, the next ones carry its arguments as they
are written, and the text before it is `delta.content`. A spoken reply says its words and not
its calls (server/spoken_calls.py); one held to calls (a required or named tool) is not spoken. A reasoning model's thinking is `message.reasoning_content`
(`delta.reasoning_content` streamed, before the answer's deltas; server/reasoning.py).
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from ..inputs.reasoning import ThinkTags
from ..inputs.tool_calls import CallPiece, ToolCall, ToolCallReader, gather, whole_pieces
from . import audio as audio_codec
from .engine import ServedEngine
from .errors import APIError, bad_request, error_body
from .generation import (Generation, check_model, failure, finish_reason, finished_outputs, merged,
                         open_requests, prepare)
from .logprobs import token_logprobs
from .messages import MediaPolicy, to_prompt
from .reasoning import ReplyReasoning, reasoning_fields, thinking_fields, thinking_tokens, whole
from .reply_audio import ReplyAudio
from .structured import structured_outputs
from .spoken_calls import SpokenCalls
from .tools import ToolUse, call_id, chat_tool_call, combined, tool_use
from .metrics import Metrics
from .schemas import ChatCompletionRequest
from .stage_params import sample_params, stage_params
from .sse import DONE, event, event_stream

# Audio deltas longer than this are split over several chunks (keeps SSE events small).
MAX_AUDIO_CHUNK_SAMPLES = 12000


def _modalities(req: ChatCompletionRequest, engine: ServedEngine) -> list[str]:
    mods = list(dict.fromkeys(req.modalities or ["text"]))
    if "text" not in mods:
        raise bad_request("modalities must include 'text' (['text'] or ['text', 'audio'])", "modalities")
    if "audio" in mods and "audio" not in engine.output_modalities:
        raise bad_request(f"{engine.no_audio_reason}; ask for modalities ['text']", "modalities")
    return mods


# OpenAI's fields this server does not serve, and why; set to anything but their off value
# (empty, "none", "auto") they are a 400 naming them.
_UNSERVED = {
    "functions": "functions (the deprecated function calling) are not supported by this server; use tools",
    "prediction": "predicted outputs are not supported by this server",
    "web_search_options": "web search is not supported by this server",
}


def _validate(req: ChatCompletionRequest) -> None:
    """400s for fields OpenAI has that are out of range here or not served yet."""
    for name, why in _UNSERVED.items():
        if getattr(req, name):
            raise bad_request(why, name, "unsupported_parameter")
    if req.function_call not in (None, "none", "auto"):
        raise bad_request("function_call (the deprecated function calling) is not supported by this server; use "
                          "tool_choice", "function_call", "unsupported_parameter")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    if req.stream and req.audio is not None and req.audio.format != "pcm16":
        raise bad_request(f"audio.format {req.audio.format!r} is not supported with stream=true; use 'pcm16'",
                          "audio.format")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")


def _usage(outs, extra_tokens: int = 0, tags: ThinkTags | None = None) -> dict:
    # The prompt once (OpenAI counts it once for n choices), every choice's tokens (and their
    # spoken replies' calls', written after them).
    p, c = len(outs[0].prompt_token_ids), sum(len(out.token_ids) for out in outs) + extra_tokens
    usage = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
    if tags is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": sum(thinking_tokens(tags, out) for out in outs)}
    return usage


class ChatHandler:
    """Serves chat completions on one engine."""

    def __init__(self, engine: ServedEngine, policy: MediaPolicy, metrics: Metrics, replies: ReplyAudio):
        self.engine, self.policy, self.metrics, self.replies = engine, policy, metrics, replies

    async def __call__(self, req: ChatCompletionRequest, request: Request):
        check_model(self.engine, req.model)
        _validate(req)
        mods = _modalities(req, self.engine)
        if req.n > 1 and "audio" in mods:
            raise bad_request("n > 1 is only supported for text replies (modalities ['text'])", "n")
        tools = tool_use(req.tools, req.tool_choice, req.parallel_tool_calls)
        if tools.constraint is not None:
            mods = ["text"]  # a reply of calls only: nothing to say
        prompt = to_prompt(req.messages, self.policy, self.replies, req.chat_template_kwargs)
        if tools.tools is not None:
            prompt["tools"] = tools.tools
        constraint = combined(tools, structured_outputs(req, req.response_format, "response_format"), "response_format")
        params = stage_params(self.engine.stage_defaults(self.engine.stage_names(mods)), req,
                              logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                              **thinking_fields(self.engine, constraint, req.thinking_token_budget))
        spoken = (SpokenCalls(self.engine, tools, params, req.chat_template_kwargs)
                  if tools.reads_calls and "audio" in mods else None)
        if spoken is not None:
            params = spoken.params
        voice = req.audio.voice if req.audio is not None and "audio" in mods else None
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        calls = _Calls(tools, spoken, prompt["messages"], rid, request)
        if req.n > 1:  # n samples of the one prompt: processed once
            prompt = await prepare(self.engine, prompt, mods, request)
        requests = [(prompt, sample_params(params, req.seed, j), rid if req.n == 1 else f"{rid}-{j}", "messages")
                    for j in range(req.n)]
        gens = await open_requests(self.engine, requests, mods, voice, request=request, voice_param="audio.voice")
        self.metrics.in_flight.inc()
        if req.stream:
            return event_stream(self._stream(req, rid, gens, mods, calls))
        outs = await finished_outputs(gens, request, self.metrics, "chat")
        if outs is None:
            return JSONResponse({}, status_code=499)
        for out in outs:
            if out.error:
                raise failure(self.engine, out)
        return JSONResponse(await self._whole(req, outs, mods, rid, calls))

    def _logprobs(self, req: ChatCompletionRequest, token_ids: list[int], logprobs) -> dict | None:
        if not req.logprobs or logprobs is None:
            return None
        return {"content": token_logprobs(self.engine.omni.tokenizer, token_ids, logprobs, req.top_logprobs or 0),
                "refusal": None}

    async def _whole(self, req: ChatCompletionRequest, outs: list, mods: list[str], rid: str,
                     calls: "_Calls") -> dict:
        choices, tags = [], self.engine.reasoning
        shown = tags is not None and req.include_reasoning
        for j, out in enumerate(outs):
            reasoning, said = whole(tags, out)
            message = {"role": "assistant", "content": said if said or reasoning is None else None, "refusal": None,
                       "audio": None, **(reasoning_fields(reasoning) if shown else {})}
            reason = finish_reason(out.finish_reason)
            if calls.tools.reads_calls:
                reader = ToolCallReader()
                said, pieces = reader.feed(said)
                reason, rest, more, failed = await calls.finish(out, reader)
                if failed is not None:
                    raise failure(self.engine, failed)
                said, made = said + rest, gather(pieces + more)
                message["content"] = said or None
                if made:
                    message["tool_calls"] = [chat_tool_call(c, call_id()) for c in made]
                    reason = _with_calls(reason)
            if "audio" in mods:  # n is 1
                fmt = req.audio.format if req.audio is not None else "wav"
                data = audio_codec.encode(out.audio, out.sample_rate, fmt)
                audio_id = f"audio_{rid[len('chatcmpl-'):]}"
                message["audio"] = {"id": audio_id, "data": base64.b64encode(data).decode(),
                                    "expires_at": self.replies.put(audio_id, said), "transcript": said}
            choices.append({"index": j, "message": message,
                            "logprobs": self._logprobs(req, out.token_ids, out.logprobs),
                            "finish_reason": reason})
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": req.model,
                "system_fingerprint": None, "choices": choices,
                "usage": _usage(outs, calls.extra_tokens, tags)}

    async def _stream(self, req: ChatCompletionRequest, rid: str, gens: list[Generation],
                      mods: list[str], calls: "_Calls") -> AsyncIterator[bytes]:
        created = int(time.time())
        audio_id = f"audio_{rid[len('chatcmpl-'):]}"
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        with_audio = "audio" in mods

        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": req.model,
                "system_fingerprint": None}

        def chunk(j: int, delta: dict, reason: str | None = None, logprobs: dict | None = None) -> bytes:
            body = {**head, "choices": [{"index": j, "delta": delta, "logprobs": logprobs, "finish_reason": reason}]}
            if include_usage:
                body["usage"] = None
            return event(body)

        outs = [None] * len(gens)
        thinking = [ReplyReasoning(self.engine.reasoning) for _ in gens]
        readers = [calls.tools.reader() for _ in gens]
        said = [""] * len(gens)  # each choice's words (its calls left out)
        called = [False] * len(gens)

        def call_chunks(j: int, pieces: list[CallPiece]) -> list[bytes]:
            """A call's first chunk names it (with its id); the next ones carry its arguments as
            they are written (vLLM's and OpenAI's stream)."""
            chunks = []
            for p in pieces:
                if p.name is not None:
                    entry = {"index": p.index, **chat_tool_call(ToolCall(p.name, p.arguments), call_id())}
                elif p.arguments:
                    entry = {"index": p.index, "function": {"arguments": p.arguments}}
                else:
                    continue
                called[j] = True
                chunks.append(chunk(j, {"tool_calls": [entry]}))
            return chunks

        try:
            for j in range(len(gens)):
                yield chunk(j, {"role": "assistant", "content": ""})
            async for j, out in merged(gens):
                outs[j] = out
                new = out.new_token_ids
                lp = self._logprobs(req, new, out.logprobs[-len(new):]) if new and out.logprobs else None
                reasoning, text = thinking[j].feed(out)
                pieces = []
                if readers[j] is not None:
                    text, pieces = readers[j].feed(text)
                said[j] += text
                if reasoning and req.include_reasoning:
                    yield chunk(j, reasoning_fields(reasoning), logprobs=lp)
                    lp = None
                if text or lp:
                    delta = {"content": text}
                    if with_audio:
                        delta["audio"] = {"id": audio_id, "transcript": text}
                    yield chunk(j, delta, logprobs=lp)
                for c in call_chunks(j, pieces):
                    yield c
                for piece, _ in audio_codec.pcm16_pieces(out.audio_delta, MAX_AUDIO_CHUNK_SAMPLES):
                    yield chunk(j, {"audio": {"id": audio_id, "data": piece}})
                if not out.finished:
                    continue
                self.metrics.finished("chat", out)
                reason = finish_reason(out.finish_reason)
                if not out.error and readers[j] is not None:
                    try:
                        reason, rest, pieces, failed = await calls.finish(out, readers[j])
                    except APIError as e:  # a spoken reply's calls could not start
                        self.metrics.error(e.status)
                        yield event(e.body())
                        yield DONE
                        return
                    if rest:
                        said[j] += rest
                        yield chunk(j, {"content": rest, **({"audio": {"id": audio_id, "transcript": rest}}
                                                             if with_audio else {})})
                    for c in call_chunks(j, pieces):
                        yield c
                    out = failed or out
                if out.error:
                    err = failure(self.engine, out)
                    self.metrics.error(err.status)
                    yield event(err.body())
                    yield DONE
                    return
                last = {"audio": {"id": audio_id, "expires_at": self.replies.put(audio_id, said[j])}} if with_audio else {}
                yield chunk(j, last, _with_calls(reason) if called[j] else reason)
            if include_usage:
                yield event({**head, "choices": [], "usage": _usage(outs, calls.extra_tokens, self.engine.reasoning)})
            yield DONE
        except Exception as e:  # an encoder bug must end the stream visibly, not hang it
            self.metrics.error(500)
            yield event(error_body(500, f"internal error: {type(e).__name__}: {e}"))
            yield DONE
        finally:
            self.metrics.in_flight.dec()
            for out in outs:
                if out is None or not out.finished:  # the client left mid-stream, or another choice failed
                    self.metrics.aborted("chat")
            for gen in gens:
                await gen.close()


def _with_calls(reason: str) -> str:
    """A reply that called tools ends with "tool_calls" (OpenAI's), unless it was cut or aborted."""
    return "tool_calls" if reason == "stop" else reason


class _Calls:
    """The calls at the end of each choice of a request with tools: the reader's last, or a spoken
    reply's, written after it (server/spoken_calls.py; their tokens are counted in extra_tokens)."""

    def __init__(self, tools: ToolUse, spoken: SpokenCalls | None, messages: list | None, rid: str, request=None):
        self.tools, self.spoken, self.messages, self.rid, self.request = tools, spoken, messages, rid, request
        self.extra_tokens = 0

    async def finish(self, out, reader: ToolCallReader) -> tuple[str, str, list[CallPiece], object | None]:
        """A finished choice's finish reason (before its calls make it "tool_calls"), last words and
        pieces of calls, and the output of its spoken calls if they failed (else None)."""
        if self.spoken is None or not self.spoken.opened(out):
            rest, pieces = reader.finish()
            return finish_reason(out.finish_reason), rest, pieces, None
        written, made = await self.spoken.write(self.messages, out, f"{self.rid}-call", self.request)
        self.extra_tokens += len(written.token_ids)
        return (finish_reason(written.finish_reason), "", whole_pieces(made, reader.count),
                written if written.error else None)
