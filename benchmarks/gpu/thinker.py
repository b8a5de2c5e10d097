"""Parts `thinker_7b` and `thinker_30b_moe`: a thinker at the real size (GPU) or the tiny one
(CPU) with random weights drawn on the device (no checkpoint), served by the engine itself
(`AREngine`: scheduler, paged KV, bucketed jitted steps, on-device sampling).

Measured: the decode step at each batch against its roofline (the bytes one step must read,
the decoder's weights (a MoE's routed experts by the share a batch is expected to hit) plus
the KV cache, over the copy bandwidth measured here), prefill tokens/s with one whole
prompt per step, and the XLA compilations after warm-up (must be 0).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np

from sizes import ROOT, hf_config

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

BLOCK = 16
# Tokens a request may hold past its prompt and the timed steps: the steps that bring
# every prompt to decoding, the one launched ahead, the last tokens.
DECODE_SLACK = 16


def build_engine(family: str, size, batches, seed: int = 0):
    """(engine, text config, module) of a thinker with random weights on the default device,
    compiled for `batches` (decode) and one token bucket of `size.prefill_tokens`."""
    from omni_jax.checkpoint import DTYPES
    from omni_jax.engine.ar_engine import AREngine, EngineConfig
    from omni_jax.engine.runner import RunnerConfig, cdiv
    from omni_jax.models.random_weights import random_module
    from omni_jax.models.registry import stages_of

    spec = stages_of(family)["thinker"]
    cfg = spec.parse_config(hf_config(family, size)[spec.config_key])
    model = random_module(spec.build, cfg, DTYPES[size.dtype], seed)
    text = cfg.text
    max_len = cdiv(max(size.prefill_tokens, DECODE_SLACK + size.decode_prompt + size.decode_steps) + 1, BLOCK) * BLOCK
    max_seqs = max(batches)
    rc = RunnerConfig(num_blocks=kv_blocks(size, max_seqs), block_size=BLOCK, max_num_seqs=max_seqs,
                      max_num_batched_tokens=size.prefill_tokens, max_model_len=max_len,
                      token_buckets=(size.prefill_tokens,), decode_buckets=tuple(sorted(batches)))
    # Text only: the plain step variants (media and DeepStack variants compile too in a served
    # stage; they are other programs, not faster or slower ones).
    engine = AREngine(model, EngineConfig(runner=rc, vocab_size=text.vocab_size, enable_prefix_caching=False),
                      num_layers=text.num_layers, num_kv_heads=text.num_kv_heads, head_dim=text.head_dim,
                      hidden_size=text.hidden_size)
    return engine, text, model


def kv_blocks(size, max_seqs: int) -> int:
    """KV blocks for the most the part holds at once: a decode batch of `max_seqs` requests
    (prompt, timed steps and what each request decodes past them), or the one prefill prompt;
    and the engine's dummy block. Not `max_seqs` sequences at the model length: that cache
    (13 GB for the 30B-A3B at 64 x 2064 tokens) beside its 63.4 GB of weights does not fit an
    H100."""
    from omni_jax.engine.runner import cdiv

    decode = max_seqs * cdiv(size.decode_prompt + size.decode_steps + DECODE_SLACK, BLOCK)
    return max(decode, cdiv(size.prefill_tokens + DECODE_SLACK, BLOCK)) + 1


def kv_bytes_per_token(text, dtype_bytes: int) -> int:
    return 2 * text.num_layers * text.num_kv_heads * text.head_dim * dtype_bytes


def _prompt(rng, n: int, vocab: int) -> list[int]:
    return rng.integers(0, min(vocab, 150000), n).tolist()


def time_decode(engine, batch: int, size, rng) -> float:
    """Seconds per engine step with `batch` requests all decoding (their prompts prefilled first)."""
    from omni_jax import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=size.decode_steps + 4, ignore_eos=True)
    ids = [f"d{batch}-{i}-{time.monotonic_ns()}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, _prompt(rng, size.decode_prompt, engine.vocab_size), params)
    got = dict.fromkeys(ids, 0)
    while min(got.values()) < 2:  # every prompt prefilled and decoding
        for out in engine.step():
            if out.error:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            got[out.request_id] += len(out.new_token_ids)
    t0 = time.perf_counter()
    for _ in range(size.decode_steps):
        engine.step()
    secs = (time.perf_counter() - t0) / size.decode_steps
    while engine.has_unfinished():
        engine.step()
    return secs


def time_prefill(engine, size, rng, reps: int = 3) -> float:
    """Median seconds from queueing one `prefill_tokens` prompt to its first token (one step)."""
    from omni_jax import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    samples = []
    for r in range(reps + 1):  # the first is not counted
        rid = f"p{r}-{time.monotonic_ns()}"
        engine.add_request(rid, _prompt(rng, size.prefill_tokens, engine.vocab_size), params)
        t0 = time.perf_counter()
        done = False
        while not done:
            for out in engine.step():
                if out.error:
                    raise RuntimeError(f"prefill request failed: {out.error}")
                done |= out.request_id == rid and len(out.new_token_ids) > 0
        if r:
            samples.append(time.perf_counter() - t0)
        while engine.has_unfinished():
            engine.step()
    return statistics.median(samples)


def run_thinker(family: str, batches, size, rep) -> None:
    import jax

    import pallas_kernels as kb
    from omni_jax.engine.jitted import compile_workers
    from omni_jax.gpu.roofline import decode_weight_bytes, step_weight_bytes

    t0 = time.perf_counter()
    engine, text, model = build_engine(family, size, batches)
    jax.block_until_ready(jax.tree.leaves(engine.runner.state))
    params = sum(a.size for a in jax.tree.leaves(nnx_params(model)))
    rep.add("random weights on device", time.perf_counter() - t0, "s",
            f"{params / 1e9:.2f}B parameters, {size.dtype}, {text.num_layers} layers")
    stats = jax.devices()[0].memory_stats() or {}
    if stats.get("bytes_in_use"):
        rep.add("device memory in use", stats["bytes_in_use"] / 2**30, "GiB", "weights and KV pages")
    bw = kb.copy_bandwidth(size.copy_bytes, iters=size.kernel_iters, reps=1 if size.interpret else 5)
    rep.add("copy bandwidth (roofline)", bw / 1e9, "GB/s")
    warm = engine.warmup(progress=False)
    compiled = engine.num_compilations  # nothing below may compile
    rep.add("warm-up (compile every bucket)", warm, "s",
            f"{compiled} compilations so far, on {compile_workers()} threads ($OMNI_JAX_COMPILE_WORKERS)")
    rng = np.random.default_rng(0)
    item = np.dtype(jax.numpy.dtype(size.dtype)).itemsize
    weights = decode_weight_bytes(nnx_params(model))
    for b in batches:
        step = time_decode(engine, b, size, rng)
        ctx = size.decode_prompt + size.decode_steps // 2 + 2
        nbytes = step_weight_bytes(weights, getattr(text, "num_experts", 0), getattr(text, "num_experts_per_tok", 0),
                                   b) + b * ctx * kv_bytes_per_token(text, item)
        roof = nbytes / bw
        target = "" if size.name != "gpu" or b != 1 else (" (target <= 1.5x: " + (
            "met)" if step / roof <= 1.5 else "NOT MET)"))
        rep.add(f"decode step b{b}", step * 1e3, "ms",
                f"{b / step:.0f} tok/s; roofline {roof * 1e3:.3g} ms ({nbytes / 1e9:.2f} GB at {ctx} ctx): "
                f"{step / roof:.2f}x{target}")
    secs = time_prefill(engine, size, rng)
    rep.add(f"prefill {size.prefill_tokens} tokens", size.prefill_tokens / secs, "tok/s",
            f"{secs * 1e3:.1f} ms to the first token")
    extra = engine.num_compilations - compiled
    rep.add("compilations after warm-up", extra, "", "" if extra == 0 else "FAIL: a step compiled while serving")
    preempted = engine.stats["preemptions"]
    rep.add("preemptions", preempted, "", "" if preempted == 0 else
            f"FAIL: {kv_blocks(size, max(batches))} KV blocks were too few; the timings include recomputes")
    same, n = same_tokens_without_stable_temporaries(engine, size, rng)
    rep.add("greedy tokens equal without SKIP_TEMP", int(same), "", f"{n} tokens" + ("" if same else ": FAIL"))


def same_tokens_without_stable_temporaries(engine, size, rng) -> tuple[bool, int]:
    """Whether one prompt's greedy tokens from the step as served (compiled with XLA's SKIP_TEMP
    mode where the jaxlib has it: engine/jitted.py) equal those of the same step compiled
    without it (the mode moves where temporaries live, never what is computed), and how many.
    Compiles the step's programs once more: after every timing."""
    from omni_jax import SamplingParams

    prompt = _prompt(rng, size.decode_prompt, engine.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=size.decode_steps, ignore_eos=True)

    def generate() -> list[int]:
        rid = f"t-{time.monotonic_ns()}"
        engine.add_request(rid, prompt, params)
        tokens = []
        while engine.has_unfinished():
            for out in engine.step():
                if out.error:
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                tokens += out.new_token_ids
        return tokens

    runner = engine.runner
    served, step = generate(), runner.jitted.step
    runner.jitted.step = runner.step_program(temporaries_in_place=False)
    try:
        plain = generate()
    finally:
        runner.jitted.step = step
    return served == plain, len(served)


def nnx_params(model):
    from flax import nnx

    return nnx.state(model, nnx.Param)


def run_qwen2_5(size, rep, results_dir) -> None:
    run_thinker("qwen2_5_omni", size.decode_batches, size, rep)


def run_qwen3(size, rep, results_dir) -> None:
    run_thinker("qwen3_omni", size.moe_decode_batches, size, rep)
