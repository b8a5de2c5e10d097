"""What both families' speech benchmarks share: transformers' batched generate, timed at its
fastest batch size (and one request at a time), and OmniJax serving the requests through a
started AsyncOmniJax at a given concurrency."""

from __future__ import annotations

import asyncio
import time

import numpy as np


def fastest_hf_batching(model, prompts, speaker, thinker_tokens, talker_tokens, batches):
    """The prompts (sorted by length) through `time_hf_generate` in batches of each size in
    `batches`; prints each and returns the fastest's (seconds, audio s, RTFs)."""
    order = np.argsort([len(p) for p in prompts], kind="stable")
    best = None
    for size in sorted({min(b, len(prompts)) for b in batches}):
        runs = [time_hf_generate(model, [prompts[i] for i in order[s:s + size]], speaker, thinker_tokens,
                                 talker_tokens) for s in range(0, len(prompts), size)]
        dt = sum(r[0] for r in runs)
        print(f"transformers, batches of {size:2d}: {dt:7.2f}s")
        if best is None or dt < best[0]:
            best = (dt, [x for r in runs for x in r[1]], [x for r in runs for x in r[2]])
    return best


def time_hf_generate(model, prompts, speaker, thinker_tokens, talker_tokens):
    """One left-padded batch through generate(return_audio=True), greedy; (seconds, audio s, RTFs)."""
    import torch

    L = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), L, dtype=torch.long)
    mask = torch.zeros(len(prompts), L, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(p)
        mask[i, L - len(p):] = 1
    t0 = time.perf_counter()
    with torch.no_grad():
        _, wavs = model.generate(input_ids=ids, attention_mask=mask, speaker=speaker,
                                 thinker_max_new_tokens=thinker_tokens, thinker_min_new_tokens=thinker_tokens,
                                 thinker_do_sample=False, talker_do_sample=False,
                                 talker_max_new_tokens=talker_tokens)
    dt = time.perf_counter() - t0
    wavs = wavs if isinstance(wavs, list) else [wavs.reshape(-1)]
    seconds = [len(w) / 24000 for w in wavs]
    return dt, seconds, [dt / max(s, 1e-9) for s in seconds]


def serve_speech(omni, prompts, params, voice, concurrency: int) -> dict:
    """The prompts through a started AsyncOmniJax, at most `concurrency` in flight; wall seconds,
    audio seconds, RTFs and times to first audio."""

    async def go():
        limit = asyncio.Semaphore(concurrency)

        async def one(i, p):
            async with limit:
                last, arrivals = None, []
                async for out in omni.generate({"prompt_token_ids": p}, sampling_params_list=params, request_id=f"s{i}-{time.monotonic_ns()}",
                                               output_modalities=["text", "audio"], voice=voice):
                    last = out
                    if out.audio_delta is not None and len(out.audio_delta):
                        arrivals.append((time.monotonic(), len(out.audio_delta)))
                return last, playback_stall(arrivals)
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        return time.perf_counter() - t0, outs

    dt, results = asyncio.run(go())
    outs, stalls = [r[0] for r in results], [r[1] for r in results]
    errors = [o.error for o in outs if o.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0]}")
    return dict(seconds=dt, audio=[o.metrics.audio_seconds for o in outs], rtf=[o.metrics.rtf for o in outs],
                ttfa=[o.metrics.time_to_first_audio for o in outs], e2e=[o.metrics.e2e_latency for o in outs],
                stall=stalls)


def playback_stall(arrivals: list[tuple[float, int]], rate: int = 24000) -> float:
    """Seconds a listener who starts playing at the first audio chunk waits for later ones
    (underruns); `arrivals` = (time, samples) per chunk."""
    stall, end = 0.0, None
    for t, n in arrivals:
        if end is not None and t > end:
            stall += t - end
        end = (t if end is None or t > end else end) + n / rate
    return stall


def hf_latency(model, prompts, speaker, thinker_tokens, talker_tokens) -> list[float]:
    """Seconds per request one at a time (transformers returns the audio at the end: its time to first audio)."""
    return [time_hf_generate(model, [p], speaker, thinker_tokens, talker_tokens)[0] for p in prompts]
