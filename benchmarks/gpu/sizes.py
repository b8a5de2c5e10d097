"""The GPU check's two sizes: the real models on a GPU, toy ones on a CPU (`check.sh --cpu`).

Every part runs the same functions at either size; this module is the one place where the
sizes, the models and the time budgets differ. GPU budgets add up to about 9 minutes (the device
tool gives one command 10): the thinkers' budgets are what their parts took on the H200 with
fresh compiles (2026-12-04: 68 s and 114 s) and a margin.
"""

from __future__ import annotations

import dataclasses
import importlib
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass(frozen=True)
class Size:
    name: str                              # "gpu" | "cpu"
    interpret: bool                        # Pallas kernels in interpret mode (no GPU)
    dtype: str                             # model weights and KV
    # kernels: (batch, context) decode points, (new, cached, seqs) prefill points, KV write
    # token counts, MoE step sizes in tokens, and the bytes the copy-bandwidth probe moves
    decode_points: tuple
    prefill_points: tuple
    kv_write_tokens: tuple
    expert_tokens: tuple
    copy_bytes: int
    kernel_iters: int                      # timed calls per sample (5 samples, median)
    # thinker engines: decode batches, the prompt before decode timing, steps timed, prefill size
    decode_batches: tuple
    moe_decode_batches: tuple
    decode_prompt: int
    decode_steps: int
    prefill_tokens: int
    # speech pipeline: concurrency levels (as many requests as the level, at least 2),
    # thinker tokens and talker codes per request
    speech_concurrency: tuple
    speech_thinker_tokens: int
    speech_talker_tokens: int
    # transformers peer: batches, prompt and new tokens
    peer_batches: tuple
    peer_prompt: int
    peer_new_tokens: int
    budgets: dict                          # part -> seconds
    # Share of the device a part's JAX may take (None: JAX's default, 75%), allocated as needed
    # (a part's stage processes set their own). The 30B-A3B's 63.4 GB of weights are past 75%
    # of an H100's 84.9 GB, the kind the device tool starts first.
    memory_fraction: float | None = None


GPU = Size(
    name="gpu", interpret=False, dtype="bfloat16",
    decode_points=((1, 4096), (64, 4096)), prefill_points=((2048, 0, 1), (512, 3584, 4)),
    kv_write_tokens=(2048,), expert_tokens=(8, 64, 2048),
    copy_bytes=2 << 30, kernel_iters=20,
    decode_batches=(1, 16, 64), moe_decode_batches=(1, 16, 64), decode_prompt=512, decode_steps=32,
    prefill_tokens=2048,
    speech_concurrency=(1, 8), speech_thinker_tokens=32, speech_talker_tokens=200,
    peer_batches=(1, 16), peer_prompt=512, peer_new_tokens=64,
    budgets=dict(environment=15, kernels=75, thinker_7b=95, thinker_30b_moe=140, speech=165, peer=45,
                 tuning=240, profile=150),
    memory_fraction=0.92,
)

CPU = Size(
    name="cpu", interpret=True, dtype="float32",
    decode_points=((2, 64),), prefill_points=((16, 16, 2),), kv_write_tokens=(32,), expert_tokens=(4,),
    copy_bytes=16 << 20, kernel_iters=2,
    decode_batches=(1, 4), moe_decode_batches=(1, 4), decode_prompt=16, decode_steps=4, prefill_tokens=64,
    speech_concurrency=(1, 2), speech_thinker_tokens=4, speech_talker_tokens=24,
    peer_batches=(1, 4), peer_prompt=16, peer_new_tokens=8,
    budgets=dict(environment=60, kernels=240, thinker_7b=240, thinker_30b_moe=240, speech=600, peer=120,
                 tuning=240, profile=240),
)

SIZES = {"gpu": GPU, "cpu": CPU}


def hf_config(family: str, size: Size) -> dict:
    """The HF config a part builds its random model from: the real model's on a GPU, the
    family's built-in tiny one on a CPU."""
    if size.name == "gpu":
        from omni_jax.gpu.programs import real_hf_config

        return real_hf_config(family)
    return importlib.import_module(f"omni_jax.models.{family}.tiny").tiny_config()
