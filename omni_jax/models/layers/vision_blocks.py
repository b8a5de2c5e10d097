"""The ViT layers both families' vision towers are built of: patch sizes, the processor's
patch order (grid helpers), attention within segments, the patch embedding and the merger MLP."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .linear import Linear

PADDING_SEGMENT = -1  # the segment id of padding patches: they attend only among themselves


class PatchSizes:
    """Sizes derived from a ViT config's heads, patches and merge (shared by the Qwen-Omni ViTs)."""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merge_unit(self) -> int:
        """Patches per merged token (m*m)."""
        return self.spatial_merge_size ** 2

    @property
    def patch_dim(self) -> int:
        """Length of one pixel_values row: C * temporal_patch * patch * patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2


def as_grid(grid_thw) -> np.ndarray:
    """(t, h, w) rows of the items' grids, [num_items, 3] int64."""
    return np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)


def num_merged_tokens(grid_thw, spatial_merge_size: int) -> np.ndarray:
    """Merged (LLM) tokens per item: t*h*w // m^2, [num_items]."""
    grid = as_grid(grid_thw)
    return grid.prod(-1) // spatial_merge_size ** 2


def vision_position_ids(grid_thw, spatial_merge_size: int) -> np.ndarray:
    """Rotary (h, w) coordinates of every patch in processor order, [N, 2] int32.

    The processor emits patches block by block (m x m blocks, row-major inside), so the
    coordinates follow that order; each frame of a video repeats the same coordinates.
    """
    m = spatial_merge_size
    out = []
    for t, h, w in as_grid(grid_thw):
        # [h/m, w/m, m, m] -> row index = block_row * m + in_row
        br, bc, ir, ic = np.meshgrid(np.arange(h // m), np.arange(w // m), np.arange(m), np.arange(m),
                                     indexing="ij")
        hw = np.stack([(br * m + ir).reshape(-1), (bc * m + ic).reshape(-1)], axis=-1)
        out.append(np.tile(hw, (t, 1)))
    if not out:
        return np.zeros((0, 2), np.int32)
    return np.concatenate(out, 0).astype(np.int32)


def vision_frame_ids(grid_thw) -> np.ndarray:
    """Frame (item, t) of every patch in processor order, [N] int32: the full-attention segments.

    transformers attends per frame (cu_seqlens from repeat_interleave(h*w, t)), not over
    the whole video.
    """
    grid = as_grid(grid_thw)
    return np.repeat(np.arange(int(grid[:, 0].sum()), dtype=np.int32), np.repeat(grid[:, 1] * grid[:, 2], grid[:, 0]))


def _masked_softmax_attention(q, k, v, mask, scale):
    """q [..., Q, H, D], k/v [..., K, H, D], mask [..., Q, K] -> [..., Q, H, D] (fp32 softmax)."""
    s = jnp.einsum("...qhd,...khd->...hqk", q, k, preferred_element_type=jnp.float32) * scale
    s = jnp.where(mask[..., None, :, :], s, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("...hqk,...khd->...qhd", p.astype(v.dtype), v)


# Queries per block of unbanded segment attention: its scores are [H, QUERY_BLOCK, N] at a time.
# All N at once (one image of 16384 patches) took 24 GiB of temporaries on H100 (deviceless
# compile), more than a serving thinker's share leaves beside its KV pages; blocks of 512 take
# 1.2 GiB (Qwen2.5-Omni) and 1.8 GiB (Qwen3-Omni), blocks of 256 saving only 0.4 more.
QUERY_BLOCK = 512


def _blockwise_attention(q, k, v, segment_ids, scale):
    """Segment attention of every query against all N keys, QUERY_BLOCK queries at a time, one
    block after the other (only one block's scores live at once); each row's softmax is unchanged."""
    n, h, d = q.shape
    if n <= QUERY_BLOCK:
        return _masked_softmax_attention(q, k, v, segment_ids[:, None] == segment_ids[None, :], scale)
    pad = -n % QUERY_BLOCK
    # Padded queries get segment -2, which no key has: their rows are discarded below.
    qb = jnp.pad(q, ((0, pad), (0, 0), (0, 0))).reshape(-1, QUERY_BLOCK, h, d)
    sb = jnp.pad(segment_ids, (0, pad), constant_values=-2).reshape(-1, QUERY_BLOCK)

    def block(args):
        qi, si = args
        return _masked_softmax_attention(qi, k, v, si[:, None] == segment_ids[None, :], scale)

    return jax.lax.map(block, (qb, sb)).reshape(-1, h, d)[:n]


def segment_attention(q, k, v, segment_ids, scale, max_segment_len: int | None = None):
    """Bidirectional attention restricted to tokens of equal segment id.

    q/k/v [N, H, D], segment_ids [N]. Every query sees at least itself, so padding
    (its own segment) never produces NaN. With `max_segment_len` L (segments contiguous
    and no longer than L), query block b of size L only looks at key blocks b-1..b+1:
    O(N * 3L) instead of O(N^2), which is what makes the window layers cheap.
    """
    n = q.shape[0]
    if max_segment_len is None or max_segment_len >= n:
        return _blockwise_attention(q, k, v, segment_ids, scale)

    L = max_segment_len
    nb = -(-n // L)
    pad = nb * L - n

    def blocks(x, fill):
        # One extra block on each side so every query block has a left and a right neighbour.
        x = jnp.pad(x, [(L, pad + L)] + [(0, 0)] * (x.ndim - 1), constant_values=fill)
        return x.reshape((nb + 2, L) + x.shape[1:])

    def band(x):
        # [nb+2, L, ...] -> [nb, 3L, ...]: blocks b-1, b, b+1 for each query block b.
        return jnp.concatenate([x[:-2], x[1:-1], x[2:]], axis=1)

    # -2 marks the side blocks: no real or padding token matches it.
    seg = blocks(segment_ids, -2)
    qb = blocks(q, 0)[1:-1]
    kb, vb = band(blocks(k, 0)), band(blocks(v, 0))
    mask = seg[1:-1, :, None] == band(seg)[:, None, :]
    out = _masked_softmax_attention(qb, kb, vb, mask, scale)
    return out.reshape((nb * L,) + out.shape[2:])[:n]


class VisionPatchEmbed(nnx.Module):
    """Conv3d with kernel == stride == (temporal, patch, patch), no bias: one matmul per patch."""

    def __init__(self, config: PatchSizes, *, dtype, param_dtype, rngs: nnx.Rngs):
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.config = config
        self.dtype = dtype
        self.proj = nnx.Conv(config.in_channels, config.hidden_size, kernel_size=kernel, strides=kernel,
                             padding="VALID", use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, pixel_values: jnp.ndarray) -> jnp.ndarray:
        c = self.config
        # kernel [kt, kh, kw, in, out] -> [in, kt, kh, kw, out] to match the (C, T, P, P) row layout.
        w = jnp.transpose(self.proj.kernel[...], (3, 0, 1, 2, 4)).reshape(c.patch_dim, c.hidden_size)
        return jnp.dot(pixel_values.astype(self.dtype), w.astype(self.dtype))


class MergerMLP(nnx.Module):
    """fc2(GELU(fc1(x))); HF's nn.Sequential indexes 0 and 2 (each
    family's vision encoder renames them)."""

    def __init__(self, dim_in: int, dim_out: int, *, dtype, param_dtype, rngs: nnx.Rngs):
        kw = dict(use_bias=True, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.fc1 = Linear(dim_in, dim_in, **kw)
        self.fc2 = Linear(dim_in, dim_out, **kw)

    def __call__(self, x):
        # nn.GELU() default is the exact (erf) form.
        return self.fc2(jax.nn.gelu(self.fc1(x), approximate=False))
