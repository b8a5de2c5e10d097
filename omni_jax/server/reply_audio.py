"""Spoken chat replies kept for a later turn: OpenAI's multi-turn audio.

A chat completion with audio gives `message.audio.id` and `expires_at`; a later request may
send `{"role": "assistant", "audio": {"id": ...}}` instead of the reply's text. The thinker
reads its own earlier replies as text, so what is kept per id is the transcript (small), for
`ttl_s` seconds and at most `max_entries` ids (the oldest go first).
"""

from __future__ import annotations

import collections
import threading
import time


class ReplyAudio:
    """audio id -> (transcript, expires_at)."""

    def __init__(self, ttl_s: float = 3600.0, max_entries: int = 100_000):
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self._entries: collections.OrderedDict[str, tuple[str, float]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def put(self, audio_id: str, transcript: str) -> int:
        """Keep a reply; its expires_at (Unix seconds)."""
        now = time.time()
        expires = now + self.ttl_s
        with self._lock:
            self._entries[audio_id] = (transcript, expires)
            self._entries.move_to_end(audio_id)
            while self._entries and (len(self._entries) > self.max_entries
                                     or next(iter(self._entries.values()))[1] <= now):
                self._entries.popitem(last=False)
        return int(expires)

    def transcript(self, audio_id: str) -> str | None:
        """The reply's transcript, or None if the id is unknown or expired."""
        with self._lock:
            entry = self._entries.get(audio_id)
        if entry is None or entry[1] <= time.time():
            return None
        return entry[0]
