"""The `omni-jax` command line: the README demo and clear errors."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


def _cli(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "omni_jax.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_generate_tiny_demo(tmp_path):
    """The README's demo, then again: the second start reads the thinker's programs back
    from the program cache (engine/program_cache.py) instead of tracing them, and says so."""
    env = {"OMNI_JAX_CACHE": str(tmp_path), "OMNI_JAX_PROGRAM_CACHE_DIR": str(tmp_path / "programs")}
    r = _cli("generate", "--model", "tiny", "--prompt", "Hello", "--max-tokens", "5", env=env)
    assert r.returncode == 0, r.stderr
    assert "[5 tokens, finish_reason=length" in r.stdout
    assert list(tmp_path.glob("tiny-qwen2_5_omni-v*/omni_jax_config.json"))
    first = re.search(r"stage 'thinker' ready in [0-9.]+ s \(0 of (\d+) programs read back", r.stderr)
    assert first and int(first[1]) > 0, r.stderr[-2000:]
    again = _cli("generate", "--model", "tiny", "--prompt", "Hello", "--max-tokens", "5", env=env)
    assert again.returncode == 0 and again.stdout.splitlines()[:-1] == r.stdout.splitlines()[:-1], again.stderr  # the reply
    assert f"({first[1]} of {first[1]} programs read back" in again.stderr, again.stderr[-2000:]


def test_generate_reports_bad_checkpoint(tmp_path):
    r = _cli("generate", "--model", str(tmp_path), "--prompt", "Hello")
    assert r.returncode == 1
    assert "not an OmniJax checkpoint" in r.stderr


def test_convert_reports_missing_dir(tmp_path):
    r = _cli("convert", "--hf-dir", str(tmp_path / "nope"), "--out", str(tmp_path / "out"))
    assert r.returncode == 1
    assert "does not exist" in r.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize("model, preset", [("tiny", "qwen2_5_omni_tiny"), ("tiny-qwen3_omni", "qwen3_omni_tiny")])
def test_serve_loads_a_built_in_tiny_model_with_its_tiny_preset(model, preset):
    """`omni-jax serve --model tiny` (README): the engine is given the name, not the directory the
    name was built into, whose full-size preset the tiny weights cannot run."""
    from omni_jax.server.engine import ServedEngine
    from omni_jax.server.serve import engine_model

    assert ServedEngine(engine_model(model), model).pipeline.name == preset
