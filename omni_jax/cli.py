"""`omni-jax` command line: convert checkpoints and run the model.

    omni-jax convert --hf-dir HF_DIR|HUB_ID --out OUT_DIR [--dtype bfloat16|float32]
    omni-jax generate --model HUB_ID|DIR|tiny --prompt TEXT | --prompt-embeds FILE.npy
    omni-jax serve --model HUB_ID|DIR|tiny [--port 8000] (OpenAI-compatible server)
    omni-jax bench --base-url URL [--concurrency N]      (load run against a server)
    omni-jax plan --model PRESET|HUB_ID|DIR --gpu h100|a100|h200
    omni-jax stage-process --model OUT_DIR --pipeline PRESET|YAML --stage NAME --process-id N
                                                         (a stage's process on another host)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from conversion import convert as convert_mod

from . import demo
from .api import add_async_chunk_argument, resolve_checkpoint_and_pipeline
from .errors import CheckpointError, ConfigError
from .gpu import plan
from .model_source import HUB_ID, add_revision_argument, fetch
from .runtime import spmd, stage_worker
from .server import bench, serve


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="omni-jax", description="Serve Qwen-Omni models with JAX.")
    sub = parser.add_subparsers(dest="command", required=True)

    p_convert = sub.add_parser("convert", help="convert a Hugging Face checkpoint")
    convert_mod.add_arguments(p_convert)
    add_revision_argument(p_convert)
    p_convert.set_defaults(func=convert)

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

    p_process = sub.add_parser("stage-process", help="run process N of a stage that spans hosts")
    p_process.add_argument("--model", required=True, help="the converted checkpoint (a copy on this host)")
    p_process.add_argument("--pipeline", default=None, help="the pipeline preset or YAML process 0 runs")
    p_process.add_argument("--stage", required=True, help="the stage's name in the pipeline")
    p_process.add_argument("--process-id", type=int, required=True, help="1 .. num_processes - 1")
    add_async_chunk_argument(p_process)
    p_process.set_defaults(func=stage_process)

    args = parser.parse_args(argv)
    return args.func(args)


def convert(args) -> int:
    """`omni-jax convert`, whose --hf-dir may also be a Hugging Face Hub id (fetched first)."""
    if not os.path.exists(args.hf_dir) and HUB_ID.fullmatch(args.hf_dir):
        try:
            args.hf_dir = fetch(args.hf_dir, args.revision)
        except CheckpointError as e:
            print(f"omni-jax convert: error: {e}", file=sys.stderr)
            return 1
    return convert_mod.run(args)


def stage_process(args) -> int:
    """Process N of a stage whose `coordinator_address` places its processes on several hosts
    (runtime/spmd.py): load the same stage as process 0, join it, and follow it until it stops."""
    try:
        ckpt, pipeline = resolve_checkpoint_and_pipeline(args.model, args.pipeline)
        if args.async_chunk is not None:
            pipeline = dataclasses.replace(pipeline, async_chunk=args.async_chunk)
        stage = pipeline.stage(args.stage)
        if stage.coordinator_address is None:
            raise ConfigError(f"stage {stage.name!r} has no coordinator_address: its processes all run on "
                              f"process 0's host, which starts them")
        if not 0 < args.process_id < stage.num_processes:
            raise ConfigError(f"--process-id must be 1 .. {stage.num_processes - 1} (stage {stage.name!r} has "
                              f"num_processes {stage.num_processes}), got {args.process_id}")
    except (CheckpointError, ConfigError, FileNotFoundError) as e:
        print(f"omni-jax stage-process: error: {e}", file=sys.stderr)
        return 1
    if os.environ.get("PYTHONHASHSEED") != spmd.HASH_SEED:  # hash as process 0 does: start again so
        again = ["stage-process", "--model", ckpt, "--stage", stage.name, "--process-id", str(args.process_id)]
        again += [] if args.pipeline is None else ["--pipeline", args.pipeline]
        again += [] if args.async_chunk is None else ["--async-chunk" if args.async_chunk else "--no-async-chunk"]
        os.execve(sys.executable, [sys.executable, "-m", "omni_jax.cli", *again],
                  dict(os.environ, PYTHONHASHSEED=spmd.HASH_SEED))
    stage_worker.follow_remote(stage.to_dict(), ckpt, pipeline.family, pipeline.async_chunk, args.process_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
