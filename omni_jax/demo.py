"""`omni-jax generate`: one chat turn through the staged runtime, printed as text.

Starts the pipeline's stage processes (`OmniJax`), sends one chat message (or, with
`--prompt-embeds FILE.npy`, a [T, H] array of prompt embeddings), and prints the reply (and writes the speech with `--output-audio`). `--model tiny` uses
the built-in tiny random model, built on first use without torch or downloads, so
its reply is random text.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from .api import OmniJax, add_async_chunk_argument
from .errors import CheckpointError, ConfigError
from .engine.sampling_params import SamplingParams
from .model_source import add_model_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--pipeline", default=None, help="pipeline preset name or YAML path (default: the model's)")
    p.add_argument("--prompt", default=None, help="the user message")
    p.add_argument("--prompt-embeds", default=None, metavar="FILE.npy",
                   help="instead of --prompt: a [num_tokens, hidden_size] array of prompt embeddings (np.save)")
    p.add_argument("--system", default=None, help="system prompt (default: the chat template's)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--output-audio", default=None, help="also speak the reply and write it to this WAV file")
    p.add_argument("--voice", default=None, help="speaker of the spoken reply")
    add_async_chunk_argument(p)


def _prompt(args: argparse.Namespace) -> dict:
    """The prompt of the command line: chat messages, or the embeddings of --prompt-embeds."""
    if (args.prompt is None) == (args.prompt_embeds is None):
        raise ValueError("give exactly one of --prompt and --prompt-embeds")
    if args.prompt_embeds is not None:
        return {"prompt_embeds": np.load(args.prompt_embeds, allow_pickle=False)}
    messages = [{"role": "user", "content": args.prompt}]
    if args.system:
        messages.insert(0, {"role": "system", "content": args.system})
    return {"messages": messages}


def run(args: argparse.Namespace) -> int:
    modalities = ["text", "audio"] if args.output_audio else ["text"]
    try:
        prompt = _prompt(args)
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
        with OmniJax(model=args.model, revision=args.revision, pipeline=args.pipeline, output_modalities=modalities,
                     async_chunk=args.async_chunk) as omni:
            out = omni.generate(prompt, sampling_params=params, voice=args.voice, use_tqdm=False)[0]
    except (CheckpointError, ConfigError, ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"omni-jax generate: error: {e}", file=sys.stderr)
        return 1
    if out.error:
        print(f"omni-jax generate: error: {out.error}", file=sys.stderr)
        return 1
    print(out.text)
    m = out.metrics
    print(f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}, "
          f"ttft {1e3 * (m.ttft or 0):.0f} ms, total {m.e2e_latency or 0:.2f} s]")
    if args.output_audio:
        out.save_audio(args.output_audio)
        print(f"[wrote {m.audio_seconds:.2f} s of speech to {args.output_audio}]")
    return 0
