"""Turn taking on a session's input audio: the buffer plus (optionally) server VAD.

Appended audio goes into the buffer and, with VAD on, through the VAD; a turn that ends
comes out with its audio (from `prefix_padding_ms` before the voice to the end of the
silence that ended it). Between turns only the prefix padding is kept, so a session that
streams silence for an hour holds a fraction of a second of it.
"""

from __future__ import annotations

import numpy as np

from . import wire_audio
from .audio_buffer import InputAudioBuffer
from .events import TurnDetection
from ..vad import ServerVAD, VADEvent


class Turns:
    """The input audio buffer of one session and its turn detection (None: manual commits)."""

    def __init__(self, max_buffer_s: float, vad: TurnDetection | None, rate: int = wire_audio.rate(wire_audio.PCM)):
        self.buffer = InputAudioBuffer(max_buffer_s, rate)
        self.configure(vad)

    def configure(self, vad: TurnDetection | None) -> None:
        """New turn detection settings (a turn in progress starts over)."""
        self.vad = None if vad is None else ServerVAD(vad.threshold, vad.prefix_padding_ms, vad.silence_duration_ms)
        self.reset()

    def reset(self) -> None:
        """No turn in progress (after a commit or a clear)."""
        self._start = None
        if self.vad is not None:
            self.vad.reset(self.buffer.end)

    def append(self, wave: np.ndarray) -> list[tuple[VADEvent, np.ndarray | None]]:
        """Add audio (at the buffer's rate); the VAD's events, a stop with its turn's 16 kHz audio (InputAudioError
        when the buffer cannot hold it). Blocking work: call it off the event loop."""
        new = self.buffer.append(wave)
        if self.vad is None:
            return []
        out = []
        for ev in self.vad.feed(new):
            if ev.kind == "speech_started":
                self._start = ev.sample
                out.append((ev, None))
            else:
                out.append((ev, self.buffer.take(self._start, ev.sample)))
                self._start = None
        if self._start is None and not self.vad.in_speech:
            self.buffer.take(end=self.vad.earliest_start)  # only what a coming turn can start with
        return out

    def commit(self) -> np.ndarray:
        """All the audio held (a manual commit); the turn starts over."""
        audio = self.buffer.take()
        self.reset()
        return audio

    def clear(self) -> None:
        self.buffer.clear()
        self.reset()
