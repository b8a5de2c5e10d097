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

__all__ = ["write_kv_pages", "page_dtype", "page_values", "BF16_BITS"]


# Pages of this dtype hold bf16 values as their bits. XLA:CPU gathers and scatters 16-bit
# floats by converting the whole operand (the cache: 43 MB a layer at the engine benchmark's
# size) to fp32 and back, and bitcasting bf16 pages to their bits inside a step copies them;
# integer pages it gathers and scatters in place. So the CPU backends (the XLA reference and
# kernels_cpu) keep a bf16 cache as uint16 (`page_dtype`); the Pallas kernels take bf16 pages
# as they are.
BF16_BITS = jnp.dtype(jnp.uint16)


def page_dtype(kv_dtype, backend: str):
    """The dtype a KV cache of `kv_dtype` is stored in for `backend` ("pallas" | "cpu" | "reference")."""
    kv_dtype = jnp.dtype(kv_dtype)
    return BF16_BITS if backend != "pallas" and kv_dtype == jnp.bfloat16 else kv_dtype


def page_values(x):
    """Values read from pages (or gathered from them): bf16 bits become bf16."""
    return lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == BF16_BITS else x


def _scatter_rows(pages, new, slots):
    nb, bs, hkv, d = pages.shape
    if pages.dtype == BF16_BITS:
        new = lax.bitcast_convert_type(new.astype(jnp.bfloat16), BF16_BITS)
    else:
        new = new.astype(pages.dtype)
    flat = pages.reshape(nb * bs, hkv, d)
    return flat.at[slots].set(new, mode="drop").reshape(pages.shape)


def write_kv_pages(k_pages, v_pages, k_new, v_new, slot_mapping):
    """Returns (k_pages, v_pages) with token t's K/V stored at slot_mapping[t].

    k_pages/v_pages: [num_blocks, block_size, Hkv, D]; k_new/v_new: [T, Hkv, D]
    (cast to the pages' dtype; to bf16 bits for `BF16_BITS` pages); slot_mapping:
    int32 [T]. In place when called from a jitted function that donates the pages.
    """
    num_slots = k_pages.shape[0] * k_pages.shape[1]
    slots = slot_mapping.astype(jnp.int32)
    # jnp would wrap negative indices python-style; send them out of range so
    # mode="drop" discards them instead.
    slots = jnp.where(slots < 0, num_slots, slots)
    return (_scatter_rows(k_pages, k_new, slots),
            _scatter_rows(v_pages, v_new, slots))
