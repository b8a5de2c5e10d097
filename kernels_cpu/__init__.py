"""Paged attention for XLA:CPU in C++ (the engine's CPU backend, "cpu").

``paged_attention`` (decode) and ``ragged_paged_attention`` (packed prefill chunks) have the
signatures and semantics of the Pallas kernels and of their XLA references
(``kernels_pallas.reference``), which the tests hold them to; they run as XLA FFI custom
calls of ``paged_attention.cc``, which ``setup.py`` compiles for this machine when OmniJax is
installed. The KV write is the shared XLA scatter (``kernels_pallas.kv_update``).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from kernels_cpu.library import KernelBuildError, register, unavailable_reason
from kernels_pallas.kv_update import write_kv_pages
from kernels_pallas.reference import write_then

__all__ = ["paged_attention", "paged_attention_with_write", "ragged_paged_attention", "write_kv_pages", "KernelBuildError",
           "unavailable_reason"]


def _attrs(sm_scale, sliding_window, head_dim):
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    return dict(sm_scale=np.float32(scale), sliding_window=np.int32(sliding_window or 0))


def paged_attention(q, k_pages, v_pages, block_tables, seq_lens, *, sm_scale=None,
                    sliding_window=None, **tuning):
    """Decode attention over paged K/V: q [B, Hq, D], row b at position ``seq_lens[b] - 1``
    (0: a padded row, zeros). Tuning keywords of the other backends are accepted and ignored.
    Returns [B, Hq, D] in q's dtype."""
    del tuning
    register()
    call = jax.ffi.ffi_call("omni_jax_paged_attention", jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(q, k_pages, v_pages, block_tables.astype(jnp.int32), seq_lens.astype(jnp.int32),
                **_attrs(sm_scale, sliding_window, q.shape[-1]))


paged_attention_with_write = write_then(paged_attention)


def ragged_paged_attention(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, *,
                           sm_scale=None, sliding_window=None, **tuning):
    """Causal attention for packed prefill chunks: sequence s owns rows
    ``cu_q_lens[s]:cu_q_lens[s+1]`` of q [T, Hq, D] and has ``kv_lens[s]`` tokens in the
    pages (its new ones included). Rows outside ``cu_q_lens[0]:cu_q_lens[S]`` are zeros.
    Returns [T, Hq, D] in q's dtype."""
    del tuning
    register()
    call = jax.ffi.ffi_call("omni_jax_ragged_paged_attention", jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(q, k_pages, v_pages, block_tables.astype(jnp.int32), kv_lens.astype(jnp.int32),
                cu_q_lens.astype(jnp.int32), **_attrs(sm_scale, sliding_window, q.shape[-1]))
