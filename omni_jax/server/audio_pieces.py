"""Long audio cut at its pauses into pieces one thinker request takes (a transcription's
`chunking_strategy`, as OpenAI's: loudness normalised, then voice activity detection chooses
the boundaries).

The thinker takes at most so much audio per prompt (its audio encoder's largest bucket), and
recognition is best on sentence-sized spans, so the spoken spans the server VAD finds are
packed, in order, into pieces of at most `max_samples`; the silence between the spans of one
piece stays in it, silence between pieces is left out. A span longer than a piece on its own is
cut at its quietest 30 ms in the last quarter of the piece. Positions are 16 kHz samples.
"""

from __future__ import annotations

import numpy as np

from .vad import FRAME, RATE, ServerVAD

# The level speech is brought to before the VAD judges it (a quiet recording is voiced too);
# the level is the 99.9th percentile of |x|, so a click does not set it.
TARGET_LEVEL = 0.5
MAX_GAIN = 100.0
SILENT = 1e-4          # below this level the audio is taken as silence, whatever the gain


def speech_spans(wave: np.ndarray, threshold: float, prefix_padding_ms: int,
                 silence_duration_ms: int) -> list[tuple[int, int]]:
    """(start, end) of each spoken span of a 16 kHz waveform, by the server VAD's turn rules."""
    level = float(np.percentile(np.abs(wave), 99.9)) if len(wave) else 0.0
    if level < SILENT:
        return []
    vad = ServerVAD(threshold, prefix_padding_ms, silence_duration_ms)
    events = vad.feed(np.clip(wave * min(TARGET_LEVEL / level, MAX_GAIN), -1.0, 1.0))
    spans, start = [], None
    for e in events:
        if e.kind == "speech_started":
            start = e.sample
        elif start is not None:
            spans.append((start, min(e.sample, len(wave))))
            start = None
    if start is not None:   # still speaking when the audio ends
        spans.append((start, len(wave)))
    return spans


def _quietest_cut(wave: np.ndarray, start: int, max_samples: int) -> int:
    """Where to end a piece that starts at `start` inside a span longer than a piece: the
    quietest frame of its last quarter."""
    lo, hi = start + max_samples * 3 // 4, start + max_samples
    frames = (hi - lo) // FRAME
    if frames < 2:
        return hi
    energy = (wave[lo:lo + frames * FRAME].reshape(frames, FRAME) ** 2).sum(axis=1)
    return lo + int(np.argmin(energy)) * FRAME + FRAME // 2


def pieces(wave: np.ndarray, max_samples: int, threshold: float = 0.5, prefix_padding_ms: int = 300,
           silence_duration_ms: int = 500) -> list[tuple[int, int]]:
    """(start, end) of the pieces to transcribe one by one, in order, each at most `max_samples`."""
    if max_samples < FRAME * 4:
        raise ValueError(f"a piece must hold at least {FRAME * 4 * 1000 // RATE} ms, got {max_samples} samples")
    out: list[tuple[int, int]] = []
    for a, b in speech_spans(wave, threshold, prefix_padding_ms, silence_duration_ms):
        if out:   # a span's prefix padding may reach back into the silence that ended the one before
            a = max(a, out[-1][1])
        if out and b - out[-1][0] <= max_samples:
            out[-1] = (out[-1][0], b)        # the span joins the piece (with the pause before it)
            continue
        while b - a > max_samples:
            cut = _quietest_cut(wave, a, max_samples)
            out.append((a, cut))
            a = cut
        out.append((a, b))
    return out
