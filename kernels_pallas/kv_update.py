"""Writing new tokens' K/V into the paged cache at a slot mapping.

Slot convention: ``slot = block_id * block_size + offset_in_block``. Padding
tokens (bucket padding) point into the reserved dummy block 0, e.g. slot 0;
any negative slot is also accepted and is dropped (nothing is written).

Why an XLA scatter and not a Pallas kernel: viewing the pages as
``[num_blocks * block_size, Hkv, D]`` (a free reshape) makes the write one
row scatter of ``T * Hkv * D`` elements. It is memory bound on both the
read of ``k_new``/``v_new`` and the write of the same bytes, so a kernel can
at best tie it; XLA runs it in place when the caller donates the cache, fuses
the cast/reshape of the projection outputs into it, and it works unchanged on
CPU and GPU. Its cost is ``2 * T * Hkv * D`` elements, negligible next to the
attention that reads all of a sequence's pages each step. (Duplicated slots
only ever occur inside the dummy block, where any write order is fine.)
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

__all__ = ["write_kv_pages"]


def _scatter_rows(pages, new, slots):
    nb, bs, hkv, d = pages.shape
    new = new.astype(pages.dtype)

    def as_floats(pages, new, slots):
        flat = pages.reshape(nb * bs, hkv, d)
        return flat.at[slots].set(new, mode="drop").reshape(pages.shape)

    def as_bits(pages, new, slots):
        bits = lax.bitcast_convert_type(pages, jnp.uint16).reshape(nb * bs, hkv, d)
        bits = bits.at[slots].set(lax.bitcast_convert_type(new, jnp.uint16), mode="drop")
        return lax.bitcast_convert_type(bits.reshape(pages.shape), pages.dtype)

    if pages.dtype.itemsize != 2:
        return as_floats(pages, new, slots)
    # XLA:CPU scatters 16-bit floats by converting the whole cache to fp32 and back
    # (66 ms a layer for the engine benchmark's bf16 cache); their bits it scatters
    # as they are. GPUs scatter bf16 natively: only CPU lowerings take the bits.
    return lax.platform_dependent(pages, new, slots, cpu=as_bits, default=as_floats)


def write_kv_pages(k_pages, v_pages, k_new, v_new, slot_mapping):
    """Returns (k_pages, v_pages) with token t's K/V stored at slot_mapping[t].

    k_pages/v_pages: [num_blocks, block_size, Hkv, D]; k_new/v_new:
    [T, Hkv, D] (cast to the pages' dtype); slot_mapping: int32 [T]. In place
    when called from a jitted function that donates the pages.
    """
    num_slots = k_pages.shape[0] * k_pages.shape[1]
    slots = slot_mapping.astype(jnp.int32)
    # jnp would wrap negative indices python-style; send them out of range so
    # mode="drop" discards them instead.
    slots = jnp.where(slots < 0, num_slots, slots)
    return (_scatter_rows(k_pages, k_new, slots),
            _scatter_rows(v_pages, v_new, slots))
