"""Thinker logits against transformers: text only, and a mixed audio + image + video prompt."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import hf_tiny
from omni_jax import load_checkpoint
from omni_jax.inputs.rope_index import RopeIndexConfig
from omni_jax.models.qwen2_5_omni.rope_index import get_rope_index
from omni_jax.models.layers.attention import AttentionMetadata
from omni_jax.models.qwen2_5_omni.audio_encoder import audio_output_lengths
from omni_jax.models.thinker_media import media_index

pytestmark = pytest.mark.parity

TOL = 1e-4


@pytest.fixture(scope="module")
def thinker(converted_thinker_fp32):
    return load_checkpoint(converted_thinker_fp32, stage="thinker")


def _jax_logits(model, ids, positions, media_embeds=None, media_idx=None):
    import jax.numpy as jnp

    ids = jnp.asarray(ids, jnp.int32)
    if media_embeds is None:
        x = model.embed(ids)
    else:
        x = model.merge_media(ids, jnp.asarray(media_embeds), jnp.asarray(media_idx))
    h, _, captured = model(x, jnp.asarray(positions), AttentionMetadata.dense(len(ids)),
                           capture_layers=(0, model.cfg.text.num_layers))
    return np.asarray(model.compute_logits(h)), {k: np.asarray(v) for k, v in captured.items()}


def test_text_only_logits_and_hidden_states(thinker, qwen2_5_omni_hf_model):
    model, cfg = thinker
    ids = np.random.default_rng(1).integers(0, 151600, 29)
    with torch.no_grad():
        ref = qwen2_5_omni_hf_model.thinker(input_ids=torch.tensor(ids)[None], output_hidden_states=True)
    logits, hidden = _jax_logits(model, ids, np.arange(len(ids)))
    assert np.abs(logits - ref.logits[0].numpy()).max() <= TOL
    assert np.abs(hidden[0] - ref.hidden_states[0][0].numpy()).max() <= TOL
    assert np.abs(hidden[cfg.text.num_layers] - ref.hidden_states[-1][0].numpy()).max() <= TOL


def _mixed_prompt(cfg, audio_frames, image_grid, video_grid):
    merge = cfg.vision.spatial_merge_size ** 2
    n_audio = int(audio_output_lengths(np.array([audio_frames]))[1][0])
    n_image = int(np.prod(image_grid)) // merge
    n_video = int(np.prod(video_grid)) // merge
    t = hf_tiny
    ids = ([t.IM_START, 872, 198, t.AUDIO_START] + [t.AUDIO_TOKEN] * n_audio + [t.AUDIO_END, 1207]
           + [t.VISION_START] + [t.IMAGE_TOKEN] * n_image + [t.VISION_END, 323]
           + [t.VISION_START] + [t.VIDEO_TOKEN] * n_video + [t.VISION_END, 3555, t.IM_END, 198])
    return np.array(ids, np.int64)


def test_mixed_audio_image_video_logits(thinker, qwen2_5_omni_hf_model, qwen2_5_omni_hf_dir):
    model, cfg = thinker
    rng = np.random.default_rng(2)
    frames, image_grid, video_grid = 90, (1, 8, 12), (2, 4, 8)
    ids = _mixed_prompt(cfg, frames, image_grid, video_grid)
    mel = hf_tiny.random_mel(frames, seed=3)
    patch_dim = cfg.vision.patch_dim
    pix_img = rng.standard_normal((int(np.prod(image_grid)), patch_dim)).astype(np.float32)
    pix_vid = rng.standard_normal((int(np.prod(video_grid)), patch_dim)).astype(np.float32)
    second_per_grid = np.array([1.0])

    with torch.no_grad():
        ref = qwen2_5_omni_hf_model.thinker(
            input_ids=torch.tensor(ids)[None],
            # Without an attention mask transformers falls back to 1-D positions.
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            input_features=torch.tensor(mel)[None],
            feature_attention_mask=torch.ones(1, frames, dtype=torch.long),
            pixel_values=torch.tensor(pix_img), image_grid_thw=torch.tensor([image_grid]),
            pixel_values_videos=torch.tensor(pix_vid), video_grid_thw=torch.tensor([video_grid]),
            video_second_per_grid=torch.tensor(second_per_grid),
        )

    audio = np.asarray(model.audio_tower.encode([mel]))
    image = np.asarray(model.visual.encode(pix_img, np.array([image_grid])))
    video = np.asarray(model.visual.encode(pix_vid, np.array([video_grid])))
    media = np.concatenate([audio, image, video])
    idx = media_index(ids, cfg, ("audio", "image", "video"))
    with open(os.path.join(qwen2_5_omni_hf_dir, "config.json")) as f:
        rope_cfg = RopeIndexConfig.from_hf(json.load(f))
    positions, _ = get_rope_index(ids, rope_cfg, image_grid_thw=np.array([image_grid]),
                                  video_grid_thw=np.array([video_grid]), audio_seqlens=np.array([frames]),
                                  second_per_grids=second_per_grid)
    logits, _ = _jax_logits(model, ids, positions, media, idx)
    err = np.abs(logits - ref.logits[0].numpy()).max()
    assert err <= TOL, err
