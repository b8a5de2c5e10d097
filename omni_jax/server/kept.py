"""What the server keeps between requests for a while (spoken replies' transcripts, stored
responses): key -> value for `ttl_s` seconds, within a count and a byte budget, oldest first out."""

from __future__ import annotations

import collections
import threading
import time
from typing import Any


class Kept:
    """key -> value for `ttl_s` seconds; at most `max_entries` keys and `max_bytes` of values (each
    put says its value's size); past either bound, or past its time, the oldest goes first."""

    def __init__(self, ttl_s: float, max_entries: int = 100_000, max_bytes: int | None = None):
        self.ttl_s, self.max_entries, self.max_bytes = ttl_s, max_entries, max_bytes
        self._entries: collections.OrderedDict[str, tuple[Any, float, int]] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, key: str, value: Any, size: int = 0) -> int:
        """Keep `value` under `key`; its expires_at (Unix seconds)."""
        now = time.time()
        expires = now + self.ttl_s
        with self._lock:
            self._drop(key)
            self._entries[key] = (value, expires, size)
            self._bytes += size
            while self._entries and (len(self._entries) > self.max_entries
                                     or (self.max_bytes is not None and self._bytes > self.max_bytes)
                                     or next(iter(self._entries.values()))[1] <= now):
                self._drop(next(iter(self._entries)))
        return int(expires)

    def get(self, key: str) -> Any | None:
        """The value kept under `key`, or None if it is unknown or expired."""
        with self._lock:
            entry = self._entries.get(key)
        if entry is None or entry[1] <= time.time():
            return None
        return entry[0]

    def pop(self, key: str) -> bool:
        """Forget `key`; whether it was kept."""
        with self._lock:
            return self._drop(key)

    def _drop(self, key: str) -> bool:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry[2]
        return entry is not None
