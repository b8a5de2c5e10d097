"""The weight bytes a decode step must read: the floor its time and traffic are measured
against (`plan`, from the compile worker's stage facts; the GPU check's thinker parts)."""

from __future__ import annotations

import numpy as np

# Parameters a decode step does not read whole: the encoders (run once per request), the
# embedding table (B rows; Qwen3's talker calls its codec table codec_embedding), Qwen3's code
# predictor (its own after-sample program).
NOT_READ_BY_DECODE = ("audio_tower", "visual", "embed_tokens", "codec_embedding", "code_predictor")


def decode_weight_bytes(state) -> dict:
    """Bytes of a stage's parameters (an `nnx.State`) a decode step reads: the dense part
    whole, and all the experts (of which a step reads those its tokens are routed to)."""
    from flax import nnx

    dense = experts = 0
    for path, var in nnx.to_flat_state(state):
        keys = [str(k) for k in path]
        if any(k in NOT_READ_BY_DECODE for k in keys):
            continue
        v = var.get_value()
        n = int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
        if "experts" in keys:
            experts += n
        else:
            dense += n
    return dict(decode_dense_bytes=dense, decode_expert_bytes=experts)


def expected_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Distinct experts a batch of `batch` tokens touches per layer, uniform routing."""
    if not num_experts:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def step_weight_bytes(weights: dict, num_experts: int, top_k: int, batch: int) -> float:
    """What a decode step of `batch` tokens reads of `decode_weight_bytes`: the dense part and
    the experts by the share the batch is expected to hit."""
    routed = weights["decode_expert_bytes"] * expected_experts(num_experts, top_k, batch) / num_experts \
        if num_experts else 0.0
    return weights["decode_dense_bytes"] + routed
