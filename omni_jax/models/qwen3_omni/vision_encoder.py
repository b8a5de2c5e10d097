"""Qwen3-Omni vision encoder (``Qwen3OmniMoeVisionEncoder``, the Qwen3-VL ViT) in Flax NNX.

Pipeline: Conv3d patch embed (with bias) + a learned ``num_position_embeddings`` (square
``S x S``) position table bilinearly resampled to each item's patch grid
(align_corners) -> blocks (LayerNorm, fused-qkv attention with 2-D rotary over the whole
frame, LayerNorm, fc1/act/fc2 MLP) -> PatchMerger (LayerNorm per patch, 2x2 group,
Linear, GELU, Linear). After the blocks listed in ``deepstack_visual_indexes`` a
``merger_list`` merger (LayerNorm *after* grouping) turns the intermediate hidden states
into DeepStack features, which the thinker adds to the visual token positions of its
first decoder layers (feature k after decoder layer k). No window attention (unlike
Qwen2.5-VL): every block attends within one frame, in processor order.

Shape contract (N = sum(t*h*w) valid patches over the items of ``grid_thw``, U = m*m with
m the spatial merge size, Np >= N the padded patch count, Np % U == 0, Mp = Np // U,
K = len(deepstack_visual_indexes)):

- ``pixel_values [Np, C * temporal_patch * patch * patch]``: rows in the Qwen-VL processor
  order (per item, per frame, per m x m block, row-major inside); rows N.. are padding
  (any finite value).
- :class:`VisionMetadata` (host-side numpy, :func:`vision_metadata`): rotary (h, w)
  position ids, the 4 interpolation taps + weights of every patch, attention segment ids
  (one per frame; padding -1, so it never mixes with valid patches).
- output ``(features [Mp, out_hidden_size], deepstack [K, Mp, out_hidden_size])``: merged
  tokens in ``grid_thw`` order; rows 0..M-1 (M = N // U) equal transformers'
  ``pooler_output`` / ``deepstack_features`` (``get_image_features`` /
  ``get_video_features`` concatenated over items); item i owns t_i*h_i*w_i // U
  consecutive rows. Padding rows are finite garbage.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from omni_jax.models.layers.linear import Linear
from omni_jax.models.layers.rope import apply_rope, inv_frequencies
from omni_jax.models.layers.mlp import ACTIVATIONS
from omni_jax.models.layers.vision_blocks import (
    PADDING_SEGMENT,
    PatchSizes,
    MergerMLP,
    VisionPatchEmbed,
    num_merged_tokens,
    segment_attention,
    vision_frame_ids,
    vision_position_ids,
)

# HF key (after "thinker.visual.") -> NNX path: the mergers' MLP is a ModuleList
# [Linear, GELU, Linear] whose indexes 0 and 2 an NNX list cannot mirror.
HF_RENAMES = [
    (r"^(merger|merger_list\.\d+)\.mlp\.0\.", r"\1.mlp.fc1."),
    (r"^(merger|merger_list\.\d+)\.mlp\.2\.", r"\1.mlp.fc2."),
]

_LN_EPS = 1e-6  # every LayerNorm of the HF vision tower


@dataclasses.dataclass(frozen=True)
class VisionEncoderConfig(PatchSizes):
    """Sizes of the Qwen3-Omni vision encoder (the HF ``thinker_config.vision_config``)."""

    depth: int = 27
    hidden_size: int = 1152
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    rope_theta: float = 10000.0

    @classmethod
    def from_hf(cls, d: dict) -> "VisionEncoderConfig":
        """Build from the HF ``vision_config`` dict of a Qwen3-Omni config.json."""
        rope = d.get("rope_parameters") or {}
        names = {f.name for f in dataclasses.fields(cls)} - {"deepstack_visual_indexes", "rope_theta"}
        kwargs = {k: d[k] for k in names if k in d}
        if "deepstack_visual_indexes" in d:
            kwargs["deepstack_visual_indexes"] = tuple(int(i) for i in d["deepstack_visual_indexes"])
        kwargs["rope_theta"] = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
        return cls(**kwargs)

    @property
    def num_grid_per_side(self) -> int:
        """Side of the learned square position table."""
        return int(self.num_position_embeddings ** 0.5)


# ----------------------------------------------------------------------------------------
# Host-side metadata (numpy).
# ----------------------------------------------------------------------------------------


class VisionMetadata(NamedTuple):
    """Per-call arrays for :class:`Qwen3OmniVisionEncoder` (a pytree of numpy arrays).

    position_ids   [Np, 2] int32    rotary (h, w) patch coordinates (padding: 0)
    interp_index   [Np, 4] int32    rows of ``pos_embed`` blended into each patch (padding: 0)
    interp_weight  [Np, 4] float32  their bilinear weights (padding: 0)
    segment_ids    [Np]    int32    attention segment = frame (item, t); padding: -1
    """

    position_ids: np.ndarray
    interp_index: np.ndarray
    interp_weight: np.ndarray
    segment_ids: np.ndarray


def _as_grid(grid_thw) -> np.ndarray:
    return np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)


def _axis_taps(index: np.ndarray, size: np.ndarray, side: int) -> tuple[np.ndarray, np.ndarray]:
    # Bilinear, align_corners=True taps (floor, floor + 1, clamped to the table) and their
    # hat-kernel weights, with transformers' float32 rounding at every step.
    index = index.astype(np.float32)
    denom = np.maximum(size - 1, 1).astype(np.float32)
    src = index * np.float32(side - 1) / denom
    floor = np.floor(src)
    offsets = np.arange(2, dtype=np.float32)
    taps = np.clip(floor.astype(np.int64)[:, None] + np.arange(2), 0, side - 1)
    distance = np.abs(src[:, None] - floor[:, None] - offsets)
    weights = np.maximum(np.float32(1) - distance, np.float32(0))
    return taps, weights.astype(np.float32)


def vision_interpolation(grid_thw, num_grid_per_side: int, spatial_merge_size: int):
    """Bilinear taps of the learned position table for every patch (processor order).

    Returns (index [N, 4] int32, weight [N, 4] float32); the patch's position embedding is
    ``sum_k pos_embed[index[:, k]] * weight[:, k]``. The (h, w) grid of each item is
    resampled from the ``S x S`` table with align_corners (corners map to corners), frames
    of a video share it. Same as transformers'
    ``get_vision_interpolation_indices_and_weights(mode="bilinear", align_corners=True)``
    (Qwen3-VL's ``fast_pos_embed_interpolate``).
    """
    grid = _as_grid(grid_thw)
    m, side = spatial_merge_size, num_grid_per_side
    if grid.shape[0] == 0:
        return np.zeros((0, 4), np.int32), np.zeros((0, 4), np.float32)
    hw = vision_position_ids(grid, m).astype(np.int64)  # (row, col) in processor order
    counts = grid.prod(-1)
    heights = np.repeat(grid[:, 1], counts)
    widths = np.repeat(grid[:, 2], counts)
    h_taps, h_w = _axis_taps(hw[:, 0], heights, side)
    w_taps, w_w = _axis_taps(hw[:, 1], widths, side)
    index = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weight = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4)
    return index.astype(np.int32), weight.astype(np.float32)


def max_frame_patches(grid_thw) -> int:
    """Patches of the largest frame (h*w): the ``max_segment_len`` for banded attention."""
    grid = _as_grid(grid_thw)
    return int((grid[:, 1] * grid[:, 2]).max()) if grid.size else 0


def vision_metadata(grid_thw, config: VisionEncoderConfig, num_patches: int | None = None) -> VisionMetadata:
    """All per-patch arrays for one encoder call over the items of ``grid_thw`` [num_items, 3].

    ``num_patches`` pads to a bucket (>= the valid patch count, a multiple of m*m).
    """
    grid = _as_grid(grid_thw)
    unit = config.merge_unit
    if (grid[:, 1:] % config.spatial_merge_size).any():
        raise ValueError(f"grid h and w must be multiples of spatial_merge_size, got {grid.tolist()}")
    n = int(grid.prod(-1).sum())
    np_ = n if num_patches is None else int(num_patches)
    if np_ < n or np_ % unit:
        raise ValueError(f"num_patches={np_} must be >= {n} (valid patches) and a multiple of {unit}")
    position_ids = np.zeros((np_, 2), np.int32)
    position_ids[:n] = vision_position_ids(grid, config.spatial_merge_size)
    interp_index = np.zeros((np_, 4), np.int32)
    interp_weight = np.zeros((np_, 4), np.float32)
    interp_index[:n], interp_weight[:n] = vision_interpolation(grid, config.num_grid_per_side,
                                                               config.spatial_merge_size)
    segment_ids = np.full((np_,), PADDING_SEGMENT, np.int32)
    segment_ids[:n] = vision_frame_ids(grid)
    return VisionMetadata(position_ids, interp_index, interp_weight, segment_ids)


def vision_rotary(position_ids: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """Axial 2-D rotary cos/sin [N, head_dim] for (h, w) position ids [N, 2].

    The same head_dim/4 frequencies for h and w; [h-bands | w-bands] is doubled to span
    the whole head (rotate-half convention). Angles in fp32, as transformers.
    """
    inv_freq = inv_frequencies(head_dim // 2, theta)
    freqs = position_ids.astype(jnp.float32)[:, :, None] * jnp.asarray(inv_freq)  # [N, 2, D/4]
    freqs = freqs.reshape(freqs.shape[0], -1)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


# ----------------------------------------------------------------------------------------
# Modules (attribute names mirror transformers' Qwen3OmniMoeVisionEncoder).
# ----------------------------------------------------------------------------------------


def _layer_norm(dim: int, *, dtype, param_dtype, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(dim, epsilon=_LN_EPS, use_fast_variance=False, dtype=dtype,
                         param_dtype=param_dtype, rngs=rngs)


class PatchEmbed(VisionPatchEmbed):
    """Qwen2.5-Omni's patch embed (Conv3d as one matmul per patch) plus the conv bias."""

    def __init__(self, config: VisionEncoderConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        super().__init__(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nnx.Conv(config.in_channels, config.hidden_size, kernel_size=kernel, strides=kernel,
                             padding="VALID", use_bias=True, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, pixel_values: jax.Array) -> jax.Array:
        return super().__call__(pixel_values) + self.proj.bias[...].astype(self.dtype)


class VisionAttention(nnx.Module):
    """Fused-qkv multi-head self-attention with 2-D rotary, restricted to equal segment ids."""

    def __init__(self, config: VisionEncoderConfig, *, dtype, param_dtype, precision, rngs: nnx.Rngs):
        dim = config.hidden_size
        kw = dict(dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.qkv = Linear(dim, 3 * dim, **kw)
        self.proj = Linear(dim, dim, **kw)

    def __call__(self, x, cos, sin, segment_ids, max_segment_len=None):
        n = x.shape[0]
        qkv = self.qkv(x).reshape(n, 3, self.num_heads, self.head_dim)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        # Rotary in fp32 as transformers does, then back to the compute dtype.
        q = apply_rope(q.astype(jnp.float32), cos, sin).astype(x.dtype)
        k = apply_rope(k.astype(jnp.float32), cos, sin).astype(x.dtype)
        out = segment_attention(q, k, v, segment_ids, self.head_dim ** -0.5, max_segment_len)
        return self.proj(out.reshape(n, -1))


class VisionMLP(nnx.Module):
    """linear_fc2(act(linear_fc1(x)))."""

    def __init__(self, config: VisionEncoderConfig, *, dtype, param_dtype, precision, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        self.act = config.hidden_act
        self.linear_fc1 = Linear(config.hidden_size, config.intermediate_size, **kw)
        self.linear_fc2 = Linear(config.intermediate_size, config.hidden_size, **kw)

    def __call__(self, x):
        return self.linear_fc2(ACTIVATIONS[self.act](self.linear_fc1(x)))


class VisionBlock(nnx.Module):
    """Pre-norm transformer block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, config: VisionEncoderConfig, *, dtype, param_dtype, precision, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.norm1 = _layer_norm(config.hidden_size, **kw)
        self.norm2 = _layer_norm(config.hidden_size, **kw)
        self.attn = VisionAttention(config, precision=precision, **kw)
        self.mlp = VisionMLP(config, precision=precision, **kw)

    def __call__(self, x, cos, sin, segment_ids, max_segment_len=None):
        x = x + self.attn(self.norm1(x), cos, sin, segment_ids, max_segment_len)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nnx.Module):
    """Group each m x m block of patches and project it to the LLM width.

    ``postshuffle_norm`` False (main merger): LayerNorm per patch, then group; True
    (DeepStack mergers): group, then LayerNorm over the grouped vector.
    """

    def __init__(self, config: VisionEncoderConfig, postshuffle_norm: bool, *, dtype, param_dtype, precision,
                 rngs: nnx.Rngs):
        self.group_dim = config.hidden_size * config.merge_unit
        self.postshuffle_norm = postshuffle_norm
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.ln_q = _layer_norm(self.group_dim if postshuffle_norm else config.hidden_size, **kw)
        self.mlp = MergerMLP(self.group_dim, config.out_hidden_size, **kw)
        if precision is not None:
            self.mlp.fc1.precision = self.mlp.fc2.precision = precision

    def __call__(self, x):
        if self.postshuffle_norm:
            return self.mlp(self.ln_q(x.reshape(-1, self.group_dim)))
        return self.mlp(self.ln_q(x).reshape(-1, self.group_dim))


class Qwen3OmniVisionEncoder(nnx.Module):
    """Qwen3-Omni ViT: pixel patches -> merged visual tokens + DeepStack features (see module doc).

    ``precision`` applies to the Linear layers; default HIGHEST for float32 compute.
    """

    def __init__(self, config: VisionEncoderConfig, *, dtype=jnp.float32, param_dtype=jnp.float32,
                 precision=None, rngs: nnx.Rngs):
        if config.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported vision activation {config.hidden_act!r}")
        if config.num_grid_per_side ** 2 != config.num_position_embeddings:
            raise ValueError(f"num_position_embeddings={config.num_position_embeddings} is not a square")
        if len(set(config.deepstack_visual_indexes)) != len(config.deepstack_visual_indexes) or any(
                not 0 <= i < config.depth for i in config.deepstack_visual_indexes):
            raise ValueError(f"bad deepstack_visual_indexes {config.deepstack_visual_indexes} for depth {config.depth}")
        if precision is None and jnp.dtype(dtype) == jnp.float32:
            precision = jax.lax.Precision.HIGHEST
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.config = config
        self.dtype = dtype
        self.precision = precision
        self.merger_list = nnx.List([PatchMerger(config, True, precision=precision, **kw)
                                     for _ in config.deepstack_visual_indexes])
        self.patch_embed = PatchEmbed(config, **kw)
        self.pos_embed = nnx.Embed(config.num_position_embeddings, config.hidden_size, **kw)
        self.blocks = nnx.List([VisionBlock(config, precision=precision, **kw) for _ in range(config.depth)])
        self.merger = PatchMerger(config, False, precision=precision, **kw)

    def __call__(self, pixel_values: jax.Array, meta: VisionMetadata,
                 max_segment_len: int | None = None) -> tuple[jax.Array, jax.Array]:
        """Padded forward, jit-friendly: ``[Np, patch_dim]`` + metadata ->
        (``[Np // U, out_hidden_size]``, ``[K, Np // U, out_hidden_size]``).

        ``max_segment_len`` (static; >= the largest frame's patch count, see
        :func:`max_frame_patches`) switches to banded attention, O(Np * 3L) instead of O(Np^2).
        """
        if self.precision is None:
            return self._forward(pixel_values, meta, max_segment_len)
        # The shared patch-embed and attention helpers take no precision argument: set it
        # for every matmul traced here (no TF32 for float32 compute on GPU).
        with jax.default_matmul_precision(jax.lax.Precision(self.precision).name.lower()):
            return self._forward(pixel_values, meta, max_segment_len)

    def _forward(self, pixel_values, meta, max_segment_len):
        c = self.config
        x = self.patch_embed(pixel_values)
        # Bilinear blend of the learned table, summed tap by tap in transformers' order.
        table = self.pos_embed.embedding[...]
        idx, w = jnp.asarray(meta.interp_index), jnp.asarray(meta.interp_weight)
        pos = jnp.take(table, idx[:, 0], axis=0) * w[:, 0:1]
        for k in range(1, idx.shape[1]):
            pos = pos + jnp.take(table, idx[:, k], axis=0) * w[:, k:k + 1]
        x = x + pos.astype(x.dtype)

        cos, sin = vision_rotary(jnp.asarray(meta.position_ids), c.head_dim, c.rope_theta)
        seg = jnp.asarray(meta.segment_ids)
        deepstack = []
        for i, blk in enumerate(self.blocks):
            x = blk(x, cos, sin, seg, max_segment_len)
            if i in c.deepstack_visual_indexes:
                deepstack.append(self.merger_list[c.deepstack_visual_indexes.index(i)](x))
        merged = self.merger(x)
        if deepstack:
            stacked = jnp.stack(deepstack)
        else:
            stacked = jnp.zeros((0,) + merged.shape, merged.dtype)
        return merged, stacked

    def encode(self, pixel_values, grid_thw, num_patches: int | None = None,
               max_segment_len: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Features and DeepStack features of all items of ``grid_thw`` (numpy):
        ``([M, out_hidden_size], [K, M, out_hidden_size])``, M = number of merged tokens.

        Convenience for tests and tools: pads to ``num_patches`` if given, runs the jitted
        forward (one compile per padded shape) and drops the padding.
        """
        pixel_values = np.asarray(pixel_values, dtype=np.float32)
        n = pixel_values.shape[0]
        m = int(num_merged_tokens(grid_thw, self.config.spatial_merge_size).sum())
        if n != m * self.config.merge_unit:
            raise ValueError(f"pixel_values has {n} rows, grid_thw needs {m * self.config.merge_unit}")
        meta = vision_metadata(grid_thw, self.config, num_patches)
        np_ = meta.position_ids.shape[0]
        if np_ > n:
            pixel_values = np.pad(pixel_values, ((0, np_ - n), (0, 0)))
        graphdef, state = nnx.split(self)
        merged, deepstack = _jitted_forward(graphdef, state, jnp.asarray(pixel_values),
                                            jax.tree.map(jnp.asarray, meta), max_segment_len)
        return np.asarray(merged[:m]), np.asarray(deepstack[:, :m])


@functools.partial(jax.jit, static_argnums=(0, 4))
def _jitted_forward(graphdef, state, pixel_values, meta, max_segment_len):
    # One compilation per (module structure, input shapes, band width).
    return nnx.merge(graphdef, state)(pixel_values, meta, max_segment_len)


__all__ = [
    "HF_RENAMES",
    "Qwen3OmniVisionEncoder",
    "VisionEncoderConfig",
    "VisionMetadata",
    "max_frame_patches",
    "num_merged_tokens",
    "vision_interpolation",
    "vision_metadata",
    "vision_rotary",
]
