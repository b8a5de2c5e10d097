"""Part `profile` (on a GPU only when asked: `--only profile`): where a served decode step's time
goes, from a `jax.profiler` trace of the Qwen3-Omni-30B-A3B thinker at batch 1, the step furthest
from its roofline (3.77 ms served, 2.98 ms called bare, against 1.49 ms: README, "Measured on a
GPU").

The engine (as the thinker parts build it, one decode bucket) prefills a prompt, decodes a few
steps, then `engine.step()` runs PROFILED_STEPS times under the profiler, each in a
"engine step" annotation. XLA replays its command buffers (CUDA graphs) under the profiler only
with `--xla_enable_command_buffers_during_profiling=true`, which this part adds to XLA_FLAGS on a
GPU (before JAX starts), so the trace is of the step as served; the Python tracer stays off (it
would slow the host side it measures). From the trace's Chrome JSON (`create_perfetto_trace`):

* a step's wall time, the device's busy time (the union of its kernels' intervals over all its
  streams: the `/device:` processes' "Stream" lanes, not the XLA op and module lines drawn over
  them) and what is left (gaps: launches, the host, synchronisation);
* the device kernels by total time a step, names with their numbers stripped (`loop_fusion_12`
  and `loop_fusion_3` are one row), the largest first;
* the host events on the engine's thread by total time a step (the jitted calls, command buffer
  updates and graph launches where XLA records them); events nest, so a jitted call's row
  includes the rows of what it ran.

The trace itself is kept beside the results (`$OUT/profile_trace.json.gz`) for a closer look
here, in Perfetto or with `summarize`. On a CPU (`check.sh --cpu`) the tiny model's trace has no
device lanes: the host rows run, the device rows say so.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import shutil
import tempfile
import time

PROFILED_STEPS = 8
TOP = 12                     # kernel and host rows reported
STEP = "engine step"         # the annotation around each profiled engine.step()
TRACE_NAME = "profile_trace.json.gz"
COMMAND_BUFFERS_FLAG = "--xla_enable_command_buffers_during_profiling=true"


def run(size, rep, results_dir) -> None:
    if size.name == "gpu":   # before JAX starts (a CPU jaxlib may not know the flag)
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + COMMAND_BUFFERS_FLAG).strip()
    import jax
    import numpy as np

    from omni_jax import SamplingParams
    from thinker import _prompt, build_engine

    engine, text, _ = build_engine("qwen3_omni", size, (1,))
    warm = engine.warmup(progress=False)
    rep.add("warm-up (compile every bucket)", warm, "s", f"{text.num_layers} layers, batch 1")
    params = SamplingParams(temperature=0.0, max_tokens=PROFILED_STEPS + 16, ignore_eos=True)
    engine.add_request("profiled", _prompt(np.random.default_rng(0), size.decode_prompt, engine.vocab_size), params)
    for _ in range(6):   # the prefill, then decode steps with one launched ahead
        engine.step()
    trace_dir = tempfile.mkdtemp(prefix="omni-jax-profile-")
    try:
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0
        jax.profiler.start_trace(trace_dir, create_perfetto_trace=True, profiler_options=options)
        t0 = time.perf_counter()
        for _ in range(PROFILED_STEPS):
            with jax.profiler.TraceAnnotation(STEP):
                engine.step()
        wall = (time.perf_counter() - t0) / PROFILED_STEPS
        jax.profiler.stop_trace()
        while engine.has_unfinished():
            engine.step()
        rep.add("served decode step b1, profiled", wall * 1e3, "ms", f"mean of {PROFILED_STEPS}, wall clock")
        found = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
        if not found:
            rep.add("trace", "missing", note=f"FAIL: no perfetto_trace.json.gz under {trace_dir}")
            return
        out = os.environ.get("OMNI_JAX_CHECK_OUT") or results_dir
        kept = os.path.join(out, TRACE_NAME)
        shutil.copyfile(found[0], kept)
        rep.add("trace kept", os.path.getsize(kept) / 2**20, "MiB", kept)
        report_summary(summarize(load_events(kept)), rep)
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)


def load_events(path: str) -> list[dict]:
    """The trace events of a Chrome-JSON trace (gzipped or not)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _kernel_family(name: str) -> str:
    """A kernel's name with its instance numbers stripped: `loop_fusion_12` -> `loop_fusion`."""
    return re.sub(r"(_\d+)+$", "", re.sub(r"\.\d+$", "", name))


def _union(intervals) -> float:
    """Total length covered by (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def summarize(events: list[dict]) -> dict:
    """Per-step figures (microseconds) of a trace whose steps are `STEP` annotations: wall,
    device busy (None where the trace has no device), device kernels and host events on the
    steps' thread by total time a step (largest first)."""
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    steps = sorted((e for e in spans if e["name"] == STEP), key=lambda e: e["ts"])
    if not steps:
        raise ValueError(f"no {STEP!r} events in the trace")
    n, first, last = len(steps), steps[0]["ts"], steps[-1]["ts"] + steps[-1]["dur"]
    inside = [e for e in spans if first <= e["ts"] < last]
    devices = {pid for pid, name in names.items() if name.startswith("/device:")}
    lanes = {k: v for k, v in threads.items() if k[0] in devices}
    streams = {k for k, v in lanes.items() if v.startswith("Stream")} or set(lanes)
    kernels = [e for e in inside if (e["pid"], e["tid"]) in streams]
    per_kernel = collections.Counter()
    for e in kernels:
        per_kernel[_kernel_family(e["name"])] += e["dur"]
    host = collections.Counter()
    thread = (steps[0]["pid"], steps[0]["tid"])
    for e in inside:
        if (e["pid"], e["tid"]) == thread and e["name"] != STEP:
            host[e["name"]] += e["dur"]
    return dict(
        steps=n, wall_us=(last - first) / n,
        lanes=sorted(lanes[k] for k in streams),
        device_busy_us=_union((e["ts"], e["ts"] + e["dur"]) for e in kernels) / n if streams else None,
        kernels_us=sum(e["dur"] for e in kernels) / n if streams else None,
        kernels=[(k, v / n) for k, v in per_kernel.most_common(TOP)],
        host=[(k, v / n) for k, v in host.most_common(TOP)],
    )


def report_summary(s: dict, rep) -> None:
    rep.add("profiled step wall (trace)", s["wall_us"] / 1e3, "ms", f"{s['steps']} steps")
    if s["device_busy_us"] is None:
        rep.add("device lanes", "none", note="no /device: process in the trace (a CPU run)")
    else:
        busy, wall = s["device_busy_us"], s["wall_us"]
        rep.add("device lanes", len(s["lanes"]), "", ", ".join(s["lanes"])[:300])
        rep.add("device busy a step", busy / 1e3, "ms", f"{100 * busy / wall:.3g}% of the step; kernels "
                f"{s['kernels_us'] / 1e3:.3g} ms summed over streams")
        rep.add("device idle a step", (wall - busy) / 1e3, "ms", "gaps between kernels: launches, host, syncs")
        for name, us in s["kernels"]:
            rep.add(f"kernel {name}", us, "us/step")
    for name, us in s["host"]:
        rep.add(f"host {name}", us, "us/step")
