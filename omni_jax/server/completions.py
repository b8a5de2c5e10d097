"""POST /v1/completions: OpenAI's legacy text completions, answered by the thinker alone.

A prompt is a text (no chat template: the model continues it) or token ids; a list of them
is a batch, `n` choices per prompt (choice i * n + j: prompt i's j-th), run side by side. `echo` puts the
prompt before the completion and, with `logprobs`, the prompt tokens' logprobs (computed in
the thinker's prefill; the first token has none) before the completion's; `echo` with
`max_tokens: 0` returns the prompt alone, which is how evaluation harnesses score a text (the
thinker samples one token, which is dropped, as vLLM does). Streamed replies are
`text_completion` chunks, one choice each, as the choices' tokens come; then a chunk with each
choice's `finish_reason`, `usage` when `stream_options.include_usage`, and `[DONE]`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from .engine import ServedEngine
from .errors import bad_request, error_body
from .generation import (Generation, check_model, failure, finish_reason, finished_outputs, merged,
                         open_requests, prepare)
from .logprobs import CompletionLogprobs
from .metrics import Metrics
from .schemas import MAX_CHOICES, CompletionRequest
from .sse import DONE, event, event_stream
from .stage_params import sample_params, stage_params
from .structured import structured_outputs

MODALITIES = ["text"]


def _is_id(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def prompts_of(req: CompletionRequest) -> list:
    """The library prompts of the request's `prompt`: one per choice. A batch's prompts may be
    texts and token id lists alike."""
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise bad_request("prompt is an empty list", "prompt")
    if all(_is_id(x) for x in p):
        return [{"prompt_token_ids": p}]
    if len(p) > MAX_CHOICES:
        raise bad_request(f"prompt holds {len(p)} prompts; at most {MAX_CHOICES} go in one request", "prompt")
    out = []
    for x in p:
        if isinstance(x, str):
            out.append(x)
        elif isinstance(x, list) and x and all(_is_id(t) for t in x):
            out.append({"prompt_token_ids": x})
        else:
            raise bad_request("prompt must be a string, a list of token ids, or a list of strings and non-empty "
                              "lists of token ids", "prompt")
    return out


def _validate(req: CompletionRequest) -> None:
    """400s for fields OpenAI has that are out of range here or not served."""
    if req.suffix:
        raise bad_request("suffix (text after the completion) is not supported by this server", "suffix",
                          "unsupported_parameter")
    if req.best_of not in (None, req.n):
        raise bad_request("best_of (choosing the best of more samples than n) is not supported by this server",
                          "best_of", "unsupported_parameter")
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens 0 is only allowed with echo (the prompt's logprobs alone)", "max_tokens")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")


class _Choice:
    """One choice: its text and logprobs as its updates come. `param`: its prompt's field."""

    def __init__(self, index: int, req: CompletionRequest, prompt, param: str, tokenizer, sample: int):
        self.index, self.req, self.prompt, self.param, self.sample = index, req, prompt, param, sample
        self.echo_only = req.echo and req.max_tokens == 0
        self.logprobs = CompletionLogprobs(tokenizer, req.logprobs) if req.logprobs is not None else None
        self.tokenizer = tokenizer
        self.out = None

    def _echo(self, out) -> tuple[str, dict | None]:
        text = self.prompt if isinstance(self.prompt, str) else self.tokenizer.decode(list(out.prompt_token_ids))
        lps = None
        if self.logprobs is not None:
            lps = self.logprobs.add(list(out.prompt_token_ids), out.prompt_logprobs or [None] * len(out.prompt_token_ids))
        return text, lps

    def _add(self, out, first: bool, text: str, token_ids: list[int], logprobs) -> tuple[str, dict | None]:
        self.out = out
        echo, lps = self._echo(out) if first and self.req.echo else ("", None)
        if self.echo_only:
            return echo, lps
        if self.logprobs is not None and token_ids:
            more = self.logprobs.add(token_ids, logprobs[-len(token_ids):])
            lps = more if lps is None else {k: lps[k] + more[k] for k in lps}
        return echo + text, lps

    def delta(self, out) -> tuple[str, dict | None]:
        """The text and logprobs this update adds to the choice (the prompt first, when echoed)."""
        return self._add(out, self.out is None, out.text_delta, out.new_token_ids, out.logprobs)

    def whole(self, out) -> tuple[str, dict | None]:
        """The finished choice's text and logprobs."""
        return self._add(out, True, out.text, list(out.token_ids), out.logprobs)

    def finish_reason(self) -> str:
        return "length" if self.echo_only else finish_reason(self.out.finish_reason)

    def usage(self) -> tuple[int, int]:
        """Its prompt's tokens (counted once for the n samples, as OpenAI's) and its own."""
        prompt = len(self.out.prompt_token_ids) if self.sample == 0 else 0
        return prompt, 0 if self.echo_only else len(self.out.token_ids)


