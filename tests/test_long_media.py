"""A request's media larger than the thinker's largest encoder bucket, encoded in several calls
(both families): audio cut at whole attention windows, images and video between frames; the rows
equal transformers' one call over all the request's audios, images or videos. A bucket bounds one
encoder call, not a prompt: the context does."""

from __future__ import annotations

import numpy as np
import pytest

from omni_jax.checkpoint import load_checkpoint, read_config
from omni_jax.errors import TooLongError
from omni_jax.inputs.rope_index import RopeIndexConfig
from omni_jax.models.qwen2_5_omni import tiny as qwen2_5_tiny
from omni_jax.models.qwen2_5_omni.media_encoder import Qwen2_5ThinkerMediaEncoder
from omni_jax.models.qwen3_omni import tiny as qwen3_tiny
from omni_jax.models.qwen3_omni.media_encoder import Qwen3ThinkerMediaEncoder
from omni_jax.models.thinker_media import MediaBuckets
from test_audio_encoder import hf_audio_features  # transformers' thinker: one call over a request's audios
from test_qwen3_encoders import hf_vision_rows
from test_vision_encoder import hf_vision_features

ATOL = 1e-4


def media_encoder(family: str, ckpt: str, audio_buckets: tuple[int, ...] = (1,), vision_buckets=(64,)):
    model, cfg = load_checkpoint(ckpt, stage="thinker")
    buckets = MediaBuckets(audio_buckets, vision_buckets)
    if family == "qwen2_5_omni":
        return Qwen2_5ThinkerMediaEncoder(model, cfg, RopeIndexConfig.from_hf(read_config(ckpt)["hf_config"]), buckets)
    return Qwen3ThinkerMediaEncoder(model, cfg, buckets)


def _tol(ref: np.ndarray) -> float:
    """1e-4, or a thousandth of the rows where they are small (the transformers-initialised tiny Qwen3's)."""
    return min(ATOL, 1e-3 * float(np.abs(ref).max()))


def _mels(num_mel_bins: int, lens, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((num_mel_bins, int(n))).astype(np.float32) for n in lens]


# Per family: the largest audio bucket, and audio lengths (mel frames) that need more chunks than
# it, as multiples of the tiny encoder's chunk: Qwen2.5's of 20 frames (attention within each),
# Qwen3's of 100 (attention windows of 2 chunks). Each set has an audio cut into pieces, a
# piece packed with other audios, and an audio alone in its call.
CASES = {
    "qwen2_5_omni": (4, [[137, 20, 5, 61], [400], [19, 41, 3, 20, 20, 7]]),
    # The last set has no full chunk: transformers pads every chunk to the longest (90 frames),
    # the call that holds only the 20-frame audio too.
    "qwen3_omni": (4, [[937, 100, 3, 250], [1234], [90, 37, 64, 50, 20]]),
}


@pytest.mark.parity
@pytest.mark.parametrize("family", ["qwen2_5_omni", "qwen3_omni"])
def test_audio_longer_than_the_largest_bucket_equals_transformers(family, converted_thinker_fp32, converted_qwen3_fp32,
                                                                  qwen2_5_omni_hf_model, qwen3_omni_hf_model):
    ckpt, hf_model = (converted_thinker_fp32, qwen2_5_omni_hf_model) if family == "qwen2_5_omni" else \
        (converted_qwen3_fp32, qwen3_omni_hf_model)
    largest, cases = CASES[family]
    enc = media_encoder(family, ckpt, (1, largest))
    for i, lens in enumerate(cases):
        mels = _mels(enc.cfg.audio.num_mel_bins, lens, seed=i)
        calls = enc._audio_calls(mels)
        assert len(calls) > 1, lens  # the case takes several calls, none over the largest bucket
        assert all(enc._num_chunks(np.array([m.shape[1] for m in call])) <= largest for call in calls)
        ours, ref = enc.encode_audio(mels), hf_audio_features(hf_model, mels)
        assert ours.shape == ref.shape, lens
        np.testing.assert_allclose(ours, ref, atol=_tol(ref), rtol=0, err_msg=str(lens))


