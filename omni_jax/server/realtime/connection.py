"""One realtime session: its event loop, over a WebSocket (endpoint.py) or a WebRTC call (calls.py).

A session reads client events one at a time from its `Channel`, answers each (a bad one gets an
`error` event; the channel stays open), and runs at most one response at a time as a task, so that it keeps
reading while the response streams: a cancel or the user's speech (barge-in) reaches the
response at once. Sends share one lock; each waits for the socket's buffer to drain, so a slow
reader slows its own response (backpressure) instead of growing memory, and one that stops
reading for `send_timeout_s` is closed. When the session ends for any reason its response and
transcriptions are aborted in every stage. On a WebRTC call the replies' audio goes to the call's
`Speaker` track instead of `response.output_audio.delta` events, and a barge-in clears it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from types import SimpleNamespace
from typing import Protocol

import numpy as np

from ..errors import APIError, InputAudioError
from ..messages import MediaPolicy
from ..metrics import Metrics
from ..stage_params import stage_params
from ..logprobs import token_logprobs
from ..transcription import token_usage, transcription_params, transcription_prompt
from ..generation import open_request
from ..reasoning import ReplyReasoning, thinking_fields
from ..spoken_calls import SpokenCalls
from . import wire_audio
from .conversation import Conversation, ConversationItem, Part, item_from_event
from .events import (ConversationItemCreate, ConversationItemDelete, ConversationItemRetrieve,
                     ConversationItemTruncate, EventError, InputAudioBufferAppend, InputAudioBufferClear,
                     InputAudioBufferCommit, OutputAudioBufferClear, ResponseCancel, ResponseCreate, SessionUpdate,
                     new_id, parse)
from .response import Response
from .session import SessionConfig
from .turns import Turns
from ..vad import RATE

log = logging.getLogger("omni_jax.server")
POLICY_VIOLATION = 1008  # a message past the size limit is closed by uvicorn with 1009 (serve.py's ws_max_size)
MIN_COMMIT_MS = 100          # OpenAI refuses to commit less


@dataclasses.dataclass(frozen=True)
class RealtimeLimits:
    max_sessions: int = 16
    max_buffer_s: float = 60.0        # input audio held before a commit
    max_session_s: float = 1800.0
    max_items: int = 512              # conversation items of one session
    send_timeout_s: float = 30.0


class Channel(Protocol):
    """How a session's events travel: a WebSocket (endpoint.py) or a call's data channel (rtc.py)."""

    async def receive(self) -> str | bytes | None: ...   # the next client event; None once the client is gone
    async def send_text(self, text: str) -> None: ...
    async def close(self, code: int, reason: str) -> None: ...


class RealtimeSession:
    """One connection's session: settings, conversation, input audio, and its response."""

    def __init__(self, channel: Channel, engine, policy: MediaPolicy, metrics: Metrics, limits: RealtimeLimits,
                 kind: str = "realtime", config: SessionConfig | None = None, speaker=None):
        """`config`: the settings it starts with (a client secret's), else the defaults of a `kind` session.
        `speaker`: a WebRTC call's audio track (rtc.Speaker), which plays the replies."""
        self.channel, self.engine, self.policy, self.metrics, self.limits = channel, engine, policy, metrics, limits
        self.speaker = speaker
        self.config = config or SessionConfig(engine.served_name, engine.voices, type=kind)
        self.conversation = Conversation(limits.max_items)
        self.conversation_id = new_id("conv")
        self.turns = Turns(limits.max_buffer_s, self.config.turn_detection, wire_audio.rate(self.config.input_format))
        self.speech_item: str | None = None       # the item id a detected turn will get
        self.response: Response | None = None
        self.tasks: set[asyncio.Task] = set()     # transcriptions, the idle timeout's turn, posted events
        self._lock = asyncio.Lock()
        self.closed = False
        self._idle: asyncio.TimerHandle | None = None   # turn_detection.idle_timeout_ms, once armed
        self._turn_lock = asyncio.Lock()  # appends (the VAD runs off the loop) and the idle timeout's commit
        self._deaf = False                # a call's audio is dropped: the input buffer is full
        self.spoken: dict[str, str] = {}  # a call's response id -> its item, while its audio may be playing

    async def send(self, event: dict) -> None:
        """Send one server event (dropped once the client is gone)."""
        if self.closed:
            return
        text = json.dumps(event)
        async with self._lock:
            try:
                await asyncio.wait_for(self.channel.send_text(text), self.limits.send_timeout_s)
            except asyncio.TimeoutError:
                self.closed = True
                log.warning("realtime session %s: the client read nothing for %gs; closing", self.config.id,
                            self.limits.send_timeout_s)
                await self._close(POLICY_VIOLATION, "the client stopped reading")
            except Exception:  # disconnected: the receive loop sees it and ends the session
                self.closed = True

    def post(self, event: dict) -> None:
        """Send an event from a callback (the call's speaker), without waiting for it."""
        self._spawn(self.send(event))

    async def _close(self, code: int, reason: str) -> None:
        self.closed = True
        await self.channel.close(code, reason)

    async def run(self) -> None:
        await self.send({"type": "session.created", "event_id": new_id("event"), "session": self.config.as_json()})
        try:
            async with asyncio.timeout(self.limits.max_session_s):
                while not self.closed:
                    data = await self.channel.receive()
                    if data is None:
                        break
                    try:
                        await self.handle(parse(data))
                    except EventError as e:
                        await self.send(e.event())
                    except Exception as e:  # a bug: said, logged, and the session goes on
                        log.exception("realtime session %s: error handling an event", self.config.id)
                        await self.send(EventError(f"internal error: {type(e).__name__}", "internal_error",
                                                   type="server_error").event())
        except TimeoutError:
            await self.send(EventError(f"the session reached its limit of {self.limits.max_session_s:g} s",
                                       "session_expired").event())
            await self._close(1000, "session expired")
        finally:
            self.closed = True
            self._disarm_idle()
            if self.response is not None:
                await self.response.cancel("client_cancelled")
            for t in list(self.tasks):
                t.cancel()
            if self.tasks:
                await asyncio.wait(self.tasks)
            await self._close(1000, "")

    # ------------------------------------------------------------------------------------ events

    async def handle(self, ev) -> None:
        if isinstance(ev, InputAudioBufferAppend):
            await self._append(ev)
        elif isinstance(ev, SessionUpdate):
            had_vad = self.config.turn_detection
            self.config.update(ev.session, ev.event_id)
            if self.config.turn_detection != had_vad:
                self.turns.configure(self.config.turn_detection)
                self._disarm_idle()  # the next reply's end arms the new setting
            self.turns.buffer.set_rate(wire_audio.rate(self.config.input_format))
            await self.send({"type": "session.updated", "event_id": new_id("event"), "session": self.config.as_json()})
        elif isinstance(ev, InputAudioBufferCommit):
            held = self.turns.buffer.ms
            if held < MIN_COMMIT_MS:
                raise EventError(f"buffer too small: expected at least {MIN_COMMIT_MS} ms of audio, but the buffer "
                                 f"holds {held} ms", "input_audio_buffer_commit_empty", None, ev.event_id)
            await self._commit(self.turns.commit(), self.speech_item)
        elif isinstance(ev, InputAudioBufferClear):
            self.turns.clear()
            self.speech_item = None
            await self.send({"type": "input_audio_buffer.cleared", "event_id": new_id("event")})
        elif isinstance(ev, ConversationItemCreate):
            try:
                item = await self._item(ev.item, self.config.input_format)
            except EventError as e:
                e.event_id = ev.event_id
                raise
            await self._add_item(item, ev.previous_item_id, ev.event_id)
        elif isinstance(ev, ConversationItemDelete):
            self.conversation.delete(ev.item_id, ev.event_id)
            await self.send({"type": "conversation.item.deleted", "event_id": new_id("event"), "item_id": ev.item_id})
        elif isinstance(ev, ConversationItemRetrieve):
            item = self.conversation.get(ev.item_id, ev.event_id)
            await self.send({"type": "conversation.item.retrieved", "event_id": new_id("event"),
                             "item": item.as_json()})
        elif isinstance(ev, ConversationItemTruncate):
            if self.response is not None and self.response.item.id == ev.item_id:
                await self.response.cancel("client_cancelled")
            self.conversation.truncate(ev.item_id, ev.content_index, ev.audio_end_ms, ev.event_id)
            await self.send({"type": "conversation.item.truncated", "event_id": new_id("event"), "item_id": ev.item_id,
                             "content_index": ev.content_index, "audio_end_ms": ev.audio_end_ms})
        elif isinstance(ev, ResponseCreate):
            await self._respond(ev)
        elif isinstance(ev, ResponseCancel):
            if self.response is None or (ev.response_id is not None and ev.response_id != self.response.id):
                raise EventError("there is no active response to cancel" if self.response is None else
                                 f"response {ev.response_id!r} is not the active one", "response_cancel_not_active",
                                 None, ev.event_id)
            await self.response.cancel("client_cancelled")
        elif isinstance(ev, OutputAudioBufferClear):
            self._clear_speaker()   # (over a WebSocket the client plays the audio: nothing to clear here)

    def _clear_speaker(self) -> None:
        """Stop a WebRTC call's reply audio where it is: the item keeps what was played of it, as a
        client's conversation.item.truncate would leave it."""
        cut = self.speaker.clear() if self.speaker is not None else None
        if cut is None:
            return
        item_id = self.spoken.get(cut[0])
        if item_id is not None:
            try:
                self.conversation.truncate(item_id, 0, cut[1])
            except EventError:  # out of band, or deleted since
                pass

    async def _append(self, ev: InputAudioBufferAppend) -> None:
        async with self._turn_lock:
            await self._append_locked(ev)

    async def _append_locked(self, ev: InputAudioBufferAppend) -> None:
        try:
            self.turns.buffer.check(wire_audio.samples_in(ev.audio, self.config.input_format))
            wave = wire_audio.decode(ev.audio, self.config.input_format)
            turn_events = await asyncio.to_thread(self.turns.append, wave)
        except InputAudioError as e:
            raise EventError(str(e), "invalid_value", "audio", ev.event_id) from None
        await self._turn_events(turn_events)

    async def hear(self, wave: np.ndarray) -> None:
        """A WebRTC call's audio, at the input rate: into the buffer as an append's would go. Past
        the buffer's bound (turn detection off and no commit) the caller is told once, and the
        audio is dropped until a commit or clear makes room."""
        async with self._turn_lock:
            if self.closed:
                return
            try:
                self.turns.buffer.check(len(wave))
            except InputAudioError as e:
                if not self._deaf:
                    self._deaf = True
                    await self.send(EventError(str(e), "input_audio_buffer_full", "audio").event())
                return
            self._deaf = False
            await self._turn_events(await asyncio.to_thread(self.turns.append, wave))

    async def _turn_events(self, turn_events) -> None:
        for vev, audio in turn_events:
            if vev.kind == "speech_started":
                self._disarm_idle()
                self.speech_item = new_id("item")
                await self.send({"type": "input_audio_buffer.speech_started", "event_id": new_id("event"),
                                 "audio_start_ms": vev.ms, "item_id": self.speech_item})
                td = self.config.turn_detection
                if td is not None and td.interrupt_response:   # barge-in
                    if self.response is not None:
                        await self.response.cancel("turn_detected")
                    self._clear_speaker()
            else:
                await self.send({"type": "input_audio_buffer.speech_stopped", "event_id": new_id("event"),
                                 "audio_end_ms": vev.ms, "item_id": self.speech_item})
                await self._commit(audio, self.speech_item)
                td = self.config.turn_detection
                if self.config.answers and td is not None and td.create_response:
                    await self._respond(None)

    async def _commit(self, audio, item_id: str | None) -> None:
        item = ConversationItem(item_id or new_id("item"), "user", [Part("input_audio", audio=audio)])
        self.speech_item = None
        self._disarm_idle()
        # Nothing answers a transcription session's turns: it goes on for as long as it is spoken
        # to, forgetting its oldest turn (and saying so) rather than refusing the newest.
        forgotten = None if self.config.answers else self.conversation.make_room()
        if forgotten is not None:
            await self.send({"type": "conversation.item.deleted", "event_id": new_id("event"), "item_id": forgotten})
        previous = self.conversation.add(item)
        await self.send({"type": "input_audio_buffer.committed", "event_id": new_id("event"),
                         "item_id": item.id, "previous_item_id": previous})
        await self._announce(item, previous)
        if self.config.transcription_settings is not None:
            self._spawn(self._transcribe(item))

    async def _item(self, item, input_format: str) -> ConversationItem:
        """A client's item, checked, its audio decoded and its images read (on a worker thread)."""
        return await asyncio.to_thread(item_from_event, item, self.policy, self.limits.max_buffer_s, input_format,
                                       self.engine.omni.processor.media_limits)

    async def _add_item(self, item: ConversationItem, previous_item_id: str | None, event_id: str | None) -> None:
        self._disarm_idle()
        try:
            previous = self.conversation.add(item, previous_item_id)
        except EventError as e:
            e.event_id = event_id
            raise
        await self._announce(item, previous)

    async def _announce(self, item: ConversationItem, previous: str | None) -> None:
        body = {"item": item.as_json(), "previous_item_id": previous}
        await self.send({"type": "conversation.item.added", "event_id": new_id("event"), **body})
        await self.send({"type": "conversation.item.done", "event_id": new_id("event"), **body})

    # ------------------------------------------------------------------------------ idle timeout

    def _arm_idle(self, played_ms: int) -> None:
        """Once a reply ends: OpenAI's idle_timeout_ms counts from when its audio has played."""
        self._disarm_idle()
        td = self.config.turn_detection
        if not self.closed and self.config.answers and td is not None and td.idle_timeout_ms:
            self._idle = asyncio.get_running_loop().call_later(
                (played_ms + td.idle_timeout_ms) / 1000, lambda: self._spawn(self._on_idle()))

    def _disarm_idle(self) -> None:
        """The user spoke, committed or added an item (or the session changed or ended)."""
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None

    async def _on_idle(self) -> None:
        """The user kept silent: input_audio_buffer.timeout_triggered, the silence committed as
        their turn (at least the shortest commit), and a response to it."""
        self._idle = None
        async with self._turn_lock:  # not while an append is in the VAD
            if self.closed or self.response is not None or self.speech_item is not None:
                return
            buffer, item_id = self.turns.buffer, new_id("item")
            await self.send({"type": "input_audio_buffer.timeout_triggered", "event_id": new_id("event"),
                             "audio_start_ms": buffer.start * 1000 // RATE, "audio_end_ms": buffer.end * 1000 // RATE,
                             "item_id": item_id})
            audio = self.turns.commit()
            try:
                await self._commit(np.pad(audio, (0, max(0, MIN_COMMIT_MS * RATE // 1000 - len(audio)))), item_id)
                await self._respond(None)
            except EventError as e:  # a full conversation, say: told, and the session goes on
                await self.send(e.event())

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _transcribe(self, item: ConversationItem) -> None:
        """The transcript of a committed item: conversation.item.input_audio_transcription.delta
        events as the thinker writes it, then .completed (or .failed)."""
        part, tc = item.parts[0], self.config.transcription_settings
        with_logprobs = self.config.transcription_logprobs
        prompt = transcription_prompt(part.audio, RATE, tc.language, tc.prompt)
        params = transcription_params(self.engine, 0.0, with_logprobs)
        gen, logprobs, heard = None, [], ""
        thinking = ReplyReasoning(self.engine.reasoning)  # a reasoning model's thinking is no transcript
        try:
            gen = await open_request(self.engine, prompt, params, ["text"], None, new_id("transcribe"))
            out = None
            async for out in gen.updates():
                new = out.new_token_ids
                lps = token_logprobs(self.engine.omni.tokenizer, new, out.logprobs[-len(new):], None) \
                    if with_logprobs and new and out.logprobs else []
                logprobs += lps
                _, delta = thinking.feed(out)
                heard += delta
                if delta:
                    await self.send({"type": "conversation.item.input_audio_transcription.delta",
                                     "event_id": new_id("event"), "item_id": item.id, "content_index": 0,
                                     "delta": delta, "logprobs": lps if with_logprobs else None})
            if out.error:
                raise RuntimeError(out.error)
            part.transcript = heard
            await self.send({"type": "conversation.item.input_audio_transcription.completed",
                             "event_id": new_id("event"), "item_id": item.id, "content_index": 0,
                             "transcript": heard, "usage": token_usage(out),
                             "logprobs": logprobs if with_logprobs else None})
        except asyncio.CancelledError:
            raise
        except Exception as e:
            await self.send({"type": "conversation.item.input_audio_transcription.failed", "event_id": new_id("event"),
                             "item_id": item.id, "content_index": 0,
                             "error": {"type": "server_error", "code": "transcription_failed",
                                       "message": str(getattr(e, "message", e))[:500]}})
        finally:
            if gen is not None:
                await gen.close()

    async def _respond(self, ev: ResponseCreate | None) -> None:
        if not self.config.answers:
            raise EventError("a transcription session makes no responses; switch it with session.update to type "
                             "'realtime' first", "invalid_request", None, ev.event_id if ev else None)
        if self.response is not None:
            raise EventError(f"Conversation already has an active response in progress: {self.response.id}. Wait "
                             f"until the response is finished before creating a new one.",
                             "conversation_already_has_active_response", None, ev.event_id if ev else None)
        fields = ev.response if ev is not None else None
        event_id = ev.event_id if ev is not None else None
        sent = fields.model_fields_set if fields is not None else set()
        cfg = self.config
        modalities = fields.output_modalities if fields is not None and fields.output_modalities else cfg.output_modalities
        if modalities == ["audio"] and not cfg.voices:
            raise EventError("this model has no speech output; ask for output_modalities ['text']", "invalid_value",
                             "response.output_modalities", event_id)
        voice, output_format = cfg.voice, cfg.output_format
        asked = fields.audio.output if fields is not None and fields.audio is not None else None
        if asked is not None and asked.voice is not None:
            voice = cfg.check_voice(asked.voice, "response.audio.output.voice", event_id)
        if asked is not None and asked.format is not None:
            output_format = asked.format.type
        tools = cfg.tool_use("response", event_id, fields.tools if fields is not None else None,
                             fields.tool_choice if fields is not None else None)
        instructions = fields.instructions if "instructions" in sent and fields.instructions is not None \
            else cfg.instructions
        max_tokens = fields.max_output_tokens if "max_output_tokens" in sent and fields.max_output_tokens \
            else cfg.max_output_tokens
        temperature = fields.temperature if "temperature" in sent and fields.temperature is not None \
            else cfg.temperature
        out_of_band = fields is not None and (fields.conversation == "none" or fields.input is not None)
        if fields is not None and fields.input is not None:
            context = Conversation(self.limits.max_items)
            for it in fields.input:
                context.add(await self._item(it, cfg.input_format))
        else:
            context = self.conversation
        messages = context.messages(instructions)
        if not any(m["role"] != "system" for m in messages):
            raise EventError("the conversation is empty: add an item or commit audio first", "invalid_value",
                             None, event_id)
        # a reply held to calls (a required or named tool) is the thinker's alone
        speaks = modalities == ["audio"] and tools.constraint is None
        chain = ["text", "audio"] if speaks else ["text"]
        fields_of = SimpleNamespace(max_tokens=max_tokens if isinstance(max_tokens, int) else None,
                                    temperature=temperature,
                                    sampling_params_list=fields.sampling_params_list if fields is not None else None)
        try:
            params = stage_params(self.engine.stage_defaults(self.engine.stage_names(chain)), fields_of)
            spoken = None
            if tools.constraint is not None:
                params[0] = params[0].updated(**thinking_fields(self.engine, tools.constraint))
            elif speaks and tools.reads_calls:
                spoken = SpokenCalls(self.engine, tools, params)
                params = spoken.params
        except APIError as e:
            raise EventError(e.message, "invalid_value", f"response.{e.param}" if e.param else "response",
                             event_id) from None
        part = Part("output_audio", transcript="") if modalities == ["audio"] else Part("output_text", text="")
        item = ConversationItem(new_id("item"), "assistant", [part], status="in_progress")
        previous = None if out_of_band else self.conversation.add(item)

        def finished(out) -> None:
            self.response = None
            self._arm_idle(part.audio_ms or 0)
            if out is not None and out.finished:
                self.metrics.finished("realtime", out)
            else:
                self.metrics.aborted("realtime")

        self.response = Response(self.engine, self.send, messages, modalities=modalities, voice=voice,
                                 speed=self.config.speed, output_format=output_format, params=params,
                                 max_output_tokens=max_tokens, conversation_id=None if out_of_band else
                                 self.conversation_id, item=item,
                                 metadata=fields.metadata if fields is not None else None,
                                 previous_item_id=previous, on_finished=finished, tools=tools, spoken_calls=spoken,
                                 add_item=None if out_of_band else self.conversation.add,
                                 speaker=self.speaker).start()
        if self.speaker is not None:
            self.spoken[self.response.id] = item.id
            while len(self.spoken) > 8:  # (only the replies still queued to play matter)
                del self.spoken[next(iter(self.spoken))]
