"""Parity of the Qwen3-Omni audio and vision encoders with transformers.

The HF towers are built directly from tiny sub-configs (no full checkpoint). Their
``state_dict`` names are the on-disk names under ``thinker.audio_tower.`` /
``thinker.visual.`` (transformers only renames the thinker's MoE experts), so loading them
with ``prefix=""`` exercises the same mapping as a real checkpoint.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conversion.mapping import load_hf_into
from omni_jax.models.layers.audio_chunks import num_chunks_for
from omni_jax.models.qwen3_omni.audio_encoder import (
    AudioEncoderConfig,
    Qwen3OmniAudioEncoder,
    audio_output_lengths,
    num_windows_for,
    prepare_audio_batch,
)
from omni_jax.models.qwen3_omni.vision_encoder import (
    HF_RENAMES,
    Qwen3OmniVisionEncoder,
    VisionEncoderConfig,
    max_frame_patches,
    num_merged_tokens,
    vision_interpolation,
    vision_metadata,
)

pytestmark = [pytest.mark.parity, pytest.mark.torch]  # the references are built here with torch

ATOL = 1e-4
MEL = 32

# n_window must be 50: transformers' token count hard-codes 13 tokens per 100-frame chunk.
# n_window_infer 200 -> attention windows of 2 chunks (26 tokens).
AUDIO_KW = dict(num_mel_bins=MEL, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64, d_model=32,
                output_dim=48, n_window=50, n_window_infer=200, downsample_hidden_size=8,
                max_source_positions=1500, activation_function="gelu")
# 8 x 8 learned position table, resampled up (16 x 12) and down (4 x 4) in the tests.
VISION_KW = dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=16, spatial_merge_size=2,
                 temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=64,
                 deepstack_visual_indexes=[0, 2], hidden_act="gelu_pytorch_tanh")


def _randomise(model, seed: int):
    """O(1) activations (so errors are not hidden by tiny outputs), norms and biases not 1/0."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(p[0].numel()))
            elif name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    for name, t in model.state_dict().items():
        assert torch.isfinite(t).all(), name
    return model


