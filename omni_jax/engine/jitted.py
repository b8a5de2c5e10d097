"""The jitted programs one object runs, by name (`Jitted`).

Every object that compiles programs (the runner's steps, the sampler, media encoders,
vocoder synthesizers) keeps them in one `Jitted` namespace and calls them through it, so
that what it compiles is declared in one place: warm-up compiles them, and the GPU tier
(`omni_jax.gpu.programs`) records each call a warm-up makes (`record`) to compile the same
program at real size for a GPU it does not have.
"""

from __future__ import annotations

import functools
import os
import types
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable

import jax


# Compiler options of the programs whose matmuls go to cuBLAS instead of XLA's Triton GEMM, which
# finds no tile for some of them ("Couldn't find output tile sizes", deviceless compiles): a bf16
# [patches, 1280] one of Qwen2.5's vision encoder on A100, an f32 [640, 32] one of the tiny
# Qwen2.5's audio encoder and an f32 [2600, 1024] one of Qwen3-Omni's code2wav (8 windows of
# 325 frames) on H100. The encoders and the fp32 vocoders use them; other backends ignore them.
NO_TRITON_GEMM = {"xla_gpu_enable_triton_gemm": False}

# XLA replays a program as a CUDA graph and re-records the whole graph (~800 commands for the
# 30B-A3B's step) whenever one of its buffers moved. Under async scheduling the step's
# temporaries moved every step (other programs run between two steps), while its inputs and
# outputs stay put (stable_buffers.py); SKIP_TEMP maps the temporaries at one virtual address
# of their own from call to call. On the H200 (README "Measured on a GPU"): the 30B-A3B's b1
# decode step 8.31 -> 3.77 ms, the 7B's 5.02 -> 4.10 ms.
_UPDATE_MODE = "xla_gpu_command_buffer_update_mode"


@functools.cache
def stable_temporaries() -> dict:
    """Compiler options of a per-step program whose temporaries keep their addresses: {} where
    this jaxlib has no SKIP_TEMP mode (before 0.11) or the user's XLA_FLAGS choose the mode."""
    if f"--{_UPDATE_MODE}" in os.environ.get("XLA_FLAGS", ""):
        return {}
    options = {_UPDATE_MODE: "SKIP_TEMP"}
    try:  # an unknown enum value is refused at compile time (20 ms, once per process)
        jax.jit(lambda: 0, compiler_options=options).lower().compile()
    except jax.errors.JaxRuntimeError:
        return {}
    return options


# Threads a warm-up compiles its programs on (`compile_workers`); "1" compiles one at a time.
COMPILE_WORKERS_ENV = "OMNI_JAX_COMPILE_WORKERS"
# At most 4 by default: an XLA compile already uses more than one core, holds its module in
# memory (~0.2 GiB more a thread for the real vocoder's programs), and on a GPU autotunes its
# GEMMs and convolutions by timing them on the device, beside the other threads' timings.
_MAX_COMPILE_WORKERS = 4


def compile_workers() -> int:
    """$OMNI_JAX_COMPILE_WORKERS, else one thread per CPU this process may run on, at most 4."""
    value = os.environ.get(COMPILE_WORKERS_ENV)
    if value is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return min(_MAX_COMPILE_WORKERS, cpus)
    try:
        workers = int(value)
    except ValueError:
        workers = 0
    if workers < 1:
        raise ValueError(f"{COMPILE_WORKERS_ENV} must be a positive integer, got {value!r}")
    return workers


def compile_ahead(calls: Iterable[tuple], workers: int | None = None, desc: str | None = None) -> int:
    """Compile the program of each (jitted fn, args[, kwargs]) of `calls` on `workers`
    threads (`compile_workers()`); returns how many. A later `fn(*args, **kwargs)` runs its
    program without compiling: JAX keeps what `fn.lower(...).compile()` built in fn's own cache,
    for arguments alike in shape, dtype and placement (committed or not). Tracing and lowering
    hold the GIL, so they run here, one program after the other, each handed to the threads as
    soon as it is lowered; XLA's compile does not (a warm-up is mostly compiling: README). A
    callable without `lower` (a `Jitted.record` wrapper) is left to its call. `desc`: a progress
    bar of that name over the compiles. The first compile error is raised once every thread is done."""
    workers = compile_workers() if workers is None else workers
    if workers <= 1:
        return 0
    # Lowering reads only the arguments' shapes, dtypes and placement: a warm-up's arguments,
    # made program by program (`calls` may be a generator), need not all be held at once.
    calls = [(c[0], _abstract(c[1]), c[2] if len(c) > 2 else {}) for c in calls if hasattr(c[0], "lower")]
    from tqdm import tqdm

    with tqdm(total=len(calls), desc=desc, unit="program", disable=desc is None) as bar, \
            ThreadPoolExecutor(workers, thread_name_prefix="compile") as pool:
        futures = []
        for fn, args, kwargs in calls:
            futures.append(pool.submit(fn.lower(*args, **kwargs).compile))
            futures[-1].add_done_callback(lambda _: bar.update())
    for f in futures:
        f.result()
    return len(futures)


def _abstract(tree):
    """`tree` with its device arrays as shapes, dtypes and placement (an uncommitted array's: none,
    as JAX keys its programs)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if x.committed else None,
                                                       weak_type=x.aval.weak_type)
                        if isinstance(x, jax.Array) else x, tree)


def warm_up(calls: Iterable[tuple[Callable, tuple]], workers: int | None = None) -> None:
    """Run each (jitted fn, args) once, their programs compiled side by side first (`compile_ahead`)."""
    calls = list(calls)
    compile_ahead(calls, workers)
    for fn, args in calls:
        jax.block_until_ready(fn(*args))


class Jitted(types.SimpleNamespace):
    """Named jitted functions: `jitted.step(...)` calls the program named "step"."""

    def record(self, wrap: Callable[[str, Callable], Callable]) -> None:
        """Route every program through `wrap(name, fn)`, which returns what is called instead."""
        for name, fn in list(vars(self).items()):
            setattr(self, name, wrap(name, fn))
