"""Parity of the Qwen2.5-Omni audio encoder against transformers' audio tower."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hf_tiny
from conversion.mapping import load_hf_into
from omni_jax.models.layers.audio_blocks import AudioEncoderConfig
from omni_jax.models.layers.audio_chunks import num_chunks_for
from omni_jax.models.qwen2_5_omni.audio_encoder import (
    Qwen2_5OmniAudioEncoder,
    audio_output_lengths,
    prepare_audio_batch,
)

pytestmark = pytest.mark.parity

ATOL = 1e-4


@pytest.fixture(scope="module")
def audio_config(qwen2_5_omni_hf_dir) -> AudioEncoderConfig:
    with open(os.path.join(qwen2_5_omni_hf_dir, "config.json")) as f:
        return AudioEncoderConfig.from_hf(json.load(f)["thinker_config"]["audio_config"])


@pytest.fixture(scope="module")
def encoder(qwen2_5_omni_hf_dir, audio_config) -> Qwen2_5OmniAudioEncoder:
    from safetensors.numpy import load_file

    model = Qwen2_5OmniAudioEncoder(audio_config, rngs=nnx.Rngs(0))
    tensors = load_file(os.path.join(qwen2_5_omni_hf_dir, "model.safetensors"))
    return load_hf_into(model, tensors, prefix="thinker.audio_tower.")


def hf_audio_features(hf_model, mels: list[np.ndarray]) -> np.ndarray:
    """What the HF thinker computes for these audios: padded batch + feature_attention_mask."""
    import torch

    lens = [m.shape[1] for m in mels]
    feats = np.zeros((len(mels), mels[0].shape[0], max(lens)), np.float32)
    mask = np.zeros((len(mels), max(lens)), np.int64)
    for i, m in enumerate(mels):
        feats[i, :, : m.shape[1]] = m
        mask[i, : m.shape[1]] = 1
    with torch.no_grad():
        out = hf_model.thinker.get_audio_features(
            input_features=torch.from_numpy(feats), feature_attention_mask=torch.from_numpy(mask))
    return out.last_hidden_state.numpy()


def test_config_from_hf(audio_config):
    assert audio_config == AudioEncoderConfig(
        num_mel_bins=128, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64, d_model=32,
        max_source_positions=1500, n_window=10, output_dim=64, activation="gelu")


def test_one_audio_partial_chunk(encoder, qwen2_5_omni_hf_model):
    mel = hf_tiny.random_mel(53, seed=1)  # 2 full chunks of 20 frames + 13
    ref = hf_audio_features(qwen2_5_omni_hf_model, [mel])
    out = encoder.encode([mel])
    assert out.shape == ref.shape == (int(audio_output_lengths([53])[1][0]), 64)
    np.testing.assert_allclose(out, ref, atol=ATOL, rtol=0)


def test_several_audios_one_call(encoder, qwen2_5_omni_hf_model):
    mels = [hf_tiny.random_mel(n, seed=i) for i, n in enumerate((37, 100, 160, 21))]
    ref = hf_audio_features(qwen2_5_omni_hf_model, mels)
    out = encoder.encode(mels)
    assert out.shape == ref.shape
    np.testing.assert_allclose(out, ref, atol=ATOL, rtol=0)
    # The concatenated form (what the thinker feeds) is the same call.
    lens = [m.shape[1] for m in mels]
    np.testing.assert_array_equal(encoder.encode(np.concatenate(mels, axis=1), lens), out)


def test_padded_bucket_matches_unpadded(encoder):
    lens = np.array([37, 100, 9])
    mels = [hf_tiny.random_mel(int(n), seed=10 + i) for i, n in enumerate(lens)]
    exact = encoder.encode(mels)

    # Bucketed call under jit: frames, chunks and output slots all padded, and the padding
    # frames hold garbage that must not leak into the valid rows.
    num_frames, num_chunks, num_tokens = 256, 16, 64
    feats = np.concatenate(mels + [1e3 * hf_tiny.random_mel(num_frames - int(lens.sum()), seed=99)], axis=1)
    batch = prepare_audio_batch(lens, encoder.config.n_window, num_chunks=num_chunks, num_tokens=num_tokens)
    assert num_chunks_for(lens, encoder.config.n_window) < num_chunks and batch.num_tokens < num_tokens
    graphdef, state = nnx.split(encoder)

    @jax.jit
    def run(state, feats, *arrays):
        return nnx.merge(graphdef, state)(feats, *arrays)

    out = np.asarray(run(state, jnp.asarray(feats), *map(jnp.asarray, batch.arrays())))
    assert out.shape == (num_tokens, 64) and np.isfinite(out).all()
    np.testing.assert_allclose(out[: batch.num_tokens], exact, atol=1e-5, rtol=0)
    # The eager convenience path with buckets agrees too.
    np.testing.assert_allclose(
        encoder.encode(mels, num_frames=num_frames, num_chunks=num_chunks, num_tokens=num_tokens),
        exact, atol=1e-5, rtol=0)


def test_output_lengths_match_hf(qwen2_5_omni_hf_model, audio_config):
    import torch

    lens = np.array([1, 2, 3, 4, 5, 19, 20, 21, 37, 40, 100, 159, 160, 161, 3000, 30001])
    after_cnn, out = audio_output_lengths(lens)
    ref_after, ref_out = qwen2_5_omni_hf_model.thinker.model.audio_tower._get_feat_extract_output_lengths(
        torch.from_numpy(lens))
    np.testing.assert_array_equal(after_cnn, ref_after.numpy())
    np.testing.assert_array_equal(out, ref_out.numpy())
    # Audios of 1 or 2 frames yield no output token; the host plan must agree.
    batch = prepare_audio_batch(lens, audio_config.n_window)
    np.testing.assert_array_equal(batch.output_lens, out)
    assert batch.pool_index.shape[0] == batch.num_tokens == out.sum()
    assert batch.num_frames == lens.sum()
