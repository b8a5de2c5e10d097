"""Decoder self-attention over a packed token batch, with one metadata object.

Tokens of all sequences in a step are packed into one axis [T]. How they attend is
described by :class:`AttentionMetadata`:

* ``mode="dense"``: no KV cache; every token attends causally to the earlier tokens
  of its own segment (``segment_ids``; -1 marks padding). This is the reference path
  used for parity tests and one-shot full-sequence forwards.
* ``mode="paged"``: new K/V are written into the paged cache at ``slot_mapping``,
  then attention reads the pages through the block tables: the decode kernel when
  every sequence brings one token (``decode_only``; it takes q and k before their RoPE
  and norm, and does those and the write itself: on a GPU one launch); otherwise the
  ragged prefill kernel, and, when ``num_decodes`` is given, the decode kernel for the first
  ``num_decodes`` sequences, which bring one token each in the first rows. So one
  step of decodes and prefill chunks is one device call. ``backend`` picks the Pallas
  kernels ("pallas", GPU), the C++ CPU kernels ("cpu") or the pure-JAX references
  ("reference"); all three have the same ops (``BACKENDS``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.sharding import PartitionSpec as P

import kernels_cpu
import kernels_pallas
from kernels_pallas import reference

from . import parallel
from .linear import Linear, skinny_linears, takes_skinny_kernel
from .norms import RMSNorm

log = logging.getLogger("omni_jax.attention")

# The attention backends by name; each has paged_attention, paged_attention_with_write,
# ragged_paged_attention and write_kv_pages with the same signatures.
BACKENDS = {"pallas": kernels_pallas, "cpu": kernels_cpu, "reference": reference}


def default_backend() -> str:
    """The Pallas kernels on GPUs; on CPU the C++ kernels, or the XLA reference where they
    cannot be built (no C++ compiler), with a warning that says why."""
    if jax.default_backend() == "gpu":
        return "pallas"
    why = kernels_cpu.unavailable_reason()
    if why is not None:
        log.warning("the CPU attention kernels are unavailable, using the XLA reference: %s", why)
        return "reference"
    return "cpu"


@struct.dataclass
class AttentionMetadata:
    """Per-step description of who attends to what (see module docstring)."""

    mode: str = struct.field(pytree_node=False, default="dense")
    backend: str = struct.field(pytree_node=False, default="reference")
    decode_only: bool = struct.field(pytree_node=False, default=False)
    segment_ids: jnp.ndarray | None = None   # [T] dense mode
    slot_mapping: jnp.ndarray | None = None  # [T] paged mode
    block_tables: jnp.ndarray | None = None  # [S, max_blocks]
    kv_lens: jnp.ndarray | None = None       # [S] cached + new tokens
    cu_q_lens: jnp.ndarray | None = None     # [S+1]
    num_decodes: jnp.ndarray | None = None   # [] int32: leading one-token sequences (not decode_only)

    @staticmethod
    def dense(num_tokens: int, segment_ids=None) -> "AttentionMetadata":
        """One causal sequence (or several packed segments) without a KV cache."""
        if segment_ids is None:
            segment_ids = jnp.zeros((num_tokens,), jnp.int32)
        return AttentionMetadata(mode="dense", segment_ids=jnp.asarray(segment_ids, jnp.int32))

    def valid_tokens(self, num_tokens: int) -> jnp.ndarray | None:
        """[T] bool: the real (not bucket-padding) tokens of a paged step; None in dense mode.

        The runner packs real tokens first and pads `cu_q_lens` with their total.
        """
        if self.mode != "paged" or self.cu_q_lens is None:
            return None
        return jnp.arange(num_tokens) < self.cu_q_lens[-1]


def dense_causal_attention(q, k, v, segment_ids, sm_scale, sliding_window=None):
    """Reference attention: q [T,Hq,D], k/v [T,Hkv,D]; causal within equal segment ids."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    qg = q.reshape(t, hkv, group, d).astype(jnp.float32)
    scores = jnp.einsum("qhgd,khd->hgqk", qg, k.astype(jnp.float32)) * sm_scale
    idx = jnp.arange(t)
    mask = (segment_ids[:, None] == segment_ids[None, :]) & (idx[None, :] <= idx[:, None])
    mask &= (segment_ids >= 0)[:, None]
    if sliding_window is not None:
        mask &= idx[:, None] - idx[None, :] < sliding_window
    scores = jnp.where(mask[None, None], scores, -jnp.inf)
    # Padding rows have no valid key; keep them finite (zeros) instead of NaN.
    probs = jax.nn.softmax(jnp.where(mask.any(-1)[None, None, :, None], scores, 0.0), axis=-1)
    probs = jnp.where(mask[None, None], probs, 0.0)
    out = jnp.einsum("hgqk,khd->qhgd", probs, v.astype(jnp.float32))
    return out.reshape(t, hq, d).astype(q.dtype)


