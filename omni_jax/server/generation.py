"""Running requests on the served engine, with the library's failures as HTTP errors.

`open_request` processes the prompt and submits it before anything is sent to the client,
so a bad prompt is a clean 400 (and a dead stage a 503) even for a streamed reply.
`updates` then yields the library's OmniRequestOutputs unchanged (text deltas, audio
chunks as `audio_delta`); closing it early (client gone) aborts the request in every stage.
A reply of several choices (`n`, a completions batch) opens them side by side
(`open_requests`, a shared prompt processed once by `prepare`) and streams them `merged`.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

import re

from ..errors import Overloaded, PromptTooLongError
from .engine import ServedEngine
from .errors import APIError, bad_request, overloaded, short

# How often a request whose prompt is being processed checks whether its client is still there.
DISCONNECT_POLL_S = 0.25
_SAMPLING_FIELD = re.compile(r"^(sampling_params_list\[\d+\]\.\w+)")


def check_model(engine: ServedEngine, model: str) -> None:
    """404 for a model name the server does not serve; 503 while it cannot serve."""
    if model != engine.served_name:
        raise APIError(404, f"The model {short(model)} does not exist; this server serves {engine.served_name!r}",
                       "model", "model_not_found")
    ok, why = engine.check()
    if not ok:
        raise APIError(503, why, None, "service_unavailable")


def _param_of_prompt_error(message: str, prompt_param: str) -> str:
    m = _SAMPLING_FIELD.match(message)
    if m:
        return m.group(1)
    if "voice" in message:
        return "voice"
    if "output_modalities" in message:
        return "modalities"
    if "chat_template_kwargs" in message:
        return "chat_template_kwargs"
    return prompt_param


class Generation:
    """One submitted request: its first update and the rest, as an async iterator."""

    def __init__(self, engine: ServedEngine, request_id: str, agen, first):
        self.engine, self.request_id, self._agen, self.first = engine, request_id, agen, first

    async def updates(self) -> AsyncIterator:
        """Every update from the first on; the request is aborted if the caller stops early."""
        try:
            out = self.first
            yield out
            while not out.finished:
                out = await self._agen.__anext__()
                yield out
        finally:
            await self._agen.aclose()

    async def close(self) -> None:
        await self._agen.aclose()

    async def result(self, request, poll_s: float = DISCONNECT_POLL_S):
        """The finished output, or None if the client disconnected first (the request is then aborted)."""

        async def collect():
            last = None
            async for last in self.updates():
                pass
            return last

        try:
            return await while_connected(request, collect(), poll_s)
        finally:
            await self.close()


async def while_connected(request, work, poll_s: float = DISCONNECT_POLL_S):
    """`work`'s result, or None if the client disconnected first (`work` is then cancelled, and
    has finished when this returns: a generator it was reading may then be closed)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                return None
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait({task})


@contextlib.contextmanager
def _as_http_errors(engine: ServedEngine, prompt_param: str, voice_param: str):
    """The library's refusals of a request (its prompt, voice, params, a dead stage) as HTTP errors."""
    try:
        yield
    except Overloaded as e:
        raise overloaded(str(e)) from None
    except PromptTooLongError as e:
        raise bad_request(str(e), prompt_param, "context_length_exceeded") from None  # OpenAI's code for it
    except ValueError as e:  # PromptError, unknown voice, modalities the engine was not started with
        msg = str(e)
        param = _param_of_prompt_error(msg, prompt_param)
        raise bad_request(msg, voice_param if param == "voice" else param) from None
    except RuntimeError as e:  # a dead stage or a shut-down engine refuses submissions
        engine.mark_dead(str(e))
        raise APIError(503, f"the engine cannot serve: {e}", None, "service_unavailable") from None


async def prepare(engine: ServedEngine, prompt, modalities, request, prompt_param: str = "messages"):
    """The prompt processed once, for several requests of it (`n` samples): the errors and the
    watch on the client's connection of `open_request`."""
    with _as_http_errors(engine, prompt_param, "voice"):
        prepared = await while_connected(request, engine.omni.process(prompt, list(modalities)))
    if prepared is None:
        raise APIError(499, "the client closed the connection", None, "client_closed")
    return prepared


