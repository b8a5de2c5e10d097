"""Warm-ups compile their programs side by side (`engine.jitted.compile_ahead`): what the
threads compile, the later calls run without compiling."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omni_jax.engine.jitted import COMPILE_WORKERS_ENV, compile_ahead, compile_workers, warm_up
from omni_jax.engine.runner import compilation_count
from omni_jax.engine.sampling_params import SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


# ------------------------------------------------------------------ an AR stage's warm-up
# The programs an AR engine compiles ahead (`AREngine.warmup`): the steps and their integer
# uploads (fed tokens or not), prompt logprobs, sampler variants, the pre-sampler and after-sample
# programs, sampled-token embeddings.
_AHEAD = {"_forward", "into", "upload_fed", "_prompt_logprobs", "_embed", "sample", "shape_logits", "_after_sample"}


class _Compiles(logging.Handler):
    """The names of the programs XLA compiled or read from JAX's persistent compilation cache
    (`jax_log_compiles`), on which thread, in order."""

    PATTERNS = (re.compile(r"Finished XLA compilation of jit\((\w+)\)"),
                re.compile(r"Persistent compilation cache hit for 'jit_(\w+)'"))
    LOGGERS = ("jax._src.dispatch", "jax._src.compiler")

    def __init__(self):
        super().__init__(logging.WARNING)
        self.seen: list[tuple[str, str]] = []

    def emit(self, record):
        for pattern in self.PATTERNS:
            m = pattern.match(record.getMessage())
            if m:
                self.seen.append((m.group(1), record.threadName))

    @contextlib.contextmanager
    def listening(self):
        jax.config.update("jax_log_compiles", True)  # not the context manager: its value is the main thread's
        for name in self.LOGGERS:
            logging.getLogger(name).addHandler(self)
        try:
            yield self
        finally:
            jax.config.update("jax_log_compiles", False)
            for name in self.LOGGERS:
                logging.getLogger(name).removeHandler(self)


def _tiny_engine(family: str, commit: bool = False, tensor_parallel: int = 1):
    """The tiny Qwen2.5-Omni thinker, or the tiny Qwen3-Omni talker (rich inputs, the code
    predictor after sampling), random weights."""
    from flax import nnx

    from omni_jax.engine.ar_engine import AREngine, EngineConfig
    from omni_jax.engine.runner import RunnerConfig
    from omni_jax.models.qwen2_5_omni import tiny as qwen2_5_tiny
    from omni_jax.models.qwen3_omni import tiny as qwen3_tiny
    from omni_jax.models.qwen3_omni.stages import talker_engine
    from omni_jax.models.random_weights import random_module
    from omni_jax.models.registry import stages_of

    stage, tiny = ("thinker", qwen2_5_tiny) if family == "qwen2_5_omni" else ("talker", qwen3_tiny)
    spec = stages_of(family)[stage]
    cfg = spec.parse_config(tiny.tiny_config()[spec.config_key])
    model = random_module(spec.build, cfg, jnp.float32, seed=0)
    if commit:
        nnx.update(model, jax.device_put(nnx.state(model), jax.devices()[0]))
    runner = RunnerConfig(num_blocks=9, block_size=16, max_num_seqs=2, max_num_batched_tokens=32,
                          max_model_len=64, token_buckets=(16, 32), decode_buckets=(1, 2),
                          sampled_embeddings=stage == "talker",  # (a Qwen3 thinker's, here to compile one)
                          tensor_parallel_size=tensor_parallel)
    if stage == "talker":
        return talker_engine(model, cfg, runner)
    text = cfg.text
    return AREngine(model, EngineConfig(runner=runner, vocab_size=text.vocab_size),
                    num_layers=text.num_layers, num_kv_heads=text.num_kv_heads, head_dim=text.head_dim,
                    hidden_size=text.hidden_size)


def warm_up_and_serve(family: str, commit: bool = False, tensor_parallel: int = 1) -> dict:
    """The programs the tiny engine's warm-up compiled ahead (name, thread) and after, and the
    compilations of a request served after it."""
    import omni_jax.engine.ar_engine as ar_engine

    # The sampler's functions are the module's: a program an earlier test compiled at these shapes
    # would be found in JAX's caches of this process, not compiled (and not seen) here.
    jax.clear_caches()
    engine = _tiny_engine(family, commit, tensor_parallel)
    engine.grammars = True  # as a served text stage: the pre-sampler program too (no tokenizer here)
    compiles, marks, real = _Compiles(), [], ar_engine.compile_ahead
    with pytest.MonkeyPatch.context() as mp, compiles.listening():
        mp.setattr(ar_engine, "compile_ahead", lambda *a, **k: (real(*a, **k), marks.append(len(compiles.seen)))[0])
        mp.setenv(COMPILE_WORKERS_ENV, "2")
        engine.warmup(progress=False)
    warm = compilation_count()
    engine.add_request("r", [1, 2, 3, 4, 5], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True,
                                                                prompt_logprobs=2))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert all(out.error is None for out in outs)
    assert any(out.prompt_logprobs for out in outs)  # the prompt logprobs program ran too
    return dict(ahead=compiles.seen[:marks[0]], after=compiles.seen[marks[0]:], serving=compilation_count() - warm)


def _check(seen: dict, expected: set) -> None:
    assert {name for name, _ in seen["ahead"]} >= expected, seen["ahead"]
    assert all(thread.startswith("compile") for name, thread in seen["ahead"] if name in _AHEAD), seen["ahead"]
    assert not [name for name, _ in seen["after"] if name in expected], seen["after"]
    assert seen["serving"] == 0


@pytest.mark.parametrize("family,commit", [("qwen2_5_omni", False), ("qwen2_5_omni", True), ("qwen3_omni", False)])
def test_an_ar_warm_up_runs_what_its_threads_compiled(family, commit):
    """Every program of the warm-up compiles on the threads; the calls that follow compile
    none of them (arguments alike in placement: committed parameters too), and serving after
    compiles nothing."""
    _check(warm_up_and_serve(family, commit),
           _AHEAD if family == "qwen3_omni" else _AHEAD - {"_after_sample", "_embed"})  # a thinker's: neither


def test_a_tensor_parallel_warm_up_runs_what_its_threads_compiled():
    """The same over a 2-device mesh (fake CPU devices: a process of its own)."""
    code = ("import json, test_compile_ahead as t\n"
            "print('RESULT' + json.dumps(t.warm_up_and_serve('qwen2_5_omni', tensor_parallel=2)))\n")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    seen = json.loads(out.stdout.split("RESULT", 1)[1])
    _check(seen, _AHEAD - {"_after_sample", "_embed"})
