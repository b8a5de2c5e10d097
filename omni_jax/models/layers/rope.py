"""Rotary position embeddings: plain RoPE and Qwen's multimodal M-RoPE.

M-RoPE gives every token three position ids (temporal, height, width). The
rotary frequency bands are split by `mrope_section` and each band takes its angle
from one of the three rows: contiguous bands for Qwen2.5-Omni ([T...][H...][W...]),
interleaved for Qwen3-Omni (T, H, W, T, H, W, ...).
"""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import numpy as np

from kernels_pallas import reference


def inv_frequencies(head_dim: int, theta: float) -> np.ndarray:
    """The standard RoPE inverse frequencies, [head_dim // 2] float32."""
    return (1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))).astype(np.float32)


def mrope_band_rows(mrope_section: Sequence[int] | None, half_dim: int, interleaved: bool = False) -> np.ndarray:
    """For each of the half_dim frequency bands, which position row (0=T, 1=H, 2=W) drives it."""
    if not mrope_section:
        return np.zeros(half_dim, np.int32)
    if sum(mrope_section) != half_dim:
        raise ValueError(f"mrope_section {list(mrope_section)} must sum to head_dim/2 = {half_dim}")
    if interleaved:
        rows = np.zeros(half_dim, np.int32)
        for row in (1, 2):
            idx = np.arange(row, mrope_section[row] * 3, 3)
            rows[idx] = row
        return rows
    return np.repeat(np.arange(3, dtype=np.int32), mrope_section)


def rope_cos_sin(positions: jnp.ndarray, inv_freq: np.ndarray, band_rows: np.ndarray, dtype=jnp.float32):
    """cos/sin tables [T, head_dim] for positions [3, T] (M-RoPE) or [T] (1-D RoPE).

    Angles are computed in fp32 (as transformers does) and cast to `dtype` at the end.
    """
    positions = jnp.asarray(positions)
    if positions.ndim == 1:
        positions = jnp.broadcast_to(positions[None], (3,) + positions.shape)
    pos = positions.astype(jnp.float32)  # [3, T]
    # Pick, per frequency band, the row that drives it: [T, half]
    pos_per_band = jnp.take(pos, jnp.asarray(band_rows), axis=0).T
    freqs = pos_per_band * jnp.asarray(inv_freq)[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


# The rotation itself (rotate-half) is the kernels' reference: the decode kernel rotates q and
# k in-kernel on a GPU.
apply_rope = reference.apply_rope
