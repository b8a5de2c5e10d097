"""The C++ CPU attention kernels (kernels_cpu) against the naive float64 attention and the
XLA reference, on the same NaN-poisoned caches as the Pallas kernels (test_kernels.py): a
kernel that reads a slot past a sequence's length, or the dummy block, produces NaN.
"""
from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_cpu
from kernels_cpu import build_info, library
from kernels_pallas import page_dtype, reference
from omni_jax.models.layers import attention
from test_kernels import (BF16, CASES, F32, assert_close, cu_of, make_cache, make_q, naive_decode,
                          naive_ragged, ragged_batch)

pytestmark = pytest.mark.kernels

# Head sizes the vector path handles (multiples of 16) and one it does not (plain loops).
HEAD_CASES = CASES + [
    pytest.param(4, 2, 16, 16, F32, id="g2-d16-bs16-f32"),
    pytest.param(6, 2, 32, 16, BF16, id="g3-d32-bs16-bf16"),
    pytest.param(4, 2, 24, 16, F32, id="g2-d24-bs16-f32-generic"),
    pytest.param(4, 1, 40, 16, BF16, id="g4-d40-bs16-bf16-generic"),
]


def stored(pages):
    """Pages as the engine stores them for the CPU backend (bf16 as its bits)."""
    return jax.lax.bitcast_convert_type(pages, page_dtype(pages.dtype, "cpu")) \
        if pages.dtype == BF16 else pages


def decode_case(hq, hkv, d, bs, dtype, seed=1):
    # Empty (padded), one token, a page exactly, one past it, and long sequences: the 16-key
    # blocks of the vector path and their remainders.
    lens = [0, 1, bs, bs + 1, 3 * bs + 7, 70, 5]
    k, v, tables = make_cache(seed, lens, hkv, d, bs, dtype)
    return make_q(seed, len(lens), hq, d, dtype), k, v, tables, jnp.asarray(lens, jnp.int32)


@pytest.mark.parametrize("hq,hkv,d,bs,dtype", HEAD_CASES)
def test_decode_matches_naive_and_reference(hq, hkv, d, bs, dtype):
    q, k, v, tables, lens = decode_case(hq, hkv, d, bs, dtype)
    out = jax.jit(kernels_cpu.paged_attention)(q, stored(k), stored(v), tables, lens)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert_close(out, naive_decode(q, k, v, tables, lens), dtype)
    assert_close(out, reference.paged_attention(q, k, v, tables, lens), dtype)
    assert not np.asarray(out[0].astype(F32)).any()  # the padded row


@pytest.mark.parametrize("hq,hkv,d,bs,dtype", HEAD_CASES)
def test_ragged_matches_naive_and_reference(hq, hkv, d, bs, dtype):
    q_lens, kv_lens, rows = ragged_batch(bs)
    k, v, tables = make_cache(2, kv_lens, hkv, d, bs, dtype)
    q = make_q(2, rows, hq, d, dtype)
    args = (q, k, v, tables, jnp.asarray(kv_lens, jnp.int32), cu_of(q_lens))
    out = jax.jit(kernels_cpu.ragged_paged_attention)(q, stored(k), stored(v), *args[3:])
    assert_close(out, naive_ragged(*args), dtype)
    assert_close(out, reference.ragged_paged_attention(*args), dtype)
    assert not np.asarray(out[sum(q_lens):].astype(F32)).any()  # rows past cu_q_lens[S]


@pytest.mark.parametrize("window", [1, 13, 40])
def test_sliding_window(window):
    q, k, v, tables, lens = decode_case(8, 2, 64, 16, F32, seed=3)
    out = kernels_cpu.paged_attention(q, k, v, tables, lens, sliding_window=window)
    assert_close(out, naive_decode(q, k, v, tables, lens, window=window), F32)
    q_lens, kv_lens, rows = ragged_batch(16)
    k, v, tables = make_cache(4, kv_lens, 2, 64, 16, F32)
    q = make_q(4, rows, 8, 64, F32)
    args = (q, k, v, tables, jnp.asarray(kv_lens, jnp.int32), cu_of(q_lens))
    out = kernels_cpu.ragged_paged_attention(*args, sliding_window=window)
    assert_close(out, naive_ragged(*args, window=window), F32)


