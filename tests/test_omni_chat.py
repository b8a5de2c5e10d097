"""An image + audio + video chat through OmniJax equals transformers (greedy, tiny checkpoint)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from omni_jax import OmniJax, SamplingParams
from omni_jax.config import load_pipeline_config
from omni_jax.inputs.qwen_tokenizer import build_qwen2_5_omni_tokenizer

pytestmark = pytest.mark.e2e


def media():
    img = Image.new("RGB", (84, 56), "white")
    ImageDraw.Draw(img).ellipse((10, 10, 50, 46), fill="red")
    t = np.arange(16000) / 16000.0
    tone = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    rng = np.random.default_rng(0)
    frames = [rng.integers(0, 255, (56, 56, 3), dtype=np.uint8) for _ in range(4)]
    return img, (tone, 16000), frames


def test_image_audio_video_chat_matches_transformers(converted_thinker_fp32, qwen2_5_omni_hf_model, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(converted_thinker_fp32, ckpt)
    build_qwen2_5_omni_tokenizer(str(ckpt))
    img, audio, frames = media()
    messages = [{"role": "user", "content": [
        {"type": "image", "image": img}, {"type": "audio", "audio": audio}, {"type": "video", "video": frames},
        {"type": "text", "text": "What do you see and hear?"}]}]
    pipeline = load_pipeline_config("qwen2_5_omni_tiny").with_overrides(thinker=dict(
        token_buckets=[16, 64], decode_buckets=[1, 4], max_num_seqs=4, max_model_len=1024, num_blocks=128,
        audio_chunk_buckets=[16], vision_patch_buckets=[64, 1152]))
    with OmniJax(model=str(ckpt), pipeline=pipeline) as omni:
        out = omni.generate({"messages": messages}, SamplingParams(temperature=0.0, max_tokens=6))[0]
        p = omni.processor.process({"messages": messages})
    assert out.error is None, out.error
    mm = p.multi_modal
    ids = torch.tensor(p.prompt_token_ids, dtype=torch.long)[None]
    feats = torch.tensor(np.concatenate(mm.audio_features, axis=1))[None]
    with torch.no_grad():
        ref = qwen2_5_omni_hf_model.thinker.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids),
            input_features=feats, feature_attention_mask=torch.ones(1, feats.shape[-1], dtype=torch.long),
            pixel_values=torch.tensor(mm.pixel_values), image_grid_thw=torch.tensor(mm.image_grid_thw),
            pixel_values_videos=torch.tensor(mm.pixel_values_videos), video_grid_thw=torch.tensor(mm.video_grid_thw),
            video_second_per_grid=torch.tensor(mm.video_second_per_grid),
            max_new_tokens=6, do_sample=False)[0, ids.shape[1]:].tolist()
    assert out.token_ids == ref
