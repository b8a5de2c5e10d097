"""`omni-jax generate`: one prompt through the thinker, printed as text.

Runs the thinker's AR engine in this process (paged KV cache, bucketed jitted steps,
the same engine a stage worker serves). `--model tiny` uses the built-in tiny random
model, built on first use without torch or downloads, so its reply is random text.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="converted checkpoint directory, or 'tiny' (default)")
    p.add_argument("--prompt", required=True, help="the user message")
    p.add_argument("--system", default=None, help="system prompt (default: Qwen2.5-Omni's)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=1024)


def resolve_model(model: str) -> str:
    """A checkpoint directory for `--model` ('tiny' builds the demo model on first use)."""
    if model == "tiny":
        from .models.qwen2_5_omni.tiny import tiny_checkpoint

        return tiny_checkpoint()
    return model


def run(args: argparse.Namespace) -> int:
    from .checkpoint import CheckpointError
    from .engine.ar_engine import RequestError
    from .engine.runner import RunnerConfig
    from .engine.sampling import SamplingParams
    from .inputs.qwen_tokenizer import DEFAULT_SYSTEM_PROMPT
    from .models.qwen2_5_omni.media import MediaBuckets
    from .models.qwen2_5_omni.stages import build_thinker_engine

    try:
        path = resolve_model(args.model)
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
        runner = RunnerConfig(num_blocks=max(8, args.max_model_len // 16 + 2), block_size=16, max_num_seqs=1,
                              max_num_batched_tokens=256, max_model_len=args.max_model_len)
        engine = build_thinker_engine(path, runner, media_buckets=MediaBuckets((1,), (64,)))
        if engine.tokenizer is None:
            raise CheckpointError(f"{path} has no tokenizer files; reconvert from an HF directory that has them")
        messages = [{"role": "system", "content": args.system or DEFAULT_SYSTEM_PROMPT},
                    {"role": "user", "content": args.prompt}]
        text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt_ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
        engine.add_request("demo", np.asarray(prompt_ids), params)
    except (CheckpointError, RequestError, ValueError, FileNotFoundError) as e:
        print(f"omni-jax generate: error: {e}", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    n = 0
    while engine.has_unfinished():
        for out in engine.step():
            n += len(out.new_token_ids)
            print(out.text_delta, end="", flush=True)
            if out.error:
                print(f"\nomni-jax generate: error: {out.error}", file=sys.stderr)
                return 1
    dt = time.perf_counter() - t0
    print(f"\n[{n} tokens in {dt:.2f}s, {n / max(dt, 1e-9):.1f} tokens/s]")
    return 0
