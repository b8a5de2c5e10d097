"""Few-row matmul against dense weights stored [in, out]: a Pallas kernel for NVIDIA GPUs.

A decode step multiplies a few rows (one per sequence) by each projection's whole weight,
so its time is the weight's bytes over the bandwidth it streams them at. XLA's GEMMs for one
row reached 48% of the copy bandwidth on an H200 (the 30B-A3B's q/k/v, README "Measured on a
GPU"), split over K with a sum kernel after them. Here one program per tile of ``block_n``
output columns (all rows in one block, the rows past M masked) streams its columns'
``[block_k, block_n]`` weight tiles in a K loop whose addresses depend on the loop index alone,
so Triton keeps ``num_stages - 1`` tiles in flight while it computes; no split, no sum, no copy
of the weights.

``weights`` may be several matrices of one K (q/k/v, gate/up): the output is their columns
side by side, as one GEMM over the concatenation would give, without the concatenation
(each program's column tile lies in one of them). A bias per matrix, if given, is added in
fp32 before the one rounding.

Whether a model's projections take this kernel is a launch setting (``SKINNY_TUNING``):
off until a GPU times it against XLA (the GPU check's tuning part). A MoE router's few rows
take it split over K (``k_splits``) whatever the row says: its partial products go straight
into the routing kernel, which sums them (``omni_jax.models.layers.moe.router_partials``),
where XLA's GEMM split K too and then needed two launches to sum and slice.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.paged_attention import dot_precision, next_pow2
from kernels_pallas.tuning import pick, target_capability

__all__ = ["skinny_matmul", "SKINNY_TUNING", "skinny_tuning", "MIN_BLOCK"]

# Launch settings per compute capability, most conservative row first. Where the models'
# projections take the kernel (`omni_jax.models.layers.linear`): calls of at most ``max_rows``
# rows (0: never, they stay XLA's GEMMs) and ``min_width`` output columns (fewer would be too
# few programs to stream at the GPU's bandwidth). Compiled for an H200 (deviceless), one row
# or 16 against the 30B-A3B's q/k/v and the 7B's MLP: 40-54 registers, no spills, 60-72 KB
# of shared memory, and the K loop keeps `num_stages - 1` tiles in flight (PTX: wait_group 4).
SKINNY_TUNING = {
    80: dict(max_rows=0, min_width=1024, block_n=32, block_k=128, num_warps=4, num_stages=4),
    90: dict(max_rows=0, min_width=1024, block_n=32, block_k=256, num_warps=4, num_stages=4),
}

# The smallest M, N and K of a Triton dot.
MIN_BLOCK = 16


def skinny_tuning(capability: int | None = None) -> dict:
    """The kernel's launch settings for a GPU (default: the one being compiled for)."""
    return pick(SKINNY_TUNING, target_capability() if capability is None else capability)


