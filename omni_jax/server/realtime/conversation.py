"""A realtime session's conversation: its items in order, and the chat prompt they make.

Items are kept as OpenAI returns them (`realtime.item` messages, function calls and their
outputs), plus what the prompt needs that an event does not carry back: a user's audio as 16 kHz
samples (events show only its transcript). Every response's prompt renders all items in order,
so each turn's prompt starts with the previous turn's and the thinker's prefix cache computes
only what is new.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import soxr

from ...inputs.media import MediaError, MediaLimits, load_image
from ..errors import APIError, InputAudioError
from ..messages import MediaPolicy
from ..tools import join_call
from . import wire_audio
from .events import EventError, Item, new_id
from ..vad import RATE

_USER_PARTS = ("input_text", "input_audio", "input_image")
_ASSISTANT_PARTS = ("output_text", "output_audio", "text")
_SYSTEM_PARTS = ("input_text", "text")


@dataclasses.dataclass
class Part:
    type: str                            # input_text, input_audio, input_image, output_text, output_audio
    text: str | None = None
    transcript: str | None = None
    audio: np.ndarray | None = None      # input_audio: 16 kHz float samples
    image_url: str | None = None
    audio_ms: int | None = None          # output_audio: how much of it was heard (after a truncate)

    def as_json(self) -> dict:
        out = {"type": self.type}
        if self.type in ("input_text", "output_text", "text"):
            out["text"] = self.text or ""
        elif self.type in ("input_audio", "output_audio"):
            out["audio"], out["transcript"] = None, self.transcript
        elif self.type == "input_image":
            out["image_url"] = self.image_url
        return out

    def prompt_text(self) -> str:
        return (self.text if self.type in ("input_text", "output_text", "text") else self.transcript) or ""


@dataclasses.dataclass
class ConversationItem:
    id: str
    role: str | None                     # a message's; None for a function call or its output
    parts: list[Part]
    status: str = "completed"
    type: str = "message"                # or function_call, function_call_output
    call: dict | None = None             # a function call's call_id, name, arguments; an output's call_id, output

    def as_json(self) -> dict:
        if self.type != "message":
            return {"id": self.id, "object": "realtime.item", "type": self.type, "status": self.status, **self.call}
        return {"id": self.id, "object": "realtime.item", "type": "message", "role": self.role,
                "status": self.status, "content": [p.as_json() for p in self.parts]}


def function_call_item(call_id: str, name: str, arguments: str) -> ConversationItem:
    return ConversationItem(new_id("item"), None, [], type="function_call",
                            call={"call_id": call_id, "name": name, "arguments": arguments})


def _call_item(item: Item) -> ConversationItem:
    """A client's function_call or function_call_output item, checked."""
    fields = ("call_id", "name", "arguments") if item.type == "function_call" else ("call_id", "output")
    for name in fields:
        if getattr(item, name) is None:
            raise EventError(f"item.{name} is required in a {item.type} item", "invalid_value", f"item.{name}")
    return ConversationItem(item.id or new_id("item"), None, [], type=item.type,
                            call={name: getattr(item, name) for name in fields})


def item_from_event(item: Item, policy: MediaPolicy, max_audio_s: float,
                    input_format: str = wire_audio.PCM, media_limits: MediaLimits | None = None) -> ConversationItem:
    """A client's item (conversation.item.create, response.create's input) -> ours, checked; its
    audio in the session's input format, its images read within `media_limits` (None: the defaults)."""
    if item.type != "message":
        return _call_item(item)
    if item.role is None or not item.content:
        raise EventError("a message item needs a role and at least one content part", "invalid_value",
                         "item.role" if item.role is None else "item.content")
    allowed = {"user": _USER_PARTS, "assistant": _ASSISTANT_PARTS, "system": _SYSTEM_PARTS}[item.role]
    parts = []
    for i, p in enumerate(item.content):
        where = f"item.content[{i}]"
        if p.type not in allowed:
            raise EventError(f"{where}.type {p.type!r} is not allowed in a {item.role} message; use {list(allowed)}",
                             "invalid_value", f"{where}.type")
        if p.type == "input_audio":
            if p.audio is None:
                raise EventError(f"{where}.audio is required ({wire_audio.describe(input_format)})", "invalid_value",
                                 f"{where}.audio")
            rate = wire_audio.rate(input_format)
            if wire_audio.samples_in(p.audio, input_format) > max_audio_s * rate:  # before it costs memory
                raise EventError(f"{where}.audio is longer than the limit of {max_audio_s:g} s", "invalid_value",
                                 f"{where}.audio")
            try:
                wave = wire_audio.decode(p.audio, input_format)
            except InputAudioError as e:
                raise EventError(f"{where}.audio: {e}", "invalid_value", f"{where}.audio") from None
            audio = soxr.resample(wave, rate, RATE).astype(np.float32)
            parts.append(Part("input_audio", transcript=p.transcript, audio=audio))
        elif p.type == "input_image":
            try:
                url = policy.source(p.image_url, f"{where}.image_url")
                # Read now, not first when a response renders the conversation: an image that
                # cannot be read would fail that response and every one after it.
                load_image(url, f"{where}.image_url", media_limits or MediaLimits())
            except APIError as e:
                raise EventError(e.message, "invalid_value", f"{where}.image_url") from None
            except MediaError as e:
                raise EventError(str(e), "invalid_value", f"{where}.image_url") from None
            parts.append(Part("input_image", image_url=url))
        elif p.type == "output_audio":
            parts.append(Part("output_audio", transcript=p.transcript or ""))
        else:
            parts.append(Part(p.type, text=p.text or ""))
    return ConversationItem(item.id or new_id("item"), item.role, parts)


