"""The stage process: load one stage, warm it up, then receive -> schedule -> run -> send.

Started by `StageClient` as a fresh interpreter (`python -m omni_jax.runtime.stage_worker
CONFIG_JSON`): spawn semantics, never a fork after JAX is imported, and unlike
multiprocessing's spawn it does not re-import the caller's main module.
It connects to the two ipc sockets the orchestrator bound, loads its stage of the
checkpoint, compiles every bucket, and only then says `Ready` (stage_loop.py). The
process exits on `Shutdown`, and also when its parent dies (a watchdog thread notices
the parent pid change, also during warm-up). The device variables are set before JAX
creates its backend (at the stage's first array), so each stage sees only its own device.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import threading
import time

import jax

from ..paths import cache_root
from .stage_loop import follow_stage, serve_stage

log = logging.getLogger("omni_jax.stage")


def _exit_with_parent(parent_pid: int, ipc_dir: str | None, period_s: float = 0.5) -> None:
    """Exit at once when the parent process is gone (no orphan stages), even mid-compile,
    removing the parent's socket directory (a killed parent could not) if `ipc_dir`."""
    def watch():
        while True:
            time.sleep(period_s)
            if os.getppid() != parent_pid:
                if ipc_dir is not None:
                    shutil.rmtree(ipc_dir, ignore_errors=True)
                os._exit(0)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def _configure_device(stage: dict) -> None:
    """Per-stage devices and memory fraction, before JAX creates its backend."""
    # A stage sees only its own GPUs (the runner then finds them at local positions 0..n-1,
    # engine/sharding.py); `device: N` has already become `devices: [N]` (config/stage.py).
    devices = stage.get("devices") or ([stage["device"]] if stage.get("device") is not None else None)
    if devices:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
    if stage.get("memory_fraction") is not None:
        os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(stage["memory_fraction"])
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"


def configure_compile_cache() -> None:
    """JAX's persistent compilation cache under the OmniJax cache, so a stage started again,
    after a restart or in the next run, loads its compiled buckets instead of compiling them.
    Unbounded, as JAX's default: it grows with each model and pipeline shape (delete the
    directory to reclaim it). `JAX_COMPILATION_CACHE_DIR` chooses another place ("" turns it off).
    Every program is kept, not only those that took JAX's default second to compile: a stage's
    small ones (samplers, input uploads, a small model's steps) are most of its programs (the
    tiny thinker: 86, 79 of them under a second), and compiling them again took 10 of the 18 s
    its start took (6 s with all loaded). `JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS` sets another bar."""
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ and jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", os.path.join(cache_root(), "jax-compile-cache"))
        if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def _set_up_process(stage: dict, process_id: int) -> None:
    """Logging, devices and compilation cache of a stage process, before JAX's backend exists."""
    name = stage["name"] + (f" process {process_id}" if process_id else "")
    logging.basicConfig(level=os.environ.get("OMNI_JAX_LOG_LEVEL", "WARNING"),
                        format=f"[omni-jax {name} %(levelname)s] %(message)s")
    _configure_device(stage)
    configure_compile_cache()


def stage_main(stage_json: str, ckpt_dir: str, family: str, ipc_dir: str, parent_pid: int,
               async_chunk: bool = False, process_id: int = 0, coordinator: str | None = None) -> None:
    """Entry point of a stage process (arguments are plain strings: nothing is unpickled).
    `process_id` > 0: another process of a multi-process stage, started by process 0 (its
    parent) with the address of its jax.distributed coordinator (runtime/spmd.py)."""
    # The orchestrator's socket directory is its stage process's to clean up, not a follower's.
    _exit_with_parent(parent_pid, ipc_dir if process_id == 0 else None)
    stage = json.loads(stage_json)
    _set_up_process(stage, process_id)
    if process_id:
        follow_stage(stage, ckpt_dir, family, ipc_dir, async_chunk, process_id, coordinator)
    else:
        serve_stage(stage, ckpt_dir, family, ipc_dir, async_chunk)


def follow_remote(stage: dict, ckpt_dir: str, family: str, async_chunk: bool, process_id: int) -> None:
    """Process `process_id` of a stage spanning hosts, started by hand on its host
    (`omni-jax stage-process`); it reaches process 0 at the stage's coordinator_address."""
    _set_up_process(stage, process_id)
    if "OMNI_JAX_LOG_LEVEL" not in os.environ:
        logging.getLogger("omni_jax.stage").setLevel(logging.INFO)  # say when it is ready, by hand
    log.info("joining process 0 at %s", stage["coordinator_address"])
    follow_stage(stage, ckpt_dir, family, None, async_chunk, process_id, stage["coordinator_address"])


def main(argv=None) -> None:
    """`python -m omni_jax.runtime.stage_worker JSON`: JSON holds stage_main's keyword arguments."""
    args = json.loads((argv or sys.argv[1:])[0])
    stage_main(**args)
    _leave()


def _leave() -> None:
    """End the process without the interpreter's teardown, which took 1.5 s of the tiny
    model's stages' exits after their work was done (JAX clearing its backend at exit, then
    the modules' own). A stage leaves nothing to it: its sockets are flushed and closed, the caches'
    files written whole as they were made, no process or thread of its own left."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader gone, or the stream closed: nothing to keep
            pass
    os._exit(0)


if __name__ == "__main__":
    main()
