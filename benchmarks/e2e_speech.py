"""Text-to-speech end to end: OmniJax (async chunk off and on) vs transformers on the same small random model.

    python benchmarks/e2e_speech.py [--family qwen2_5_omni|qwen3_omni] [--requests 16]
                                    [--thinker-tokens 16] [--talker-tokens 64] [--concurrency 1 4 16]
                                    [--initial-chunk-frames N] [--chunk-frames N]

Both sides answer the same 16 prompts with text and 24 kHz speech: greedy thinker,
greedy talker (repetition penalty 1.05), then the vocoder.
* OmniJax: three stage processes through `AsyncOmniJax`, two engines started side by side,
  one with async chunk off (each stage waits for the whole output of the one before), one
  with it on (the talker starts while the thinker writes, audio comes in codec chunks). At
  each concurrency (requests in flight at once) the same prompts run off, then on, on an
  otherwise idle machine; prints req/s, mean and p90 time to first audio (TTFA, and its
  share of the request), mean real-time factor (processing time / audio seconds) and playback
  stalls (a listener who starts at the first chunk waits for a later one: how often, how long).
* transformers: `generate(return_audio=True)` one request at a time (its time to first
  audio is the whole request: it does not stream), and on left-padded batches (its batched
  path) of 4, 8 and 16, the fastest compared; CPU threads = cores.
The Qwen2.5 model is a random Qwen2.5-Omni a few times larger than the test one (its vocoder
embeds the whole talker vocabulary, so random codec ids cannot crash transformers).
`--family qwen3_omni`: the same with a small random Qwen3-Omni (benchmarks/speech_qwen3.py:
MoE thinker and talker, 16 code groups, code2wav), chat prompts, voice "ethan".
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

from speech_serving import fastest_hf_batching, hf_latency, serve_speech

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def small_config() -> dict:
    import hf_tiny

    cfg = hf_tiny.qwen2_5_omni_config_dict()
    text = cfg["thinker_config"]["text_config"]
    text.update(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=4)
    text["rope_parameters"]["mrope_section"] = [4, 6, 6]
    cfg["thinker_config"]["audio_config"]["output_dim"] = 256
    cfg["thinker_config"]["vision_config"]["out_hidden_size"] = 256
    talker = cfg["talker_config"]
    talker.update(embedding_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    talker["rope_parameters"] = dict(talker["rope_parameters"], mrope_section=[4, 6, 6])
    cfg["token2wav_config"]["dit_config"].update(num_embeds=8448, hidden_size=64, num_hidden_layers=4,
                                                 num_attention_heads=4, head_dim=16)
    return cfg


def build(tmp: str) -> tuple[str, str]:
    """Random HF checkpoint (saved with transformers) and its OmniJax conversion."""
    import torch
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration

    import hf_tiny
    from conversion.convert import convert

    torch.manual_seed(0)
    model = Qwen2_5OmniForConditionalGeneration(Qwen2_5OmniConfig(**small_config())).eval().float()
    hf_dir = os.path.join(tmp, "hf")
    model.generation_config.eos_token_id = [hf_tiny.ENDOFTEXT, hf_tiny.IM_END]  # the thinker's end ids
    model.save_pretrained(hf_dir)
    hf_tiny._write_speakers(hf_dir, small_config()["token2wav_config"]["dit_config"])
    out = convert(hf_dir, os.path.join(tmp, "omni"), dtype="float32", progress=False)
    return hf_dir, out


def run_transformers(hf_dir, prompts, thinker_tokens, talker_tokens, batches):
    """transformers at its fastest batching, then one request at a time: ((seconds, audio s, RTFs), latencies)."""
    import torch
    from transformers import Qwen2_5OmniForConditionalGeneration

    torch.set_num_threads(os.cpu_count())
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(hf_dir, dtype="float32").eval()
    return (fastest_hf_batching(model, prompts, "Chelsie", thinker_tokens, talker_tokens, batches),
            hf_latency(model, prompts, "Chelsie", thinker_tokens, talker_tokens))


def omnijax_setup(n, thinker_tokens, talker_tokens):
    """(pipeline, per-stage sampling params, voice) for n requests in flight."""
    from omni_jax import SamplingParams
    from omni_jax.config import load_pipeline_config

    pipeline = load_pipeline_config("qwen2_5_omni_tiny").with_overrides(
        thinker=dict(max_num_seqs=n, decode_buckets=sorted({1, 4, n}), token_buckets=[16, 64, 1024],
                     max_num_batched_tokens=1024, hidden_layers=[0, 4]),
        talker=dict(max_num_seqs=n, decode_buckets=sorted({1, 4, n}), token_buckets=[16, 64, 1024],
                    max_num_batched_tokens=1024, num_blocks=n * (1024 // 16) + 1),
        token2wav=dict(max_num_seqs=n, decode_buckets=[1, 4, 8], token_buckets=[talker_tokens],
                       max_num_batched_tokens=n * talker_tokens))
    params = [SamplingParams(temperature=0.0, max_tokens=thinker_tokens, ignore_eos=True),
              SamplingParams(temperature=0.0, repetition_penalty=1.05, max_tokens=talker_tokens), None]
    return pipeline, params, "Chelsie"


def _row(label: str, r: dict, n: int) -> str:
    ttfa, e2e = np.array(r["ttfa"]), np.array(r["e2e"])
    return (f"{label:28s} {n / r['seconds']:6.2f} req/s  TTFA mean {ttfa.mean():5.2f}s p90 {np.percentile(ttfa, 90):5.2f}s"
            f"  ({100 * np.mean(ttfa / e2e):3.0f}% of request)  mean RTF {np.mean(r['rtf']):5.2f}"
            f"  playback stalls {np.mean(np.array(r['stall']) > 0):4.0%} of requests, mean {np.mean(r['stall']):5.3f}s")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=("qwen2_5_omni", "qwen3_omni"), default="qwen2_5_omni")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--thinker-tokens", type=int, default=16)
    ap.add_argument("--talker-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16],
                    help="requests in flight at once (each run with async chunk off, then on)")
    ap.add_argument("--initial-chunk-frames", type=int, default=None,
                    help="the vocoder's first streamed chunk in codec frames (default: the preset's)")
    ap.add_argument("--chunk-frames", type=int, default=None,
                    help="the vocoder's steady streamed chunk in codec frames (default: the preset's)")
    ap.add_argument("--hf-batch", type=int, nargs="+", default=[4, 8, 16],
                    help="transformers batch sizes to try; the fastest is compared")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    if args.family == "qwen3_omni":
        import speech_qwen3 as family

        prompts = [family.chat(rng, int(rng.integers(8, 40))) for _ in range(args.requests)]
    else:
        family = sys.modules[__name__]
        prompts = [rng.integers(0, 151000, int(rng.integers(8, 40))).tolist() for _ in range(args.requests)]
    n = args.requests
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir, ckpt = family.build(tmp)
        pipeline, params, voice = family.omnijax_setup(n, args.thinker_tokens, args.talker_tokens)
        chunks = dict(initial_codec_chunk_frames=args.initial_chunk_frames, codec_chunk_frames=args.chunk_frames)
        chunks = {k: v for k, v in chunks.items() if v is not None}
        if chunks:
            pipeline = pipeline.with_overrides(**{pipeline.stages[-1].name: chunks})
        results = run_both(ckpt, prompts, (pipeline, params, voice), args.concurrency)
        (dt_h, sec_h, rtf_h), lat_h = family.run_transformers(hf_dir, prompts, args.thinker_tokens,
                                                              args.talker_tokens, args.hf_batch)
    print(f"{args.family}: {n} text+speech requests, thinker {args.thinker_tokens} tokens, talker <= "
          f"{args.talker_tokens} codes, CPU ({os.cpu_count()} cores), fp32")
    for c in args.concurrency:
        for mode in ("off", "on"):
            print(_row(f"omnijax c={c:<2d} async_chunk {mode}", results[c, mode], n))
        ratio = np.mean(results[c, "on"]["ttfa"]) / np.mean(results[c, "off"]["ttfa"])
        print(f"{'':28s} TTFA on / off: {ratio:.2f}; req/s on / off: "
              f"{results[c, 'off']['seconds'] / results[c, 'on']['seconds']:.2f}")
    print(f"transformers, one at a time: {n / sum(lat_h):6.2f} req/s  TTFA mean {np.mean(lat_h):5.2f}s "
          f"p90 {np.percentile(lat_h, 90):5.2f}s (the whole request: no streaming)")
    print(f"transformers, fastest batching: {n / dt_h:6.2f} req/s  audio {sum(sec_h):6.1f}s  mean RTF {np.mean(rtf_h):.2f}")
    best = min(results.values(), key=lambda r: r["seconds"])
    print(f"ratio omnijax (best run) / transformers (fastest batching), req/s: {dt_h / best['seconds']:.2f}x; "
          f"TTFA at c=1, omnijax async_chunk on / transformers one at a time: "
          f"{np.mean(results[min(args.concurrency), 'on']['ttfa']) / np.mean(lat_h):.2f}")


def run_both(ckpt, prompts, setup, concurrencies) -> dict:
    """Both engines (async chunk off and on) started, then each concurrency run off then on."""
    from omni_jax import AsyncOmniJax

    pipeline, params, voice = setup
    engines = {mode: AsyncOmniJax(model=ckpt, pipeline=pipeline, output_modalities=["text", "audio"],
                                  async_chunk=mode == "on") for mode in ("off", "on")}
    try:
        for omni in engines.values():  # warm: the first requests pay one-time costs
            serve_speech(omni, prompts[:2], params, voice, 2)
        return {(c, mode): serve_speech(omni, prompts, params, voice, c)
                for c in concurrencies for mode, omni in engines.items()}
    finally:
        for omni in engines.values():
            omni.shutdown()


if __name__ == "__main__":
    main()
