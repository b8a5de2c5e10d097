"""A one-device engine whose caller committed its parameters to a device
(`jax.device_put(params, device)`, as a notebook placing a model on one GPU of several does).

JAX compiles a program again when an input's committedness changes, and a step's outputs are
committed wherever its parameters are: the runner commits every step input there too, so the
programs warm-up compiled are the ones serving runs. Torch-free, on the tiny Qwen2.5-Omni thinker
with random weights.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from omni_jax.engine.ar_engine import AREngine, EngineConfig
from omni_jax.engine.runner import RunnerConfig
from omni_jax.engine.sampling_params import SamplingParams
from omni_jax.engine.sharding import committed_device
from omni_jax.models.qwen2_5_omni.tiny import tiny_config
from omni_jax.models.random_weights import random_module
from omni_jax.models.registry import stages_of


def _engine(commit: bool) -> AREngine:
    spec = stages_of("qwen2_5_omni")["thinker"]
    cfg = spec.parse_config(tiny_config()[spec.config_key])
    model = random_module(spec.build, cfg, jnp.float32, seed=0)
    if commit:
        nnx.update(model, jax.device_put(nnx.state(model), jax.devices()[0]))
    text = cfg.text
    runner = RunnerConfig(num_blocks=33, block_size=16, max_num_seqs=4, max_num_batched_tokens=64,
                          max_model_len=128, token_buckets=(32, 64), decode_buckets=(1, 2, 4))
    return AREngine(model, EngineConfig(runner=runner, vocab_size=text.vocab_size),
                    num_layers=text.num_layers, num_kv_heads=text.num_kv_heads, head_dim=text.head_dim,
                    hidden_size=text.hidden_size)


def _serve(engine: AREngine) -> dict:
    """Greedy requests of several lengths (prefill and decode buckets), one asking for prompt
    logprobs, and one seeded sampled request with penalties and logprobs (the full sampler)."""
    rng = np.random.default_rng(0)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    requests = {f"g{n}": (rng.integers(0, 1000, n).tolist(), greedy) for n in (5, 40, 70)}
    requests["p"] = (rng.integers(0, 1000, 9).tolist(), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=2))
    requests["s"] = (rng.integers(0, 1000, 12).tolist(),
                     SamplingParams(temperature=0.8, seed=3, repetition_penalty=1.2, top_k=20, logprobs=2,
                                    max_tokens=6, ignore_eos=True))
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    tokens = {rid: [] for rid in requests}
    for _ in range(200):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            assert out.error is None, out.error
            tokens[out.request_id] += out.new_token_ids
    return tokens


@pytest.fixture(scope="module")
def uncommitted_tokens():
    engine = _engine(commit=False)
    assert engine.runner.placement is None
    return _serve(engine)


def test_committed_parameters_compile_nothing_after_warmup(uncommitted_tokens):
    engine = _engine(commit=True)
    assert engine.runner.placement == jax.sharding.make_single_device_sharding(jax.devices()[0])
    assert all(k.committed for pair in engine.runner.kv_caches for k in pair)
    engine.warmup(progress=False)
    warm = engine.num_compilations
    tokens = _serve(engine)
    assert engine.num_compilations == warm
    assert tokens == uncommitted_tokens
    assert all(len(t) == 6 for t in tokens.values())


def test_where_committed_parameters_are():
    on_first = jax.device_put(np.zeros(2, np.float32), jax.devices()[0])
    first = jax.sharding.make_single_device_sharding(jax.devices()[0])
    assert committed_device({"a": on_first, "b": np.zeros(2)}) == first
    assert committed_device({"a": jnp.zeros(2)}) is None  # uncommitted: left on the default device
    # Two devices (fake CPU ones, made before jax is imported: a process of its own).
    code = ("import jax, numpy as np; from omni_jax.engine.sharding import committed_device\n"
            "a, b = (jax.device_put(np.zeros(2), d) for d in jax.devices())\n"
            "try:\n    committed_device({'a': a, 'b': b})\nexcept ValueError as e:\n    print(e)\n")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "committed to 2 devices" in out.stdout, out.stdout + out.stderr