def _kernel(x_ref, *refs, tiles, has_bias, block_rows, block_n, block_k, split_k, precision):
    """refs: the weights, their biases (where given), the output. `tiles`: each weight's
    first column tile, first output column and width; `split_k`: the K rows of each split
    (the output's leading axis), or None."""
    nw = len(tiles)
    weights, biases = refs[:nw], list(refs[nw:-1])
    out_ref = refs[-1]
    n, split = pl.program_id(0), pl.program_id(1)
    num_rows, k_dim = x_ref.shape
    k_first, k_end = (0, k_dim) if split_k is None else (split * split_k, jnp.minimum((split + 1) * split_k, k_dim))
    # One block of rows past the last real one, masked: a masked load or store touches no memory
    # (and interpret mode drops a store out of bounds), so x needs no padding, the output no slice.
    r = jnp.arange(block_rows, dtype=jnp.int32)
    row_ok = r < num_rows
    for w_ref, (first, offset, width), bias in zip(weights, tiles, has_bias):
        bias_ref = biases.pop(0) if bias else None

        @pl.when((n >= first) & (n < first + pl.cdiv(width, block_n)))
        def _(w_ref=w_ref, first=first, offset=offset, width=width, bias_ref=bias_ref):
            c = (n - first) * block_n + jnp.arange(block_n, dtype=jnp.int32)   # columns of this weight
            col_ok = c < width

            def body(s, acc):
                kk = k_first + s * block_k + jnp.arange(block_k, dtype=jnp.int32)
                k_ok = kk < k_end
                a = plgpu.load(x_ref.at[r[:, None], kk[None, :]], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b = plgpu.load(w_ref.at[kk[:, None], c[None, :]], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                return acc + plgpu.dot(a, b, precision=precision)

            steps = pl.cdiv(k_dim if split_k is None else split_k, block_k)
            acc = lax.fori_loop(0, steps, body, jnp.zeros((block_rows, block_n), jnp.float32))
            if bias_ref is not None:  # once: in the first split's partial
                bias = plgpu.load(bias_ref.at[c], mask=col_ok, other=0.0).astype(jnp.float32)[None, :]
                acc = acc + jnp.where(split == 0, bias, 0.0)
            # Index every axis with an array (interpret mode discharges only all-array indexers).
            at = (r[:, None], (offset + c)[None, :])
            if split_k is not None:
                at = (jnp.full((1, 1), split, jnp.int32), *at)
            plgpu.store(out_ref.at[at], acc.astype(out_ref.dtype), mask=row_ok[:, None] & col_ok[None, :])


@functools.partial(jax.jit, static_argnames=("out_dtype", "k_splits", "block_n", "block_k", "num_warps",
                                             "num_stages", "interpret"))
def skinny_matmul(x, weights, biases=None, out_dtype=None, *, k_splits=1, block_n=None, block_k=None,
                  num_warps=None, num_stages=None, interpret=False):
    """x [M, K] times each of `weights` ([K, N_i], one dtype with x), side by side -> [M, sum N_i].

    `biases`: None, or one [N_i] array (or None) per weight. Products accumulate in fp32
    (IEEE fp32 dots for fp32 inputs) and round once to `out_dtype` (default x's dtype).
    ``k_splits`` > 1 (a narrow output: a router's, too few column tiles to keep a GPU busy):
    K is cut into that many runs of whole ``block_k`` tiles, a program each, and the result
    is their fp32 partial products [k_splits, M, sum N_i] (the biases in the first), for the
    kernel that reads them to sum. Unset launch settings come from ``SKINNY_TUNING`` for the
    GPU being compiled for.
    """
    weights = tuple(weights)
    biases = (None,) * len(weights) if biases is None else tuple(biases)
    m, k_dim = x.shape
    if not weights or len(biases) != len(weights):
        raise ValueError(f"{len(weights)} weights and {len(biases)} biases: give one bias (or None) per weight")
    for w, b in zip(weights, biases):
        if w.ndim != 2 or w.shape[0] != k_dim:
            raise ValueError(f"x has {k_dim} columns, a weight is {w.shape} (give [in, out] = [{k_dim}, N])")
        if w.dtype != x.dtype:  # Triton's dot takes one element type (interpret mode would promote)
            raise ValueError(f"x is {x.dtype}, a weight {w.dtype}: give both one dtype")
        if b is not None and b.shape != (w.shape[1],):
            raise ValueError(f"a bias is {b.shape}, its weight has {w.shape[1]} columns")
    tune = skinny_tuning()
    bn, bk = block_n or tune["block_n"], block_k or tune["block_k"]
    widths = [w.shape[1] for w in weights]
    if min(bn, bk) < MIN_BLOCK or bn != next_pow2(bn) or bk != next_pow2(bk):
        raise ValueError(f"block_n={bn} and block_k={bk} must be powers of two >= {MIN_BLOCK}")
    bm = max(MIN_BLOCK, next_pow2(m))   # one block of rows: the kernel is for a step's few rows
    first, offset = [0], [0]
    for width in widths:
        first.append(first[-1] + pl.cdiv(width, bn))
        offset.append(offset[-1] + width)
    if k_splits < 1 or (k_splits > 1 and out_dtype not in (None, jnp.float32)):
        raise ValueError(f"k_splits={k_splits}: give a count >= 1; the partials of more than one are fp32")
    split_k = bk * pl.cdiv(pl.cdiv(k_dim, k_splits), bk) if k_splits > 1 else None
    out_dtype = jnp.float32 if split_k else out_dtype or x.dtype
    out = ((k_splits,) if split_k else ()) + (m, offset[-1])
    given = [b for b in biases if b is not None]
    whole = lambda shape: pl.BlockSpec(shape, lambda n, s: (0,) * len(shape))  # noqa: E731
    kernel = functools.partial(
        _kernel, tiles=tuple(zip(first, offset, widths)), has_bias=tuple(b is not None for b in biases),
        block_rows=bm, block_n=bn, block_k=bk, split_k=split_k, precision=dot_precision(x.dtype))
    return pl.pallas_call(
        kernel,
        grid=(first[-1], k_splits),
        in_specs=[whole(x.shape)] + [whole(w.shape) for w in weights] + [whole(b.shape) for b in given],
        out_specs=whole(out),
        out_shape=jax.ShapeDtypeStruct(out, out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps or tune["num_warps"],
                                             num_stages=num_stages or tune["num_stages"]),
        interpret=interpret,
        name=f"skinny_matmul_bm{bm}_bn{bn}_bk{bk}" + (f"_split{k_splits}" if split_k else ""),
    )(x, *weights, *given)
