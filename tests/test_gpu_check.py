"""The GPU check's real-size parts fit every GPU the device tool lends (an H100 first, then an
H200), checked here without one: a part that runs out of device memory spends the few GPU
minutes a session gets on nothing."""

import os
import sys

import pytest
from flax import nnx

from omni_jax.gpu.memory import tree_bytes
from omni_jax.gpu.programs import real_hf_config, stage_model
from omni_jax.gpu.targets import load_target

# The check's modules are imported from its folder, which is then taken off the path again with
# the `benchmarks/` folder they put first: the tests this process runs after these import the
# project's own modules, not a benchmark's of the same name.
_path = list(sys.path)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "gpu"))
try:
    import check
    import sizes
    import thinker
finally:
    sys.path[:] = _path

# What a part needs besides its weights and KV pages: the steps' temporaries (the 2048-token
# prefill's logits alone are 1.2 GB in fp32), XLA's autotuning and the copy-bandwidth probe.
TEMPORARIES = 6 << 30


@pytest.mark.parametrize("family,batches", [("qwen2_5_omni", sizes.GPU.decode_batches),
                                             ("qwen3_omni", sizes.GPU.moe_decode_batches)])
@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_thinker_parts_fit_the_lent_gpus(family, batches, gpu):
    model, cfg = stage_model(family, "thinker", real_hf_config(family))
    weights = tree_bytes(nnx.state(model, nnx.Param))
    kv = thinker.kv_blocks(sizes.GPU, max(batches)) * thinker.BLOCK * thinker.kv_bytes_per_token(cfg.text, 2)
    share = sizes.GPU.memory_fraction * load_target(gpu).device_memory_size
    assert weights + kv + TEMPORARIES <= share, (
        f"{family} on {gpu}: {weights / 1e9:.1f} GB of weights + {kv / 1e9:.1f} GB of KV + "
        f"{TEMPORARIES / 1e9:.1f} GB of temporaries > {share / 1e9:.1f} GB")


def test_kv_blocks_hold_a_decode_batch_or_the_prefill_prompt():
    size = sizes.GPU
    per_request = -(-(size.decode_prompt + size.decode_steps + 4) // thinker.BLOCK)  # prompt + max_tokens
    assert thinker.kv_blocks(size, 64) >= 64 * per_request + 1
    assert thinker.kv_blocks(size, 1) >= -(-(size.prefill_tokens + 1) // thinker.BLOCK) + 1


def test_gpu_parts_get_the_memory_share_and_a_users_setting_wins(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    env = check.part_env("gpu", "/tmp/out")
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == str(sizes.GPU.memory_fraction)
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert env["OMNI_JAX_CHECK_OUT"] == "/tmp/out"
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in check.part_env("cpu", "/tmp/out")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    assert check.part_env("gpu", "/tmp/out")["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"
