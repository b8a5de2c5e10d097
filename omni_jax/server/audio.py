"""Waveform (float32, mono) -> the bytes of an audio format.

wav and raw pcm (16-bit little-endian) are written with the standard library; mp3, opus,
aac and flac are encoded with PyAV (FFmpeg). Samples are clipped to [-1, 1] and rounded
to the nearest 16-bit step (`to_pcm16`) before any encoding.
"""

from __future__ import annotations

import base64
import io
import wave

import numpy as np

# format -> (container, codec, encoder sample rate or None for the input rate)
_AV_FORMATS = {
    "mp3": ("mp3", "libmp3lame", None),
    "flac": ("flac", "flac", None),
    "opus": ("ogg", "libopus", 48000),   # opus runs at 48 kHz; the stream is resampled
    "aac": ("adts", "aac", None),
}
MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "pcm16": "audio/pcm", "mp3": "audio/mpeg",
               "flac": "audio/flac", "opus": "audio/ogg", "aac": "audio/aac"}


def to_pcm16(audio: np.ndarray) -> bytes:
    """16-bit little-endian PCM bytes of a float waveform."""
    x = np.clip(np.asarray(audio, np.float32), -1.0, 1.0)
    return np.round(x * 32767.0).astype("<i2").tobytes()


def wav_bytes(audio: np.ndarray, sample_rate: int) -> bytes:
    """A 16-bit mono WAV file."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(sample_rate)
        f.writeframes(to_pcm16(audio))
    return buf.getvalue()


def _av_bytes(audio: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    # PyAV (35 MB of FFmpeg) is imported only here, as in inputs/media.py: a server that
    # writes wav or pcm, and the GPU machine's check (which carries no PyAV), run without it.
    import av

    container, codec, rate = _AV_FORMATS[fmt]
    pcm = np.frombuffer(to_pcm16(audio), "<i2")
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream(codec, rate=rate or sample_rate, layout="mono")
        frame = av.AudioFrame.from_ndarray(pcm[None, :], format="s16", layout="mono")
        frame.sample_rate = sample_rate
        resampler = av.AudioResampler(format=stream.codec_context.format.name, layout="mono",
                                      rate=stream.codec_context.sample_rate)
        for f in resampler.resample(frame) + resampler.resample(None):
            for packet in stream.encode(f):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


def encode(audio: np.ndarray | None, sample_rate: int, fmt: str) -> bytes:
    """The waveform in `fmt` (wav, pcm / pcm16, mp3, flac, opus, aac)."""
    audio = np.zeros(0, np.float32) if audio is None else audio
    if fmt == "wav":
        return wav_bytes(audio, sample_rate)
    if fmt in ("pcm", "pcm16"):
        return to_pcm16(audio)
    if fmt in _AV_FORMATS:
        return _av_bytes(audio, sample_rate, fmt)
    raise ValueError(f"unknown audio format {fmt!r}")


def pcm16_pieces(delta: np.ndarray | None, max_samples: int) -> list[tuple[str, int]]:
    """An audio delta as (base64 pcm16, samples) pieces of at most `max_samples` samples each:
    streamed replies send audio in events of bounded size."""
    if delta is None or len(delta) == 0:
        return []
    return [(base64.b64encode(to_pcm16(delta[i:i + max_samples])).decode(), len(delta[i:i + max_samples]))
            for i in range(0, len(delta), max_samples)]
