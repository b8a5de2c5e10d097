"""Speech at another speed, same pitch: `Tempo(speed)` time-stretches a waveform as it streams.

WSOLA (waveform-similarity overlap-add): output frames of FRAME samples are laid HOP apart, each
cut from the input near `speed` x its output position, shifted by up to SEEK samples to where the
input best continues the frame before (cross-correlation), and overlap-added under a Hann window
(which sums to one at half overlap). Pitch stays; only the pace changes, as OpenAI's `speed`
asks. At 24 kHz a frame is 40 ms and the search +-10 ms: several pitch periods of a voice.

Streaming: `push` returns the output no later frame changes, `flush` the rest, round(input /
speed) samples in all; pushed in any pieces, the output equals one push of the whole. The input
starts on HOP samples of silence, so that the reply does not open on a rising window; the first
HOP output samples, the first frame's copy of that silence, are dropped.
"""

from __future__ import annotations

import numpy as np

FRAME = 960
HOP = FRAME // 2
SEEK = 240
_WINDOW = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(FRAME) / FRAME)).astype(np.float32)  # periodic Hann


class Tempo:
    """A waveform at `speed` x its pace (0.25 to 4), chunk by chunk (see module docstring).
    Positions are absolute: input from the leading silence's first sample, output likewise."""

    def __init__(self, speed: float):
        if not 0.25 <= speed <= 4.0:
            raise ValueError(f"speed must be in [0.25, 4], got {speed}")
        self.speed = float(speed)
        self._in, self._in_start = np.zeros(HOP, np.float32), 0   # input still read by a later frame
        self._taken = 0                                           # input samples pushed
        self._out, self._out_start = np.zeros(0, np.float32), 0   # output not yet returned
        self._frame = 0                                           # the next output frame
        self._prev = 0                                            # the input position of the frame before

    def push(self, samples: np.ndarray) -> np.ndarray:
        """Take more input; the output that is final."""
        samples = np.asarray(samples, np.float32).reshape(-1)
        self._taken += len(samples)
        self._in = np.concatenate([self._in, samples])
        have = self._in_start + len(self._in)
        while self._needed(self._frame) <= have:
            self._add_frame()
        out = self._release(self._frame * HOP)  # the next frame starts there: what lies before is final
        self._forget()
        return out

    def flush(self) -> np.ndarray:
        """The rest of the output, the input's end followed by silence."""
        end = HOP + round(self._taken / self.speed)
        while self._frame * HOP < end:
            short = self._needed(self._frame) - (self._in_start + len(self._in))
            if short > 0:
                self._in = np.concatenate([self._in, np.zeros(short, np.float32)])
            self._add_frame()
        return self._release(end)

    def _nominal(self, k: int) -> int:
        return int(round(k * HOP * self.speed))

    def _needed(self, k: int) -> int:
        """The input (absolute samples) frame k reads: its search region and the frame before's continuation."""
        return self._nominal(k) + SEEK + FRAME if k == 0 else max(self._nominal(k) + SEEK, self._prev + HOP) + FRAME

    def _add_frame(self) -> None:
        k, nominal = self._frame, self._nominal(self._frame)
        start = nominal
        if k:
            lo = max(nominal - SEEK, 0)
            continuation = self._read(self._prev + HOP, FRAME)
            score = np.correlate(self._read(lo, nominal + SEEK + FRAME - lo), continuation, mode="valid")
            start = lo + int(np.argmax(score))
        at = k * HOP - self._out_start
        if len(self._out) < at + FRAME:
            self._out = np.concatenate([self._out, np.zeros(at + FRAME - len(self._out), np.float32)])
        self._out[at:at + FRAME] += self._read(start, FRAME) * _WINDOW
        self._prev, self._frame = start, k + 1

    def _read(self, start: int, n: int) -> np.ndarray:
        a = start - self._in_start
        return self._in[a:a + n]

    def _release(self, upto: int) -> np.ndarray:
        """The output before absolute sample `upto`, without the leading silence's HOP samples."""
        n = upto - self._out_start
        out, self._out = self._out[:n], self._out[n:]
        first, self._out_start = self._out_start, upto
        return out[max(0, HOP - first):]

    def _forget(self) -> None:
        """Drop the input no later frame reads."""
        cut = min(self._nominal(self._frame) - SEEK, self._prev + HOP) - self._in_start
        if cut > 0:
            self._in, self._in_start = self._in[cut:], self._in_start + cut


def stretch(samples: np.ndarray, speed: float) -> np.ndarray:
    """A whole waveform at `speed` x its pace."""
    if speed == 1.0:
        return np.asarray(samples, np.float32)
    t = Tempo(speed)
    return np.concatenate([t.push(samples), t.flush()])
