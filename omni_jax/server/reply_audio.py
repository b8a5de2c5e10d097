"""Spoken chat replies kept for a later turn: OpenAI's multi-turn audio.

A chat completion with audio gives `message.audio.id` and `expires_at`; a later request may
send `{"role": "assistant", "audio": {"id": ...}}` instead of the reply's text. The thinker
reads its own earlier replies as text, so what is kept per id is the transcript (small), for
`ttl_s` seconds and at most `max_entries` ids (the oldest go first).
"""

from __future__ import annotations

from .kept import Kept


class ReplyAudio:
    """audio id -> transcript, kept `ttl_s` seconds (at most `max_entries` ids)."""

    def __init__(self, ttl_s: float = 3600.0, max_entries: int = 100_000):
        self._kept = Kept(ttl_s, max_entries)

    def put(self, audio_id: str, transcript: str) -> int:
        """Keep a reply; its expires_at (Unix seconds)."""
        return self._kept.put(audio_id, transcript)

    def transcript(self, audio_id: str) -> str | None:
        """The reply's transcript, or None if the id is unknown or expired."""
        return self._kept.get(audio_id)
