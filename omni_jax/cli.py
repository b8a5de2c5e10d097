"""`omni-jax` command line: convert checkpoints and run the model.

    omni-jax convert --hf-dir HF_DIR --out OUT_DIR [--dtype bfloat16|float32]
    omni-jax generate --model OUT_DIR|tiny --prompt TEXT
    omni-jax plan --model PRESET|OUT_DIR --gpu h100|a100
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="omni-jax", description="Serve Qwen-Omni models with JAX.")
    sub = parser.add_subparsers(dest="command", required=True)

    from conversion import convert as convert_mod

    p_convert = sub.add_parser("convert", help="convert a Hugging Face checkpoint")
    convert_mod.add_arguments(p_convert)
    p_convert.set_defaults(func=convert_mod.run)

    from . import demo

    p_gen = sub.add_parser("generate", help="generate a reply to a prompt")
    demo.add_arguments(p_gen)
    p_gen.set_defaults(func=demo.run)

    from .gpu import plan

    p_plan = sub.add_parser("plan", help="memory and roofline plan of a preset on an H100 or A100")
    plan.add_arguments(p_plan)
    p_plan.set_defaults(func=plan.run)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
