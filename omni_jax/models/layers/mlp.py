"""Gated feed-forward block (SwiGLU) used by the Qwen decoders and the vision towers, and the one
table of activation functions every model reads (transformers' ACT2FN names)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from .linear import Linear, parallel_linears

# transformers' ACT2FN names -> JAX functions ("gelu" is the exact, erf-based GELU).
ACTIVATIONS = {
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_new": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
}


class GatedMLP(nnx.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)), names as in transformers."""

    def __init__(self, hidden: int, intermediate: int, *, act: str = "silu", bias: bool = False,
                 dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        kw = dict(use_bias=bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate_proj = Linear(hidden, intermediate, **kw)
        self.up_proj = Linear(hidden, intermediate, **kw)
        self.down_proj = Linear(intermediate, hidden, **kw)
        self.act = ACTIVATIONS[act]

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        gate, up = parallel_linears(x, self.gate_proj, self.up_proj)
        return self.down_proj(self.act(gate) * up)
