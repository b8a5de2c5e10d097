"""Arrays by key within a byte budget, least recently used first out.

The prompt processor keeps each media item's processed inputs (inputs/processor.py) and a
thinker stage each item's encoder rows (models/thinker_media.py) in one: a conversation sends
its earlier media again every turn, and each should cost its work once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Hashable

import numpy as np


def _nbytes(value: tuple) -> int:
    return sum(v.nbytes for v in value if isinstance(v, np.ndarray))


class LRUCache:
    """Tuples by key (their size: the arrays' bytes among them), at most `max_bytes` held; a value
    larger than the whole budget is not kept. Safe to share between threads (prompt workers)."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.bytes = int(max_bytes), 0
        self.items: OrderedDict[Hashable, tuple] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, key: Hashable) -> bool:
        return key in self.items

    def __len__(self) -> int:
        return len(self.items)

    def get(self, key: Hashable) -> tuple | None:
        """The value of `key`, now the most recently used (None if not held)."""
        with self._lock:
            value = self.items.get(key)
            if value is not None:
                self.items.move_to_end(key)
            return value

    def put(self, key: Hashable, value: tuple) -> None:
        size = _nbytes(value)
        with self._lock:
            if key in self.items or size > self.max_bytes:
                return
            self.items[key], self.bytes = value, self.bytes + size
            while self.bytes > self.max_bytes:
                _, old = self.items.popitem(last=False)
                self.bytes -= _nbytes(old)