def _check(ours, ref):
    ours, ref = np.asarray(ours), np.asarray(ref)
    assert ours.shape == ref.shape
    assert np.isfinite(ours).all()
    # Outputs are O(1) here, so the absolute bound is also a meaningful relative one.
    assert float(np.abs(ref).max()) > 0.5
    np.testing.assert_allclose(ours, ref, atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------------------
# Audio
# ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_audio():
    import torch
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeAudioEncoderConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeAudioEncoder

    torch.manual_seed(0)
    return _randomise(Qwen3OmniMoeAudioEncoder(Qwen3OmniMoeAudioEncoderConfig(**AUDIO_KW)).eval(), 1)


@pytest.fixture(scope="module")
def audio_encoder(hf_audio):
    config = AudioEncoderConfig.from_hf(hf_audio.config.to_dict())
    model = Qwen3OmniAudioEncoder(config, rngs=nnx.Rngs(0))
    return load_hf_into(model, {k: v.numpy() for k, v in hf_audio.state_dict().items()}, prefix="")


def _mels(lens, seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((MEL, int(n))).astype(np.float32) for n in lens]


def _hf_audio_features(hf_audio, mels):
    """One transformers call over the audios concatenated along time (as get_audio_features)."""
    import torch

    with torch.no_grad():
        out = hf_audio(torch.from_numpy(np.concatenate(mels, axis=1)),
                       feature_lens=torch.tensor([m.shape[1] for m in mels]))
    return out.last_hidden_state.numpy()


def test_audio_config_from_hf(hf_audio):
    c = AudioEncoderConfig.from_hf(hf_audio.config.to_dict())
    assert c == AudioEncoderConfig(num_mel_bins=MEL, encoder_layers=2, encoder_attention_heads=4,
                                   encoder_ffn_dim=64, d_model=32, max_source_positions=1500, n_window=50,
                                   n_window_infer=200, output_dim=48, downsample_hidden_size=8, activation="gelu")
    assert (c.chunk_frames, c.chunk_tokens, c.window_chunks, c.window_tokens, c.freq_bins) == (100, 13, 2, 26, 4)
    assert AudioEncoderConfig().window_tokens == 104  # real model: 8 chunks of 13 tokens


def test_audio_output_lengths_match_hf():
    import torch
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

    lens = np.array([1, 2, 3, 4, 5, 7, 8, 9, 37, 99, 100, 101, 199, 200, 201, 537, 1000, 3001, 30000])
    ref = _get_feat_extract_output_lengths(torch.from_numpy(lens), 50).numpy()
    np.testing.assert_array_equal(audio_output_lengths(lens, 50), ref)
    batch = prepare_audio_batch(lens, 50, 200)
    np.testing.assert_array_equal(batch.output_lens, ref)
    assert batch.num_tokens == batch.output_index.shape[0] == ref.sum() == batch.token_mask.sum()
    assert batch.num_frames == lens.sum()
    assert batch.frame_index.shape[0] == num_chunks_for(lens, 50)
    assert batch.token_index.shape[0] == num_windows_for(lens, 50, 200)


def test_audio_several_lengths(audio_encoder, hf_audio):
    # 537: five full chunks + 37 frames (three 2-chunk windows, the last one partial);
    # 100: exactly one chunk; 3 and 1: a few frames; 250: a window + a partial chunk.
    mels = _mels([537, 100, 3, 250, 1], seed=0)
    out = audio_encoder.encode(mels)
    _check(out, _hf_audio_features(hf_audio, mels))
    assert out.shape[0] == int(audio_output_lengths([537, 100, 3, 250, 1]).sum())
    # The concatenated form (what the thinker feeds) is the same call.
    lens = [m.shape[1] for m in mels]
    np.testing.assert_array_equal(audio_encoder.encode(np.concatenate(mels, axis=1), lens), out)


def test_audio_short_batch_padding_quirk(audio_encoder, hf_audio):
    # No audio has a full chunk: transformers convolves at the longest chunk's length (64),
    # which changes the 37-frame audio's features compared with encoding it alone.
    mels = _mels([37, 64], seed=1)
    both = _hf_audio_features(hf_audio, mels)
    _check(audio_encoder.encode(mels), both)
    alone = _hf_audio_features(hf_audio, mels[:1])
    assert np.abs(alone - both[: alone.shape[0]]).max() > 1e-3
    _check(audio_encoder.encode(mels[:1]), alone)
    # extent_groups: one call that computes what separate transformers calls would.
    grouped = audio_encoder.encode(mels + _mels([150], seed=2), extent_groups=[0, 1, 1])
    _check(grouped[: alone.shape[0]], alone)
    _check(grouped[alone.shape[0]:], _hf_audio_features(hf_audio, mels[1:] + _mels([150], seed=2)))


def test_audio_padded_bucket_matches_unpadded(audio_encoder):
    lens = np.array([537, 37, 250])
    mels = _mels(lens, seed=3)
    exact = audio_encoder.encode(mels)
    c = audio_encoder.config

    # Bucketed jitted call: frames, chunks, windows and output rows all padded; the padding
    # frames hold large garbage that must not reach the valid rows.
    num_frames, num_chunks, num_windows, num_tokens = 1024, 12, 8, 128
    garbage = 1e3 * _mels([num_frames - int(lens.sum())], seed=99)[0]
    feats = np.concatenate(mels + [garbage], axis=1)
    batch = prepare_audio_batch(lens, c.n_window, c.n_window_infer, num_chunks=num_chunks,
                                num_windows=num_windows, num_tokens=num_tokens)
    assert num_chunks_for(lens, c.n_window) < num_chunks
    assert num_windows_for(lens, c.n_window, c.n_window_infer) < num_windows and batch.num_tokens < num_tokens
    graphdef, state = nnx.split(audio_encoder)

    @jax.jit
    def run(state, feats, *arrays):
        return nnx.merge(graphdef, state)(feats, *arrays)

    out = np.asarray(run(state, jnp.asarray(feats), *map(jnp.asarray, batch.arrays())))
    assert out.shape == (num_tokens, c.output_dim) and np.isfinite(out).all()
    np.testing.assert_allclose(out[: batch.num_tokens], exact, atol=1e-5, rtol=0)
    np.testing.assert_allclose(
        audio_encoder.encode(mels, num_frames=num_frames, num_chunks=num_chunks, num_windows=num_windows,
                             num_tokens=num_tokens), exact, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------------------
# Vision
# ----------------------------------------------------------------------------------------

IMAGE_A = (1, 16, 12)   # larger than the 8 x 8 table: upsampled positions
IMAGE_B = (1, 4, 6)     # smaller: downsampled
VIDEO = (3, 8, 10)      # three frames, each its own attention segment


@pytest.fixture(scope="module")
def hf_vision():
    import torch
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeVisionEncoderConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeVisionEncoder

    torch.manual_seed(0)
    return _randomise(Qwen3OmniMoeVisionEncoder(Qwen3OmniMoeVisionEncoderConfig(**VISION_KW)).eval(), 2)


@pytest.fixture(scope="module")
def vision_encoder(hf_vision):
    config = VisionEncoderConfig.from_hf(hf_vision.config.to_dict())
    model = Qwen3OmniVisionEncoder(config, rngs=nnx.Rngs(0))
    return load_hf_into(model, {k: v.numpy() for k, v in hf_vision.state_dict().items()}, prefix="",
                        renames=HF_RENAMES)


def _pixels(grids, config: VisionEncoderConfig, seed: int) -> np.ndarray:
    n = int(np.prod(np.asarray(grids), axis=-1).sum())
    return np.random.default_rng(seed).standard_normal((n, config.patch_dim)).astype(np.float32)


def hf_vision_rows(hf_vision, pixels, grids):
    """(pooler_output, stacked deepstack_features) of one transformers call."""
    import torch

    with torch.no_grad():
        out = hf_vision(torch.from_numpy(pixels), grid_thw=torch.tensor(grids, dtype=torch.long))
    return out.pooler_output.numpy(), np.stack([f.numpy() for f in out.deepstack_features])


def test_vision_config_from_hf(hf_vision):
    c = VisionEncoderConfig.from_hf(hf_vision.config.to_dict())
    assert (c.depth, c.hidden_size, c.num_heads, c.patch_size, c.num_grid_per_side) == (4, 32, 4, 16, 8)
    assert c.deepstack_visual_indexes == (0, 2) and c.rope_theta == 10000.0
    assert c.hidden_act == "gelu_pytorch_tanh" and c.patch_dim == 3 * 2 * 16 * 16


@pytest.mark.parametrize("grids", [[IMAGE_A], [IMAGE_B], [VIDEO, (1, 2, 2), (2, 20, 2)]])
def test_vision_interpolation_matches_transformers(grids):
    import torch
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights

    ref_idx, ref_w = get_vision_interpolation_indices_and_weights(
        torch.tensor(grids), num_grid_per_side=8, mode="bilinear", align_corners=True, spatial_merge_size=2)
    idx, w = vision_interpolation(grids, 8, 2)
    np.testing.assert_array_equal(idx, ref_idx.numpy())
    np.testing.assert_array_equal(w, ref_w.numpy())  # bit-exact float32 weights
    meta = vision_metadata(grids, VisionEncoderConfig.from_hf(VISION_KW))
    assert meta.segment_ids.max() + 1 == sum(t for t, _, _ in grids)


def test_vision_single_image(vision_encoder, hf_vision):
    pixels = _pixels([IMAGE_A], vision_encoder.config, 0)
    feats, deep = vision_encoder.encode(pixels, [IMAGE_A])
    ref_feats, ref_deep = hf_vision_rows(hf_vision, pixels, [IMAGE_A])
    assert deep.shape == (2, IMAGE_A[1] * IMAGE_A[2] // 4, 64)
    _check(feats, ref_feats)
    _check(deep, ref_deep)


def test_vision_two_images(vision_encoder, hf_vision):
    grids = [IMAGE_A, IMAGE_B]
    pixels = _pixels(grids, vision_encoder.config, 1)
    feats, deep = vision_encoder.encode(pixels, grids)
    ref_feats, ref_deep = hf_vision_rows(hf_vision, pixels, grids)
    assert feats.shape[0] == int(num_merged_tokens(grids, 2).sum())
    _check(feats, ref_feats)
    _check(deep, ref_deep)


def test_vision_video(vision_encoder, hf_vision):
    grids = [VIDEO, (2, 4, 4)]
    pixels = _pixels(grids, vision_encoder.config, 2)
    feats, deep = vision_encoder.encode(pixels, grids)
    ref_feats, ref_deep = hf_vision_rows(hf_vision, pixels, grids)
    _check(feats, ref_feats)
    _check(deep, ref_deep)


def test_vision_padded_equals_unpadded(vision_encoder):
    c = vision_encoder.config
    grids = [IMAGE_A, VIDEO]
    pixels = _pixels(grids, c, 3)
    n = pixels.shape[0]
    m = n // c.merge_unit
    ref_feats, ref_deep = vision_encoder.encode(pixels, grids)

    bucket = 512
    meta = vision_metadata(grids, c, num_patches=bucket)
    # Garbage padding rows must not leak into valid tokens.
    padded = np.concatenate([pixels, 100.0 * np.ones((bucket - n, c.patch_dim), np.float32)])
    graphdef, state = nnx.split(vision_encoder)

    @jax.jit
    def run(state, pv, meta):
        return nnx.merge(graphdef, state)(pv, meta)

    feats, deep = map(np.asarray, run(state, jnp.asarray(padded), jax.tree.map(jnp.asarray, meta)))
    assert feats.shape == (bucket // c.merge_unit, c.out_hidden_size)
    assert deep.shape == (2, bucket // c.merge_unit, c.out_hidden_size)
    assert np.isfinite(feats).all() and np.isfinite(deep).all()
    np.testing.assert_allclose(feats[:m], ref_feats, atol=1e-5, rtol=0)
    np.testing.assert_allclose(deep[:, :m], ref_deep, atol=1e-5, rtol=0)
    # Banded attention (segments no longer than the largest frame) computes the same.
    band_feats, band_deep = vision_encoder.encode(pixels, grids, num_patches=bucket,
                                                  max_segment_len=max_frame_patches(grids))
    np.testing.assert_allclose(band_feats, ref_feats, atol=1e-5, rtol=0)
    np.testing.assert_allclose(band_deep, ref_deep, atol=1e-5, rtol=0)
