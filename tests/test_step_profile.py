"""The GPU check's `profile` part reads a served step's time out of a profiler trace: its
summary of a trace laid out as a GPU's (device stream lanes, XLA's op lines over them)."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

# Imported from the check's folder, which is then taken off the path again (as test_gpu_check
# does): a module name there would shadow a package of the same name in later tests.
_path = list(sys.path)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"))
try:
    import step_profile
finally:
    sys.path[:] = _path


def _meta(pid, name, tid=None):
    e = {"ph": "M", "pid": pid, "name": "thread_name" if tid is not None else "process_name", "args": {"name": name}}
    if tid is not None:
        e["tid"] = tid
    return e


def _x(pid, tid, name, ts, dur):
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}


def gpu_like_trace():
    """Two 100 us steps; on two streams: kernels overlapping across streams, one before the
    first step (not counted); an XLA op line covering each whole step (not a kernel)."""
    host, gpu = 1, 2
    events = [_meta(host, "/host:CPU"), _meta(host, "python", tid=10), _meta(gpu, "/device:GPU:0"),
              _meta(gpu, "Stream #13(Compute)", tid=13), _meta(gpu, "Stream #14(Memcpy)", tid=14),
              _meta(gpu, "XLA Ops", tid=99)]
    for step, t in enumerate((1000, 1100)):
        events += [_x(host, 10, step_profile.STEP, t, 100), _x(host, 10, "PjitFunction(_forward)", t + 5, 30),
                   _x(host, 10, "command_buffer::update", t + 10, 20),
                   _x(gpu, 13, f"loop_fusion_{step + 3}", t + 10, 20), _x(gpu, 13, "paged_decode_bs16_ppb4_k4", t + 40, 30),
                   _x(gpu, 14, "MemcpyH2D", t + 60, 20), _x(gpu, 99, "fusion.7", t, 100)]
    events.append(_x(gpu, 13, "loop_fusion_1", 900, 50))
    return events


def test_summary_of_a_gpu_like_trace(tmp_path):
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": gpu_like_trace()}, f)
    s = step_profile.summarize(step_profile.load_events(str(path)))
    assert s["steps"] == 2 and s["wall_us"] == 100
    assert s["lanes"] == ["Stream #13(Compute)", "Stream #14(Memcpy)"]
    # 10-30, 40-70 and 60-80 (two streams overlapping): 60 us busy, 70 summed
    assert s["device_busy_us"] == 60 and s["kernels_us"] == 70
    assert s["kernels"] == [("paged_decode_bs16_ppb4_k4", 30), ("loop_fusion", 20), ("MemcpyH2D", 20)]
    assert dict(s["host"]) == {"PjitFunction(_forward)": 30, "command_buffer::update": 20}


def test_summary_of_a_host_only_trace():
    events = [e for e in gpu_like_trace() if e["pid"] == 1]
    s = step_profile.summarize(events)
    assert s["device_busy_us"] is None and s["kernels"] == [] and s["lanes"] == []


def test_a_trace_without_steps_is_an_error():
    with pytest.raises(ValueError, match="engine step"):
        step_profile.summarize([_x(1, 10, "PjitFunction(f)", 0, 5)])
