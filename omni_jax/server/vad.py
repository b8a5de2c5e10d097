"""Server VAD: where speech starts and stops in a stream of audio (a realtime session's turns,
the pieces a long transcription is cut into), and its settings as OpenAI's `server_vad` has them.

The voice/silence call per frame is WebRTC's VAD (`webrtcvad-wheels`): a small C library with
wheels for every Python we support, no model file and no torch or onnxruntime, and it costs
about 0.3 ms per second of audio on one core (measured on an AMD EPYC). Silero's network
separates speech from music and noise better, but it needs onnxruntime (~15 MB more) and its
model file, and on a voice page the user is close to the microphone. This module adds the
turn rules OpenAI's `server_vad` has: speech must last `min_speech_ms` to start a turn (a
click does not), the turn starts `prefix_padding_ms` before the first voiced frame, and it
ends after `silence_duration_ms` without voice.

Positions are in samples of the 16 kHz stream since the session began; events say ms.
"""

from __future__ import annotations

import dataclasses

from typing import Literal

import numpy as np
import webrtcvad
from pydantic import BaseModel, ConfigDict, Field

RATE = 16000
FRAME = RATE * 30 // 1000   # webrtcvad takes 10, 20 or 30 ms frames; 30 ms is the steadiest


class VADSettings(BaseModel):
    """OpenAI's `server_vad` turn rules (a realtime session's `turn_detection`, a transcription's
    `chunking_strategy`); unknown fields are ignored, as OpenAI does."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["server_vad"]
    threshold: float = Field(default=0.5, ge=0.0, le=1.0)
    prefix_padding_ms: int = Field(default=300, ge=0, le=5000)
    silence_duration_ms: int = Field(default=500, ge=30, le=10000)


@dataclasses.dataclass(frozen=True)
class VADEvent:
    kind: str          # "speech_started" | "speech_stopped"
    sample: int        # position in the 16 kHz stream since the session began

    @property
    def ms(self) -> int:
        return self.sample * 1000 // RATE


def aggressiveness(threshold: float) -> int:
    """OpenAI's threshold (0..1, higher: needs louder, clearer speech) as webrtcvad's mode 0..3."""
    return min(3, int(threshold * 4))


class ServerVAD:
    """Turn detection on a 16 kHz float stream, fed in pieces of any length."""

    def __init__(self, threshold: float = 0.5, prefix_padding_ms: int = 300, silence_duration_ms: int = 500,
                 min_speech_ms: int = 90):
        self._vad = webrtcvad.Vad(aggressiveness(threshold))
        self.prefix = prefix_padding_ms * RATE // 1000
        self.silence_frames = max(1, -(-silence_duration_ms // 30))
        self.speech_frames = max(1, -(-min_speech_ms // 30))
        self.position = 0            # samples judged so far
        self.in_speech = False
        self._rest = np.zeros(0, np.int16)
        self._run = 0                # consecutive frames of the state we are looking for
        self._run_start = 0          # where that run began

    @property
    def earliest_start(self) -> int:
        """The earliest sample a turn not yet started can begin at (its prefix padding included)."""
        return max(0, (self._run_start if self._run and not self.in_speech else self.position) - self.prefix)

    def reset(self, position: int) -> None:
        """Start afresh at `position` (after a commit or clear): no turn in progress."""
        self.position, self.in_speech, self._run = position, False, 0
        self._rest = np.zeros(0, np.int16)

    def feed(self, audio: np.ndarray) -> list[VADEvent]:
        """Judge the new samples (float, 16 kHz); the turn starts and stops they complete."""
        pcm = np.concatenate([self._rest, np.round(np.clip(audio, -1, 1) * 32767).astype(np.int16)])
        n = len(pcm) // FRAME * FRAME
        self._rest = pcm[n:]
        events = []
        for i in range(0, n, FRAME):
            voiced = self._vad.is_speech(pcm[i:i + FRAME].tobytes(), RATE)
            at = self.position
            self.position += FRAME
            if voiced != self.in_speech:   # a frame of the other state: the run toward a change grows
                if self._run == 0:
                    self._run_start = at
                self._run += 1
            else:
                self._run = 0
            if not self.in_speech and self._run >= self.speech_frames:
                self.in_speech, self._run = True, 0
                events.append(VADEvent("speech_started", max(0, self._run_start - self.prefix)))
            elif self.in_speech and self._run >= self.silence_frames:
                self.in_speech, self._run = False, 0
                events.append(VADEvent("speech_stopped", self.position))
        return events
