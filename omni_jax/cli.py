"""`omni-jax` command line: convert checkpoints and run the model.

    omni-jax convert --hf-dir HF_DIR --out OUT_DIR [--dtype bfloat16|float32]
    omni-jax generate --model OUT_DIR|tiny --prompt TEXT | --prompt-embeds FILE.npy
    omni-jax serve --model OUT_DIR|tiny [--port 8000]     (OpenAI-compatible server)
    omni-jax bench --base-url URL [--concurrency N]      (load run against a server)
    omni-jax plan --model PRESET|OUT_DIR --gpu h100|a100
"""

from __future__ import annotations

import argparse
import sys

from conversion import convert as convert_mod

from . import demo
from .gpu import plan
from .server import bench, serve


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="omni-jax", description="Serve Qwen-Omni models with JAX.")
    sub = parser.add_subparsers(dest="command", required=True)

    p_convert = sub.add_parser("convert", help="convert a Hugging Face checkpoint")
    convert_mod.add_arguments(p_convert)
    p_convert.set_defaults(func=convert_mod.run)

    p_gen = sub.add_parser("generate", help="generate a reply to a prompt")
    demo.add_arguments(p_gen)
    p_gen.set_defaults(func=demo.run)

    p_serve = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    serve.add_arguments(p_serve)
    p_serve.set_defaults(func=serve.run)
    p_bench = sub.add_parser("bench", help="measure a running server under concurrent streaming load")
    bench.add_arguments(p_bench)
    p_bench.set_defaults(func=bench.run)
    p_plan = sub.add_parser("plan", help="memory and roofline plan of a preset on an H100 or A100")
    plan.add_arguments(p_plan)
    p_plan.set_defaults(func=plan.run)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
