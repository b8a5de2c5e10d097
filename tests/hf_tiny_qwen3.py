"""A tiny random Qwen3-Omni (Qwen3OmniMoe) checkpoint built with transformers, for parity tests.

Toy sizes, real structure: every thinker text layer is MoE (8 experts, top-2,
renormalised), q/k RMSNorm, no attention bias, GQA 4 q / 2 kv heads,
interleaved M-RoPE; DeepStack on the first two thinker layers; an MoE talker with
a sigmoid-gated shared expert; a code predictor; a code2wav with the real 1920x
upsampling (12.5 Hz codes -> 24 kHz).

The thinker keeps the REAL vocabulary size (152064) and the real special token ids,
so the real Qwen tokenizer fits the tiny thinker and no id needs remapping
(embeddings cost 2 x 152064 x 64 floats, as in the tiny Qwen2.5-Omni). The talker
keeps the real codebook (2048) and codec vocabulary (3072 = 2048 + 1024: generate
suppresses the top 1024 ids except eos), so the real codec ids (pad 2148, bos 2149,
eos 2150, nothink/think 2155-2157, speakers 2301-2303) are valid.

Deviations from the real sizes that matter to tests (written down so nobody
mistakes them for real values): 4 code groups instead of 16 (talker `num_code_groups`
= code predictor `num_code_groups` = code2wav `num_quantizers`); audio attention
window `n_window_infer` 200 instead of 800 (so a few seconds of audio already span
several windows); `accept_hidden_layer` 2 of 3 thinker layers (real 24 of 48).

Pitfalls handled (QWEN_NOTES.md): the talker's fused experts are left uninitialised
by transformers (garbage or NaN) and every router starts at zero, so all MoE
weights are drawn here; fields that transformers reads but the config classes do
not declare are set (talker `spatial_merge_size`, talker text
`shared_expert_intermediate_size`, thinker `vision_start_token_id`); after
loading, the talker config gets the thinker's `audio_config` (read by the
talker's rope index when the prompt has audio).
"""

from __future__ import annotations

# Real Qwen3-Omni ids (QWEN_NOTES.md and the released config.json).
VOCAB = 152064
ENDOFTEXT = 151643
IM_START = 151644
IM_END = 151645
VISION_START = 151652
VISION_END = 151653
IMAGE_TOKEN = 151655
VIDEO_TOKEN = 151656
AUDIO_START = 151669
AUDIO_END = 151670
TTS_PAD = 151671
TTS_BOS = 151672
TTS_EOS = 151673
AUDIO_TOKEN = 151675
SYSTEM_TOKEN = 8948
USER_TOKEN = 872
ASSISTANT_TOKEN = 77091

CODEBOOK = 2048
TALKER_VOCAB = CODEBOOK + 1024
CODEC_PAD, CODEC_BOS, CODEC_EOS = 2148, 2149, 2150
CODEC_NOTHINK, CODEC_THINK_BOS, CODEC_THINK_EOS = 2155, 2156, 2157
SPEAKERS = {"chelsie": 2301, "ethan": 2302, "aiden": 2303}
NUM_CODE_GROUPS = 4

# Std of the MoE weights drawn here (experts and routers of thinker and talker).
# Larger than initializer_range (0.02) on purpose: the experts then contribute as
# much as attention to the residual stream and router logits are spread enough
# (std ~0.8) that top-k choices are not decided by float rounding, so a routing or
# expert-weight bug shows up well above the 1e-4 parity tolerance.
MOE_INIT_STD = 0.1


