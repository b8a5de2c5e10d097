"""A session's input audio buffer: audio at the input format's rate in, 16 kHz float out.

Appended audio is resampled as it comes (soxr, streamed) to the rate the audio encoders take,
so that the VAD and the prompt see the same samples, and a commit hands over a slice without
another pass. The buffer holds at most `max_seconds`; an append past it is refused whole.
Positions are absolute: samples of the 16 kHz stream since the session began (VAD events
name them), `start` is the first one still held.
"""

from __future__ import annotations

import numpy as np
import soxr

from ..errors import InputAudioError
from ..vad import RATE
from . import wire_audio


class InputAudioBuffer:
    """Audio appended since the last commit or clear, at 16 kHz."""

    def __init__(self, max_seconds: float, rate: int = wire_audio.rate(wire_audio.PCM)):
        self.max_samples = int(max_seconds * RATE)
        self.rate = 0
        self.set_rate(rate)
        self._chunks: list[np.ndarray] = []
        self.start = 0   # absolute position of the first sample held
        self.end = 0     # absolute position after the last

    def __len__(self) -> int:
        return self.end - self.start

    @property
    def ms(self) -> int:
        return len(self) * 1000 // RATE

    def set_rate(self, rate: int) -> None:
        """The rate appended audio comes at from now on (the session's input format)."""
        if rate != self.rate:
            self.rate, self._stream = rate, soxr.ResampleStream(rate, RATE, 1, dtype="float32")

    def check(self, samples: int) -> None:
        """InputAudioError if `samples` more (at `rate`) would pass the bound (said before an
        append is decoded, so that one too big costs no memory)."""
        if len(self) + samples * RATE // self.rate > self.max_samples:
            raise InputAudioError(f"the input audio buffer holds at most {self.max_samples / RATE:g} s; commit or "
                                  f"clear it (it holds {len(self) / RATE:.1f} s, the append adds "
                                  f"{samples / self.rate:.1f} s)")

    def append(self, audio: np.ndarray) -> np.ndarray:
        """Add samples at `rate`; the new 16 kHz samples (InputAudioError past the bound, nothing added)."""
        self.check(len(audio))
        new = self._stream.resample_chunk(audio)
        if len(new):
            self._chunks.append(new)
            self.end += len(new)
        return new

    def take(self, start: int | None = None, end: int | None = None) -> np.ndarray:
        """The samples in [start, end) (absolute; default all held); everything before `end` is dropped."""
        start = self.start if start is None else max(start, self.start)
        end = self.end if end is None else min(end, self.end)
        whole = np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.float32)
        out = whole[start - self.start:max(start, end) - self.start].copy()
        rest = whole[end - self.start:]
        self._chunks = [rest] if len(rest) else []
        self.start = max(self.start, end)
        return out

    def clear(self) -> None:
        self._chunks, self.start = [], self.end
