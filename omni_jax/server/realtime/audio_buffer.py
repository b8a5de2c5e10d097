"""A session's input audio buffer: PCM16 24 kHz in (OpenAI's `audio/pcm`), 16 kHz float out.

Appended audio is resampled as it comes (soxr, streamed) to the rate the audio encoders take,
so that the VAD and the prompt see the same samples, and a commit hands over a slice without
another pass. The buffer holds at most `max_seconds`; an append past it is refused whole.
Positions are absolute: samples of the 16 kHz stream since the session began (VAD events
name them), `start` is the first one still held.
"""

from __future__ import annotations

import base64
import binascii

import numpy as np
import soxr

from ..errors import InputAudioError
from ..vad import RATE

INPUT_RATE = 24000


def decode_pcm16(data: str) -> np.ndarray:
    """Base64 PCM16 little-endian mono -> float32 in [-1, 1)."""
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InputAudioError("audio is not valid base64") from None
    if len(raw) % 2:
        raise InputAudioError(f"audio must be 16-bit PCM: {len(raw)} bytes is not a whole number of samples")
    return np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0


class InputAudioBuffer:
    """Audio appended since the last commit or clear, at 16 kHz."""

    def __init__(self, max_seconds: float):
        self.max_samples = int(max_seconds * RATE)
        self._stream = soxr.ResampleStream(INPUT_RATE, RATE, 1, dtype="float32")
        self._chunks: list[np.ndarray] = []
        self.start = 0   # absolute position of the first sample held
        self.end = 0     # absolute position after the last

    def __len__(self) -> int:
        return self.end - self.start

    @property
    def ms(self) -> int:
        return len(self) * 1000 // RATE

    def append(self, audio_24k: np.ndarray) -> np.ndarray:
        """Add 24 kHz samples; the new 16 kHz samples (InputAudioError past the bound, nothing added)."""
        if len(self) + len(audio_24k) * RATE // INPUT_RATE > self.max_samples:
            raise InputAudioError(f"the input audio buffer holds at most {self.max_samples / RATE:g} s; commit or "
                                  f"clear it (it holds {len(self) / RATE:.1f} s, the append adds {len(audio_24k) / INPUT_RATE:.1f} s)")
        new = self._stream.resample_chunk(audio_24k)
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
