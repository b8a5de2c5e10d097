"""Async chunk end to end (stage processes), both families: streamed speech equals the whole-output
path (on long replies too, before the clamp to [-1, 1] as well as after), audio reaches the caller
in chunks before the thinker is done, and an abort at any moment or a killed stage leaves nothing behind.

Qwen2.5 runs on the built-in tiny checkpoint (`--model tiny`): its vocoder is loud (the whole
waveform peaks near 30 before the clamp), where the transformers-initialised one peaks at 2e-4,
below any bound worth stating."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import numpy as np
import pytest

import hf_tiny_qwen3 as tiny3
from conftest import HAVE_TORCH
from omni_jax import AsyncOmniJax, OmniJax, SamplingParams
from omni_jax.config import load_pipeline_config
from omni_jax.models.qwen2_5_omni.tiny import tiny_checkpoint

pytestmark = [pytest.mark.pipeline, pytest.mark.e2e]

# Qwen2.5's token2wav audio trails its codes by 41 (models/qwen2_5_omni/token2wav.py): its
# replies must be longer to come in several chunks, and before the thinker is done.
# Each thinker writes long enough that, even on a loaded machine, it is still writing when
# the first audio arrives: Qwen3's 100 tokens (with 40 it sometimes finished first), Qwen2.5's
# 400 (with 200 its first audio once came one update after its last token).
THINKER_TOKENS = {"qwen2_5_omni": 400, "qwen3_omni": 100}
TALKER_TOKENS = {"qwen2_5_omni": 100, "qwen3_omni": 40}

# Streamed vs whole waveform, max abs, before and after the clamp. Qwen3's chunks are exact.
# Qwen2.5's are not (its DiT sees the whole sequence through 10 ODE steps, so each window's
# context is cut somewhere): the bound the tiny preset's 48 codes of DiT look-ahead hold
# (qwen2_5_omni_tiny.yaml, README "Streamed speech": 2.2e-4 on the tiny model's 30-peak signal,
# windows of 160 codes; with the 24 of before, 1.3e-2 there and 0.02-0.03 here, issue 46).
WAVEFORM_TOL = {"qwen2_5_omni": 1e-3, "qwen3_omni": 1e-5}
if not HAVE_TORCH:
    # The package's numpy-built tiny Qwen3 (conftest), whose vocoder's kernels are drawn with
    # variance 1/fan-in (transformers': std 0.02), peaks in the tens unclamped and amplifies the fp32
    # rounding that differs between a chunk's shapes and the whole's some 600-fold: 6e-8 after its
    # second ConvNeXt block, 4e-4 at the output with no stream involved (a prefix decoded alone
    # against the whole's first samples). Streams measured 1.5e-3 and 2e-3; a chunk that lost its
    # history is off by the signal itself.
    WAVEFORM_TOL["qwen3_omni"] = 1e-2
# The long replies: many chunks (codec frames; Qwen3's cross its whole decode's 300-frame windows).
LONG_CODES = {"qwen2_5_omni": 320, "qwen3_omni": 320}
# Chunks small enough that a reply comes in several.
CHUNKS = dict(codec_chunk_frames=8, initial_codec_chunk_frames=4)
# The health_timeout_s of the stages the tests stop (SIGSTOP): a stage silent longer is restarted.
# Qwen2.5's vocoder is only killed, and keeps the default (30 s): its tiny DiT takes seconds a step
# on a loaded machine (about 1.5 s for 4 requests of 128 codes on a quiet one).
SILENT_S = 8.0


def pipeline_for(family: str):
    """The family's tiny preset with few buckets (quick warm-up), the vocoder's waveform unclamped
    (`clip_audio: false`: the tests compare it as it is and clamped, so the clamp hides nothing)."""
    if family == "qwen2_5_omni":
        return load_pipeline_config("qwen2_5_omni_tiny").with_overrides(
            thinker=dict(token_buckets=[16, 64], decode_buckets=[1, 4], max_num_seqs=4),
            talker=dict(token_buckets=[16, 64], decode_buckets=[1, 4], max_num_seqs=4, health_timeout_s=SILENT_S),
            token2wav=dict(token_buckets=[128, 384], decode_buckets=[1, 4], max_num_seqs=4, max_model_len=384,
                           max_num_batched_tokens=384, clip_audio=False, **CHUNKS))
    return load_pipeline_config("qwen3_omni_tiny").with_overrides(
        thinker=dict(token_buckets=[64], decode_buckets=[1, 4], max_num_seqs=4, audio_chunk_buckets=[4],
                     vision_patch_buckets=[64]),
        talker=dict(token_buckets=[64], decode_buckets=[1, 4], max_num_seqs=4, max_model_len=512,
                    health_timeout_s=SILENT_S),
        code2wav=dict(token_buckets=[16, 64, 325], decode_buckets=[1, 4], max_num_seqs=4,
                      max_model_len=LONG_CODES["qwen3_omni"], max_num_batched_tokens=325, health_timeout_s=SILENT_S,
                      clip_audio=False, **CHUNKS))


def prompts_for(family: str, n: int) -> list[dict]:
    rng = np.random.default_rng(21)
    if family == "qwen2_5_omni":
        return [{"prompt_token_ids": rng.integers(0, 151000, int(k)).tolist()} for k in rng.integers(6, 20, n)]
    return [{"prompt_token_ids": tiny3.text_prompt_ids(tuple(rng.integers(0, 151000, int(k)).tolist()))}
            for k in rng.integers(3, 9, n)]


def params_for(family: str, first_chunk: int | None = None, talker: int | None = None) -> list[SamplingParams]:
    """Thinker and talker run to their limits (no early end token; `talker` codec frames, default
    TALKER_TOKENS), the vocoder seeded."""
    extra = None if first_chunk is None else {"initial_codec_chunk_frames": first_chunk}
    talker = talker or TALKER_TOKENS[family]
    return [SamplingParams(temperature=0.0, max_tokens=THINKER_TOKENS[family], ignore_eos=True),
            SamplingParams(temperature=0.0, repetition_penalty=1.05, min_tokens=talker - 2, max_tokens=talker),
            SamplingParams(seed=77, extra_args=extra)]


@pytest.fixture(scope="module", params=["qwen2_5_omni", "qwen3_omni"])
def family_engines(request, converted_qwen3_fp32, tmp_path_factory):
    """(family, streaming AsyncOmniJax, whole-output OmniJax) on the family's tiny checkpoint."""
    family = request.param
    ckpt = tiny_checkpoint(str(tmp_path_factory.mktemp("tiny") / "model")) if family == "qwen2_5_omni" \
        else converted_qwen3_fp32
    mods = ["text", "audio"]
    streamed = AsyncOmniJax(model=ckpt, pipeline=pipeline_for(family), output_modalities=mods, async_chunk=True)
    try:
        whole = OmniJax(model=ckpt, pipeline=pipeline_for(family), output_modalities=mods, async_chunk=False)
    except BaseException:
        streamed.shutdown()
        raise
    yield family, streamed, whole
    streamed.shutdown()
    whole.shutdown()


