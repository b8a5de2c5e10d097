"""The built-in tiny Qwen3-Omni: random weights made with numpy, no torch, no download.

`--model tiny-qwen3_omni` resolves here, and the suite uses it where torch (the reference)
is absent. Toy sizes, real structure: every thinker text layer is MoE (8 experts, top-2,
renormalised), q/k RMSNorm, no attention bias, GQA 4 q / 2 kv heads, interleaved M-RoPE;
DeepStack on the first two thinker layers; an MoE talker with a sigmoid-gated shared expert;
a code predictor; a code2wav with the real 1920x upsampling (12.5 Hz codes -> 24 kHz).

The thinker keeps the REAL vocabulary size (152064) and the real special token ids, so the
real Qwen tokenizer fits the tiny thinker and no id needs remapping. The talker keeps the real
codebook (2048) and codec vocabulary (3072 = 2048 + 1024: generate suppresses the top 1024
ids except eos), so the real codec ids (pad 2148, bos 2149, eos 2150, nothink/think
2155-2157, speakers 2301-2303) are valid.

Deviations from the real sizes that matter to tests (written down so nobody mistakes them
for real values): 4 code groups instead of 16 (talker `num_code_groups` = code predictor
`num_code_groups` = code2wav `num_quantizers`); audio attention window `n_window_infer` 200
instead of 800 (so a few seconds of audio already span several windows);
`accept_hidden_layer` 2 of 3 thinker layers (real 24 of 48).
"""

from __future__ import annotations

import os
import sys

from ...checkpoint import CONFIG_FILE
from ...inputs.qwen_tokenizer import build_qwen3_omni_tokenizer
from ...paths import cache_root
from ..random_checkpoint import write_random_checkpoint

# 2: the built-in model has the Qwen3-Omni tokenizer (chat prompts, the server's realtime API).
TINY_VERSION = 3  # 3: the tokenizer's function-calling tags are plain tokens, as in Qwen3

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

# As the released checkpoint's generation_config.json: the thinker ends at either id.
TINY_GENERATION_CONFIG = {"eos_token_id": [ENDOFTEXT, IM_END], "pad_token_id": ENDOFTEXT}


def tiny_config() -> dict:
    """HF-style config.json contents of the tiny Qwen3-Omni (thinker, talker, code2wav)."""
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
        model_type="qwen3_omni_moe", architectures=["Qwen3OmniMoeForConditionalGeneration"],
        thinker_config=thinker, talker_config=talker, code2wav_config=code2wav,
        enable_audio_output=True, im_start_token_id=IM_START, im_end_token_id=IM_END,
        tts_pad_token_id=TTS_PAD, tts_bos_token_id=TTS_BOS, tts_eos_token_id=TTS_EOS,
        system_token_id=SYSTEM_TOKEN, user_token_id=USER_TOKEN, assistant_token_id=ASSISTANT_TOKEN,
    )


def default_cache_dir() -> str:
    return os.path.join(cache_root(), f"tiny-qwen3_omni-v{TINY_VERSION}")


def build_tiny_checkpoint(out_dir: str, seed: int = 0, tokenizer: bool = False) -> str:
    """Write a random-initialised tiny checkpoint (OmniJax format, fp32); with `tokenizer`, the
    Qwen3-Omni tokenizer's files too (without, it is like a conversion of a checkpoint that
    has none: prompts must then be token ids)."""
    return write_random_checkpoint(out_dir, tiny_config(), seed=seed, generation_config=TINY_GENERATION_CONFIG,
                                   write_tokenizer=build_qwen3_omni_tokenizer if tokenizer else None)


def tiny_checkpoint(cache_dir: str | None = None) -> str:
    """Path of the tiny checkpoint, building it on first use."""
    path = cache_dir or default_cache_dir()
    if not os.path.isfile(os.path.join(path, CONFIG_FILE)):
        print(f"[omni-jax] building the tiny Qwen3-Omni model in {path}", file=sys.stderr, flush=True)
        build_tiny_checkpoint(path, tokenizer=True)
    return path
