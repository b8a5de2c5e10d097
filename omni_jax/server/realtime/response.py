"""One realtime response: an `AsyncOmniJax` request turned into OpenAI's response events.

The events follow OpenAI's order: response.created, the assistant item (output_item.added,
conversation.item.added, content_part.added), its deltas as the stages make them (transcript
or text from the thinker, audio chunks from the vocoder), then the `.done` events and
response.done with the status and usage. A response cancelled (response.cancel, barge-in,
the client gone) is aborted in every stage by closing its request, and still ends with its
`.done` events, status `cancelled`; its item keeps the audio sent and is marked incomplete.

With tools, the calls the model makes are function_call items after the message item (each
added with its name, its arguments as they are written, done; in the conversation from its
name on); a spoken reply says its words and not its calls (server/spoken_calls.py). On a WebRTC
call the audio goes to the call's track (rtc.Speaker) instead of `response.output_audio.delta`
events.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

import numpy as np

from ...inputs.tool_calls import CallPiece, whole_pieces
from ..errors import APIError
from ..generation import failure, open_request
from ..reasoning import ReplyReasoning
from ..tempo import Tempo
from ..spoken_calls import SpokenCalls
from ..tools import NO_TOOLS, ToolUse, call_id
from .conversation import ConversationItem, Part, function_call_item, without_oldest_turn
from . import wire_audio
from .events import EventError, new_id

Send = Callable[[dict], Awaitable[None]]
SR = wire_audio.OUTPUT_RATE
# Audio deltas are cut to at most this many samples (OpenAI sends pieces of ~100 ms; a piece
# this size keeps one event under 20 kB and a barge-in's waste small).
MAX_DELTA_SAMPLES = 4800


class Response:
    """Runs one response (`run`), cancellable (`cancel`) from the session's receive loop."""

    def __init__(self, engine, send: Send, messages: list[dict], *, modalities: list[str], voice: str | None,
                 speed: float = 1.0, output_format: str = wire_audio.PCM, params: list, max_output_tokens,
                 conversation_id: str, item: ConversationItem, metadata: dict | None, previous_item_id: str | None,
                 on_finished: Callable[[object], None],
                 tools: ToolUse = NO_TOOLS, spoken_calls: SpokenCalls | None = None,
                 add_item: Callable[[ConversationItem, str | None], str | None] | None = None,
                 speaker=None):
        self.engine, self.send, self.messages, self.params = engine, send, messages, params
        # tools; a spoken reply's calls (None: a reply with tools is written in one go); how a
        # function_call item joins the conversation (None: out of band)
        self.tools, self.spoken_calls, self.add_item = tools, spoken_calls, add_item
        self.calls: list[ConversationItem] = []
        self._after: dict[str, str | None] = {}  # a call item's previous_item_id in the conversation
        self.id = new_id("resp")
        self.modalities, self.voice, self.max_output_tokens = modalities, voice, max_output_tokens
        self.conversation_id, self.item, self.metadata = conversation_id, item, metadata
        self.on_finished, self.previous_item_id = on_finished, previous_item_id
        self.audio = modalities == ["audio"]
        # a reply held to calls (a required or named tool) has nothing to say: the thinker alone writes it
        self.speaks = self.audio and tools.constraint is None
        self.call_tokens = 0
        self.tempo = Tempo(speed) if self.audio and speed != 1.0 else None  # the session's pace
        self.output_format, self.wire = output_format, wire_audio.OutputAudio(output_format)
        self.speaker = speaker  # a WebRTC call's track (rtc.Speaker): the audio goes there, not in events
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
            while not self._begun:  # response.created first (a task cancelled before its first step sends nothing)
                await asyncio.sleep(0)
            self.task.cancel()
            await asyncio.wait({self.task})

    def _object(self) -> dict:
        details = None
        if self.status != "in_progress" and self.status != "completed":
            details = {"type": self.status, "reason": self.reason, "error": self.error}
        return {"id": self.id, "object": "realtime.response", "status": self.status, "status_details": details,
                "output": [] if self.status == "in_progress" else [it.as_json() for it in (self.item, *self.calls)],
                "conversation_id": self.conversation_id, "output_modalities": self.modalities,
                "max_output_tokens": self.max_output_tokens, "metadata": self.metadata,
                "audio": {"output": {"format": wire_audio.as_json(self.output_format), "voice": self.voice}},
                "usage": self.usage}

    def _at(self) -> dict:
        return {"response_id": self.id, "item_id": self.item.id, "output_index": 0, "content_index": 0}

    async def run(self) -> None:
        try:  # response.created goes out before a cancel can land (cancel waits for _begun): a
            # barge-in as the response starts, while another event holds the socket, still opens with it
            await self.send({"type": "response.created", "event_id": new_id("event"), "response": self._object()})
        finally:
            self._begun = True
        part = self.item.parts[0]
        out, gen = None, None
        try:  # from here on: a cancel anywhere still ends with response.done
            try:
                gen = await self._open(["text", "audio"] if self.speaks else ["text"])
            except APIError as e:
                self._failed(e)
                return
            await self._item_added(part)
            reader = self.tools.reader()
            # A reasoning model's thinking is left out: a realtime reply is what is said (OpenAI's
            # realtime events have no place for it).
            thinking = ReplyReasoning(self.engine.reasoning)
            async for out in gen.updates():
                _, text = thinking.feed(out)
                pieces = []
                if reader is not None:
                    text, pieces = reader.feed(text)
                    if out.finished and not self._call_opened(out):  # an opened call's tag stays held
                        rest, closing = reader.finish()
                        text, pieces = text + rest, pieces + closing
                if text:
                    await self._text(text, part)
                for piece in pieces:
                    await self._call(piece)
                if self.speaks and out.audio_delta is not None:
                    await self._audio(out.audio_delta if self.tempo is None else self.tempo.push(out.audio_delta), part)
            if self.tempo is not None and out.finished and not out.error:
                await self._audio(self.tempo.flush(), part)
            if self.speaks and out.finished and not out.error and self.speaker is None:
                await self._send_audio(self.wire.flush(), part)
            ending = out
            if not out.error and self._call_opened(out):
                try:
                    ending, calls = await self.spoken_calls.write(self.messages, out, f"{self.id}-call")
                except APIError as e:
                    self._failed(e)
                    return
                self.call_tokens = len(ending.token_ids)
                for piece in whole_pieces(calls, reader.count):
                    await self._call(piece)
            if ending.error:
                self._failed(failure(self.engine, ending))
            elif ending.finish_reason == "length":
                self.status, self.reason = "incomplete", "max_output_tokens"
            else:
                self.status = "completed"
        except asyncio.CancelledError:
            self.status, self.reason = "cancelled", self._cancel_reason or "client_cancelled"
        finally:
            if gen is not None:
                await gen.close()  # aborts the request in every stage if it is still running
            if self.speaker is not None:
                self.speaker.finish(self.id)
            self.usage = _usage(out, self.call_tokens)
            self.item.status = "completed" if self.status == "completed" else "incomplete"
            for call in self.calls:  # a call cut off as it was written (cancelled, failed)
                if call.status == "in_progress":
                    call.status = "incomplete"
            try:
                await self._done(part, items_added=gen is not None)
            finally:
                self.on_finished(out)

    def _failed(self, e: APIError) -> None:
        self.status, self.error = "failed", {"type": "invalid_request_error" if e.status < 500 else "server_error",
                                             "code": e.code, "message": e.message}

    def _call_opened(self, out) -> bool:
        return self.spoken_calls is not None and self.spoken_calls.opened(out)

    async def _text(self, text: str, part: Part) -> None:
        if self.audio:
            part.transcript += text
            await self.send({"type": "response.output_audio_transcript.delta", "event_id": new_id("event"),
                             **self._at(), "delta": text})
        else:
            part.text += text
            await self.send({"type": "response.output_text.delta", "event_id": new_id("event"), **self._at(),
                             "delta": text})

    async def _call(self, piece: CallPiece) -> None:
        """A piece of a function call the reply makes: with its name, its item added to the
        response and the conversation; its arguments as they are written; at its end, the item done."""
        if piece.name is not None:
            item = function_call_item(call_id(), piece.name, "")
            item.status = "in_progress"
            self.calls.append(item)
            self._after[item.id] = None
            if self.add_item is not None:
                try:
                    self._after[item.id] = self.add_item(item, (self.calls[-2] if len(self.calls) > 1 else self.item).id)
                except EventError:  # a full conversation, or its message deleted meanwhile:
                    pass            # the client still gets the call
            added = item.as_json()
            await self._send_all([
                {"type": "response.output_item.added", "response_id": self.id, "output_index": len(self.calls),
                 "item": added},
                {"type": "conversation.item.added", "item": added, "previous_item_id": self._after[item.id]}])
        item = self.calls[piece.index]
        index = piece.index + 1  # the message is output 0
        at = {"response_id": self.id, "item_id": item.id, "output_index": index}
        if piece.arguments:
            item.call["arguments"] += piece.arguments
            await self._send_all([{"type": "response.function_call_arguments.delta", **at,
                                   "call_id": item.call["call_id"], "delta": piece.arguments}])
        if piece.done:
            item.status = "incomplete" if piece.cut else "completed"
            await self._send_all([
                {"type": "response.function_call_arguments.done", **at, **item.call},
                {"type": "response.output_item.done", "response_id": self.id, "output_index": index,
                 "item": item.as_json()},
                {"type": "conversation.item.done", "item": item.as_json(), "previous_item_id": self._after[item.id]}])

    async def _send_all(self, events: list[dict]) -> None:
        for e in events:
            await self.send({"event_id": new_id("event"), **e})

    async def _open(self, chain_mods: list[str]):
        """The request, on as much of the conversation as the model takes: while the prompt is
        too long, the oldest turn is left out (the conversation itself keeps it)."""
        messages = self.messages
        while True:
            try:
                prompt = {"messages": messages, **({"tools": self.tools.tools} if self.tools.tools else {})}
                gen = await open_request(self.engine, prompt, self.params, chain_mods,
                                         self.voice if self.speaks else None, self.id)
                if gen.first.error:  # a stage refused it as soon as it saw it
                    refused = failure(self.engine, gen.first)
                    if refused.code == "context_length_exceeded":
                        await gen.close()
                        raise refused
                self.messages = messages
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
        if self.speaker is None:
            await self._send_audio(self.wire.pieces(delta, MAX_DELTA_SAMPLES), part)
        elif delta is not None:
            self.speaker.play(self.id, delta)
            self._sent(len(delta), part)

    async def _send_audio(self, pieces: list[tuple[str, int]], part: Part) -> None:
        for piece, n in pieces:
            if piece:  # (a G.711 piece of a few samples may be all in the resampler yet)
                await self.send({"type": "response.output_audio.delta", "event_id": new_id("event"), **self._at(),
                                 "delta": piece})
            self._sent(n, part)

    def _sent(self, samples: int, part: Part) -> None:
        self.sent_samples += samples
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


def _usage(out, call_tokens: int = 0) -> dict | None:
    """`call_tokens`: those of a spoken reply's calls, written after it (Response._write_call)."""
    if out is None:
        return None
    prompt, reply = len(out.prompt_token_ids), len(out.token_ids) + call_tokens
    return {"total_tokens": prompt + reply, "input_tokens": prompt, "output_tokens": reply,
            "input_token_details": {"cached_tokens": out.num_cached_tokens,
                                    "text_tokens": None, "audio_tokens": None, "image_tokens": None},
            "output_token_details": {"text_tokens": reply, "audio_tokens": len(out.stage_token_ids.get("talker", ()))}}
