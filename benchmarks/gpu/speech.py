"""Part `speech`: the Qwen2.5-Omni speech pipeline (thinker -> talker -> token2wav, three stage
processes) through `AsyncOmniJax` with async chunk, at the real size (GPU) or the tiny one
(CPU), random weights: time to first audio and real-time factor at each concurrency.

The stages load a checkpoint, so a random one is written first (`build_random_checkpoint`)
without weights: each stage draws its own on the device as it loads. The real size's 14.2 GiB
took 95-98 s of the part's budget to write (2026-12-04), to disk or to /dev/shm alike, and the
part never reached its figures.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

import numpy as np

from sizes import ROOT, hf_config

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

VOICE = "Chelsie"  # one of the random checkpoint's voices (tiny.tiny_speakers)


def pipeline_for(size, n: int):
    """The family's preset (real or tiny) with its buckets cut to what the check sends: fewer
    programs to compile at start-up, the same programs per step."""
    from omni_jax.config import load_pipeline_config

    text = size.speech_thinker_tokens
    codes = size.speech_talker_tokens
    # The part's time budget bounds the start-up, not the presets' ready timeouts (the tiny one's
    # 300 s ran out for the vocoder on a loaded 2-core machine).
    wait = dict(ready_timeout_s=float(size.budgets["speech"]))
    if size.name == "gpu":
        max_len, blocks = 1024, n * (1024 // 16) + 1
        return load_pipeline_config("qwen2_5_omni").with_overrides(
            thinker=dict(max_num_seqs=n, decode_buckets=sorted({1, n}), token_buckets=[64, 512],
                         max_num_batched_tokens=512, max_model_len=max_len, num_blocks=blocks, **wait),
            talker=dict(max_num_seqs=n, decode_buckets=sorted({1, n}), token_buckets=[64, 512],
                        max_num_batched_tokens=512, max_model_len=max_len, num_blocks=blocks, **wait),
            token2wav=dict(max_num_seqs=n, decode_buckets=sorted({1, n}), token_buckets=[256],
                           max_num_batched_tokens=n * 256, max_model_len=256, **wait))
    assert codes <= 256 and text <= 64
    return load_pipeline_config("qwen2_5_omni_tiny").with_overrides(
        thinker=dict(max_num_seqs=n, decode_buckets=sorted({1, n}), **wait),
        talker=dict(max_num_seqs=n, decode_buckets=sorted({1, n}), **wait),
        token2wav=dict(max_num_seqs=n, decode_buckets=sorted({1, n}), token_buckets=[64],
                       max_num_batched_tokens=n * 64, max_model_len=64, **wait))


def run(size, rep, results_dir) -> None:
    from omni_jax import AsyncOmniJax, SamplingParams
    from speech_serving import serve_speech

    from omni_jax.models.qwen2_5_omni.tiny import build_random_checkpoint

    n = max(size.speech_concurrency)
    tmp = tempfile.mkdtemp(prefix="omni-jax-speech-")
    omni = None
    try:
        ckpt = os.path.join(tmp, "qwen2_5_omni_random")
        t0 = time.perf_counter()
        build_random_checkpoint(ckpt, hf_config("qwen2_5_omni", size), dtype=size.dtype, store_weights=False)
        rep.add("random checkpoint written (weights drawn by the stages)", time.perf_counter() - t0, "s")
        t0 = time.perf_counter()
        omni = AsyncOmniJax(model=ckpt, pipeline=pipeline_for(size, n), output_modalities=["text", "audio"],
                            async_chunk=True)
        rep.add("pipeline start (draw weights + compile, 3 stages)", time.perf_counter() - t0, "s")
        params = [SamplingParams(temperature=0.0, max_tokens=size.speech_thinker_tokens, ignore_eos=True),
                  SamplingParams(temperature=0.0, repetition_penalty=1.05, max_tokens=size.speech_talker_tokens,
                                 ignore_eos=True), None]
        rng = np.random.default_rng(0)

        def prompts(k):
            return [rng.integers(0, 151000, int(rng.integers(16, 48))).tolist() for _ in range(k)]

        serve_speech(omni, prompts(1), params, VOICE, 1)  # one-time costs off the figures
        for c in size.speech_concurrency:
            r = serve_speech(omni, prompts(max(2, c)), params, VOICE, c)
            ttfa, rtf = np.array(r["ttfa"]), np.array(r["rtf"])
            rep.add(f"time to first audio c={c}", float(ttfa.mean()) * 1e3, "ms",
                    f"p90 {np.percentile(ttfa, 90) * 1e3:.0f} ms over {len(ttfa)} requests")
            rep.add(f"RTF c={c}", float(rtf.mean()), "", f"{np.mean(r['audio']):.2f} s of audio per request, "
                    f"{len(ttfa) / r['seconds']:.2f} req/s")
    finally:
        if omni is not None:
            omni.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)