def collect(omni: AsyncOmniJax, prompts, params, abort_when=None):
    """Run prompts together; per prompt the list of updates. `abort_when(i, update)` -> True
    aborts prompt i at that update (once)."""

    async def one(i, p):
        updates, aborted = [], False
        gen = omni.generate(p, sampling_params_list=params, request_id=f"p{i}-{time.monotonic_ns()}", output_modalities=["text", "audio"])
        async for out in gen:
            updates.append(out)
            if abort_when is not None and not aborted and abort_when(i, out):
                omni.abort(out.request_id)
                aborted = True
        return updates

    async def go():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    return asyncio.run(asyncio.wait_for(go(), 300))


def test_streamed_speech_equals_whole(family_engines):
    family, streamed, whole = family_engines
    vocoder = streamed.pipeline.stages[-1].name
    compiled = [e.stage_stats()[vocoder]["num_compilations"] for e in (streamed, whole)]
    prompts = prompts_for(family, 3)
    ref = whole.generate(prompts, sampling_params_list=params_for(family), output_modalities=["text", "audio"])
    runs = collect(streamed, prompts, params_for(family))
    for r, updates in zip(ref, runs):
        final = updates[-1]
        assert r.error is None and final.error is None, (r.error, final.error)
        assert final.token_ids == r.token_ids and len(final.token_ids) == THINKER_TOKENS[family]
        got, want = final.stage_token_ids["talker"], r.stage_token_ids["talker"]
        assert got == want, (len(got), len(want), next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None))
        assert final.audio.shape == r.audio.shape
        assert_close_speech(final.audio, r.audio, WAVEFORM_TOL[family])
        deltas = [u.audio_delta for u in updates if u.audio_delta is not None and len(u.audio_delta)]
        np.testing.assert_array_equal(np.concatenate(deltas), final.audio)
    # Alone, a request's speech reaches the caller in chunks, the first while the thinker still
    # writes. (Beside two others, a request's codes can all be in before the vocoder, busy with
    # the others' windows, gets to it: the tiny Qwen2.5 DiT takes about 1.5 s a batch of 4.)
    updates = collect(streamed, prompts[:1], params_for(family))[0]
    final = updates[-1]
    assert final.error is None and final.audio.shape == ref[0].audio.shape, final.error
    deltas = [u.audio_delta for u in updates if u.audio_delta is not None and len(u.audio_delta)]
    assert len(deltas) >= 2, "speech should arrive in several chunks"
    first_audio = next(i for i, u in enumerate(updates) if u.audio_delta is not None and len(u.audio_delta))
    last_text = max(i for i, u in enumerate(updates) if u.new_token_ids)
    assert first_audio < last_text, "the first audio chunk should come before the thinker's last token"
    assert final.metrics.time_to_first_audio < final.metrics.e2e_latency
    # Each vocoder compiled, at warm-up, the calls of its pipeline's path (async chunk or not).
    assert [e.stage_stats()[vocoder]["num_compilations"] for e in (streamed, whole)] == compiled


