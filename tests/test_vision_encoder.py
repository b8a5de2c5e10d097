"""Parity of the Qwen2.5-Omni vision encoder with transformers (tiny random checkpoint)."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conversion.mapping import load_hf_into
from omni_jax.models.layers.vision_blocks import (
    num_merged_tokens,
    segment_attention,
    vision_frame_ids,
    vision_position_ids,
)
from omni_jax.models.qwen2_5_omni.vision_encoder import (
    HF_RENAMES,
    Qwen2_5OmniVisionEncoder,
    VisionEncoderConfig,
    vision_metadata,
    vision_window_index,
)

pytestmark = pytest.mark.parity

# (1,16,12): several 4x4-merged-token windows plus partial ones; (1,6,10): partial windows
# only at the edges; (3,8,8): a video of three frames.
IMAGE_A = (1, 16, 12)
IMAGE_B = (1, 6, 10)
VIDEO = (3, 8, 8)


@pytest.fixture(scope="module")
def vision_config(qwen2_5_omni_hf_dir) -> VisionEncoderConfig:
    with open(os.path.join(qwen2_5_omni_hf_dir, "config.json")) as f:
        return VisionEncoderConfig.from_hf(json.load(f)["thinker_config"]["vision_config"])


@pytest.fixture(scope="module")
def encoder(qwen2_5_omni_hf_dir, vision_config):
    from flax import nnx
    from safetensors.numpy import load_file

    model = Qwen2_5OmniVisionEncoder(vision_config, rngs=nnx.Rngs(0))
    tensors = load_file(os.path.join(qwen2_5_omni_hf_dir, "model.safetensors"))
    return load_hf_into(model, tensors, prefix="thinker.visual.", renames=HF_RENAMES)


@pytest.fixture(scope="module")
def hf_visual(qwen2_5_omni_hf_model):
    return qwen2_5_omni_hf_model.thinker.model.visual


def _pixels(grids, config: VisionEncoderConfig, seed: int) -> np.ndarray:
    n = int(np.prod(np.asarray(grids), axis=-1).sum())
    return np.random.default_rng(seed).standard_normal((n, config.patch_dim)).astype(np.float32)


def hf_vision_features(hf_model, pixels: np.ndarray, grids, video: bool = False) -> np.ndarray:
    import torch

    thinker = hf_model.thinker
    pv, grid = torch.from_numpy(pixels), torch.tensor(grids, dtype=torch.long)
    with torch.no_grad():
        out = thinker.get_video_features(pv, grid) if video else thinker.get_image_features(pv, grid)
    return torch.cat(out.pooler_output, 0).numpy()


def _check(ours, ref):
    ours = np.asarray(ours)
    assert ours.shape == ref.shape
    err = float(np.max(np.abs(ours - ref)))
    # The tiny model's features are ~0.1 in size and nearly uniform attention makes a wrong
    # window layout cost only ~3e-4, so also bound the error relative to the output scale.
    tol = min(1e-4, 1e-4 * float(np.max(np.abs(ref))))
    assert err <= tol, f"max abs error {err} > {tol}"


def test_config_from_hf(vision_config):
    assert vision_config.depth == 4 and vision_config.hidden_size == 32 and vision_config.num_heads == 4
    assert vision_config.fullatt_block_indexes == (1, 3)
    assert vision_config.max_window_patches == 64 and vision_config.patch_dim == 3 * 2 * 14 * 14


@pytest.mark.parametrize("grids", [[IMAGE_A], [IMAGE_B], [VIDEO], [(1, 8, 8), (2, 4, 6), IMAGE_A, (1, 18, 2)]])
def test_index_helpers_match_transformers(grids, vision_config):
    import torch
    from transformers.vision_utils import (
        get_vision_cu_seqlens,
        get_vision_position_ids,
        get_vision_window_index,
    )

    c = vision_config
    grid = torch.tensor(grids, dtype=torch.long)
    ref_index, ref_cu = get_vision_window_index(grid, c.spatial_merge_size, c.window_size, c.patch_size)
    index, window_ids = vision_window_index(grids, c.spatial_merge_size, c.window_size, c.patch_size)
    np.testing.assert_array_equal(index, ref_index.numpy())
    # Our per-token window ids as HF's cumulative window boundaries (in patches).
    starts = np.flatnonzero(np.diff(window_ids)) + 1
    cu = np.concatenate([[0], starts, [len(window_ids)]]) * c.merge_unit
    np.testing.assert_array_equal(cu, ref_cu.numpy())

    meta = vision_metadata(grids, c)
    np.testing.assert_array_equal(meta.window_index[meta.reverse_index], np.arange(len(index)))
    np.testing.assert_array_equal(meta.reverse_index, torch.argsort(ref_index).numpy())
    np.testing.assert_array_equal(
        vision_position_ids(grids, c.spatial_merge_size), get_vision_position_ids(grid, c.spatial_merge_size).numpy())
    frame_cu = get_vision_cu_seqlens(grid).numpy()
    np.testing.assert_array_equal(np.bincount(vision_frame_ids(grids)), np.diff(frame_cu))
    # Full-attention segments stay contiguous after the window permutation (HF relies on it).
    np.testing.assert_array_equal(meta.full_segment_ids, np.repeat(np.arange(len(frame_cu) - 1), np.diff(frame_cu)))


def test_banded_segment_attention_equals_dense():
    rng = np.random.default_rng(0)
    n, h, d = 200, 2, 8
    q, k, v = (jnp.asarray(rng.standard_normal((n, h, d)), jnp.float32) for _ in range(3))
    lengths = [5, 16, 16, 3, 16, 1, 16, 16, 9, 16, 16, 16, 12, 16, 14, 12]
    seg = np.repeat(np.arange(len(lengths)), lengths)
    seg = jnp.asarray(np.concatenate([seg, -np.ones(n - len(seg), int)]), jnp.int32)
    attend = jax.jit(segment_attention, static_argnames="max_segment_len")
    dense = attend(q, k, v, seg, 0.3)
    banded = attend(q, k, v, seg, 0.3, max_segment_len=16)
    np.testing.assert_allclose(np.asarray(banded), np.asarray(dense), atol=1e-6)


def test_queries_in_blocks_equal_all_at_once(monkeypatch):
    """Unbanded segment attention takes QUERY_BLOCK queries at a time (bounded temporaries on a
    GPU): with blocks of 32 over 200 queries (the last one padded) it equals all of them at once."""
    from omni_jax.models.layers import vision_blocks

    rng = np.random.default_rng(1)
    n, h, d = 200, 2, 8
    q, k, v = (jnp.asarray(rng.standard_normal((n, h, d)), jnp.float32) for _ in range(3))
    seg = jnp.asarray(np.concatenate([np.repeat(np.arange(3), [70, 90, 30]), -np.ones(10, int)]), jnp.int32)
    whole = jax.jit(segment_attention)(q, k, v, seg, 0.3)
    monkeypatch.setattr(vision_blocks, "QUERY_BLOCK", 32)
    blocks = jax.jit(segment_attention)(q, k, v, seg, 0.3)
    np.testing.assert_allclose(np.asarray(blocks), np.asarray(whole), atol=1e-6)
    assert "while" in jax.jit(segment_attention).lower(q, k, v, seg, 0.3).as_text()  # one block after another


def test_single_image(encoder, qwen2_5_omni_hf_model, vision_config):
    pixels = _pixels([IMAGE_A], vision_config, 0)
    _check(encoder.encode(pixels, [IMAGE_A]), hf_vision_features(qwen2_5_omni_hf_model, pixels, [IMAGE_A]))


def test_several_images(encoder, qwen2_5_omni_hf_model, vision_config):
    grids = [IMAGE_A, IMAGE_B, (1, 4, 4)]
    pixels = _pixels(grids, vision_config, 1)
    out = encoder.encode(pixels, grids)
    _check(out, hf_vision_features(qwen2_5_omni_hf_model, pixels, grids))
    assert out.shape[0] == int(num_merged_tokens(grids, vision_config.spatial_merge_size).sum())


def test_video(encoder, qwen2_5_omni_hf_model, vision_config):
    grids = [VIDEO, (2, 6, 10)]
    pixels = _pixels(grids, vision_config, 2)
    _check(encoder.encode(pixels, grids), hf_vision_features(qwen2_5_omni_hf_model, pixels, grids, video=True))


def test_padded_equals_unpadded(encoder, vision_config):
    from flax import nnx

    grids = [IMAGE_A, IMAGE_B]
    pixels = _pixels(grids, vision_config, 3)
    n = pixels.shape[0]
    m = n // vision_config.merge_unit
    ref = np.asarray(encoder.encode(pixels, grids))

    bucket = 512
    meta = vision_metadata(grids, vision_config, num_patches=bucket)
    # Garbage in the padding rows must not leak into valid tokens.
    padded = np.concatenate([pixels, 100.0 * np.ones((bucket - n, pixels.shape[1]), np.float32)])

    @nnx.jit
    def forward(model, pv, meta):
        return model(pv, meta)

    out = np.asarray(forward(encoder, jnp.asarray(padded), jax.tree.map(jnp.asarray, meta)))
    assert out.shape == (bucket // vision_config.merge_unit, vision_config.out_hidden_size)
    np.testing.assert_allclose(out[:m], ref, atol=1e-5, rtol=0)
    assert np.isfinite(out).all()
