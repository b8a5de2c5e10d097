"""One realtime response: an `AsyncOmniJax` request turned into OpenAI's response events.

The events follow OpenAI's order: response.created, the assistant item (output_item.added,
conversation.item.added, content_part.added), its deltas as the stages make them (transcript
or text from the thinker, audio chunks from the vocoder), then the `.done` events and
response.done with the status and usage. A response cancelled (response.cancel, barge-in,
the client gone) is aborted in every stage by closing its request, and still ends with its
`.done` events, status `cancelled`; its item keeps the audio sent and is marked incomplete.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

import numpy as np

from .. import audio as audio_codec
from ..errors import APIError
from ..generation import failure, open_request
from ..tempo import Tempo
from .conversation import ConversationItem, Part, without_oldest_turn
from .events import new_id
from .session import PCM

Send = Callable[[dict], Awaitable[None]]
SR = 24000
# Audio deltas are cut to at most this many samples (OpenAI sends pieces of ~100 ms; a piece
# this size keeps one event under 20 kB and a barge-in's waste small).
MAX_DELTA_SAMPLES = 4800


class Response:
    """Runs one response (`run`), cancellable (`cancel`) from the session's receive loop."""

    def __init__(self, engine, send: Send, messages: list[dict], *, modalities: list[str], voice: str | None,
                 speed: float = 1.0, params: list, max_output_tokens, conversation_id: str, item: ConversationItem,
                 metadata: dict | None, previous_item_id: str | None, on_finished: Callable[[object], None]):
        self.engine, self.send, self.messages, self.params = engine, send, messages, params
        self.id = new_id("resp")
        self.modalities, self.voice, self.max_output_tokens = modalities, voice, max_output_tokens
        self.conversation_id, self.item, self.metadata = conversation_id, item, metadata
        self.on_finished, self.previous_item_id = on_finished, previous_item_id
        self.audio = modalities == ["audio"]
        self.tempo = Tempo(speed) if self.audio and speed != 1.0 else None  # the session's pace
        self.status, self.reason, self.error = "in_progress", None, None
        self.usage = None
        self.sent_samples = 0
        self.task: asyncio.Task | None = None
        self._cancel_reason: str | None = None
        self._begun = False

    def start(self) -> "Response":
        self.task = asyncio.ensure_future(self.run())
        return self

    async def cancel(self, reason: str) -> None:
        """Stop the response (its request is aborted in every stage) and wait for response.done."""
        if self.task is not None and not self.task.done():
            self._cancel_reason = reason
            while not self._begun:  # a task cancelled before its first step never runs its finally
                await asyncio.sleep(0)
            self.task.cancel()
            await asyncio.wait({self.task})

    def _object(self) -> dict:
        details = None
        if self.status != "in_progress" and self.status != "completed":
            details = {"type": self.status, "reason": self.reason, "error": self.error}
        return {"id": self.id, "object": "realtime.response", "status": self.status, "status_details": details,
                "output": [] if self.status == "in_progress" else [self.item.as_json()],
                "conversation_id": self.conversation_id, "output_modalities": self.modalities,
                "max_output_tokens": self.max_output_tokens, "metadata": self.metadata,
                "audio": {"output": {"format": PCM, "voice": self.voice}}, "usage": self.usage}

    def _at(self) -> dict:
        return {"response_id": self.id, "item_id": self.item.id, "output_index": 0, "content_index": 0}

    async def run(self) -> None:
        self._begun = True
        part = self.item.parts[0]
        out, gen = None, None
        try:  # from the first await on: a cancel anywhere still ends with response.done
            await self.send({"type": "response.created", "event_id": new_id("event"), "response": self._object()})
            chain_mods = ["text", "audio"] if self.audio else ["text"]
            try:
                gen = await self._open(chain_mods)
            except APIError as e:
                self.status, self.error = "failed", {"type": "invalid_request_error" if e.status < 500 else
                                                     "server_error", "code": e.code, "message": e.message}
                return
            await self._item_added(part)
            async for out in gen.updates():
                if out.text_delta:
                    if self.audio:
                        part.transcript += out.text_delta
                        await self.send({"type": "response.output_audio_transcript.delta", "event_id": new_id("event"),
                                         **self._at(), "delta": out.text_delta})
                    else:
                        part.text += out.text_delta
                        await self.send({"type": "response.output_text.delta", "event_id": new_id("event"),
                                         **self._at(), "delta": out.text_delta})
                if self.audio and out.audio_delta is not None:
                    await self._audio(out.audio_delta if self.tempo is None else self.tempo.push(out.audio_delta), part)
            if self.tempo is not None and out.finished and not out.error:
                await self._audio(self.tempo.flush(), part)
            if out.error:
                err = failure(self.engine, out)
                self.status, self.error = "failed", {"type": "server_error" if err.status >= 500 else
                                                     "invalid_request_error", "code": err.code, "message": err.message}
            elif out.finish_reason == "length":
                self.status, self.reason = "incomplete", "max_output_tokens"
            else:
                self.status = "completed"
        except asyncio.CancelledError:
            self.status, self.reason = "cancelled", self._cancel_reason or "client_cancelled"
        finally:
            if gen is not None:
                await gen.close()  # aborts the request in every stage if it is still running
            self.usage = _usage(out)
            self.item.status = "completed" if self.status == "completed" else "incomplete"
            try:
                await self._done(part, items_added=gen is not None)
            finally:
                self.on_finished(out)

    async def _open(self, chain_mods: list[str]):
        """The request, on as much of the conversation as the model takes: while the prompt is
        too long (its tokens, or its media for the thinker's encoders), the oldest turn is left
        out (the conversation itself keeps it)."""
        messages = self.messages
        while True:
            try:
                gen = await open_request(self.engine, {"messages": messages}, self.params, chain_mods,
                                         self.voice if self.audio else None, self.id)
                if gen.first.error:  # a stage refused it as soon as it saw it
                    refused = failure(self.engine, gen.first)
                    if refused.code == "context_length_exceeded":
                        await gen.close()
                        raise refused
                return gen
            except APIError as e:
                shorter = without_oldest_turn(messages) if e.code == "context_length_exceeded" else None
                if shorter is None:
                    raise
                messages = shorter

    async def _item_added(self, part: Part) -> None:
        self.item.status = "in_progress"
        added = self.item.as_json()
        await self.send({"type": "response.output_item.added", "event_id": new_id("event"), "response_id": self.id,
                         "output_index": 0, "item": added})
        await self.send({"type": "conversation.item.added", "event_id": new_id("event"), "item": added,
                         "previous_item_id": self.previous_item_id})
        await self.send({"type": "response.content_part.added", "event_id": new_id("event"), **self._at(),
                         "part": _content(part)})

    async def _audio(self, delta: np.ndarray, part: Part) -> None:
        for piece, n in audio_codec.pcm16_pieces(delta, MAX_DELTA_SAMPLES):
            await self.send({"type": "response.output_audio.delta", "event_id": new_id("event"), **self._at(),
                             "delta": piece})
            self.sent_samples += n
            part.audio_ms = self.sent_samples * 1000 // SR

    async def _done(self, part: Part, items_added: bool) -> None:
        if items_added:
            at = self._at()
            if self.audio:
                await self.send({"type": "response.output_audio.done", "event_id": new_id("event"), **at})
                await self.send({"type": "response.output_audio_transcript.done", "event_id": new_id("event"), **at,
                                 "transcript": part.transcript})
            else:
                await self.send({"type": "response.output_text.done", "event_id": new_id("event"), **at,
                                 "text": part.text})
            await self.send({"type": "response.content_part.done", "event_id": new_id("event"), **at,
                             "part": _content(part)})
            item = self.item.as_json()
            await self.send({"type": "response.output_item.done", "event_id": new_id("event"), "response_id": self.id,
                             "output_index": 0, "item": item})
            await self.send({"type": "conversation.item.done", "event_id": new_id("event"), "item": item,
                             "previous_item_id": self.previous_item_id})
        await self.send({"type": "response.done", "event_id": new_id("event"), "response": self._object()})


def _content(part: Part) -> dict:
    if part.type == "output_audio":
        return {"type": "audio", "transcript": part.transcript or ""}
    return {"type": "text", "text": part.text or ""}


def _usage(out) -> dict | None:
    if out is None:
        return None
    prompt, reply = len(out.prompt_token_ids), len(out.token_ids)
    return {"total_tokens": prompt + reply, "input_tokens": prompt, "output_tokens": reply,
            "input_token_details": {"cached_tokens": out.num_cached_tokens,
                                    "text_tokens": None, "audio_tokens": None, "image_tokens": None},
            "output_token_details": {"text_tokens": reply, "audio_tokens": len(out.stage_token_ids.get("talker", ()))}}
