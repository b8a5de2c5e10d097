"""server/tempo.py: speech at another speed keeps its pitch, its loudness and its order, lasts
1/speed as long, and streams to the same samples as the whole."""

from __future__ import annotations

import numpy as np
import pytest

from omni_jax.server.tempo import Tempo, stretch

SR = 24000


def _tone(freq: float, seconds: float) -> np.ndarray:
    t = np.arange(int(seconds * SR)) / SR
    return (0.5 * np.sin(2 * np.pi * freq * t) + 0.2 * np.sin(2 * np.pi * 1.57 * freq * t)).astype(np.float32)


def _peak_hz(x: np.ndarray) -> float:
    spectrum = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return float(np.argmax(spectrum)) * SR / len(x)


@pytest.mark.parametrize("speed", [0.25, 0.5, 0.8, 1.25, 2.0, 4.0])
def test_pace_changes_pitch_and_loudness_stay(speed):
    x = np.concatenate([_tone(220, 1.5), _tone(330, 1.5)])
    y = stretch(x, speed)
    assert len(y) == round(len(x) / speed)
    half = len(y) // 2
    first, second = y[half // 8:half - half // 8], y[half + half // 8:-(half // 8)]
    assert abs(_peak_hz(first) - 220) < 2 and abs(_peak_hz(second) - 330) < 2  # same notes, same order
    rms = lambda v: float(np.sqrt(np.mean(v ** 2)))  # noqa: E731
    assert rms(first) == pytest.approx(rms(x[:len(x) // 2]), rel=0.05)
    assert np.max(np.abs(y)) < 1.2 * np.max(np.abs(x))


@pytest.mark.parametrize("speed", [0.5, 1.5, 3.0])
def test_streamed_in_any_pieces_equals_the_whole(speed):
    x = np.random.default_rng(0).normal(0, 0.3, SR * 2).astype(np.float32) * np.hanning(SR * 2).astype(np.float32)
    rng = np.random.default_rng(int(speed * 10))
    tempo, parts, i = Tempo(speed), [], 0
    while i < len(x):
        n = int(rng.integers(0, 4000))
        parts.append(tempo.push(x[i:i + n]))
        i += n
    parts.append(tempo.flush())
    np.testing.assert_allclose(np.concatenate(parts), stretch(x, speed), rtol=0, atol=1e-6)
    assert sum(len(p) for p in parts[:-1]) > len(x) / speed - 2000  # most of it before the end


def test_speed_one_is_the_input_and_a_bad_speed_is_refused():
    x = _tone(200, 0.3)
    assert stretch(x, 1.0) is not None and np.array_equal(stretch(x, 1.0), x)
    assert len(stretch(x[:10], 2.0)) == 5 and len(stretch(np.zeros(0, np.float32), 0.5)) == 0
    with pytest.raises(ValueError, match="speed must be in"):
        Tempo(5.0)
