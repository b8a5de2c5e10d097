"""A tiny random Qwen3-Omni (Qwen3OmniMoe) checkpoint built with transformers, for parity tests.

The architecture, its sizes and the real ids it keeps are the package's built-in tiny
Qwen3-Omni (`omni_jax/models/qwen3_omni/tiny.py`, whose docstring lists the deviations from
the real sizes); here transformers builds it, for the parity tests.

Pitfalls handled (QWEN_NOTES.md): the talker's fused experts are left uninitialised
by transformers (garbage or NaN) and every router starts at zero, so all MoE
weights are drawn here; fields that transformers reads but the config classes do
not declare are set (talker `spatial_merge_size`, talker text
`shared_expert_intermediate_size`, thinker `vision_start_token_id`); after
loading, the talker config gets the thinker's `audio_config` (read by the
talker's rope index when the prompt has audio).
"""

from __future__ import annotations

from hf_tiny import assert_finite

# The sizes and the real ids the tiny model keeps are the package's (its docstring says which).
from omni_jax.models.qwen3_omni.tiny import (  # noqa: F401 (re-exported for the tests)
    ASSISTANT_TOKEN, AUDIO_END, AUDIO_START, AUDIO_TOKEN, CODEBOOK, CODEC_BOS, CODEC_EOS, CODEC_NOTHINK,
    CODEC_PAD, CODEC_THINK_BOS, CODEC_THINK_EOS, ENDOFTEXT, IM_END, IM_START, IMAGE_TOKEN, NUM_CODE_GROUPS,
    SPEAKERS, SYSTEM_TOKEN, TALKER_VOCAB, TTS_BOS, TTS_EOS, TTS_PAD, USER_TOKEN, VIDEO_TOKEN, VISION_END,
    VISION_START, VOCAB, tiny_config)

# Std of the MoE weights drawn here (experts and routers of thinker and talker).
# Larger than initializer_range (0.02) on purpose: the experts then contribute as
# much as attention to the residual stream and router logits are spread enough
# (std ~0.8) that top-k choices are not decided by float rounding, so a routing or
# expert-weight bug shows up well above the 1e-4 parity tolerance.
MOE_INIT_STD = 0.1


def qwen3_omni_config_dict() -> dict:
    """Keyword arguments of `Qwen3OmniMoeConfig` for the tiny model: the package's built-in tiny one."""
    cfg = tiny_config()
    for key in ("model_type", "architectures"):
        cfg.pop(key)
    return cfg


def _randomise(model, seed: int) -> None:
    """Draw every weight transformers leaves empty or constant, from a seeded generator."""
    import torch

    g = torch.Generator().manual_seed(seed + 1)

    def normal(p, std, mean=0.0):
        p.copy_(mean + std * torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype))

    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.is_floating_point():
                continue
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")) or (
                    name.endswith("mlp.gate.weight") and p.dim() == 2):
                # Fused experts (talker ones are uninitialised memory) and routers (zeros).
                normal(p, MOE_INIT_STD)
            elif name.endswith("weight") and ("norm" in name or "ln_" in name):
                # Norm scales start at exactly one: perturb them so parity checks see them.
                normal(p, 0.1, mean=1.0)
            elif name.endswith("bias"):
                normal(p, 0.02)
            elif name.endswith((".alpha", ".beta", ".gamma")):
                # SnakeBeta log-scales start at zero and ConvNeXt layer scales at 1e-6.
                normal(p, 0.1)


def build_qwen3_omni(path: str, seed: int = 0, config_dict: dict | None = None) -> str:
    """Build, check and save (`save_pretrained`) a random Qwen3-Omni checkpoint under `path`
    (the tiny one unless `config_dict` gives other sizes)."""
    import torch
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    torch.manual_seed(seed)
    config = Qwen3OmniMoeConfig(**(config_dict or qwen3_omni_config_dict()))
    model = Qwen3OmniMoeForConditionalGeneration(config).eval().float()
    _randomise(model, seed)
    assert_finite(model)
    # As the released checkpoint's generation_config.json: the thinker ends at either id.
    model.generation_config.eos_token_id = [ENDOFTEXT, IM_END]
    model.save_pretrained(path)
    return path


def load_qwen3_omni(path: str):
    """The HF reference model from a tiny checkpoint directory (fp32, eval), ready for `generate`."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(path, dtype="float32").eval()
    # The talker's rope index reads `config.audio_config.n_window` when the prompt has audio;
    # the talker config has no such field (QWEN_NOTES pitfall), the thinker's is the one meant.
    model.talker.config.audio_config = model.thinker.config.audio_config
    assert_finite(model)
    return model


def text_prompt_ids(user_text_ids=(9707, 11, 1879, 0)) -> list[int]:
    """A chat prompt in token ids (system, user turn, open assistant turn) with real Qwen ids.

    Default user text is "Hello, world!"; "\\n" is 198.
    """
    nl = 198
    return ([IM_START, SYSTEM_TOKEN, nl, 2610, 525, 264, 10950, 17847, 13, IM_END, nl,
             IM_START, USER_TOKEN, nl, *user_text_ids, IM_END, nl, IM_START, ASSISTANT_TOKEN, nl])