def assert_close_speech(got: np.ndarray, want: np.ndarray, tol: float) -> None:
    """Within `tol` (max abs) before the clamp to [-1, 1] and after it, on audible speech."""
    clamp = lambda x: np.clip(x, -1.0, 1.0)  # noqa: E731  (what the vocoder does unless clip_audio is false)
    err, clamped_err = np.abs(got - want).max(), np.abs(clamp(got) - clamp(want)).max()
    assert np.abs(want).max() > 30 * tol, "speech too quiet for its error to mean anything"
    assert err <= tol and clamped_err <= tol, f"streamed vs whole: max abs {err:.3g}, clamped {clamped_err:.3g}"


def test_long_streamed_speech_equals_whole(family_engines):
    """A reply of several hundred codec frames streams in dozens of chunks (past the first few,
    windows far from the request's start; Qwen3's past its whole decode's 300-frame window)."""
    family, streamed, whole = family_engines
    params = params_for(family, talker=LONG_CODES[family])
    prompt = prompts_for(family, 1)
    ref = whole.generate(prompt, sampling_params_list=params, output_modalities=["text", "audio"])[0]
    updates = collect(streamed, prompt, params)[0]
    final = updates[-1]
    assert ref.error is None and final.error is None, (ref.error, final.error)
    assert final.stage_token_ids["talker"] == ref.stage_token_ids["talker"]
    samples_per_frame = 1920 if family == "qwen3_omni" else 480  # 24 kHz at 12.5 / 50 codec frames a second
    assert len(ref.audio) >= (LONG_CODES[family] - 4) * samples_per_frame, len(ref.audio)
    # How many audio deltas come depends on timing (a loaded vocoder may find every code there at
    # its first step); the streamed path still decodes them in windows of at most a chunk's.
    assert final.audio.shape == ref.audio.shape
    if family == "qwen2_5_omni":  # clip_audio: false took effect (this model's speech peaks near 30)
        assert np.abs(ref.audio).max() > 1.0 and np.abs(final.audio).max() > 1.0
    assert_close_speech(final.audio, ref.audio, WAVEFORM_TOL[family])


def test_first_chunk_size_per_request(family_engines):
    """A smaller first chunk (extra_args) makes a smaller first audio update."""
    family, streamed, _ = family_engines
    prompt = prompts_for(family, 1)
    sizes = []
    for first in (2, 16):
        updates = collect(streamed, prompt, params_for(family, first_chunk=first))[0]
        assert updates[-1].error is None, updates[-1].error
        sizes.append(next(len(u.audio_delta) for u in updates if u.audio_delta is not None and len(u.audio_delta)))
    assert sizes[0] < sizes[1]


def _healthy(omni, stage: str) -> bool:
    try:
        return omni.stage_stats()[stage]["healthy"] == 1.0
    except TimeoutError:  # a stage still silent (stopped, or busy coming back)
        return False


def _idle(omni) -> dict:
    """Stage stats once every stage holds nothing (bounded wait)."""
    for _ in range(100):
        stats = omni.stage_stats()
        held = [(n, k) for n, s in stats.items() for k in ("num_running", "num_waiting", "num_waiting_for_input",
                                                            "num_streamed_inputs", "num_streams")
                if s.get(k, 0)]
        if not held:
            return stats
        time.sleep(0.1)
    raise AssertionError(f"stages still hold requests: {held}")


