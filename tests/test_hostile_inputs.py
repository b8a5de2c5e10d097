"""Hostile media and prompts fail their own request within seconds, with an error naming the problem
(issue 20: absurd sample rates, empty or huge images, video fps=inf, prompt processing that
would stall every stream of an AsyncOmniJax)."""

from __future__ import annotations

import io
import time

import numpy as np
import pytest
from PIL import Image

from omni_jax.inputs.media import MediaLimits
from omni_jax.inputs.processor import InputProcessor, PromptError
from omni_jax.inputs.qwen_tokenizer import build_qwen2_5_omni_tokenizer

VOCAB = 152064


@pytest.fixture(scope="module")
def tok():
    return build_qwen2_5_omni_tokenizer()


@pytest.fixture(scope="module")
def proc(tok):
    return InputProcessor(tok, VOCAB)


def _user(*parts):
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "what is this?"}]}]}


def _refused_fast(proc, prompt, match: str, bound_s: float = 2.0) -> None:
    t0 = time.perf_counter()
    with pytest.raises(PromptError, match=match):
        proc.process(prompt)
    assert time.perf_counter() - t0 < bound_s


def _png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("L", (width, height)).save(buf, format="PNG")
    return buf.getvalue()


# ---------------------------------------------------------------------------------------- audio
def test_absurd_sample_rates_are_refused_with_the_configured_range(tok):
    """Tiny rates (1 Hz: a 1.6 s clip becomes 26 min at 16 kHz; 1e-30 Hz never resamples) and
    rates outside a configured range are refused, naming the range."""
    proc = InputProcessor(tok, VOCAB, max_audio_seconds=None)
    for rate in (1e-30, 1.0, float("inf"), float("nan")):
        _refused_fast(proc, _user({"type": "audio", "audio": (np.zeros(1600, np.float32), rate)}),
                      r"sample rate must be in \[1000, 384000\] Hz")
    narrow = InputProcessor(tok, VOCAB, media_limits=MediaLimits(min_sample_rate=8000, max_sample_rate=48000))
    _refused_fast(narrow, _user({"type": "audio", "audio": (np.zeros(9600, np.float32), 96000)}),
                  r"sample rate must be in \[8000, 48000\] Hz, got 96000")
    ok = narrow.process(_user({"type": "audio", "audio": (np.zeros(4800, np.float32), 48000)}))
    assert ok.prompt_token_ids.size > 0


# ---------------------------------------------------------------------------------------- images
def test_empty_pil_image_is_a_prompt_error(proc):
    _refused_fast(proc, _user({"type": "image", "image": Image.new("RGB", (0, 0))}), r"no pixels \(0x0\)")


def test_huge_png_is_refused_from_its_header_before_decoding(proc):
    """A ~140 KB PNG declaring 12000 x 12000 pixels: refused in milliseconds (decoding it took
    2.6 GB and seconds), by the default limit and by a configured one."""
    data = _png(12000, 12000)
    assert len(data) < 1_000_000
    t0 = time.perf_counter()
    with pytest.raises(PromptError, match="12000x12000 = 144000000 pixels, more than the limit of 67108864"):
        proc.process(_user({"type": "image", "image": data}))
    assert time.perf_counter() - t0 < 0.5
    small = InputProcessor(proc.tokenizer, VOCAB, media_limits=MediaLimits(max_image_pixels=64 * 64))
    _refused_fast(small, _user({"type": "image", "image": _png(65, 64)}), "more than the limit of 4096")
    _refused_fast(small, _user({"type": "image", "image": np.zeros((65, 64, 3), np.uint8)}), "65 = 4160 pixels")
    assert small.process(_user({"type": "image", "image": _png(64, 64)})).prompt_token_ids.size > 0


# ---------------------------------------------------------------------------------------- video
def test_video_fps_inf_is_a_prompt_error(proc):
    frames = np.zeros((4, 28, 28, 3), np.uint8)
    for fps in (float("inf"), float("nan"), 1e9):
        _refused_fast(proc, _user({"type": "video", "video": frames, "fps": fps}), r"fps must be in \(0, 1000\]")


def test_video_frame_count_and_size_are_checked_before_loading(tok):
    limits = MediaLimits(max_video_frames=8, max_image_pixels=32 * 32)
    proc = InputProcessor(tok, VOCAB, media_limits=limits)
    _refused_fast(proc, _user({"type": "video", "video": [np.zeros((28, 28, 3), np.uint8)] * 9, "fps": 2.0}),
                  "has 9 frames, more than the limit of 8")
    _refused_fast(proc, _user({"type": "video", "video": np.zeros((4, 56, 28, 3), np.uint8), "fps": 2.0}),
                  "28x56 = 1568 pixels, more than the limit of 1024")