def paged_attention_step(q, k, v, kv_cache, meta: AttentionMetadata, sm_scale, sliding_window=None,
                         qk: dict | None = None, norm_eps: float = 1e-6):
    """Write k/v into the pages, then attend through the block tables. Returns (out, kv_cache).

    `qk`: what q and k still take before attending, as `reference.prepare_qk`'s keywords
    (``rope`` = (cos, sin), ``qk_norm`` = the q/k norm weights, eps `norm_eps`): on a decode
    step the decode kernel applies them (on a GPU the launches of that fusion are saved).

    Under a tensor-parallel mesh (layers/parallel.py) this runs per shard: q, k, v split over
    heads, the pages over their KV-head axis, the metadata and `qk` replicated. k/v come in
    with the model's KV heads and are repeated to the cache's when it stores each head
    several times.
    """
    tp = parallel.axis_size(parallel.TP)
    local = functools.partial(_paged_attention_local, sm_scale=sm_scale, sliding_window=sliding_window,
                              norm_eps=norm_eps)
    if tp == 1:
        return local(q, k, v, kv_cache, meta, qk)
    if q.shape[1] % tp:
        raise ValueError(f"tensor_parallel_size {tp} must divide the {q.shape[1]} attention heads")
    repeat = kv_cache[0].shape[2] // k.shape[1]
    if repeat > 1:
        k, v = jnp.repeat(k, repeat, axis=1), jnp.repeat(v, repeat, axis=1)
    heads, pages = P(None, parallel.TP, None), P(None, None, parallel.TP, None)
    return jax.shard_map(local, mesh=parallel.current_mesh(),
                         in_specs=(heads, heads, heads, (pages, pages), P(), P()),
                         out_specs=(heads, (pages, pages)), check_vma=False)(q, k, v, kv_cache, meta, qk)


def _paged_attention_local(q, k, v, kv_cache, meta: AttentionMetadata, qk=None, *, sm_scale, sliding_window=None,
                           norm_eps=1e-6):
    ops = BACKENDS[meta.backend]
    k_pages, v_pages = kv_cache
    qk = dict(qk or {}, norm_eps=norm_eps)
    if meta.decode_only:  # q/k's last touches, the write and the attention: one launch on a GPU
        out, k_pages, v_pages = ops.paged_attention_with_write(
            q, k, v, k_pages, v_pages, meta.slot_mapping, meta.block_tables, meta.kv_lens,
            sm_scale=sm_scale, sliding_window=sliding_window, **qk)
        return out, (k_pages, v_pages)
    q, k = reference.prepare_qk(q, k, **qk)
    k_pages, v_pages = ops.write_kv_pages(k_pages, v_pages, k, v, meta.slot_mapping)
    cu_q_lens = meta.cu_q_lens
    if meta.num_decodes is not None:
        # The decode sequences become empty ones just past their rows: the ragged kernel then
        # leaves those rows alone instead of scoring each against a whole block of rows.
        cu_q_lens = jnp.maximum(cu_q_lens, meta.num_decodes)
    out = ops.ragged_paged_attention(q, k_pages, v_pages, meta.block_tables, meta.kv_lens, cu_q_lens,
                                     sm_scale=sm_scale, sliding_window=sliding_window)
    if meta.num_decodes is not None:
        # Sequence i < num_decodes owns row i; the rest of the first d rows see nothing here.
        d = min(q.shape[0], meta.kv_lens.shape[0])
        mine = jnp.arange(d) < meta.num_decodes
        dec = ops.paged_attention(q[:d], k_pages, v_pages, meta.block_tables[:d],
                                  jnp.where(mine, meta.kv_lens[:d], 0),
                                  sm_scale=sm_scale, sliding_window=sliding_window)
        out = out.at[:d].set(jnp.where(mine[:, None, None], dec, out[:d]))
    return out, (k_pages, v_pages)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Shape of one decoder attention layer."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool = True
    o_bias: bool = False
    qk_norm: bool = False
    rms_norm_eps: float = 1e-6
    sliding_window: int | None = None


class Attention(nnx.Module):
    """GQA self-attention with rotary embeddings; names as in transformers (q/k/v/o_proj)."""

    def __init__(self, cfg: AttentionConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        h, nq, nkv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = Linear(h, nq * d, use_bias=cfg.qkv_bias, **kw)
        self.k_proj = Linear(h, nkv * d, use_bias=cfg.qkv_bias, **kw)
        self.v_proj = Linear(h, nkv * d, use_bias=cfg.qkv_bias, **kw)
        self.o_proj = Linear(nq * d, h, use_bias=cfg.o_bias, **kw)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)

    def __call__(self, x, cos, sin, meta: AttentionMetadata, kv_cache=None):
        """x [T, hidden] -> ([T, hidden], updated kv_cache or None)."""
        cfg = self.cfg
        t = x.shape[0]
        projections = (self.q_proj, self.k_proj, self.v_proj)
        if takes_skinny_kernel(x, *projections):
            # One launch over the three weights; sliced as heads, so that the decode kernel's
            # concatenation of q, k and v is the kernel's output again (no copy, no launch).
            heads = skinny_linears(x, *projections).reshape(t, cfg.num_heads + 2 * cfg.num_kv_heads, cfg.head_dim)
            q, k, v = jnp.split(heads, (cfg.num_heads, cfg.num_heads + cfg.num_kv_heads), axis=1)
        else:   # XLA merges the three dots itself
            q = self.q_proj(x).reshape(t, cfg.num_heads, cfg.head_dim)
            k = self.k_proj(x).reshape(t, cfg.num_kv_heads, cfg.head_dim)
            v = self.v_proj(x).reshape(t, cfg.num_kv_heads, cfg.head_dim)
        norms = (self.q_norm.weight[...], self.k_norm.weight[...]) if cfg.qk_norm else None
        qk = dict(rope=(cos, sin), qk_norm=norms)
        scale = cfg.head_dim ** -0.5
        if meta.mode == "dense":
            q, k = reference.prepare_qk(q, k, **qk, norm_eps=cfg.rms_norm_eps)
            out = dense_causal_attention(q, k, v, meta.segment_ids, scale, cfg.sliding_window)
        else:
            out, kv_cache = paged_attention_step(q, k, v, kv_cache, meta, scale, cfg.sliding_window, qk,
                                                 cfg.rms_norm_eps)
        return self.o_proj(out.reshape(t, cfg.num_heads * cfg.head_dim)), kv_cache