@pytest.mark.parametrize("phase", ["thinker", "talker", "vocoder", "after_text"])
def test_abort_in_each_phase_frees_every_stage(family_engines, phase):
    family, streamed, _ = family_engines
    prompts = prompts_for(family, 2)

    def abort_when(i, out):
        if i != 0:
            return False
        # At least, not exactly: a reader slower than the engine gets merged updates, whose token
        # count can step over any one number (then the request ran to its end: a flaky 'length').
        if phase == "thinker":
            return len(out.token_ids) >= 1  # the first text: the talker needs two tokens to start
        if phase == "talker":
            return len(out.token_ids) >= 12  # thinker and talker both running
        if phase == "vocoder":
            return out.audio_delta is not None and len(out.audio_delta) > 0
        return len(out.new_token_ids) > 0 and len(out.token_ids) == params[0].max_tokens  # talker, vocoder left

    params = params_for(family, first_chunk=2)
    if phase == "after_text":  # a short reply: the talker surely has frames left at the thinker's end
        params[0] = params[0].updated(max_tokens=40)
    aborted, other = collect(streamed, prompts, params, abort_when=abort_when)
    assert aborted[-1].finish_reason == "abort"
    assert other[-1].error is None and len(other[-1].audio) > 0
    stats = _idle(streamed)
    for name, s in stats.items():
        assert s.get("kv_cache_usage", 0.0) == 0.0, name


def test_text_goes_on_after_the_audio_ends(family_engines):
    """A talker capped short finishes (and its vocoder) while the thinker still writes: the
    request ends only with the thinker, its text whole."""
    family, streamed, _ = family_engines
    params = params_for(family)
    params[0] = params[0].updated(max_tokens=150)
    params[1] = params[1].updated(min_tokens=4, max_tokens=6)
    final = collect(streamed, prompts_for(family, 1), params)[0][-1]
    assert final.error is None, final.error
    assert len(final.token_ids) == 150 and final.finish_reason == "length"
    assert final.audio is not None and len(final.audio) > 0


def test_killed_stage_fails_the_stream_and_comes_back(family_engines):
    """The vocoder, then the talker, killed (SIGKILL) or stopped (SIGSTOP, silent past its
    health_timeout_s) while the request runs: the request ends with an error naming the stage,
    which is started again (auto_restart); then speech streams again and no stage holds anything.
    Each family takes the other signal per stage, so both signals meet both stages. The signal
    goes with the first text tokens, when the stage surely has work left (at the first audio, a fast
    talker and vocoder may already have sent everything). Last in the module."""
    family, streamed, _ = family_engines
    vocoder = streamed.pipeline.stages[-1].name
    kill, stop = (signal.SIGKILL, "died"), (signal.SIGSTOP, "stopped answering")
    for stage, (sig, says) in zip((vocoder, "talker"), (kill, stop) if family == "qwen2_5_omni" else (stop, kill)):
        pid = streamed.stage_pids()[stage]
        signalled = []

        def signal_on_first_text(i, out):
            if out.new_token_ids and not signalled:
                os.kill(pid, sig)
                signalled.append(time.monotonic())
            return False

        t0 = time.monotonic()
        updates = collect(streamed, prompts_for(family, 1), params_for(family, first_chunk=2),
                          abort_when=signal_on_first_text)[0]
        assert updates[-1].finish_reason == "error" and f"{stage!r} {says}" in updates[-1].error, updates[-1].error
        assert time.monotonic() - t0 < 60
        if sig == signal.SIGSTOP:
            assert time.monotonic() - signalled[0] < SILENT_S + 5
        # Back within the stage's own start-up limit: a restart reloads and recompiles (from the
        # compilation cache), which took over 120 s for the Qwen2.5 vocoder on a slow 2-core machine.
        ready_s = next(s.ready_timeout_s for s in streamed.pipeline.stages if s.name == stage)
        while not _healthy(streamed, stage):
            assert time.monotonic() - t0 < ready_s, f"{stage} not back within its ready_timeout_s {ready_s:g}"
            time.sleep(0.2)
    final = collect(streamed, prompts_for(family, 1), params_for(family))[0][-1]
    assert final.error is None and len(final.audio) > 0 and len(final.token_ids) == THINKER_TOKENS[family]
    for name, stats in _idle(streamed).items():
        assert stats.get("kv_cache_usage", 0.0) == 0.0 and stats["num_restarts"] == (name != "thinker"), name
