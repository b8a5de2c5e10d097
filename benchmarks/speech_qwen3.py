"""The Qwen3-Omni side of benchmarks/e2e_speech.py: model, transformers run, OmniJax run.

A random Qwen3-Omni a few times larger than the test one, with the real 16 code groups
(so the code predictor does its real 15 steps per talker step): thinker 4 MoE layers of
hidden 256, talker 4 MoE layers of hidden 128, code predictor 2 layers, code2wav 2 layers.
"""

from __future__ import annotations

import os


def small_config() -> dict:
    import hf_tiny_qwen3

    cfg = hf_tiny_qwen3.qwen3_omni_config_dict()
    thinker = cfg["thinker_config"]
    thinker["text_config"].update(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                  num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                                  moe_intermediate_size=128)
    thinker["text_config"]["rope_parameters"] = dict(thinker["text_config"]["rope_parameters"],
                                                     mrope_section=[8, 4, 4])
    thinker["audio_config"]["output_dim"] = 256
    thinker["vision_config"]["out_hidden_size"] = 256
    talker = cfg["talker_config"]
    talker.update(num_code_groups=16, thinker_hidden_size=256, accept_hidden_layer=2)
    talker["text_config"].update(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                 head_dim=32, moe_intermediate_size=64, shared_expert_intermediate_size=128)
    talker["text_config"]["rope_parameters"] = dict(talker["text_config"]["rope_parameters"],
                                                    mrope_section=[8, 4, 4])
    talker["code_predictor_config"].update(hidden_size=128, intermediate_size=256, head_dim=32,
                                           num_code_groups=16)
    cfg["code2wav_config"].update(num_quantizers=16, hidden_size=64, decoder_dim=64)
    return cfg


def build(tmp: str) -> tuple[str, str]:
    """Random HF checkpoint (saved with transformers) and its OmniJax conversion."""
    import hf_tiny_qwen3
    from conversion.convert import convert

    hf_dir = hf_tiny_qwen3.build_qwen3_omni(os.path.join(tmp, "hf"), config_dict=small_config())
    return hf_dir, convert(hf_dir, os.path.join(tmp, "omni"), dtype="float32", progress=False)


def chat(rng, n: int) -> list[int]:
    """A chat prompt (system, user turn of n random tokens, open assistant turn)."""
    import hf_tiny_qwen3

    return hf_tiny_qwen3.text_prompt_ids(tuple(rng.integers(0, 151000, n).tolist()))


def run_transformers(hf_dir, prompts, thinker_tokens, talker_tokens, batches):
    """transformers at its fastest batching, then one request at a time: ((seconds, audio s, RTFs), latencies)."""
    import torch

    import hf_tiny_qwen3
    from speech_serving import fastest_hf_batching, hf_latency

    torch.set_num_threads(os.cpu_count())
    model = hf_tiny_qwen3.load_qwen3_omni(hf_dir)
    return (fastest_hf_batching(model, prompts, "ethan", thinker_tokens, talker_tokens, batches),
            hf_latency(model, prompts, "ethan", thinker_tokens, talker_tokens))


def omnijax_setup(n, thinker_tokens, talker_tokens):
    """(pipeline, per-stage sampling params, voice) for n requests in flight."""
    from omni_jax import SamplingParams
    from omni_jax.config import load_pipeline_config

    pipeline = load_pipeline_config("qwen3_omni_tiny").with_overrides(
        thinker=dict(max_num_seqs=n, decode_buckets=sorted({1, 4, n}), token_buckets=[16, 64, 1024],
                     max_num_batched_tokens=1024, audio_chunk_buckets=[1], vision_patch_buckets=[64]),
        talker=dict(max_num_seqs=n, decode_buckets=sorted({1, 4, n}), token_buckets=[16, 64, 1024],
                    max_num_batched_tokens=1024, max_model_len=256, num_blocks=n * (256 // 16) + 1),
        # Small windows too: a streamed chunk is decoded padded to the next bucket.
        code2wav=dict(max_num_seqs=n, decode_buckets=[1, 4, 8], token_buckets=sorted({16, 32, talker_tokens}),
                      max_model_len=talker_tokens, max_num_batched_tokens=n * talker_tokens))
    params = [SamplingParams(temperature=0.0, max_tokens=thinker_tokens, ignore_eos=True),
              SamplingParams(temperature=0.0, repetition_penalty=1.05, max_tokens=talker_tokens), None]
    return pipeline, params, "ethan"
