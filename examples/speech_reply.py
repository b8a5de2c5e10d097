"""A chat turn answered with text and speech: thinker -> talker -> token2wav.

    python examples/speech_reply.py                   # the built-in tiny random model
    python examples/speech_reply.py --model ckpt/qwen2_5_omni_7b --voice Ethan --out reply.wav

Writes the spoken reply to a WAV file (24 kHz mono) and prints the latency metrics:
time to first token, time to first audio and the real-time factor (processing time /
audio duration, below 1 is faster than real time). `--model tiny` (the default) is a
random model, so the "speech" is noise; a checkpoint converted with `omni-jax convert`
speaks. The notebook speech_reply.ipynb walks through the same steps and plays the audio.
"""

from __future__ import annotations

import argparse

from omni_jax import OmniJax, SamplingParams
from omni_jax.models.qwen2_5_omni.voices import Voices


def small_pipeline(model: str):
    """For the tiny model, the three stages with one shape bucket per step (quick warm-up) and a
    talker capped at 40 codec tokens; None (the checkpoint's default pipeline) otherwise."""
    if model != "tiny":
        return None
    from omni_jax.config import load_pipeline_config

    one = dict(max_num_seqs=1, token_buckets=[64], decode_buckets=[1])
    return load_pipeline_config("qwen2_5_omni_tiny").with_overrides(
        thinker=dict(**one, audio_chunk_buckets=[1], vision_patch_buckets=[64]),
        talker=dict(**one, default_sampling=dict(temperature=0.0, repetition_penalty=1.05, max_tokens=40)),
        token2wav=dict(token_buckets=[48], decode_buckets=[1], max_num_seqs=1, max_num_batched_tokens=48))


def speak(model: str, voice: str | None, max_tokens: int, out_path: str):
    """One spoken reply; returns the finished OmniRequestOutput."""
    print("voices:", ", ".join(Voices.load(_checkpoint(model)).names))
    messages = [{"role": "user", "content": "Say hello and tell me a fun fact about owls."}]
    # The first SamplingParams is the thinker's (the text); the talker and the vocoder keep the
    # pipeline's defaults. Chat messages without a system message get Qwen's speech system prompt.
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    with OmniJax(model=model, pipeline=small_pipeline(model), output_modalities=["text", "audio"]) as omni:
        out = omni.generate({"messages": messages}, sampling_params=params,
                            output_modalities=["text", "audio"], voice=voice)[0]
    if out.error:
        raise RuntimeError(out.error)
    print(f"text: {out.text!r}")
    m = out.metrics
    print(f"audio: {m.audio_seconds:.2f} s at {out.sample_rate} Hz ({len(out.stage_token_ids.get('talker', []))} "
          f"codec tokens)")
    print(f"TTFT {1e3 * m.ttft:.0f} ms | time to first audio {1e3 * m.time_to_first_audio:.0f} ms | "
          f"RTF {m.rtf:.2f} | total {m.e2e_latency:.2f} s")
    out.save_audio(out_path)
    print(f"wrote {out_path}")
    return out


def _checkpoint(model: str) -> str:
    from omni_jax.model_source import checkpoint_dir

    return checkpoint_dir(model)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny",
                   help="'tiny' (the built-in random model), a Hugging Face Hub id (Qwen/Qwen2.5-Omni-7B) or "
                        "checkpoint directory, or a checkpoint converted with `omni-jax convert`")
    p.add_argument("--voice", default=None, help="speaker (default: the checkpoint's first, e.g. Chelsie)")
    p.add_argument("--max-tokens", type=int, default=8, help="text tokens of the reply")
    p.add_argument("--out", default="reply.wav", help="WAV file to write")
    args = p.parse_args(argv)
    speak(args.model, args.voice, args.max_tokens, args.out)


if __name__ == "__main__":
    main()
