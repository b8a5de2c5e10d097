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


GROUP_BYTES = 1 << 30  # parameters drawn together, at most: the program's temporaries stay small


@functools.partial(jax.jit, static_argnames=("specs",))
def _draw(key, specs):
    """Every parameter of `specs` ((shape, dtype, kind, value) each) in one program: one
    compilation for the whole stage (one per shape would be hundreds), the parameters of one
    shape drawn together up to GROUP_BYTES (the program's size does not grow with the layers,
    its temporaries stay far below the weights: a 30B model fills most of a GPU)."""
    groups: dict = {}
    for i, spec in enumerate(specs):
        groups.setdefault(spec, []).append(i)
    out = [None] * len(specs)
    g = 0
    for (shape, dtype, kind, x), members in groups.items():
        per = max(1, GROUP_BYTES // max(1, int(np.prod(shape)) * np.dtype(dtype).itemsize))
        for c in range(0, len(members), per):
            chunk = members[c:c + per]
            if kind == "const":
                block = jnp.full((len(chunk), *shape), x, dtype)
            else:  # uniform of the normal's std (cheaper to compile: no erfinv), in the parameter's dtype
                bound = float(np.sqrt(3.0 / x))
                block = jax.random.uniform(jax.random.fold_in(key, g), (len(chunk), *shape), dtype, -bound, bound)
            g += 1
            for j, i in enumerate(chunk):
                out[i] = block[j]
    return out


def _draw_on_device(params, seed: int):
    """(path, array) per parameter of an abstract Param state, drawn on the default device."""
    flat = list(nnx.to_flat_state(params))
    specs = []
    for path, v in flat:
        value = v.get_value()
        specs.append((tuple(value.shape), np.dtype(value.dtype), *param_init(path, value.shape)))
    # rbg keys: XLA's own RngBitGenerator, one op per draw (threefry unrolls into code that took
    # 45 s to compile for the tiny thinker on a loaded CPU).
    return zip([path for path, _ in flat], _draw(jax.random.key(seed, impl="rbg"), tuple(specs)))


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
