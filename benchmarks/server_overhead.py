"""The HTTP server's own cost: `omni-jax bench` against `omni-jax serve`, and the same requests
through `AsyncOmniJax` in one process (`omni-jax bench --library`), one after the other.

    python benchmarks/server_overhead.py [--model tiny] [--concurrency 1,16,64] [--num-requests 64]
                                         [--modalities text text,audio] [--rounds 2]

Each round runs the server phase (start `serve`, bench every modality and concurrency, stop it)
and then the library phase, so the two peers alternate and never run at once. Prints, per
modality and concurrency, req/s and TTFT p50 of both and the server / library ratio (issue 16's
target: the server at most 10% below), with the load average when each phase started. Engines
share a JAX compilation cache in a temporary directory, so only the first start compiles.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
from serve_process import served


def _bench(extra: list[str], mods: str, args, env, out: str) -> list[dict]:
    cmd = [sys.executable, "-m", "omni_jax.cli", "bench", "--modalities", mods, "--concurrency", args.concurrency,
           "--num-requests", str(args.num_requests), "--max-tokens", str(args.max_tokens), "--json", out, *extra]
    r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        sys.exit(f"bench failed ({' '.join(cmd)}):\n{r.stdout[-3000:]}")
    with open(out) as f:
        return json.load(f)


def _server_phase(args, env, tmp: str) -> dict[str, list[dict]]:
    serve_args = ["--model", args.model] + (["--pipeline", args.pipeline] if args.pipeline else [])
    with served(serve_args, env, os.path.join(tmp, "serve.log")) as (_, url):
        return {m: _bench(["--base-url", url], m, args, env, os.path.join(tmp, "server.json")) for m in args.modalities}


def _library_phase(args, env, tmp: str) -> dict[str, list[dict]]:
    extra = ["--library", args.model] + (["--pipeline", args.pipeline] if args.pipeline else [])
    return {m: _bench(extra, m, args, env, os.path.join(tmp, "library.json")) for m in args.modalities}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--pipeline", default=None)
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--modalities", nargs="+", default=["text", "text,audio"])
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="omni-jax-server-overhead-") as tmp:
        env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tmp, "jax-cache"))
        env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
        runs: dict[str, list] = {"server": [], "library": []}
        for r in range(args.rounds):
            for peer, phase in (("server", _server_phase), ("library", _library_phase)):
                load = os.getloadavg()[0]
                t0 = time.monotonic()
                runs[peer].append(phase(args, env, tmp))
                print(f"round {r + 1}: {peer} phase in {time.monotonic() - t0:.0f} s (load average {load:.2f} at its "
                      f"start)", flush=True)
    levels = [int(c) for c in args.concurrency.split(",")]
    print(f"\n{'modalities':11s} {'conc':>4s} {'server req/s':>13s} {'library req/s':>14s} {'ratio':>6s} "
          f"{'TTFT p50 server':>16s} {'library':>8s}")
    for mods in args.modalities:
        for i, level in enumerate(levels):
            def mean(peer, key, sub=None):
                vals = [run[mods][i][key] if sub is None else run[mods][i].get(key, {}).get(sub, np.nan)
                        for run in runs[peer]]
                return float(np.mean(vals))
            srv, lib = mean("server", "req_per_s"), mean("library", "req_per_s")
            print(f"{mods:11s} {level:4d} {srv:13.2f} {lib:14.2f} {srv / lib:6.2f} "
                  f"{mean('server', 'ttft', 'p50') * 1e3:13.1f} ms {mean('library', 'ttft', 'p50') * 1e3:5.1f} ms")
    per_round = {peer: [[round(run[m][i]["req_per_s"], 2) for m in args.modalities for i in range(len(levels))]
                        for run in runs[peer]] for peer in runs}
    print(f"req/s per round (modalities x concurrency, in the order above): {per_round}")


if __name__ == "__main__":
    main()
