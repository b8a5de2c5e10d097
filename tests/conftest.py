"""Session fixtures: tiny random HF checkpoints (built once, never downloaded)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One JAX compilation cache for the session, this process and every stage process it starts:
# the many engines of the suite compile the same tiny programs once. Engines count a program
# loaded from it as a compilation (engine/runner.py), so no warm-up test gets weaker.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="omni-jax-test-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)
    # Tiny programs compile in well under the default 1 s threshold; cache them all.
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import pytest

import hf_tiny


@pytest.fixture(scope="session")
def qwen2_5_omni_hf_dir(tmp_path_factory) -> str:
    """Directory of a tiny random Qwen2.5-Omni checkpoint (safetensors + config + spk_dict.pt)."""
    return hf_tiny.build_qwen2_5_omni(str(tmp_path_factory.mktemp("qwen2_5_omni_hf")))


@pytest.fixture(scope="session")
def qwen2_5_omni_hf_model(qwen2_5_omni_hf_dir):
    """The transformers reference model loaded from the tiny checkpoint (fp32, eval mode)."""
    return hf_tiny.load_qwen2_5_omni(qwen2_5_omni_hf_dir)


@pytest.fixture(scope="session")
def converted_thinker_fp32(qwen2_5_omni_hf_dir, tmp_path_factory) -> str:
    """The tiny checkpoint converted to OmniJax format in fp32."""
    from conversion.convert import convert

    return convert(qwen2_5_omni_hf_dir, str(tmp_path_factory.mktemp("omni_jax") / "tiny_fp32"),
                   dtype="float32", progress=False)


@pytest.fixture(scope="session")
def qwen3_omni_hf_dir(tmp_path_factory) -> str:
    """Directory of a tiny random Qwen3-Omni checkpoint."""
    import hf_tiny_qwen3

    return hf_tiny_qwen3.build_qwen3_omni(str(tmp_path_factory.mktemp("qwen3_omni_hf")))


@pytest.fixture(scope="session")
def qwen3_omni_hf_model(qwen3_omni_hf_dir):
    """The transformers reference Qwen3-Omni (fp32, eval, talker audio_config fixed)."""
    import hf_tiny_qwen3

    return hf_tiny_qwen3.load_qwen3_omni(qwen3_omni_hf_dir)


@pytest.fixture(scope="session")
def converted_qwen3_fp32(qwen3_omni_hf_dir, tmp_path_factory) -> str:
    """The tiny Qwen3-Omni converted to OmniJax format in fp32."""
    from conversion.convert import convert

    return convert(qwen3_omni_hf_dir, str(tmp_path_factory.mktemp("omni_jax_q3") / "tiny_fp32"),
                   dtype="float32", progress=False)
