"""Random weights for any stage (models/random_weights.py): the rule per parameter kind, the
numpy draw the tiny model's values depend on, and the on-device draw the GPU check builds
real-size stages with."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from omni_jax.models.qwen2_5_omni.tiny import tiny_config
from omni_jax.models.random_weights import device_params, param_init, random_module, random_params
from omni_jax.models.registry import stages_of


def _talker():
    spec = stages_of("qwen2_5_omni")["talker"]
    return spec, spec.parse_config(tiny_config()["talker_config"])


def test_param_init_rules():
    assert param_init(("x", "bias"), (8,)) == ("const", 0.0)
    assert param_init(("x", "input_layernorm", "weight"), (8,)) == ("const", 1.0)
    assert param_init(("x", "gamma"), (8,)) == ("const", 0.01)
    assert param_init(("x", "kernel"), (3, 4, 5)) == ("normal", 12)      # conv: every axis but out
    assert param_init(("x", "embedding"), (100, 6)) == ("normal", 6)
    assert param_init(("x", "experts", "gate_up_proj"), (8, 32, 16)) == ("normal", 16)  # [E, out, in]
    with pytest.raises(ValueError, match="no random initializer for parameter x/mystery"):
        param_init(("x", "mystery"), (2, 2))


def test_numpy_draw_is_seeded_and_typed():
    spec, cfg = _talker()
    a = random_params(spec.build, cfg, np.random.default_rng(3))
    b = random_params(spec.build, cfg, np.random.default_rng(3), jnp.bfloat16)
    assert a.keys() == b.keys()
    k = ("model", "embed_tokens", "embedding")
    assert a[k].dtype == np.float32 and b[k].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(b[k], np.float32), a[k], rtol=1e-2, atol=1e-2)


def test_device_draw_matches_the_rules_and_builds_a_working_module():
    spec, cfg = _talker()
    arrays = device_params(spec.build, cfg, jnp.bfloat16, seed=1)
    for path, a in arrays.items():
        assert isinstance(a, jax.Array) and a.dtype == jnp.bfloat16, path
        kind, x = param_init(path, a.shape)
        v = np.asarray(a, np.float32)
        if kind == "const":
            assert np.all(v == x), path
        elif v.size >= 4096:  # the std is 1/sqrt(fan-in), every value fresh
            assert abs(v.std() * np.sqrt(x) - 1) < 0.1, path
            assert len(np.unique(v)) > 100, path
    # Different parameters of one shape get different values; another seed, other values.
    layers = [np.asarray(arrays[("model", "layers", i, "mlp", "gate_proj", "kernel")], np.float32)
              for i in range(cfg.text.num_layers)]
    assert not np.array_equal(layers[0], layers[1])
    other = device_params(spec.build, cfg, jnp.bfloat16, seed=2)
    assert not np.array_equal(np.asarray(other[("model", "embed_tokens", "embedding")], np.float32),
                              np.asarray(arrays[("model", "embed_tokens", "embedding")], np.float32))
    module = random_module(spec.build, cfg, jnp.bfloat16, seed=1)
    state = dict(nnx.to_flat_state(nnx.state(module, nnx.Param)))
    assert state.keys() == arrays.keys()
    assert all(np.isfinite(np.asarray(v.get_value(), np.float32)).all() for v in state.values())