def _usage(choices: list[_Choice]) -> dict:
    p = sum(c.usage()[0] for c in choices)
    c = sum(c.usage()[1] for c in choices)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


class CompletionsHandler:
    """Serves text completions on one engine."""

    def __init__(self, engine: ServedEngine, metrics: Metrics):
        self.engine, self.metrics = engine, metrics

    async def __call__(self, req: CompletionRequest, request: Request):
        check_model(self.engine, req.model)
        _validate(req)
        prompts = prompts_of(req)
        echo_only = req.echo and req.max_tokens == 0
        params = stage_params(self.engine.stage_defaults(self.engine.stage_names(MODALITIES)), req,
                              max_tokens=1 if echo_only else req.max_tokens, logprobs=req.logprobs,
                              prompt_logprobs=req.logprobs if req.echo else None,
                              structured_outputs=structured_outputs(req, req.response_format, "response_format"))
        if len(prompts) * req.n > MAX_CHOICES:
            raise bad_request(f"{len(prompts)} prompt(s) x n={req.n} make more than {MAX_CHOICES} choices", "n")
        rid = f"cmpl-{uuid.uuid4().hex}"
        # Choice i * n + j is prompt i's j-th sample (OpenAI's order).
        choices, requests = [], []
        tokenizer = self.engine.omni.tokenizer
        fields = ["prompt"] if len(prompts) == 1 else [f"prompt[{i}]" for i in range(len(prompts))]
        inputs = prompts
        if req.n > 1:  # each prompt's n samples: the prompt processed once
            inputs = await asyncio.gather(*(prepare(self.engine, p, MODALITIES, request, f)
                                            for p, f in zip(prompts, fields)), return_exceptions=True)
            refused = [x for x in inputs if isinstance(x, BaseException)]
            if refused:
                raise refused[0]
        for prompt, given, param in zip(inputs, prompts, fields):
            for j in range(req.n):
                choices.append(_Choice(len(choices), req, given, param, tokenizer, j))
                requests.append((prompt, sample_params(params, req.seed, j), f"{rid}-{len(requests)}", param))
        gens = await open_requests(self.engine, requests, MODALITIES, None, request=request)
        self.metrics.in_flight.inc()
        if req.stream:
            return event_stream(self._stream(req, rid, gens, choices))
        outs = await finished_outputs(gens, request, self.metrics, "completions")
        if outs is None:
            return JSONResponse({}, status_code=499)
        for choice, out in zip(choices, outs):
            if out.error:
                raise failure(self.engine, out, choice.param)
        body = []
        for choice, out in zip(choices, outs):
            text, lps = choice.whole(out)
            body.append({"index": choice.index, "text": text, "logprobs": lps, "finish_reason": choice.finish_reason()})
        return JSONResponse({"id": rid, "object": "text_completion", "created": int(time.time()), "model": req.model,
                             "system_fingerprint": None, "choices": body, "usage": _usage(choices)})

    async def _stream(self, req: CompletionRequest, rid: str, gens: list[Generation],
                      choices: list[_Choice]) -> AsyncIterator[bytes]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": req.model,
                "system_fingerprint": None}

        def chunk(index: int, text: str, logprobs: dict | None = None, reason: str | None = None) -> bytes:
            body = {**head, "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}]}
            if include_usage:
                body["usage"] = None
            return event(body)

        finished = 0
        try:
            async for i, out in merged(gens):
                choice = choices[i]
                text, lps = choice.delta(out)
                if text or lps:
                    yield chunk(i, text, lps)
                if out.finished:
                    finished += 1
                    self.metrics.finished("completions", out)
                    if out.error:
                        err = failure(self.engine, out, choice.param)
                        self.metrics.error(err.status)
                        yield event(err.body())
                        yield DONE
                        return
                    yield chunk(i, "", None, choice.finish_reason())
            if include_usage:
                yield event({**head, "choices": [], "usage": _usage(choices)})
            yield DONE
        except Exception as e:  # a bug must end the stream visibly, not hang it
            self.metrics.error(500)
            yield event(error_body(500, f"internal error: {type(e).__name__}: {e}"))
            yield DONE
        finally:
            self.metrics.in_flight.dec()
            for _ in range(len(gens) - finished):  # the client left mid-stream, or a choice failed
                self.metrics.aborted("completions")
            for gen in gens:
                await gen.close()

