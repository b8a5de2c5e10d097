"""The built-in tiny Qwen2.5-Omni: random weights made with numpy, no torch, no download.

`--model tiny` resolves here. The config keeps every structural feature of the real
model (GQA, q/k/v biases, M-RoPE sections, vision window + full attention, audio
chunking, the real vocabulary and special token ids) at toy sizes; the tests build
the same architecture with transformers for parity checks. The checkpoint is built
once into a cache directory and reused.
"""

from __future__ import annotations

import os
import sys

import numpy as np

from ...checkpoint import CONFIG_FILE
from ...inputs.qwen_tokenizer import build_qwen2_5_omni_tokenizer
from ...paths import cache_root
from ..random_checkpoint import write_random_checkpoint

# 6: the chat template writes an assistant's reasoning_content back; 5: it takes tools
# (inputs/chat_template.py); 4: weights drawn with numpy (`random_weights.random_params`)
# instead of flax's initializers
TINY_VERSION = 6
# <|endoftext|> and <|im_end|> end the reply, as in the released checkpoint's generation config.
TINY_GENERATION_CONFIG = {"eos_token_id": [151643, 151645], "pad_token_id": 151643}


def tiny_config() -> dict:
    """HF-style config.json contents of the tiny Qwen2.5-Omni (thinker, talker, token2wav)."""
    rope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]}
    ids = dict(audio_token_index=151646, image_token_index=151655, video_token_index=151656,
               audio_start_token_id=151647, audio_end_token_id=151648, vision_start_token_id=151652)
    tts = dict(tts_codec_start_token_id=8293, tts_codec_end_token_id=8294, tts_codec_pad_token_id=8292,
               tts_codec_mask_token_id=8296, tts_text_start_token_id=151860, tts_text_end_token_id=151861,
               tts_text_pad_token_id=151859)
    thinker = dict(
        text_config=dict(vocab_size=152064, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                         max_position_embeddings=4096, tie_word_embeddings=False, rope_parameters=rope),
        audio_config=dict(num_mel_bins=128, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
                          d_model=32, max_source_positions=1500, n_window=10, output_dim=64),
        vision_config=dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=4, in_channels=3,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           out_hidden_size=64, fullatt_block_indexes=[1, 3]),
        position_id_per_seconds=25, seconds_per_chunk=2, **ids)
    talker = dict(vocab_size=8448, embedding_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                  spatial_merge_size=2, rope_parameters=rope, **ids, **tts)
    dit = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, head_dim=16, ff_mult=2, emb_dim=16,
               block_size=24, look_ahead_layers=[1], look_backward_layers=[0], repeats=2, num_embeds=8193,
               mel_dim=80, enc_emb_dim=16, enc_dim=16, enc_channels=[32, 32, 32, 32, 96],
               enc_kernel_sizes=[5, 3, 3, 3, 1], enc_dilations=[1, 2, 3, 4, 1], enc_attention_channels=16,
               enc_se_channels=16, dropout=0.0)
    return dict(model_type="qwen2_5_omni", architectures=["Qwen2_5OmniForConditionalGeneration"],
                thinker_config=thinker, talker_config=talker,
                token2wav_config=dict(dit_config=dit, bigvgan_config=dict(mel_dim=80, upsample_initial_channel=128)),
                enable_audio_output=True)


def tiny_speakers(hf_config: dict, seed: int = 0) -> dict:
    """Two random voices shaped like the real ones (bos token, cond vector, reference mel)."""
    dit = hf_config["token2wav_config"]["dit_config"]
    rng = np.random.default_rng(seed)
    return {name: {"bos_token": bos, "cond": rng.standard_normal((1, dit["enc_emb_dim"])).astype(np.float32),
                   "ref_mel": rng.standard_normal((1, 40, dit["mel_dim"])).astype(np.float32)}
            for name, bos in (("Chelsie", 151870), ("Ethan", 151871))}


def default_cache_dir() -> str:
    return os.path.join(cache_root(), f"tiny-qwen2_5_omni-v{TINY_VERSION}")


def build_tiny_checkpoint(out_dir: str, seed: int = 0) -> str:
    """Write a random-initialised tiny checkpoint (OmniJax format, fp32) with a real Qwen tokenizer."""
    return build_random_checkpoint(out_dir, tiny_config(), seed=seed)


def build_random_checkpoint(out_dir: str, hf_config: dict, *, seed: int = 0, dtype: str = "float32",
                            store_weights: bool = True, tokenizer: bool = True) -> str:
    """Write a random Qwen2.5-Omni checkpoint of the sizes in `hf_config` (the tiny one, or the
    real 7B for the GPU check) with two random voices and the real Qwen tokenizer (`tokenizer`:
    False leaves it out, as a conversion of a directory without one does;
    `write_random_checkpoint` says how the weights are drawn)."""
    return write_random_checkpoint(out_dir, hf_config, seed=seed, dtype=dtype, store_weights=store_weights,
                                   generation_config=TINY_GENERATION_CONFIG,
                                   speakers=tiny_speakers(hf_config, seed),
                                   write_tokenizer=build_qwen2_5_omni_tokenizer if tokenizer else None)


def tiny_checkpoint(cache_dir: str | None = None) -> str:
    """Path of the tiny checkpoint, building it on first use."""
    path = cache_dir or default_cache_dir()
    if not os.path.isfile(os.path.join(path, CONFIG_FILE)):
        print(f"[omni-jax] building the tiny demo model in {path}", file=sys.stderr, flush=True)
        build_tiny_checkpoint(path)
    return path
