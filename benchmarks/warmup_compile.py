"""Seconds a stage's warm-up spends compiling: its programs compiled side by side on
`--workers` threads (`engine/jitted.compile_ahead`, what a warm-up does) against one at a time
(the peer: every warm-up before, measured in the same run).

    python benchmarks/warmup_compile.py [--target h100] [--family qwen2_5_omni] [--stage thinker]
        [--programs 8] [--workers 2] [--repeat 1]
    python benchmarks/warmup_compile.py --tiny [--stage thinker] [--workers 2] [--repeat 2]

The programs are the real model's, as the stage's warm-up calls them (recorded by
`omni_jax.gpu.programs`: the vocoder's streamed calls, or with `--stage` an AR stage's steps,
sampler variants, prompt logprobs and after-sample programs), compiled without a GPU for
`--target` in the GPU compile environment (`.venv-gpu`, `omni_jax.gpu`): XLA's GPU compiler,
which a GPU host's warm-up runs too (a GPU host also autotunes its GEMMs and convolutions, which
this does not). `--programs` picks that many spread over the recorded calls (every kind and
bucket). Each way is a fresh process (nothing cached between them); the ways alternate
`--repeat` times.
`--tiny`: instead, the tiny model's streamed vocoder stage (`--stage thinker`: its thinker at the
7B's depth with the 7B preset's buckets) started on the CPU with nothing cached
(`stage_start.start`: load, compile, warm up), `OMNI_JAX_COMPILE_WORKERS` 1 against `--workers`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.machine import cpu_model  # noqa: E402


def compile_programs(target: str, family: str, stage_name: str | None, count: int, workers: int) -> dict:
    """In the GPU compile environment: compile `count` of a stage's warm-up programs (the
    vocoder's when `stage_name` is None)."""
    import jax

    from omni_jax.engine.jitted import compile_ahead
    from omni_jax.gpu import aot
    from omni_jax.gpu import programs as P
    from omni_jax.gpu.targets import load_target

    pipeline = P.preset(family)
    hf_config = P.real_hf_config(pipeline.family)
    if stage_name is None:
        stage = next(s for s in pipeline.stages if s.runner != "ar")
        # The streamed calls: what the presets serve with (async chunk), so what their warm-up compiles.
        recorded = [p for p in P.vocoder_programs(pipeline.family, stage, hf_config) if p.info["call"] != "whole"]
    else:  # what an AR engine's warm-up compiles ahead (`AREngine.warmup`), but the small uploads
        # (~2 s together for the 7B thinker), which would take most of `--programs`' picks
        stage = next(s for s in pipeline.stages if s.name == stage_name)
        recorded = [p for p in P.ar_engine_programs(pipeline.family, stage, hf_config, num_blocks=64)
                    if not p.kind.startswith("upload")]
    step = max(1, len(recorded) // count)
    picked = recorded[::step][:count]
    compiler = aot.Compiler(load_target(target))
    calls = [(p.fn, tuple(compiler.place(p.args)), p.kwargs) for p in picked]
    t0 = time.perf_counter()
    with jax.sharding.use_abstract_mesh(compiler.mesh):
        if workers > 1:
            compile_ahead(calls, workers)
        else:
            for fn, args, kwargs in calls:
                fn.lower(*args, **kwargs).compile()
    return dict(seconds=time.perf_counter() - t0, programs=[p.name for p in picked],
                peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)


def tiny_first_starts(workers: int, repeat: int, stage_name: str | None) -> None:
    import tempfile

    from benchmarks.stage_start import start, thinker_stage, vocoder_stage
    from omni_jax.engine.jitted import COMPILE_WORKERS_ENV
    from omni_jax.models.qwen2_5_omni.tiny import build_random_checkpoint, tiny_config

    load0 = os.getloadavg()[0]
    stage = thinker_stage() if stage_name == "thinker" else vocoder_stage()
    what = ("a 28-layer tiny thinker with the 7B preset's buckets" if stage_name == "thinker"
            else "the tiny model's streamed vocoder")
    hf = tiny_config()
    if stage_name == "thinker":  # the 7B's depth: a warm-up whose compiles weigh as a real one's more
        hf["thinker_config"]["text_config"]["num_hidden_layers"] = 28
    times: dict[int, list] = {1: [], workers: []}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = build_random_checkpoint(os.path.join(tmp, "ckpt"), hf, tokenizer=False)
        for i in range(repeat):
            for w in times:
                os.environ[COMPILE_WORKERS_ENV] = str(w)
                seconds = start(stage, ckpt, os.path.join(tmp, f"caches-{i}-{w}"), cached=False)["seconds"]
                times[w].append(seconds)
                print(f"{w} worker(s): first start {seconds:.1f} s", flush=True)
    print(f"{what}, first start: one at a time {min(times[1]):.1f} s, on {workers} "
          f"threads {min(times[workers]):.1f} s: {min(times[1]) / min(times[workers]):.2f}x (best of {repeat}; "
          f"{cpu_model()}, {os.cpu_count()} CPUs, load average {load0:.1f} -> {os.getloadavg()[0]:.1f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="h100")
    ap.add_argument("--family", default="qwen2_5_omni")
    ap.add_argument("--stage", default=None, help="an AR stage (thinker, talker) instead of the vocoder")
    ap.add_argument("--programs", type=int, default=8)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--tiny", action="store_true", help="the tiny vocoder stage's first start on the CPU")
    ap.add_argument("--arm", type=int, default=None, help=argparse.SUPPRESS)  # a child: its workers
    args = ap.parse_args()
    if args.arm is not None:
        print(json.dumps(compile_programs(args.target, args.family, args.stage, args.programs, args.arm)))
        return
    if args.tiny:
        tiny_first_starts(args.workers, args.repeat, args.stage)
        return

    from omni_jax.gpu.client import gpu_python, worker_env

    python = gpu_python()
    env = worker_env(python)
    load0 = os.getloadavg()[0]
    runs: dict[int, list] = {1: [], args.workers: []}
    for _ in range(args.repeat):
        for workers in (1, args.workers):
            out = subprocess.run([python, os.path.abspath(__file__), "--target", args.target, "--family",
                                  args.family, "--programs", str(args.programs), "--arm", str(workers)]
                                 + (["--stage", args.stage] if args.stage else []),
                                 env=env, capture_output=True, text=True, cwd=ROOT)
            if out.returncode != 0:
                raise SystemExit(f"compile process failed:\n{out.stderr[-3000:]}")
            result = json.loads(out.stdout.strip().splitlines()[-1])
            runs[workers].append(result)
            print(f"{workers} worker(s): {result['seconds']:.1f} s, peak RSS {result['peak_rss_gib']:.2f} GiB",
                  flush=True)
    serial = min(r["seconds"] for r in runs[1])
    side = min(r["seconds"] for r in runs[args.workers])
    print(f"programs: {', '.join(runs[1][0]['programs'])}")
    print(f"{args.family} {args.stage or 'vocoder'}, {args.programs} warm-up programs for {args.target}: one at a time "
          f"{serial:.1f} s, on {args.workers} threads {side:.1f} s: {serial / side:.2f}x "
          f"(best of {args.repeat}; {cpu_model()}, {os.cpu_count()} CPUs, load average "
          f"{load0:.1f} -> {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
