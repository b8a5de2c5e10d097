"""A realtime session's audio on the wire: its formats, the input decoded, the output encoded.

`audio/pcm` is PCM16 little-endian mono at 24 kHz (the default). `audio/pcmu` and `audio/pcma`
are G.711 mu-law and A-law at 8 kHz, what phone lines carry (Twilio's media streams send and
take `audio/pcmu` as is). Input is decoded at its own rate (the input buffer resamples it for
the encoders); the reply's audio, made at 24 kHz, is resampled to 8 kHz as it streams.
"""

from __future__ import annotations

import base64
import binascii

import numpy as np
import soxr

from .. import g711
from ..audio import pcm16_pieces, to_pcm16
from ..errors import InputAudioError

PCM, PCMU, PCMA = "audio/pcm", "audio/pcmu", "audio/pcma"
OUTPUT_RATE = 24000  # the vocoders'
# format -> (sample rate, G.711 law or None for PCM16, how the API reference names it)
FORMATS = {PCM: (24000, None, "base64 PCM16 little-endian, 24 kHz mono"),
           PCMU: (8000, "ulaw", "base64 G.711 mu-law, 8 kHz mono"),
           PCMA: (8000, "alaw", "base64 G.711 A-law, 8 kHz mono")}


def rate(fmt: str) -> int:
    return FORMATS[fmt][0]


def describe(fmt: str) -> str:
    return FORMATS[fmt][2]


def as_json(fmt: str) -> dict:
    """The format object of OpenAI's session (only audio/pcm has a rate field)."""
    return {"type": fmt, "rate": rate(fmt)} if fmt == PCM else {"type": fmt}


def samples_in(data: str, fmt: str) -> int:
    """How many samples base64 `data` in `fmt` holds, read from its length (before decoding it)."""
    raw = len(data) * 3 // 4 - data[-2:].count("=")
    return raw if FORMATS[fmt][1] is not None else raw // 2


def decode(data: str, fmt: str) -> np.ndarray:
    """Base64 audio in `fmt` -> float32 samples in [-1, 1) at the format's rate."""
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InputAudioError("audio is not valid base64") from None
    law = FORMATS[fmt][1]
    if law is not None:
        return g711.decode(raw, law).astype(np.float32) / 32768.0
    if len(raw) % 2:
        raise InputAudioError(f"audio must be 16-bit PCM: {len(raw)} bytes is not a whole number of samples")
    return np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0


class OutputAudio:
    """One reply's audio in `fmt`: 24 kHz deltas in, base64 pieces out (resampled as a stream
    for G.711, so that pieces join without clicks; `flush` gives the resampler's tail)."""

    def __init__(self, fmt: str):
        self.law = FORMATS[fmt][1]
        self._stream = None if self.law is None else soxr.ResampleStream(OUTPUT_RATE, rate(fmt), 1, dtype="float32")

    def pieces(self, delta: np.ndarray | None, max_samples: int) -> list[tuple[str, int]]:
        """(base64 piece, 24 kHz samples it holds) for pieces of at most `max_samples` 24 kHz samples."""
        if self._stream is None:
            return pcm16_pieces(delta, max_samples)
        if delta is None:
            return []
        return [(self._g711(self._stream.resample_chunk(delta[i:i + max_samples].astype(np.float32))),
                 len(delta[i:i + max_samples])) for i in range(0, len(delta), max_samples)]

    def flush(self) -> list[tuple[str, int]]:
        """The last samples a G.711 reply's resampler held (none for PCM16)."""
        if self._stream is None:
            return []
        return [(self._g711(self._stream.resample_chunk(np.zeros(0, np.float32), last=True)), 0)]

    def _g711(self, audio: np.ndarray) -> str:
        """Base64 G.711 of 8 kHz samples ("" for none)."""
        return base64.b64encode(g711.encode(np.frombuffer(to_pcm16(audio), "<i2"), self.law)).decode()
