"""Seconds a restarted stage takes to be ready: its programs read back from OmniJax's program
cache (engine/program_cache.py), against tracing them again with only JAX's compilation cache
warm (the peer: how every stage started before, measured in the same run).

    python benchmarks/stage_start.py [--stage thinker|token2wav] [--layers 28] [--repeat 3]

The thinker: a random Qwen2.5-Omni thinker as deep as the 7B's (`--layers`, 28) and as narrow as
the tiny model (tracing costs per layer and per operation, not per weight: the restart's
tracing is a real model's, its weights and compiles are not), with the 7B preset's 13 token
and decode buckets. The vocoder (`--stage token2wav`): the tiny model's, as its preset serves it
(streamed: async chunk), whose restart was the longest of the demo's three stages. Each start
is a fresh process doing what a stage process does before it says it is ready
(`build_stage_engine`: load, trace or read back, compile or load from JAX's cache, warm up). First one start of each way fills the caches; then the ways alternate
`--repeat` times and the best and median of each are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.machine import cpu_model  # noqa: E402

FAMILY = "qwen2_5_omni"

START = """
import json, sys, time
from omni_jax.runtime.stage_worker import configure_compile_cache
configure_compile_cache()
from omni_jax.engine import program_cache
from omni_jax.runtime.stage_loop import activate_program_cache, build_stage_engine
from omni_jax.config import StageConfig
stage, ckpt, family, streamed = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4] == "1"
t0 = time.perf_counter()
activate_program_cache(stage, ckpt, family, streamed)
build_stage_engine(family, StageConfig.from_dict(stage), ckpt, streamed)
cache = program_cache.active()
print(json.dumps({"seconds": time.perf_counter() - t0, "stats": cache.stats if cache else None}))
"""


def thinker_stage() -> dict:
    """The tiny preset's thinker with the 7B preset's buckets and batch (what a restart traces)."""
    from omni_jax.config import load_pipeline_config

    real = {s.name: s for s in load_pipeline_config("qwen2_5_omni").stages}["thinker"]
    tiny = load_pipeline_config("qwen2_5_omni_tiny").with_overrides(thinker=dict(
        token_buckets=list(real.token_buckets), decode_buckets=list(real.decode_buckets),
        max_num_seqs=real.max_num_seqs, max_num_batched_tokens=real.max_num_batched_tokens))
    return {s.name: s for s in tiny.stages}["thinker"].to_dict()


def vocoder_stage() -> dict:
    from omni_jax.config import load_pipeline_config

    return {s.name: s for s in load_pipeline_config("qwen2_5_omni_tiny").stages}["token2wav"].to_dict()


def start(stage: dict, ckpt: str, caches: str, cached: bool) -> dict:
    # Both caches where a stage keeps them by default (under $OMNI_JAX_CACHE, every program kept)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE",
                                                                     "OMNI_JAX_PROGRAM_CACHE"))}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, OMNI_JAX_CACHE=caches)
    if not cached:
        env["OMNI_JAX_PROGRAM_CACHE_DIR"] = ""
    streamed = "1" if stage["runner"] == "oneshot" else "0"  # the vocoder as the presets serve it
    out = subprocess.run([sys.executable, "-c", START, json.dumps(stage), ckpt, FAMILY, streamed], capture_output=True,
                         text=True, env=env)
    if out.returncode:
        raise SystemExit(f"a stage start failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stage", choices=("thinker", "token2wav"), default="thinker")
    p.add_argument("--layers", type=int, default=28, help="decoder layers of the thinker (the 7B's: 28)")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    from omni_jax.models.qwen2_5_omni.tiny import build_random_checkpoint, tiny_config

    print(f"CPU {cpu_model()} ({os.cpu_count()} cores); load average {os.getloadavg()[0]:.2f}", flush=True)
    stage = thinker_stage() if args.stage == "thinker" else vocoder_stage()
    with tempfile.TemporaryDirectory() as tmp:
        hf = tiny_config()
        hf["thinker_config"]["text_config"]["num_hidden_layers"] = args.layers
        ckpt = build_random_checkpoint(os.path.join(tmp, "ckpt"), hf, tokenizer=False)
        caches = os.path.join(tmp, "caches")
        ways = {"traced (JAX's compilation cache only)": False, "read back (program cache)": True}
        for name, cached in ways.items():  # fill the caches
            first = start(stage, ckpt, caches, cached)
            print(f"first start, {name}: {first['seconds']:.1f} s", flush=True)
        times = {name: [] for name in ways}
        stats = None
        for _ in range(args.repeat):
            for name, cached in ways.items():
                run = start(stage, ckpt, caches, cached)
                times[name].append(run["seconds"])
                stats = run["stats"] or stats
    what = f"a {args.layers}-layer thinker" if args.stage == "thinker" else "the tiny model's vocoder, streamed,"
    print(f"{what} {len(stage['token_buckets'])} token and {len(stage['decode_buckets'])} "
          f"decode buckets; {stats['loaded']} programs read back; {args.repeat} restarts of each way:")
    print("| restart | best s | median s | / read back |")
    print("|---|---|---|---|")
    ours = min(times["read back (program cache)"])
    for name, t in times.items():
        print(f"| {name} | {min(t):.2f} | {statistics.median(t):.2f} | {min(t) / ours:.2f} |")


if __name__ == "__main__":
    main()