def test_long_prefill_chunks_span_several_work_items():
    """Chunks longer than one work item's rows (16), after a cached prefix, and a long context."""
    q_lens, kv_lens = [40, 3, 100], [300, 3, 100]
    k, v, tables = make_cache(5, kv_lens, 4, 128, 16, BF16)
    q = make_q(5, sum(q_lens) + 5, 28, 128, BF16)
    args = (q, k, v, tables, jnp.asarray(kv_lens, jnp.int32), cu_of(q_lens))
    out = kernels_cpu.ragged_paged_attention(q, stored(k), stored(v), *args[3:])
    assert_close(out, naive_ragged(*args), BF16)


def test_rows_before_the_first_sequence_see_nothing():
    q_lens, kv_lens, rows = ragged_batch(16)
    k, v, tables = make_cache(11, kv_lens, 4, 64, 16, F32, width=5)
    q = make_q(11, rows + 3, 8, 64, F32)
    args = (q, k, v, tables, jnp.asarray(kv_lens, jnp.int32), cu_of(q_lens) + 3)
    out = kernels_cpu.ragged_paged_attention(*args)
    assert_close(out, naive_ragged(*args), F32)
    assert not np.asarray(out[:3]).any()


@pytest.mark.parametrize("op", ["decode", "ragged"])
def test_bf16_pages_and_their_bits_give_the_same_output(op):
    q_lens, kv_lens, rows = ragged_batch(16)
    k, v, tables = make_cache(8, kv_lens, 2, 64, 16, BF16)
    if op == "decode":
        q = make_q(8, len(kv_lens), 8, 64, BF16)
        call = lambda k, v: kernels_cpu.paged_attention(q, k, v, tables, jnp.asarray(kv_lens, jnp.int32))
    else:
        q = make_q(8, rows, 8, 64, BF16)
        call = lambda k, v: kernels_cpu.ragged_paged_attention(
            q, k, v, tables, jnp.asarray(kv_lens, jnp.int32), cu_of(q_lens))
    a, b = call(k, v), call(stored(k), stored(v))
    np.testing.assert_array_equal(np.asarray(a.astype(F32)), np.asarray(b.astype(F32)))
    np.testing.assert_array_equal(np.asarray(a.astype(F32)), np.asarray(call(k, v).astype(F32)))


@pytest.mark.parametrize("window", [None, 9])
def test_mixed_step_through_the_attention_layer(window):
    """The attention layer's mixed step (decodes first, then chunks) on the "cpu" backend."""
    bs, hq, hkv, d = 16, 8, 2, 64
    q_lens = [1, 1, 1, 5, 37, 1, 0]
    kv_lens = [3 * bs + 2, 1, bs, 21, 37, 2 * bs + 5, 0]
    rows = sum(q_lens) + 6
    k, v, tables = make_cache(12, kv_lens, hkv, d, bs, F32, width=5)
    q = make_q(12, rows, hq, d, F32)
    cu = cu_of(q_lens)
    meta = attention.AttentionMetadata(
        mode="paged", backend="cpu", slot_mapping=jnp.zeros(rows, jnp.int32), block_tables=tables,
        kv_lens=jnp.asarray(kv_lens, jnp.int32), cu_q_lens=cu, num_decodes=jnp.int32(3))
    zeros = jnp.zeros((rows, hkv, d), F32)
    out, _ = attention.paged_attention_step(q, zeros, zeros, (k, v), meta, d ** -0.5, sliding_window=window)
    want = naive_ragged(q, k.at[0].set(jnp.nan), v.at[0].set(jnp.nan), tables, jnp.asarray(kv_lens), cu,
                        window=window)
    assert_close(out, want, F32)


