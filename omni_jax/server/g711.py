"""G.711 (ITU-T): the 8-bit mu-law and A-law telephone codecs, to and from 16-bit PCM.

Phone lines (Twilio's media streams, SIP trunks) carry 8 kHz G.711, and OpenAI's realtime API
takes it as `audio/pcmu` (mu-law) and `audio/pcma` (A-law). Each code is one sample; the
coding is the classic one (Sun's reference, which Python's former `audioop` used: its
results are equal to it for every input), held in lookup tables: 65,536 entries to encode,
256 to decode.
"""

from __future__ import annotations

import functools

import numpy as np

LAWS = ("ulaw", "alaw")
_ULAW_END = np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF])  # 14-bit segment ends
_ALAW_END = np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF])    # 13-bit segment ends


def _ulaw_codes(pcm: np.ndarray) -> np.ndarray:
    x = pcm >> 2  # mu-law codes 14 bits
    mask = np.where(x < 0, 0x7F, 0xFF)
    mag = np.minimum(np.abs(x), 8159) + 33  # clipped, plus the bias
    seg = np.searchsorted(_ULAW_END, mag)
    code = (np.minimum(seg, 7) << 4) | ((mag >> (np.minimum(seg, 7) + 1)) & 0xF)
    return (np.where(seg >= 8, 0x7F, code) ^ mask).astype(np.uint8)


def _alaw_codes(pcm: np.ndarray) -> np.ndarray:
    x = pcm >> 3  # A-law codes 13 bits
    mask = np.where(x >= 0, 0xD5, 0x55)
    mag = np.where(x >= 0, x, -x - 1)
    seg = np.searchsorted(_ALAW_END, mag)
    low = np.where(seg < 2, mag >> 1, mag >> np.maximum(seg, 1)) & 0xF
    code = (np.minimum(seg, 7) << 4) | low
    return (np.where(seg >= 8, 0x7F, code) ^ mask).astype(np.uint8)


def _ulaw_samples(code: np.ndarray) -> np.ndarray:
    u = ~code & 0xFF
    t = (((u & 0x0F) << 3) + 0x84) << ((u & 0x70) >> 4)
    return np.where(u & 0x80, 0x84 - t, t - 0x84).astype(np.int16)


def _alaw_samples(code: np.ndarray) -> np.ndarray:
    a = code ^ 0x55
    seg = (a & 0x70) >> 4
    t = (a & 0x0F) << 4
    t = np.where(seg == 0, t + 8, (t + 0x108) << np.maximum(seg - 1, 0))
    return np.where(a & 0x80, t, -t).astype(np.int16)


@functools.cache
def _tables(law: str) -> tuple[np.ndarray, np.ndarray]:
    """(code of each 16-bit sample, indexed by sample + 32768; sample of each code)."""
    pcm = np.arange(-32768, 32768, dtype=np.int64)
    codes = np.arange(256, dtype=np.int64)
    if law == "ulaw":
        return _ulaw_codes(pcm), _ulaw_samples(codes)
    return _alaw_codes(pcm), _alaw_samples(codes)


def encode(pcm16: np.ndarray, law: str) -> bytes:
    """16-bit samples -> one G.711 byte each."""
    return _tables(law)[0][np.asarray(pcm16, np.int16).astype(np.int64) + 32768].tobytes()


def decode(data: bytes, law: str) -> np.ndarray:
    """G.711 bytes -> 16-bit samples."""
    return _tables(law)[1][np.frombuffer(data, np.uint8)]
