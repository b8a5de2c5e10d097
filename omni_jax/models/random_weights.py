"""Random parameters for any stage of any family, with no checkpoint and no torch.

One rule per parameter kind, as flax's default initializers draw them (biases and log-scale
activations 0, norm scales 1, kernels, embeddings and expert weights of variance 1/fan-in,
layer scales 0.01), and two ways to draw: with numpy on the host (normal; the tiny demo
model, whose values must stay the same from run to run), or with JAX on the default device
(uniform of the same variance, cheaper to compile; a real-size stage for the GPU check, never
through host memory).
The module is only traced for its shapes (`abstract_module`): running flax's initializers
compiles one program per parameter shape.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .registry import abstract_module

LAYER_SCALE = 0.01  # ConvNeXt layer scales (Qwen3's code2wav `gamma`): transformers' initial value


def param_init(path: tuple, shape: tuple) -> tuple[str, float]:
    """("const", value) or ("normal", fan-in: the std is 1/sqrt of it) for the parameter at
    `path` of `shape`."""
    leaf = path[-1]
    if leaf in ("bias", "alpha", "beta"):
        return "const", 0.0
    if leaf == "gamma":
        return "const", LAYER_SCALE
    if leaf in ("scale", "weight") and len(shape) == 1:
        return "const", 1.0
    if leaf in ("embedding", "gate_up_proj", "down_proj"):  # experts: [E, out, in]
        return "normal", shape[-1]
    if leaf == "kernel":
        return "normal", int(np.prod(shape[:-1]))
    raise ValueError(f"no random initializer for parameter {'/'.join(map(str, path))} {shape}")


def _abstract_params(build: Callable, cfg, dtype):
    return nnx.split(abstract_module(lambda rngs: build(cfg, dtype, rngs)), nnx.Param, ...)


def random_params(build: Callable, cfg, rng: np.random.Generator, dtype=jnp.float32) -> dict[tuple, np.ndarray]:
    """A stage's parameters by path, drawn with numpy (float64, then cast to each parameter's
    dtype: the same values for the same seed on any machine)."""
    _, params, _ = _abstract_params(build, cfg, dtype)
    arrays = {}
    for path, v in nnx.to_flat_state(params):
        value = v.get_value()
        kind, x = param_init(path, value.shape)
        a = np.full(value.shape, x) if kind == "const" else rng.standard_normal(value.shape) / np.sqrt(x)
        arrays[path] = a.astype(value.dtype)
    return arrays


@functools.partial(jax.jit, static_argnames=("spec",))
def _draw(key, index, spec):
    """One parameter of `spec` (shape, dtype, kind, value): one small program per distinct spec,
    called once per parameter (`index` picks its stream). A stage has 25-36 distinct specs; one
    program drawing a whole stage's ~1400 parameters took 5x as long to compile for an H200
    (30B-A3B thinker, deviceless: 199 s against 39 s for its 36 small ones)."""
    shape, dtype, kind, x = spec
    if kind == "const":
        return jnp.full(shape, x, dtype)
    # uniform of the normal's std (cheaper to compile: no erfinv), in the parameter's dtype
    bound = float(np.sqrt(3.0 / x))
    return jax.random.uniform(jax.random.fold_in(key, index), shape, dtype, -bound, bound)


def _draw_on_device(params, seed: int):
    """(path, array) per parameter of an abstract Param state, drawn on the default device."""
    flat = list(nnx.to_flat_state(params))
    specs = []
    for path, v in flat:
        value = v.get_value()
        specs.append((tuple(value.shape), np.dtype(value.dtype), *param_init(path, value.shape)))
    # rbg keys: XLA's own RngBitGenerator, one op per draw (threefry unrolls into code that took
    # 45 s to compile for the tiny thinker on a loaded CPU).
    key = jax.random.key(seed, impl="rbg")
    return [(path, _draw(key, i, spec)) for i, ((path, _), spec) in enumerate(zip(flat, specs))]


def device_params(build: Callable, cfg, dtype, seed: int = 0) -> dict[tuple, jax.Array]:
    """A stage's parameters by path, drawn with JAX on the default device in their own dtype
    (the module decides: a vocoder stays float32 in a bfloat16 model)."""
    _, params, _ = _abstract_params(build, cfg, dtype)
    return dict(_draw_on_device(params, seed))


def random_module(build: Callable, cfg, dtype, seed: int = 0) -> nnx.Module:
    """A concrete module with `device_params` weights: a stage at any size with no checkpoint."""
    graphdef, params, rest = _abstract_params(build, cfg, dtype)
    flat = dict(nnx.to_flat_state(params))
    for path, array in _draw_on_device(params, seed):
        flat[path].set_value(array)
    return nnx.merge(graphdef, nnx.from_flat_state(flat), rest)


class RandomRows:
    """An embedding table of `shape` that is never held: indexing it (an id or a list of ids)
    draws those rows, each seeded by (`seed`, id), by the embedding rule above. What a family's
    side files read of a stage whose weights are drawn at load (checkpoint.RANDOM_WEIGHTS_FILE):
    a few rows, of a table that can be gigabytes."""

    def __init__(self, shape: tuple, seed: int):
        self.shape, self.seed = tuple(shape), seed

    def __getitem__(self, ids):
        one = np.ndim(ids) == 0
        rows = np.stack([np.random.default_rng([self.seed, int(i)]).standard_normal(self.shape[1:])
                         for i in np.atleast_1d(ids)]) / np.sqrt(self.shape[-1])
        return rows[0] if one else rows
