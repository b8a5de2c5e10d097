"""Tiny random Qwen-Omni checkpoints built with transformers, for parity tests.

The sizes are small enough for CPU tests but keep every structural feature of the
real models: GQA (4 q heads / 2 kv heads), q/k/v biases, M-RoPE sections summing to
head_dim/2, vision window attention plus full-attention blocks, several audio chunks,
the real Qwen2.5-Omni vocabulary size and special token ids (so the real tokenizer
fits the tiny thinker).
"""

from __future__ import annotations

import os

import numpy as np

# Real Qwen2.5-Omni special ids (QWEN_NOTES.md).
AUDIO_TOKEN = 151646
AUDIO_START = 151647
AUDIO_END = 151648
VISION_START = 151652
VISION_END = 151653
IMAGE_TOKEN = 151655
VIDEO_TOKEN = 151656
IM_START = 151644
IM_END = 151645
ENDOFTEXT = 151643
VOCAB = 152064

def qwen2_5_omni_config_dict() -> dict:
    """Config kwargs of the tiny Qwen2.5-Omni: the package's built-in tiny architecture."""
    from omni_jax.models.qwen2_5_omni.tiny import tiny_config

    cfg = tiny_config()
    for key in ("model_type", "architectures"):
        cfg.pop(key)
    return cfg


def assert_finite(model) -> None:
    """AssertionError naming the first parameter of a transformers model that is not finite."""
    import torch

    for name, p in model.state_dict().items():
        if p.is_floating_point() and not torch.isfinite(p).all():
            raise AssertionError(f"tiny checkpoint parameter {name} is not finite")


def _write_speakers(path: str, dit_cfg: dict) -> None:
    """A small spk_dict.pt: two voices with a bos token, a cond vector and a reference mel."""
    import torch

    g = torch.Generator().manual_seed(7)
    speakers = {}
    for name, bos in (("Chelsie", 151870), ("Ethan", 151871)):
        speakers[name] = {
            "bos_token": bos,
            "cond": torch.randn(1, dit_cfg["enc_emb_dim"], generator=g),
            "ref_mel": torch.randn(1, 40, dit_cfg["mel_dim"], generator=g),
        }
    torch.save(speakers, os.path.join(path, "spk_dict.pt"))


def build_qwen2_5_omni(path: str, seed: int = 0) -> str:
    """Build, check and save a tiny random Qwen2.5-Omni checkpoint under `path`."""
    import torch
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration

    torch.manual_seed(seed)
    cfg_dict = qwen2_5_omni_config_dict()
    config = Qwen2_5OmniConfig(**cfg_dict)
    model = Qwen2_5OmniForConditionalGeneration(config).eval().float()
    # Random init leaves some weights at exactly zero or one (norms, biases); perturb
    # every floating parameter a little so parity tests exercise each one.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.is_floating_point():
                if name.endswith(("norm.weight", "layernorm.weight", "ln_q.weight", "ln_post.weight")) or ".norm" in name:
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
                elif name.endswith("bias"):
                    p.copy_(0.02 * torch.randn_like(p))
    assert_finite(model)
    # As the released checkpoint's generation_config.json: the thinker ends at either id.
    model.generation_config.eos_token_id = [ENDOFTEXT, IM_END]
    model.save_pretrained(path)
    _write_speakers(path, cfg_dict["token2wav_config"]["dit_config"])
    return path


def load_qwen2_5_omni(path: str):
    """Load the full HF model from a tiny checkpoint directory (fp32, eval)."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    return Qwen2_5OmniForConditionalGeneration.from_pretrained(path, dtype="float32").eval()


def random_mel(num_frames: int, seed: int = 0) -> np.ndarray:
    """A log-mel-like input [128, num_frames] for the audio encoder."""
    return np.random.default_rng(seed).standard_normal((128, num_frames)).astype(np.float32)
