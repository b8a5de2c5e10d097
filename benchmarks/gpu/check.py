"""The one-command GPU check (run it through check.sh, which installs the carried wheels).

    bash benchmarks/gpu/check.sh [--cpu [--jobs N]] [--only PART ...] [--out DIR]

Runs each part in its own process with its own time budget (sizes.py), so a part that
hangs, crashes or runs out of memory is reported and the next one runs on a clean device
(on a CPU, `--jobs N` runs N at a time: CI's two cores finish the tiny check sooner).
After every part, results.json and results.md (a markdown table) are rewritten in `--out`
($OUT when set, else benchmarks/gpu/out/), with check.log holding every part's output;
the table is printed at the end. This process never imports JAX: the device stays free
for the parts.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import report as report_mod  # noqa: E402
from sizes import ROOT, SIZES  # noqa: E402

# part -> "module:function" (modules beside this file); each function takes (size, report, results_dir).
PARTS = {
    "environment": "environment:run",
    "kernels": "kernel_check:run",
    "thinker_7b": "thinker:run_qwen2_5",
    "thinker_30b_moe": "thinker:run_qwen3",
    "speech": "speech:run",
    "peer": "peer:run",
    "tuning": "tuning:run",
    "profile": "step_profile:run",
}
# Parts a GPU run takes only when `--only` names them (the rest fill the device tool's 10
# minutes a command); a CPU run takes every part.
ASKED_ONLY_ON_GPU = ("tuning", "profile")


def run_part(name: str, size_name: str, results_dir: str) -> int:
    """In the part's own process: run it, recording rows as they come."""
    rep = report_mod.Report(name, os.path.join(results_dir, f"{name}.json"))
    # Past its budget the part gets SIGTERM: exit through the `finally`s (stage processes shut
    # down, a 17 GB temporary checkpoint removed) before the SIGKILL 10 s later.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    module, func = PARTS[name].split(":")
    try:
        getattr(importlib.import_module(module), func)(SIZES[size_name], rep, results_dir)
    except report_mod.Unavailable as e:
        rep.finish("unavailable", str(e))
        print(f"[{name}] unavailable: {e}", flush=True)
        return 0
    except BaseException as e:  # noqa: BLE001 - reported, then the next part runs
        traceback.print_exc()
        rep.finish("failed", f"{type(e).__name__}: {e}")
        return 1
    failed = [r["metric"] for r in rep.data["rows"] if r["note"].startswith("FAIL")]
    rep.finish("failed" if failed else "ok", f"checks failed: {', '.join(failed)}" if failed else None)
    return 1 if failed else 0


def _kill_group(proc: subprocess.Popen) -> None:
    """End the part and every process it started (stage workers share its process group)."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def part_env(size_name: str, out: str) -> dict:
    """A part's environment: where its files to keep go, and the share of the device its JAX
    may take, grown as needed (a user's XLA_PYTHON_CLIENT_* settings win)."""
    env = dict(os.environ, OMNI_JAX_CHECK_OUT=out)
    fraction = SIZES[size_name].memory_fraction
    if fraction is not None:
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(fraction))
        env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    return env


def _start(name: str, budget: float, size_name: str, parts_dir: str, out: str, log_path: str | None) -> dict:
    """Start a part's process. Its output goes to `log_path` (check.log, as it comes: what a
    killed GPU run leaves), or with None to its own file, copied into check.log when it ends."""
    print(f"[check] {name}: starting (budget {budget}s)", flush=True)
    own = log_path is None
    path = os.path.join(parts_dir, f"{name}.log") if own else log_path
    with open(path, "a") as log:
        log.write(f"\n===== {name} (budget {budget}s)\n")
        log.flush()
        offset = log.tell()
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--run-part", name, "--size",
                                 size_name, "--results", parts_dir], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, env=part_env(size_name, out))
    return dict(name=name, proc=proc, budget=budget, log=path, own_log=own, offset=offset, t0=time.perf_counter())


