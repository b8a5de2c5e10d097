"""Run the compile worker in the GPU compile environment from any interpreter.

The worker needs JAX's CUDA plugin and pip's ptxas, which live in their own venv
(`.venv-gpu`, made by `.ci/setup`; see `omni_jax.gpu`). This module only starts it as a
subprocess, one per target, side by side, and reads its JSON.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GPU_PYTHON_ENV = "OMNI_JAX_GPU_PYTHON"


def gpu_python() -> str:
    """The GPU environment's interpreter: $OMNI_JAX_GPU_PYTHON, else <repo>/.venv-gpu."""
    path = os.environ.get(GPU_PYTHON_ENV) or str(REPO / ".venv-gpu" / "bin" / "python")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"no GPU compile environment at {path}: run `bash .ci/setup` (it creates .venv-gpu with "
            f"jax-cuda12-plugin and ptxas) or set {GPU_PYTHON_ENV}")
    return path


def cuda_data_dir() -> str:
    """pip's CUDA compiler directory in this interpreter, with the ptxas and libdevice that XLA
    and the kernel checks run: CUDA 12's wheel (nvidia-cuda-nvcc-cu12) is the package
    nvidia.cuda_nvcc, CUDA 13's (nvidia-cuda-nvcc 13) lays every component out under nvidia/cu13."""
    for name in ("nvidia.cuda_nvcc", "nvidia.cu13"):
        try:
            return str(Path(list(importlib.import_module(name).__path__)[0]))
        except ImportError:
            continue
    raise FileNotFoundError("no pip CUDA compiler here: install nvidia-cuda-nvcc-cu12 (CUDA 12) "
                            "or nvidia-cuda-nvcc 13 (CUDA 13)")


def worker_env(python: str) -> dict:
    """Environment of a worker: CPU as JAX's platform (the CUDA plugin then registers without
    a driver), XLA pointed at pip's ptxas, and this checkout first on the path."""
    find = "from omni_jax.gpu.client import cuda_data_dir; print(cuda_data_dir())"
    site = subprocess.run([python, "-c", find], capture_output=True, text=True, check=True,
                          env=dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")).stdout.strip()
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
               XLA_FLAGS=f"--xla_gpu_cuda_data_dir={site}", TF_CPP_MIN_LOG_LEVEL="2")
    return env


def run_workers(targets, select: str = "tier", extra_args=(), log=None, timeout: float = 1800) -> dict:
    """Run one worker per target in parallel; returns {target: result dict}.

    A worker that fails raises RuntimeError with the end of its stderr.
    """
    python = gpu_python()
    env = worker_env(python)
    procs = {}
    with tempfile.TemporaryDirectory(prefix="omni_jax_gpu_") as tmp:
        try:
            for t in targets:
                out = os.path.join(tmp, f"{t}.json")
                err = open(os.path.join(tmp, f"{t}.log"), "w")
                cmd = [python, "-m", "omni_jax.gpu.worker", "--target", t, "--select", select, "--out", out,
                       *extra_args]
                procs[t] = (subprocess.Popen(cmd, env=env, stdout=err, stderr=subprocess.STDOUT, cwd=str(REPO)),
                            out, err)
            results = {}
            for t, (proc, out, err) in procs.items():
                proc.wait(timeout=timeout)
                err.close()
                log_text = Path(err.name).read_text()
                if log is not None:
                    log.write(log_text)
                if proc.returncode != 0 or not os.path.isfile(out):
                    raise RuntimeError(f"compile worker for {t} failed (exit {proc.returncode}):\n{log_text[-3000:]}")
                results[t] = json.loads(Path(out).read_text())
            return results
        finally:  # a failed or timed-out run leaves no worker compiling on
            for proc, _, err in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                err.close()


def summary(results: dict) -> str:
    """One line per compiled program: target, name, verdict, seconds, memory, launches (of
    which outside command buffers, and the graphs), bytes moved (Pallas tables aside)."""
    lines = []
    for t, r in results.items():
        lines.append(f"# {t}: {len(r['reports'])} programs in {r['seconds']:.0f} s, "
                     f"peak {r['peak_rss_bytes'] / 2**30:.2f} GiB")
        for p in r["reports"]:
            k = max(p["kernels"], key=lambda k: k["shared_memory"], default=None)
            res = (f"smem {k['shared_memory']} regs {k['registers']} spills {k['spill_stores']}"
                   if k else "")
            lines.append(f"{t} {p['name']}: {'ok' if p['ok'] else 'FAIL ' + p['error'][:160]} "
                         f"{p['seconds']:.1f}s temp {p['temp_bytes'] / 2**20:.0f} MiB alias "
                         f"{p['alias_bytes'] / 2**30:.2f} GiB launches {p['launches']} "
                         f"({len(p['outside_launches'])} outside, {p['command_buffers']} graphs) "
                         f"moved {p['bytes_accessed'] / 2**30:.2f} GiB {res}")
    return "\n".join(lines)


if __name__ == "__main__":
    # python -m omni_jax.gpu.client [--full] [h100 a100]: compile and list every program.
    full = "--full" in sys.argv
    names = [a for a in sys.argv[1:] if not a.startswith("--")] or ["h100", "a100"]
    print(summary(run_workers(names, "full" if full else "tier", timeout=4 * 3600)))
