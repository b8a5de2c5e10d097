"""Memory and roofline plan of both families' presets on H100 and A100 (no GPU needed).

    .venv/bin/python benchmarks/plan.py [--gpu h100 a100] [--model qwen2_5_omni qwen3_omni] [--ends]

Runs `omni-jax plan` for each (preset, GPU): the programs are compiled for the target in
.venv-gpu (see omni_jax/gpu). The roofline time is the physical limit the GPU benchmark
(`benchmarks/pallas_kernels.py`, needs a GPU) will be compared with.
"""
from __future__ import annotations

import argparse
import sys

from omni_jax.cli import main as cli_main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", nargs="+", default=["h100", "a100"])
    ap.add_argument("--model", nargs="+", default=["qwen2_5_omni", "qwen3_omni"])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--ends", action="store_true", help="only the smallest and largest bucket")
    args = ap.parse_args()
    status = 0
    for model in args.model:
        for gpu in args.gpu:
            print(f"\n===== {model} on {gpu} =====", flush=True)
            argv = ["plan", "--model", model, "--gpu", gpu, "--context", str(args.context)]
            status |= cli_main(argv + (["--ends"] if args.ends else []))
    return status


if __name__ == "__main__":
    sys.exit(main())
