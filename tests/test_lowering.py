"""Every Pallas kernel lowers for CUDA on this CPU-only machine.

``jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))`` runs the
Pallas -> Triton IR lowering (with Triton's op verifiers, e.g. the
power-of-two tensor rule) at the production shapes, in bf16, with the tile
sizes the kernels ship. Arguments are ShapeDtypeStructs: no memory needed.
Interpret mode cannot catch these constraints; nothing here is skipped.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from kernels_pallas import rms_norm, write_kv_pages
from kernels_pallas.paged_attention import paged_attention, paged_attention_with_write
from kernels_pallas.ragged_paged_attention import ragged_paged_attention
from omni_jax.gpu.targets import load_target

pytestmark = pytest.mark.lowering

BF16, I32 = jnp.bfloat16, jnp.int32
TRITON_CALL = "__gpu$xla.gpu.triton"

# (q heads, kv heads, head dim) of the attention layers we serve.
MODELS = {
    "qwen2_5_omni_thinker": (28, 4, 128),
    "qwen2_5_omni_talker": (12, 4, 128),
    "qwen3_omni_thinker": (32, 4, 128),
    "qwen3_omni_talker": (16, 2, 128),
}
NUM_BLOCKS = 8192          # pool size only changes strides; any value works


def sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def lower_cuda(fn, *args):
    """Lowers fn for CUDA and returns the StableHLO text. For an A100: from JAX 0.11 on, Pallas'
    Triton backend lowers for a named GPU only, and the A100's is the kernels' most conservative
    tuning row, the one they take with no GPU at all."""
    with jax.sharding.use_abstract_mesh(load_target("a100").abstract_mesh()):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def pages(bs, hkv, d):
    return sds((NUM_BLOCKS, bs, hkv, d), BF16)


# (batch, context) buckets: small batch/long context engages split-K, large
# batch/short context runs a single split; forced k_splits=1 covers the
# in-kernel normalisation path at a split-sized batch.
DECODE_SHAPES = [(1, 32768, None), (64, 4096, None), (256, 2048, None),
                 (8, 4096, 1)]


@pytest.mark.parametrize("bs", [16, 32, 64])
@pytest.mark.parametrize("model", MODELS)
def test_decode_lowers(model, bs):
    hq, hkv, d = MODELS[model]
    for batch, context, k_splits in DECODE_SHAPES:
        fn = functools.partial(paged_attention, k_splits=k_splits)
        text = lower_cuda(fn, sds((batch, hq, d), BF16), pages(bs, hkv, d),
                          pages(bs, hkv, d), sds((batch, context // bs), I32),
                          sds((batch,), I32))
        # Split-K (the kernel's name records its splits): the merge is a second kernel.
        splits = int(re.search(r"paged_decode_bs\d+_ppb\d+_k(\d+)", text).group(1))
        assert splits > 1 or k_splits == 1 or batch >= 64, (batch, context)
        assert text.count(f"@{TRITON_CALL}(") == (2 if splits > 1 else 1), (batch, context, splits)


@pytest.mark.parametrize("model", MODELS)
def test_decode_with_write_lowers(model):
    """The decode kernel that also rotates q and k (and normalises them: Qwen3) and stores
    the step's K/V, at every decode shape: one kernel (and the merge), the two pools updated
    in place (outputs aliased to them)."""
    hq, hkv, d = MODELS[model]
    for batch, context, k_splits in DECODE_SHAPES:
        rope = (sds((batch, d), BF16),) * 2
        norms = (sds((d,), BF16),) * 2 if model.startswith("qwen3") else None
        fn = functools.partial(paged_attention_with_write, k_splits=k_splits)
        new = sds((batch, hkv, d), BF16)
        text = lower_cuda(lambda *a: fn(*a[:8], rope=a[8], qk_norm=a[9]),
                          sds((batch, hq, d), BF16), new, new, pages(16, hkv, d), pages(16, hkv, d),
                          sds((batch,), I32), sds((batch, context // 16), I32), sds((batch,), I32), rope, norms)
        splits = int(re.search(r"paged_decode_bs16_ppb\d+_k(\d+)_write", text).group(1))
        assert text.count(f"@{TRITON_CALL}(") == (2 if splits > 1 else 1), (batch, context, splits)
        assert text.count("output_operand_alias<") == 2, (batch, context)


@pytest.mark.parametrize("bs", [16, 32, 64])
@pytest.mark.parametrize("model", MODELS)
def test_ragged_lowers(model, bs):
    hq, hkv, d = MODELS[model]
    # (tokens bucket, sequences, context, sliding window)
    for tokens, seqs, context, window in [(2048, 16, 32768, None),
                                          (256, 64, 4096, None),
                                          (512, 8, 8192, 4096)]:
        fn = functools.partial(ragged_paged_attention, sliding_window=window)
        text = lower_cuda(fn, sds((tokens, hq, d), BF16), pages(bs, hkv, d),
                          pages(bs, hkv, d), sds((seqs, context // bs), I32),
                          sds((seqs,), I32), sds((seqs + 1,), I32))
        assert TRITON_CALL in text, (tokens, seqs)


@pytest.mark.parametrize("tuning", [
    dict(pages_per_compute_block=1, num_warps=8, num_stages=2),
    dict(pages_per_compute_block=8, num_warps=4, num_stages=4, k_splits=16),
    dict(pages_per_compute_block=4, num_warps=1, num_stages=3, preload_table=True),
])
def test_decode_tuning_variants_lower(tuning):
    """The variants benchmarks/pallas_kernels.py and the GPU check's tuning part sweep lower too."""
    hq, hkv, d = MODELS["qwen2_5_omni_thinker"]
    fn = functools.partial(paged_attention, **tuning)
    text = lower_cuda(fn, sds((64, hq, d), BF16), pages(16, hkv, d),
                      pages(16, hkv, d), sds((64, 256), I32), sds((64,), I32))
    assert TRITON_CALL in text


