"""Qwen2.5-Omni vision encoder (the Qwen2.5-VL ViT) in Flax NNX.

Pipeline: Conv3d patch embed -> blocks (RMSNorm, attention with 2-D rotary, RMSNorm,
SwiGLU) -> PatchMerger (RMSNorm, 2x2 group, Linear, GELU, Linear). Most blocks attend
within windows of `window_size` pixels (8x8 patches for the real model); the blocks in
`fullatt_block_indexes` attend within a whole frame. Like transformers, the blocks run
on the tokens permuted into *window order* (windows contiguous) and the merged output
is permuted back.

Shape contract (N = sum(t*h*w) valid patches over the items of `grid_thw`, m = spatial
merge size, U = m*m, Np >= N the padded patch count with Np % U == 0, Mp = Np // U):

- `pixel_values` [Np, C * temporal_patch * patch * patch]: rows in the order the Qwen2-VL
  image processor emits them (per item, per frame, per m x m block, row-major inside the
  block); each row flattened as (C, temporal, patch_h, patch_w). Rows N..Np-1 are padding
  (any value).
- `VisionMetadata` (host-side numpy, from :func:`vision_metadata`): position ids,
  window permutation and its inverse, segment ids. Padding belongs to segment -1 in every
  layer, so it never mixes with valid tokens.
- output [Mp, out_hidden_size]: merged tokens in `grid_thw` order; rows 0..M-1 with
  M = N // U are the features (equal to HF `get_image_features` / `get_video_features`
  concatenated), the rest is padding. Item i owns t_i*h_i*w_i // U consecutive rows.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from omni_jax.models.layers.linear import Linear
from omni_jax.models.layers.mlp import GatedMLP
from omni_jax.models.layers.norms import RMSNorm
from omni_jax.models.layers.rope import apply_rope, inv_frequencies
from omni_jax.models.layers.vision_blocks import (PADDING_SEGMENT, MergerMLP, PatchSizes, VisionPatchEmbed, as_grid,
                                                  num_merged_tokens, segment_attention, vision_frame_ids,
                                                  vision_position_ids)

# HF checkpoint key (after the "thinker.visual." prefix) -> NNX path. The merger MLP is an
# nn.Sequential with GELU at index 1, which an NNX list cannot mirror (lists are contiguous).
HF_RENAMES = [
    (r"^merger\.mlp\.0\.", "merger.mlp.fc1."),
    (r"^merger\.mlp\.2\.", "merger.mlp.fc2."),
]

@dataclasses.dataclass(frozen=True)
class VisionEncoderConfig(PatchSizes):
    """Sizes of the vision encoder (the HF `thinker_config.vision_config`)."""

    depth: int = 32
    hidden_size: int = 1280
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    out_hidden_size: int = 3584
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    @classmethod
    def from_hf(cls, d: dict) -> "VisionEncoderConfig":
        """Build from the HF `vision_config` dict of a Qwen2.5-Omni config.json."""
        rope = d.get("rope_parameters") or {}
        return cls(
            depth=int(d["depth"]),
            hidden_size=int(d.get("hidden_size", d.get("embed_dim"))),
            intermediate_size=int(d["intermediate_size"]),
            num_heads=int(d["num_heads"]),
            in_channels=int(d.get("in_channels", d.get("in_chans", 3))),
            patch_size=int(d.get("patch_size", 14)),
            temporal_patch_size=int(d.get("temporal_patch_size", 2)),
            spatial_merge_size=int(d.get("spatial_merge_size", 2)),
            window_size=int(d.get("window_size", 112)),
            out_hidden_size=int(d["out_hidden_size"]),
            fullatt_block_indexes=tuple(int(i) for i in d.get("fullatt_block_indexes", (7, 15, 23, 31))),
            hidden_act=d.get("hidden_act", "silu"),
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
        )

    @property
    def window_merged_side(self) -> int:
        """Window side in merged tokens (4 for 112 px windows of 14 px patches, merge 2)."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    @property
    def max_window_patches(self) -> int:
        """Upper bound on the patches of one attention window (64 for the real model)."""
        return self.window_merged_side ** 2 * self.merge_unit


# ----------------------------------------------------------------------------------------
# Host-side metadata (numpy). Everything the forward needs that depends on grid_thw.
# ----------------------------------------------------------------------------------------


class VisionMetadata(NamedTuple):
    """Per-call index arrays for :class:`Qwen2_5OmniVisionEncoder` (a pytree of int32 arrays).

    position_ids        [Np, 2]  (h, w) patch coordinates, processor order (padding: 0)
    window_index        [Mp]     window-order merged token r is processor merged token window_index[r]
    reverse_index       [Mp]     inverse permutation (argsort of window_index)
    window_segment_ids  [Np]     attention window of each patch, window order (padding: -1)
    full_segment_ids    [Np]     frame (item, t) of each patch, window order (padding: -1)
    """

    position_ids: np.ndarray
    window_index: np.ndarray
    reverse_index: np.ndarray
    window_segment_ids: np.ndarray
    full_segment_ids: np.ndarray


