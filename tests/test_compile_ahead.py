"""Warm-ups compile their programs side by side (`engine.jitted.compile_ahead`): what the
threads compile, the later calls run without compiling."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omni_jax.engine.jitted import COMPILE_WORKERS_ENV, compile_ahead, compile_workers, warm_up
from omni_jax.engine.runner import compilation_count


def _layers(x, w):
    for i in range(8):
        x = jnp.tanh(x @ w + i)
    return x


def _calls(fn, rows=(1, 2, 3, 5)):
    w = np.full((16, 16), 0.01, np.float32)
    return [(fn, (np.ones((n, 16), np.float32), w)) for n in rows]


def test_programs_compiled_ahead_run_without_compiling():
    fn = jax.jit(_layers)
    calls = _calls(fn)
    want = [np.asarray(_layers(*args)) for _, args in calls]  # op by op (eager ops compile too)
    before = compilation_count()
    assert compile_ahead(calls, workers=3) == 4
    assert compilation_count() - before >= 4  # compiled on the threads, counted like any other
    compiled = compilation_count()
    for (f, args), ref in zip(calls, want):
        np.testing.assert_allclose(np.asarray(f(*args)), ref, rtol=1e-6)
    assert compilation_count() == compiled


def test_one_worker_leaves_the_compiles_to_the_calls():
    fn = jax.jit(_layers)
    calls = _calls(fn, rows=(7, 9))
    assert compile_ahead(calls, workers=1) == 0
    before = compilation_count()
    warm_up(calls, workers=1)
    assert compilation_count() - before >= 2


def test_warm_up_runs_every_call_once():
    seen = []

    def recorder(x, w):  # a `Jitted.record` wrapper has no `lower`: only called
        seen.append(x.shape)

    fn = jax.jit(_layers)
    calls = _calls(fn, rows=(4, 6)) + [(recorder, (np.zeros((2, 16)), None))]
    warm_up(calls, workers=2)
    assert seen == [(2, 16)]
    before = compilation_count()
    fn(*calls[0][1])
    assert compilation_count() == before


def test_a_compile_error_is_raised():
    bad = jax.jit(_layers, compiler_options={"xla_no_such_option_in_any_xla": True})
    with pytest.raises(Exception, match="xla_no_such_option_in_any_xla"):
        compile_ahead(_calls(bad, rows=(1,)) + _calls(jax.jit(_layers), rows=(11,)), workers=2)


def test_compile_workers_from_the_environment(monkeypatch):
    monkeypatch.delenv(COMPILE_WORKERS_ENV, raising=False)
    assert 1 <= compile_workers() <= 4
    monkeypatch.setenv(COMPILE_WORKERS_ENV, "3")
    assert compile_workers() == 3
    for bad in ("0", "-2", "two", ""):
        monkeypatch.setenv(COMPILE_WORKERS_ENV, bad)
        with pytest.raises(ValueError, match=COMPILE_WORKERS_ENV):
            compile_workers()
