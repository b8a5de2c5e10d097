"""A text chat with OmniJax: a multi-turn conversation, then a streamed reply.

    python examples/text_chat.py                      # the built-in tiny random model
    python examples/text_chat.py --model ckpt/qwen2_5_omni_7b

`--model tiny` (the default) is a random model: its replies are gibberish, but every
step runs as it would with a real checkpoint converted with `omni-jax convert`.
The notebook text_chat.ipynb walks through the same steps.
"""

from __future__ import annotations

import argparse
import asyncio

from omni_jax import AsyncOmniJax, OmniJax, SamplingParams


def small_pipeline(model: str):
    """For the tiny model, a pipeline with one shape bucket per step so it warms up in seconds;
    None (the checkpoint's default pipeline) for a real checkpoint."""
    if model != "tiny":
        return None
    from omni_jax.config import load_pipeline_config

    return load_pipeline_config("qwen2_5_omni_tiny").with_overrides(
        thinker=dict(max_num_seqs=1, token_buckets=[64], decode_buckets=[1],
                     audio_chunk_buckets=[1], vision_patch_buckets=[64]))


def chat(model: str, max_tokens: int) -> list[dict]:
    """Two user turns; the conversation so far is sent again with each new turn."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    with OmniJax(model=model, pipeline=small_pipeline(model)) as omni:
        for question in ("What is the capital of France?", "And how many people live there?"):
            messages.append({"role": "user", "content": question})
            out = omni.generate({"messages": messages}, sampling_params=params)[0]
            if out.error:
                raise RuntimeError(out.error)
            messages.append({"role": "assistant", "content": out.text})
            print(f"user: {question}\nassistant: {out.text!r}")
            print(f"  [{len(out.token_ids)} tokens, {out.finish_reason}, ttft {1e3 * out.metrics.ttft:.0f} ms]")
    return messages


async def stream(model: str, max_tokens: int) -> str:
    """One reply printed piece by piece as the thinker produces it."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    prompt = {"messages": [{"role": "user", "content": "Write a haiku about the sea."}]}
    text = ""
    async with AsyncOmniJax(model=model, pipeline=small_pipeline(model)) as omni:
        async for out in omni.generate(prompt, sampling_params=params):
            print(out.text_delta, end="", flush=True)
            text += out.text_delta
        print(f"\n  [{len(out.token_ids)} tokens, {out.finish_reason}]")
    return text


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny",
                   help="'tiny' (the built-in random model) or the path of a checkpoint converted with "
                        "`omni-jax convert`")
    p.add_argument("--max-tokens", type=int, default=12)
    args = p.parse_args(argv)
    chat(args.model, args.max_tokens)
    asyncio.run(stream(args.model, args.max_tokens))


if __name__ == "__main__":
    main()