def vision_window_index(grid_thw, spatial_merge_size: int, window_size: int, patch_size: int):
    """Window permutation of the merged tokens and the window of each, in window order.

    Returns (window_index [M] int32, window_ids [M] int32): merged token r of the
    window-ordered sequence is processor token window_index[r], and it lies in window
    window_ids[r]. Windows are `window_size // m // patch_size` merged tokens square, laid
    out per frame from the top-left, ordered frame, window row, window column, then
    row-major inside (partial windows at the right/bottom edges simply hold fewer tokens).
    Equal to transformers' `get_vision_window_index` (with window_ids in place of its
    cu_window_seqlens, which count patches rather than merged tokens).
    """
    m = spatial_merge_size
    side = window_size // m // patch_size
    index, ids = [], []
    token_offset = window_offset = 0
    for t, h, w in as_grid(grid_thw):
        lh, lw = h // m, w // m
        nwh, nww = -(-lh // side), -(-lw // side)
        tt, ii, jj = np.meshgrid(np.arange(t), np.arange(lh), np.arange(lw), indexing="ij")
        tt, ii, jj = tt.reshape(-1), ii.reshape(-1), jj.reshape(-1)
        window = (tt * nwh + ii // side) * nww + jj // side
        # Stable sort by window keeps the row-major order inside each window.
        order = np.argsort(window, kind="stable")
        index.append(order + token_offset)
        ids.append(window[order] + window_offset)
        token_offset += t * lh * lw
        window_offset += t * nwh * nww
    if not index:
        return np.zeros((0,), np.int32), np.zeros((0,), np.int32)
    return np.concatenate(index).astype(np.int32), np.concatenate(ids).astype(np.int32)


def vision_metadata(grid_thw, config: VisionEncoderConfig, num_patches: int | None = None) -> VisionMetadata:
    """All index arrays for one encoder call over the items of `grid_thw` [num_items, 3].

    `num_patches` pads to a bucket (>= the valid patch count, a multiple of m*m); the
    padded merged tokens keep their place (identity permutation) so they stay at the end.
    """
    grid = as_grid(grid_thw)
    unit = config.merge_unit
    n = int(grid.prod(-1).sum())
    np_ = n if num_patches is None else int(num_patches)
    if np_ < n or np_ % unit:
        raise ValueError(f"num_patches={np_} must be >= {n} (valid patches) and a multiple of {unit}")
    m_valid, m_pad = n // unit, np_ // unit

    win_index, win_ids = vision_window_index(grid, config.spatial_merge_size, config.window_size, config.patch_size)
    window_index = np.concatenate([win_index, np.arange(m_valid, m_pad, dtype=np.int32)])
    reverse_index = np.argsort(window_index).astype(np.int32)

    # Patch-level view of the merged-token permutation: each merged token is U consecutive patches.
    patch_perm = (win_index[:, None] * unit + np.arange(unit)[None, :]).reshape(-1)
    pad = np.full((np_ - n,), PADDING_SEGMENT, np.int32)
    window_segment_ids = np.concatenate([np.repeat(win_ids, unit), pad]).astype(np.int32)
    full_segment_ids = np.concatenate([vision_frame_ids(grid)[patch_perm], pad]).astype(np.int32)

    position_ids = np.zeros((np_, 2), np.int32)
    position_ids[:n] = vision_position_ids(grid, config.spatial_merge_size)
    return VisionMetadata(position_ids, window_index.astype(np.int32), reverse_index,
                          window_segment_ids, full_segment_ids)


# ----------------------------------------------------------------------------------------
# Attention over segments (static shapes).
# ----------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------
# Modules (attribute names mirror transformers' Qwen2_5OmniVisionEncoder).
# ----------------------------------------------------------------------------------------


class VisionAttention(nnx.Module):
    """Multi-head self-attention with 2-D rotary on q/k; segments given by the caller."""

    def __init__(self, config: VisionEncoderConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        dim = config.hidden_size
        kw = dict(use_bias=True, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.q = Linear(dim, dim, **kw)
        self.k = Linear(dim, dim, **kw)
        self.v = Linear(dim, dim, **kw)
        self.proj = Linear(dim, dim, **kw)

    def __call__(self, x, cos, sin, segment_ids, max_segment_len=None):
        n = x.shape[0]
        split = lambda y: y.reshape(n, self.num_heads, self.head_dim)
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        # Rotary in fp32 as transformers does, then back to the compute dtype.
        q = apply_rope(q.astype(jnp.float32), cos, sin).astype(x.dtype)
        k = apply_rope(k.astype(jnp.float32), cos, sin).astype(x.dtype)
        out = segment_attention(q, k, v, segment_ids, self.head_dim ** -0.5, max_segment_len)
        return self.proj(out.reshape(n, -1))


class VisionBlock(nnx.Module):
    """Pre-norm transformer block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, config: VisionEncoderConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        self.norm1 = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, **kw)
        self.norm2 = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, **kw)
        self.attn = VisionAttention(config, rngs=rngs, **kw)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, act=config.hidden_act, bias=True,
                            rngs=rngs, **kw)

    def __call__(self, x, cos, sin, segment_ids, max_segment_len=None):
        x = x + self.attn(self.norm1(x), cos, sin, segment_ids, max_segment_len)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nnx.Module):
    """RMSNorm each patch, concatenate each m x m group, project to the LLM width."""

    def __init__(self, config: VisionEncoderConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.group_dim = config.hidden_size * config.merge_unit
        self.ln_q = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.mlp = MergerMLP(self.group_dim, config.out_hidden_size, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x):
        return self.mlp(self.ln_q(x).reshape(-1, self.group_dim))


class Qwen2_5OmniVisionEncoder(nnx.Module):
    """Qwen2.5-Omni ViT: pixel patches -> merged visual tokens for the thinker (see module doc)."""

    def __init__(self, config: VisionEncoderConfig, *, dtype=jnp.float32, param_dtype=jnp.float32,
                 rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.config = config
        self.dtype = dtype
        self.patch_embed = VisionPatchEmbed(config, **kw)
        self.blocks = nnx.List([VisionBlock(config, **kw) for _ in range(config.depth)])
        self.merger = PatchMerger(config, **kw)

    def _rotary(self, position_ids):
        # Axial 2-D rotary: the same head_dim/4 frequencies for h and w; [h-bands | w-bands]
        # is then doubled so that cos/sin span the whole head (rotate-half convention).
        inv_freq = inv_frequencies(self.config.head_dim // 2, self.config.rope_theta)
        freqs = position_ids.astype(jnp.float32)[:, :, None] * jnp.asarray(inv_freq)  # [N, 2, D/4]
        freqs = freqs.reshape(freqs.shape[0], -1)
        emb = jnp.concatenate([freqs, freqs], axis=-1)
        return jnp.cos(emb), jnp.sin(emb)

    def __call__(self, pixel_values: jnp.ndarray, meta: VisionMetadata) -> jnp.ndarray:
        """Padded forward, jit-friendly: [Np, patch_dim] + metadata -> [Np // m^2, out_hidden_size]."""
        c = self.config
        n = pixel_values.shape[0]
        unit = c.merge_unit
        window_index = jnp.asarray(meta.window_index)
        # Permutation at merged-token granularity: the m*m patches of a token stay together.
        to_window = lambda a: a.reshape((n // unit, unit) + a.shape[1:])[window_index].reshape(a.shape)

        x = to_window(self.patch_embed(pixel_values))
        cos, sin = self._rotary(to_window(jnp.asarray(meta.position_ids)))
        win_seg = jnp.asarray(meta.window_segment_ids)
        full_seg = jnp.asarray(meta.full_segment_ids)
        full = set(c.fullatt_block_indexes)
        for i, blk in enumerate(self.blocks):
            if i in full:
                x = blk(x, cos, sin, full_seg)
            else:
                x = blk(x, cos, sin, win_seg, c.max_window_patches)
        merged = self.merger(x)
        return merged[jnp.asarray(meta.reverse_index)]

    def encode(self, pixel_values, grid_thw, num_patches: int | None = None) -> jnp.ndarray:
        """Features of all items of `grid_thw`, [num_merged_tokens, out_hidden_size].

        Convenience for tests and one-off use: pads to `num_patches` if given, runs the
        jitted forward (one compile per padded size) and drops the padding. Equals HF
        `get_image_features` / `get_video_features` concatenated over the items.
        """
        pixel_values = jnp.asarray(pixel_values)
        n = pixel_values.shape[0]
        meta = vision_metadata(grid_thw, self.config, num_patches)
        np_ = meta.position_ids.shape[0]
        if np_ > n:
            pixel_values = jnp.pad(pixel_values, ((0, np_ - n), (0, 0)))
        out = _jitted_forward(self, pixel_values, jax.tree.map(jnp.asarray, meta))
        return out[: n // self.config.merge_unit]


@nnx.jit
def _jitted_forward(model: Qwen2_5OmniVisionEncoder, pixel_values, meta: VisionMetadata):
    return model(pixel_values, meta)


__all__ = [
    "HF_RENAMES",
    "VisionEncoderConfig",
    "VisionMetadata",
    "Qwen2_5OmniVisionEncoder",
    "num_merged_tokens",
    "segment_attention",
    "vision_frame_ids",
    "vision_metadata",
    "vision_position_ids",
    "vision_window_index",
]