@pytest.mark.parametrize("tuning", [
    dict(block_q=32, pages_per_compute_block=2, num_warps=8),
    dict(block_q=8, pages_per_compute_block=8, num_stages=3),
])
def test_ragged_tuning_variants_lower(tuning):
    hq, hkv, d = MODELS["qwen3_omni_thinker"]
    fn = functools.partial(ragged_paged_attention, **tuning)
    text = lower_cuda(fn, sds((1024, hq, d), BF16), pages(16, hkv, d),
                      pages(16, hkv, d), sds((8, 512), I32), sds((8,), I32),
                      sds((9,), I32))
    assert TRITON_CALL in text


@pytest.mark.parametrize("model", MODELS)
def test_kv_write_lowers(model):
    """The KV write is an XLA scatter; it must lower for CUDA as well, as a bf16
    scatter (the scatter of bits is XLA:CPU's workaround, not the GPU's)."""
    _, hkv, d = MODELS[model]
    text = lower_cuda(write_kv_pages, pages(16, hkv, d), pages(16, hkv, d),
                      sds((2048, hkv, d), BF16), sds((2048, hkv, d), BF16),
                      sds((2048,), I32))
    assert "bitcast_convert" not in text and "ui16" not in text


@pytest.mark.parametrize("experts,top_k", [(128, 8), (128, 6)])   # Qwen3-Omni thinker, talker
def test_moe_route_lowers(experts, top_k):
    """A decode step's MoE routing kernel at the smallest and largest token counts it takes."""
    from kernels_pallas.moe_route import MAX_TOKENS, moe_route

    for tokens in (1, MAX_TOKENS):
        fn = functools.partial(moe_route, top_k=top_k, norm_topk_prob=top_k == 8)
        text = lower_cuda(fn, sds((tokens, experts), BF16), sds((tokens,), jnp.bool_))
        assert text.count(f"@{TRITON_CALL}(") == 1, tokens


# Hidden sizes of the decoders we serve (Qwen2.5-Omni-7B thinker and talker, Qwen3-Omni
# thinker and talker/code predictor): 3584 and 896 are no power of two (the row is padded).
HIDDEN_SIZES = (3584, 896, 2048, 1024)


@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
def test_rms_norm_lowers(hidden):
    for tokens in (1, 64, 4096):
        x, w = sds((tokens, hidden), BF16), sds((hidden,), BF16)
        for fn, args in ((functools.partial(rms_norm, eps=1e-6), (x, w)),
                         (functools.partial(rms_norm, eps=1e-6), (x, w, x))):
            assert TRITON_CALL in lower_cuda(fn, *args), (hidden, tokens, len(args))