def qwen3_omni_config_dict() -> dict:
    """Keyword arguments of `Qwen3OmniMoeConfig` for the tiny model (plain dicts, JSON-able)."""
    # head_dim 16 -> 8 rotary bands; interleaved M-RoPE puts H on bands 1,4,..<3*s_h and
    # W on 2,5,..<3*s_w, T on the rest, so it needs 3*s_h - 2 < 8 and 3*s_w - 1 < 8:
    # [4, 2, 2] keeps the real layout's shape (H == W, T also owning a contiguous tail).
    # [2, 3, 3] would ask for W band 8, which transformers silently drops (it slices).
    mrope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 2, 2],
             "interleaved": True, "mrope_interleaved": True}
    text = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_act="silu",
        max_position_embeddings=4096, rms_norm_eps=1e-6, rope_parameters=mrope,
        attention_bias=False, decoder_sparse_step=1, mlp_only_layers=[],
        moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        tie_word_embeddings=False,
    )
    audio = dict(
        num_mel_bins=128, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
        d_model=32, max_source_positions=1500, n_window=50, n_window_infer=200,
        conv_chunksize=500, downsample_hidden_size=8, output_dim=64,
        activation_function="gelu",
    )
    vision = dict(
        depth=3, hidden_size=32, hidden_act="gelu_pytorch_tanh", intermediate_size=64,
        num_heads=2, in_channels=3, patch_size=16, spatial_merge_size=2,
        temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=2304,
        deepstack_visual_indexes=[1, 2],
    )
    thinker = dict(
        text_config=text, audio_config=audio, vision_config=vision,
        audio_token_id=AUDIO_TOKEN, image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN,
        audio_start_token_id=AUDIO_START, audio_end_token_id=AUDIO_END,
        vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
        user_token_id=USER_TOKEN, position_id_per_seconds=13, seconds_per_chunk=2,
        tie_word_embeddings=False,
    )
    talker_text = dict(
        vocab_size=TALKER_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_act="silu",
        max_position_embeddings=4096, rms_norm_eps=1e-6, rope_parameters=dict(mrope),
        attention_bias=False, decoder_sparse_step=1, mlp_only_layers=[],
        moe_intermediate_size=16, shared_expert_intermediate_size=32,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False,
    )
    code_predictor = dict(
        vocab_size=CODEBOOK, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_act="silu",
        max_position_embeddings=4096, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        num_code_groups=NUM_CODE_GROUPS, tie_word_embeddings=False,
    )
    talker = dict(
        text_config=talker_text, code_predictor_config=code_predictor,
        num_code_groups=NUM_CODE_GROUPS, thinker_hidden_size=64, accept_hidden_layer=2,
        codec_eos_token_id=CODEC_EOS, codec_nothink_id=CODEC_NOTHINK,
        codec_think_bos_id=CODEC_THINK_BOS, codec_think_eos_id=CODEC_THINK_EOS,
        codec_pad_id=CODEC_PAD, codec_bos_id=CODEC_BOS,
        audio_token_id=AUDIO_TOKEN, image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN,
        vision_start_token_id=VISION_START, audio_start_token_id=AUDIO_START,
        audio_end_token_id=AUDIO_END, position_id_per_seconds=13, seconds_per_chunk=2,
        speaker_id=dict(SPEAKERS), spatial_merge_size=2, tie_word_embeddings=False,
    )
    code2wav = dict(
        codebook_size=CODEBOOK, hidden_size=32, max_position_embeddings=8000,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        num_attention_heads=2, num_key_value_heads=2, attention_bias=False, sliding_window=72,
        intermediate_size=64, hidden_act="silu", layer_scale_initial_scale=0.01, rms_norm_eps=1e-5,
        num_hidden_layers=2, num_quantizers=NUM_CODE_GROUPS, upsample_rates=[8, 5, 4, 3],
        upsampling_ratios=[2, 2], decoder_dim=32,
    )
    return dict(
        thinker_config=thinker, talker_config=talker, code2wav_config=code2wav,
        enable_audio_output=True, im_start_token_id=IM_START, im_end_token_id=IM_END,
        tts_pad_token_id=TTS_PAD, tts_bos_token_id=TTS_BOS, tts_eos_token_id=TTS_EOS,
        system_token_id=SYSTEM_TOKEN, user_token_id=USER_TOKEN, assistant_token_id=ASSISTANT_TOKEN,
    )


def _assert_finite(model) -> None:
    import torch

    for name, p in model.state_dict().items():
        if p.is_floating_point() and not torch.isfinite(p).all():
            raise AssertionError(f"tiny checkpoint parameter {name} is not finite")


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
    _assert_finite(model)
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
    _assert_finite(model)
    return model


def text_prompt_ids(user_text_ids=(9707, 11, 1879, 0)) -> list[int]:
    """A chat prompt in token ids (system, user turn, open assistant turn) with real Qwen ids.

    Default user text is "Hello, world!"; "\\n" is 198.
    """
    nl = 198
    return ([IM_START, SYSTEM_TOKEN, nl, 2610, 525, 264, 10950, 17847, 13, IM_END, nl,
             IM_START, USER_TOKEN, nl, *user_text_ids, IM_END, nl, IM_START, ASSISTANT_TOKEN, nl])