def test_bad_operands_are_refused_with_the_reason():
    q, k, v, tables, lens = decode_case(8, 2, 64, 16, F32)
    with pytest.raises(Exception, match="pages must be float32, bfloat16 or uint16"):
        kernels_cpu.paged_attention(q, k.astype(jnp.int32), v.astype(jnp.int32), tables, lens).block_until_ready()
    with pytest.raises(Exception, match="k and v pages must have one dtype"):
        kernels_cpu.paged_attention(q, k, v.astype(BF16), tables, lens).block_until_ready()
    with pytest.raises(Exception, match="multiple"):
        kernels_cpu.paged_attention(q[:, :3], k, v, tables, lens).block_until_ready()


def test_the_install_built_the_kernels_for_this_source_and_cpu():
    assert kernels_cpu.unavailable_reason() is None
    assert library.library_path().parent == Path(kernels_cpu.__file__).parent


def test_a_missing_or_stale_library_is_refused_with_the_remedy(monkeypatch):
    monkeypatch.setattr(library, "library_path", lambda: None)
    with pytest.raises(library.KernelBuildError, match="was not compiled.*pip install -v -e ."):
        library.register.__wrapped__()
    monkeypatch.undo()
    # Another source or CPU than the library was built for (its embedded key differs).
    monkeypatch.setattr(build_info, "build_key", lambda: "0" * 16)
    with pytest.raises(library.KernelBuildError, match="built from another paged_attention.cc or for "
                                                       "another CPU.*pip install -v -e ."):
        library.register.__wrapped__()


def test_a_library_xla_refuses_is_reported_not_raised_from_xla(monkeypatch):
    # What a library compiled against a newer jaxlib's FFI headers than the one installed gets.
    refusal = "handler's API version (0.5) is incompatible with the framework's API version (0.4)"

    def refuse(*args, **kwargs):
        raise jax.errors.JaxRuntimeError(f"INVALID_ARGUMENT: {refusal}")

    monkeypatch.setattr(jax.ffi, "register_ffi_target", refuse)
    with pytest.raises(library.KernelBuildError, match=rf"XLA \(jaxlib {jax.lib.__version__}\) refused "
                                                       rf".*{re.escape(refusal)}.*pip install -v -e ."):
        library.register.__wrapped__()


def test_the_kernels_compile_against_the_oldest_supported_jax():
    # XLA accepts handlers of its own FFI API version or older: the headers pip builds against
    # (in its isolated build environment) must be those of the oldest jax the package runs on.
    with open(Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as f:
        meta = tomllib.load(f)
    floor = [d for d in meta["project"]["dependencies"] if re.match(r"jax\b", d)]
    build = [d for d in meta["build-system"]["requires"] if re.match(r"jax\b", d)]
    assert len(floor) == 1 and build == [floor[0].replace(">=", "==")], (floor, build)


def test_an_install_without_a_compiler_succeeds_without_the_kernels(tmp_path):
    # setup.py's extension is optional: the install goes on, the engine then falls back.
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, CC="false", CXX="false")
    proc = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib"),
                           "--build-temp", str(tmp_path / "tmp")], cwd=root, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    # The failure is reported, naming the extension.
    assert 'building extension "kernels_cpu._paged_attention" failed' in proc.stdout + proc.stderr
    assert not list(tmp_path.rglob("*.so"))


def test_the_engine_falls_back_to_the_reference_without_the_kernels(monkeypatch, caplog):
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert attention.default_backend() == "cpu"
    monkeypatch.setattr(kernels_cpu, "unavailable_reason", lambda: "no C++ compiler found")
    with caplog.at_level(logging.WARNING, logger="omni_jax.attention"):
        assert attention.default_backend() == "reference"
    assert "no C++ compiler found" in caplog.text