def _finish(run: dict, parts_dir: str, log_path: str, timed_out: bool) -> dict:
    """The part's results (its status from how its process ended); its own log appended to check.log."""
    name, budget = run["name"], run["budget"]
    data = report_mod.read(os.path.join(parts_dir, f"{name}.json")) or dict(part=name, rows=[], error=None)
    data.update(seconds=round(time.perf_counter() - run["t0"], 1), budget=budget)
    if timed_out:
        data.update(status="timeout", error=f"over its {budget}s budget (rows so far kept)")
    elif data.get("status") in (None, "running"):
        data.update(status="failed", error=f"the part's process ended with code {run['proc'].returncode} "
                                           "before reporting")
    with open(run["log"], errors="replace") as part_log:
        text = part_log.read()
    if run["own_log"]:
        with open(log_path, "a") as log:
            log.write(text)
    print(f"[check] {name}: {data['status']} in {data['seconds']}s"
          + (f": {data['error']}" if data.get("error") else ""), flush=True)
    if data["status"] in ("failed", "timeout"):
        print("".join(text[run["offset"]:].splitlines(keepends=True)[-15:]), flush=True)
    return data


def orchestrate(args) -> int:
    size = SIZES["cpu" if args.cpu else "gpu"]
    if args.jobs < 1:
        raise SystemExit(f"--jobs {args.jobs}: want at least 1")
    if args.jobs > 1 and not args.cpu:
        raise SystemExit("--jobs: parts run side by side only with --cpu (on a GPU they would share the device)")
    out = args.out or os.environ.get("OUT") or os.path.join(HERE, "out")
    os.makedirs(out, exist_ok=True)
    parts_dir = tempfile.mkdtemp(prefix="omni-jax-check-")  # per-part JSON (not in $OUT: 8 files come back)
    log_path = os.path.join(out, "check.log")
    open(log_path, "w").close()
    header = dict(size=size.name, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  host=platform.node(), python=platform.python_version(),
                  wheels=os.environ.get("OMNI_JAX_CHECK_SITE") or "none installed")
    names = args.only or [p for p in PARTS if size.name == "cpu" or p not in ASKED_ONLY_ON_GPU]
    budgets = dict(size.budgets)
    for item in args.budget:
        part, _, secs = item.partition("=")
        if part not in PARTS or not secs.replace(".", "", 1).isdigit():
            raise SystemExit(f"--budget {item!r}: want PART=SECONDS with PART one of {', '.join(PARTS)}")
        budgets[part] = float(secs)
    results, t_start = {}, time.perf_counter()
    waiting, running = list(names), []
    while waiting or running:
        while waiting and len(running) < args.jobs:
            name = waiting.pop(0)
            running.append(_start(name, budgets[name], size.name, parts_dir, out,
                                  log_path if args.jobs == 1 else None))
        time.sleep(0.1)
        for run in list(running):
            timed_out = run["proc"].poll() is None and time.perf_counter() - run["t0"] > run["budget"]
            if timed_out:
                _kill_group(run["proc"])
            elif run["proc"].poll() is None:
                continue
            running.remove(run)
            results[run["name"]] = _finish(run, parts_dir, log_path, timed_out)
            # Rewritten after every part, in the order asked for: what is known so far.
            done = [results[n] for n in names if n in results]
            header["wall_s"] = round(time.perf_counter() - t_start, 1)
            with open(os.path.join(out, "results.json"), "w") as f:
                json.dump(dict(header=header, parts=done), f, indent=1)
            with open(os.path.join(out, "results.md"), "w") as f:
                f.write(report_mod.markdown(header, done))
    shutil.rmtree(parts_dir, ignore_errors=True)
    done = [results[n] for n in names]
    print("\n" + report_mod.markdown(header, done), flush=True)
    print(f"[check] wall time {header['wall_s']}s; results in {out}", flush=True)
    return 0 if all(p["status"] in ("ok", "unavailable") for p in done) else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="tiny models, interpret-mode kernels (no GPU needed)")
    ap.add_argument("--only", nargs="+", choices=list(PARTS), help="run these parts only, in this order")
    ap.add_argument("--out", help="results folder (default: $OUT, else benchmarks/gpu/out)")
    ap.add_argument("--jobs", type=int, default=1, metavar="N",
                    help="with --cpu: run N parts side by side (their timings then share the CPU)")
    ap.add_argument("--budget", action="append", default=[], metavar="PART=SECONDS",
                    help="another time budget for a part (default: sizes.py's)")
    ap.add_argument("--run-part", choices=list(PARTS), help=argparse.SUPPRESS)
    ap.add_argument("--size", choices=list(SIZES), help=argparse.SUPPRESS)
    ap.add_argument("--results", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.run_part:
        return run_part(args.run_part, args.size, args.results)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