async def open_request(engine: ServedEngine, prompt, params, modalities, voice, request_id: str,
                       voice_param: str = "voice", request=None, prompt_param: str = "messages") -> Generation:
    """Submit the request and wait for its first update (400 / 503 on failure to start; a bad
    prompt's 400 names `prompt_param`).

    While the prompt is processed, the client's connection is watched (`request`): a client that
    leaves cancels the processing itself (the prompt workers stop at their next step), not only
    the reply. 503 with Retry-After when the prompt workers' queue is full."""
    agen = None
    first_update = None
    try:
        with _as_http_errors(engine, prompt_param, voice_param):
            agen = engine.omni.generate(prompt, sampling_params_list=params, request_id=request_id,
                                        output_modalities=list(modalities), voice=voice)
            first_update = asyncio.ensure_future(agen.__anext__())
            while True:
                done, _ = await asyncio.wait({first_update}, timeout=DISCONNECT_POLL_S)
                if done:
                    first = first_update.result()
                    break
                if request is not None and await request.is_disconnected():
                    await _cancel(first_update, agen)
                    raise APIError(499, "the client closed the connection", None, "client_closed")
    except asyncio.CancelledError:
        await _cancel(first_update, agen)
        raise
    return Generation(engine, request_id, agen, first)


async def open_requests(engine: ServedEngine, requests: list[tuple], modalities, voice, request=None,
                        voice_param: str = "voice") -> list[Generation]:
    """Several requests (each `(prompt, params, request_id, prompt_param)`) submitted side by side
    as `open_request` does; if one is refused, the others are aborted and its error raised."""
    opened = await asyncio.gather(
        *(open_request(engine, prompt, params, modalities, voice, rid, voice_param=voice_param, request=request,
                       prompt_param=param) for prompt, params, rid, param in requests),
        return_exceptions=True)
    refused = [x for x in opened if isinstance(x, BaseException)]
    if refused:
        for gen in opened:
            if isinstance(gen, Generation):
                await gen.close()
        raise refused[0]
    return list(opened)


async def merged(gens: list[Generation]) -> AsyncIterator[tuple[int, object]]:
    """(index, update) of every generation as they come, until each has finished. Closing this
    early stops reading them (the caller closes them, which aborts their requests)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: Generation) -> None:
        try:
            async for out in gen.updates():
                await queue.put((i, out, None))
        except Exception as e:
            await queue.put((i, None, e))
        finally:
            await queue.put((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        running = len(tasks)
        while running:
            i, out, err = await queue.get()
            if err is not None:
                raise err
            if out is None:
                running -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def finished_outputs(gens: list[Generation], request, metrics, endpoint: str) -> list | None:
    """Every generation's finished output, counted in `metrics` (the reply leaves the in-flight
    count the handler raised), or None if the client left first (each request is then aborted);
    a failed one's HTTP error is for the caller to raise."""
    try:
        outs = await asyncio.gather(*(g.result(request) for g in gens))
    finally:
        metrics.in_flight.dec()
    if any(out is None for out in outs):  # the client left; nobody reads this
        for _ in gens:
            metrics.aborted(endpoint)
        return None
    for out in outs:
        metrics.finished(endpoint, out)
    return outs


async def _cancel(first_update, agen) -> None:
    """Stop a request still being prepared: its prompt's processing (PromptWorkers.run) and its
    generator (which aborts it if it was submitted meanwhile)."""
    if first_update is not None and not first_update.done():
        first_update.cancel()
        await asyncio.wait({first_update})
    if first_update is not None and first_update.done() and not first_update.cancelled():
        first_update.exception()  # retrieved: nobody reads it
    if agen is not None:
        await agen.aclose()


def failure(engine: ServedEngine, out, prompt_param: str = "messages") -> APIError:
    """The HTTP error for a request the library failed (an OmniRequestOutput with `error` and
    its `error_code`; a prompt too long for a stage names `prompt_param`)."""
    error, code = out.error, out.error_code
    ok, _ = engine.check()
    if not ok or code == "unavailable":
        # A stage failed (check() tells whether for good: then /health stays 503).
        return APIError(503, f"the request failed because a stage failed: {error}", None, "service_unavailable")
    own = error.removeprefix(f"request {out.request_id!r}: ")  # a stage's refusal names the request
    if code == "context_length_exceeded":
        # The prompt (its tokens or its media) exceeds what this deployment was sized for: OpenAI's
        # code for a prompt longer than the model takes, which a realtime session answers by
        # leaving out its oldest turns.
        return bad_request(own, prompt_param, "context_length_exceeded")
    if code == "invalid_request":
        # A stage refused the request as given (its own checks; most are made up front): the client's doing.
        return bad_request(own, "sampling_params_list", "invalid_request")
    return APIError(500, f"the request failed: {error}", None, "internal_error")


def finish_reason(reason: str | None) -> str:
    """The library's finish reason in OpenAI's vocabulary."""
    return reason if reason in ("stop", "length", "abort") else "stop"