class Conversation:
    """The items of one session, in order, with at most `max_items`."""

    def __init__(self, max_items: int = 1024):
        self.items: list[ConversationItem] = []
        self.max_items = max_items

    def get(self, item_id: str, event_id: str | None = None) -> ConversationItem:
        for it in self.items:
            if it.id == item_id:
                return it
        raise EventError(f"no item with id {item_id[:64]!r} in the conversation", "item_not_found", "item_id", event_id)

    def make_room(self) -> str | None:
        """Forget the oldest item if the conversation is full; its id, else None."""
        if len(self.items) < self.max_items:
            return None
        return self.items.pop(0).id

    def add(self, item: ConversationItem, previous_item_id: str | None = None) -> str | None:
        """Insert after `previous_item_id` (default: at the end); the id it follows."""
        if len(self.items) >= self.max_items:
            raise EventError(f"the conversation holds its limit of {self.max_items} items; delete some first",
                             "conversation_full")
        if any(it.id == item.id for it in self.items):
            raise EventError(f"an item with id {item.id!r} already exists", "item_exists", "item.id")
        at = len(self.items)
        if previous_item_id is not None:
            at = self.items.index(self.get(previous_item_id)) + 1
        self.items.insert(at, item)
        return self.items[at - 1].id if at else None

    def delete(self, item_id: str, event_id: str | None = None) -> None:
        self.items.remove(self.get(item_id, event_id))

    def truncate(self, item_id: str, content_index: int, audio_end_ms: int, event_id: str | None = None) -> None:
        """Keep the first `audio_end_ms` of an assistant item's audio, and the share of its transcript
        spoken by then (estimated from the share of the audio made so far: the words are not timed)."""
        item = self.get(item_id, event_id)
        if item.role != "assistant" or content_index >= len(item.parts) or item.parts[content_index].type != "output_audio":
            raise EventError(f"item {item_id!r} has no assistant audio at content_index {content_index}",
                             "invalid_value", "content_index", event_id)
        part = item.parts[content_index]
        made = part.audio_ms or 0
        if audio_end_ms > made:
            raise EventError(f"audio_end_ms {audio_end_ms} is past the item's audio ({made} ms)", "invalid_value",
                             "audio_end_ms", event_id)
        part.transcript = cut_words(part.transcript or "", audio_end_ms / made if made else 0.0)
        part.audio_ms = audio_end_ms
        item.status = "incomplete"

    def messages(self, instructions: str | None) -> list[dict]:
        """The chat messages (the prompt processor's parts) of every item, instructions first; a
        function call joins the assistant turn before it, an output is a tool message."""
        out = [{"role": "system", "content": instructions}] if instructions else []
        for it in self.items:
            if it.type == "function_call":
                join_call(out, it.call["name"], it.call["arguments"])
            elif it.type == "function_call_output":
                out.append({"role": "tool", "content": it.call["output"]})
            elif it.role == "user":
                out.append({"role": "user", "content": [_prompt_part(p) for p in it.parts]})
            else:
                out.append({"role": it.role, "content": "".join(p.prompt_text() for p in it.parts)})
        return out


def without_oldest_turn(messages: list[dict]) -> list[dict] | None:
    """`messages` less its oldest turn (a user message and the replies to it), the instructions
    kept; None if only the newest turn is left. OpenAI's truncation "auto": a conversation longer
    than the model takes loses its oldest turns."""
    head = [m for m in messages if m["role"] == "system"]
    turns = [m for m in messages if m["role"] != "system"]
    users = [i for i, m in enumerate(turns) if m["role"] == "user"]
    later = [i for i in users if i > 0]
    if not later:
        return None
    return head + turns[later[0]:]


def _prompt_part(p: Part) -> dict:
    if p.type == "input_audio":
        return {"type": "audio", "audio": (p.audio, RATE)}
    if p.type == "input_image":
        return {"type": "image_url", "image_url": {"url": p.image_url}}
    return {"type": "text", "text": p.text or ""}


def cut_words(text: str, share: float) -> str:
    """The first `share` of `text`, ending at a word boundary."""
    if share >= 1.0:
        return text
    keep = int(len(text) * max(share, 0.0))
    cut = text.rfind(" ", 0, keep + 1)
    return text[:cut if cut > 0 else keep].rstrip()