@pytest.mark.parametrize("family", ["qwen2_5_omni", "qwen3_omni"])
def test_audio_in_several_calls_equals_one_call(family, tmp_path):
    """On the package's tiny models, whose encoders are loud enough to tell a wrong cut (the
    transformers-initialised tiny Qwen3's rows are a few hundredths: a wrong extent moves them
    by 3e-6): the calls give one call's rows (one call equals transformers: test_audio_encoder.py,
    test_qwen3_encoders.py), and the controls, a cut inside an attention window and (Qwen3) a
    piece convolved at its own length rather than the request's longest chunk, do not."""
    tiny = qwen2_5_tiny if family == "qwen2_5_omni" else qwen3_tiny
    ckpt = tiny.build_tiny_checkpoint(str(tmp_path / "tiny"))
    largest, cases = CASES[family]
    split, whole = media_encoder(family, ckpt, (1, largest)), media_encoder(family, ckpt, (1, 64))
    for i, lens in enumerate(cases):
        mels = _mels(split.cfg.audio.num_mel_bins, lens, seed=i)
        assert len(split._audio_calls(mels)) > 1 and len(whole._audio_calls(mels)) == 1
        ref = whole.encode_audio(mels)
        np.testing.assert_allclose(split.encode_audio(mels), ref, atol=_tol(ref), rtol=0, err_msg=str(lens))
    # The controls: the first set's longest audio cut half a window in; the last set's last audio alone.
    mels = _mels(split.cfg.audio.num_mel_bins, cases[0][0:1], 0)
    lens, w = np.array([mels[0].shape[1]]), split.cfg.audio.chunk_frames * split._audio_window_chunks()
    ref = whole.encode_audio(mels)
    wrong = np.concatenate([whole._encode_audio_call([mels[0][:, :w + w // 2]], lens),
                            whole._encode_audio_call([mels[0][:, w + w // 2:]], lens)])
    assert wrong.shape == ref.shape and np.abs(wrong - ref).max() > 10 * _tol(ref)
    if family == "qwen3_omni":
        mels = _mels(split.cfg.audio.num_mel_bins, cases[-1], len(cases) - 1)
        ref = whole.encode_audio(mels)
        wrong = whole._encode_audio_call(mels[-1:], np.array([mels[-1].shape[1]]))
        assert np.abs(wrong - ref[-len(wrong):]).max() > 10 * _tol(ref)


def test_a_bucket_smaller_than_an_attention_window_cannot_be_cut(converted_qwen3_fp32):
    """Qwen3 attends over windows of 2 tiny chunks: with buckets of 1 chunk, audio of more is
    refused by name rather than encoded differently from transformers."""
    enc = media_encoder("qwen3_omni", converted_qwen3_fp32, (1,))
    assert enc.encode_audio(_mels(enc.cfg.audio.num_mel_bins, [100], 0)).shape[0] == 13  # one chunk fits
    with pytest.raises(TooLongError, match=r"less than one attention window \(2 chunks\)"):
        enc.encode_audio(_mels(enc.cfg.audio.num_mel_bins, [150], 0))


# Images and videos (grids [t, h, w] of patches) with more patches together than the largest bucket
# (128): a video cut into runs of frames, images packed in order, a video of non-square frames
# whose last frame takes a call of its own. Both encoders attend within a frame.
VISION_CASES = [("video", [(5, 8, 8)]), ("image", [(1, 8, 12), (1, 8, 8), (1, 4, 6), (1, 10, 8)]),
                ("video", [(3, 6, 10), (2, 4, 4)])]


def _pixels(enc, grids, seed: int) -> np.ndarray:
    n = int(np.prod(np.asarray(grids), axis=-1).sum())
    return np.random.default_rng(seed).standard_normal((n, enc.cfg.vision.patch_dim)).astype(np.float32)


def _check_vision(ours, ref, what):
    for o, r in zip(ours, ref):
        if r is not None:
            assert o.shape == r.shape, what
            np.testing.assert_allclose(o, r, atol=_tol(r), rtol=0, err_msg=what)


@pytest.mark.parity
@pytest.mark.parametrize("family", ["qwen2_5_omni", "qwen3_omni"])
def test_images_and_video_larger_than_the_largest_bucket_equal_transformers(
        family, converted_thinker_fp32, converted_qwen3_fp32, qwen2_5_omni_hf_model, qwen3_omni_hf_model):
    ckpt = converted_thinker_fp32 if family == "qwen2_5_omni" else converted_qwen3_fp32
    enc = media_encoder(family, ckpt, vision_buckets=(64, 128))
    for i, (what, grids) in enumerate(VISION_CASES):
        pixels = _pixels(enc, grids, seed=i)
        calls = enc._vision_calls(np.array(grids), what)
        assert len(calls) > 1 and all(int(np.prod(g, axis=1).sum()) <= 128 for _, g in calls), grids
        if family == "qwen2_5_omni":  # features only
            ref = hf_vision_features(qwen2_5_omni_hf_model, pixels, grids, video=what == "video"), None
        else:  # features and DeepStack features
            ref = hf_vision_rows(qwen3_omni_hf_model.thinker.model.visual, pixels, grids)
        _check_vision(enc.encode_vision(pixels, np.array(grids), what), ref, str(grids))


@pytest.mark.parametrize("family", ["qwen2_5_omni", "qwen3_omni"])
def test_images_and_video_in_several_calls_equal_one_call(family, tmp_path):
    """On the package's tiny models (loud encoders): the calls give one call's rows, and the
    control, a frame cut into two halves (attention no longer spans the frame), does not."""
    tiny = qwen2_5_tiny if family == "qwen2_5_omni" else qwen3_tiny
    ckpt = tiny.build_tiny_checkpoint(str(tmp_path / "tiny"))
    split, whole = media_encoder(family, ckpt, vision_buckets=(128,)), media_encoder(family, ckpt, vision_buckets=(512,))
    for i, (what, grids) in enumerate(VISION_CASES):
        pixels = _pixels(split, grids, seed=i)
        assert len(split._vision_calls(np.array(grids), what)) > 1
        _check_vision(split.encode_vision(pixels, np.array(grids), what),
                      whole.encode_vision(pixels, np.array(grids), what), str(grids))
    pixels = _pixels(split, [(1, 8, 12)], seed=0)
    ref = whole.encode_vision(pixels, np.array([(1, 8, 12)]), "image")[0]
    halves = whole.encode_vision(pixels, np.array([(1, 4, 12), (1, 4, 12)]), "image")[0]
    assert halves.shape == ref.shape and np.abs(halves - ref).max() > 10 * _tol(ref)


def test_a_frame_larger_than_the_largest_bucket_is_refused(converted_thinker_fp32):
    enc = media_encoder("qwen2_5_omni", converted_thinker_fp32, vision_buckets=(64, 128))
    grids = np.array([(2, 8, 8), (1, 12, 12)])
    with pytest.raises(TooLongError, match="video too large: 144 patches in one frame, more than the largest "
                                           "bucket 128"):
        enc.encode_vision(_pixels(enc, grids, 0), grids, "video")
