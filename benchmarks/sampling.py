"""The sampler's cost per step on Qwen's vocabulary: OmniJax's jitted `sample` against
transformers' logits warpers + torch.multinomial on the same logits, one after the other.

    python benchmarks/sampling.py [--batch 8] [--vocab 152064] [--steps 20]

Rows: greedy, temperature only, top-k 50, top-p 0.9 (no top-k) over N(0, 3) logits, where the
nucleus spans thousands of tokens, top-k 50 + top-p 0.9, and top-p 0.9 over "peaked" logits
(16 tokens per row raised by 20, as a trained model's few likely tokens: the nucleus is small). Prints ms per step for both and the ratio (transformers / OmniJax).
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import numpy as np
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from omni_jax.engine.sampling import sample
from omni_jax.engine.sampling_metadata import SamplingMetadataBuilder
from omni_jax.engine.sampling_params import SamplingParams

CASES = {
    "greedy": dict(temperature=0.0),
    "temperature 0.8": dict(temperature=0.8),
    "top-k 50": dict(temperature=0.8, top_k=50),
    "top-p 0.9": dict(temperature=0.8, top_p=0.9),
    "top-k 50 + top-p 0.9": dict(temperature=0.8, top_k=50, top_p=0.9),
    "top-p 0.9, peaked": dict(temperature=0.8, top_p=0.9),
}


def _time(fn, steps: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t) / steps * 1e3


def omnijax_ms(logits: np.ndarray, kw: dict, steps: int) -> float:
    B, V = logits.shape
    params = [SamplingParams(seed=i, **kw) for i in range(B)]
    md, flags = SamplingMetadataBuilder().build(params, [[] for _ in params], None, B, V)
    step = jax.jit(sample, static_argnames=("flags",))
    x = jax.device_put(logits)
    return _time(lambda: jax.block_until_ready(step(x, md, flags=flags).token_ids), steps)


def transformers_ms(logits: np.ndarray, kw: dict, steps: int) -> float:
    x = torch.from_numpy(logits)
    warpers = []
    if kw.get("temperature", 1.0) > 0:
        warpers.append(TemperatureLogitsWarper(kw["temperature"]))
    if kw.get("top_k"):
        warpers.append(TopKLogitsWarper(kw["top_k"]))
    if kw.get("top_p", 1.0) < 1.0:
        warpers.append(TopPLogitsWarper(kw["top_p"]))

    def one():
        if not warpers:
            return torch.argmax(x, dim=-1)
        y = x
        for w in warpers:
            y = w(None, y)
        return torch.multinomial(torch.softmax(y, dim=-1), 1)

    with torch.no_grad():
        return _time(one, steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=152064)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    logits = (rng.normal(size=(args.batch, args.vocab)) * 3).astype(np.float32)
    peaked = logits.copy()
    for row in peaked:
        row[rng.choice(args.vocab, 16, replace=False)] += 20.0
    print(f"batch {args.batch}, vocabulary {args.vocab}, {args.steps} steps; load average {os.getloadavg()[0]:.2f}; "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'case':22s} {'OmniJax ms':>11s} {'transformers ms':>16s} {'ratio':>6s}")
    for name, kw in CASES.items():
        x = peaked if "peaked" in name else logits
        ours, peer = omnijax_ms(x, kw, args.steps), transformers_ms(x, kw, args.steps)
        print(f"{name:22s} {ours:11.2f} {peer:16.2f} {peer / ours:6.2f}")


if __name__ == "__main__":
    main()
