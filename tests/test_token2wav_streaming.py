"""Streamed Qwen2.5-Omni token2wav (async chunk) against the whole-request decode.

The DiT windows leave an error (its exact context would be the whole request, see the
module docstring of token2wav.py); the vocoder's part and short requests are exact.
"""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from omni_jax.checkpoint import load_checkpoint
from omni_jax.engine.jitted import COMPILE_WORKERS_ENV
from omni_jax.engine.oneshot_engine import ChunkJob, OneShotRequestData
from omni_jax.engine.protocol import Request
from omni_jax.engine.runner import compilation_count
from omni_jax.engine.sampling_params import SamplingParams
from omni_jax.models.qwen2_5_omni.token2wav import StreamContext, Token2WavSynthesizer, initial_noise, plan_windows
from omni_jax.models.qwen2_5_omni.voices import Voices


# Streamed vs whole waveform, max abs error (waveforms peak at ~0.62), per DiT context (left /
# right codes), measured below for the two requests: the default 24 / 12 (the model authors'
# streaming) engine pattern 1.4e-3 / 3.4e-4, uneven 2.1e-3 / 1.7e-3, all at once 1.3e-5 /
# 3e-7; 24 / 24: 2.0e-5 / 5.2e-6, 7.4e-5 / 3e-7, 3.8e-6 / 3e-7 (3e-7: every window of that
# request started at its first code, the vocoder's 20 frames of context leave that much).
STREAM_BOUND = {StreamContext(): 4e-3, StreamContext(24, 24): 2e-4}
# Where chunking is exact (one-window requests; the vocoder given the mel): measured 0.
EXACT = 1e-6


def _redraw(model: nnx.Module, seed: int = 0) -> None:
    """Weights under which chunking shows: a unit-gain DiT transformer and an audible vocoder.

    The checkpoint's random init couples DiT blocks by ~1e-4 and its vocoder is near silent,
    so against it any context would pass. The speaker encoder and codec embedding stay.
    """
    rng = np.random.default_rng(seed)
    _, params, _ = nnx.split(model, nnx.Param, ...)
    flat = nnx.to_flat_state(params)
    for path, var in flat:
        v = np.asarray(var.get_value())
        name = path[-1]
        if path[0] == "code2wav_dit_model":
            if path[1] == "text_embed" or (path[1] == "input_embed" and path[2] != "proj"):
                continue
            new = rng.standard_normal(v.shape) / np.sqrt(v.shape[0]) if name == "kernel" else \
                0.05 * rng.standard_normal(v.shape)
        elif name in ("alpha", "beta"):
            new = 0.3 * rng.standard_normal(v.shape)
        elif name == "bias":
            new = 0.05 * rng.standard_normal(v.shape)
        else:  # conv kernels [k, in, out]; the transposed convs' [k, out, in]
            fan_in = v.shape[0] * (v.shape[2] if path[1] == "ups" else v.shape[1])
            new = 0.85 * rng.standard_normal(v.shape) / np.sqrt(fan_in)
        var.set_value(np.asarray(new, v.dtype))
    nnx.update(model, nnx.from_flat_state(flat))


@pytest.fixture(scope="module")
def synth(converted_thinker_fp32) -> Token2WavSynthesizer:
    """Warmed up for both paths, so the tests also show streaming compiles nothing more."""
    model, _ = load_checkpoint(converted_thinker_fp32, stage="token2wav", dtype="float32")
    _redraw(model)
    out = Token2WavSynthesizer(model, Voices.load(converted_thinker_fp32), length_buckets=(64,),
                               batch_buckets=(1, 2))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(COMPILE_WORKERS_ENV, "2")  # compiled on threads, as served (conftest: one)
        out.warmup()
        out.warmup_stream()
    return out


def _request(rid: str, n: int, voice: str, seed: int) -> Request:
    codes = np.random.default_rng(seed).integers(0, 8192, n)
    return Request(rid, codes, SamplingParams(seed=seed), data=OneShotRequestData(voice=voice))


def _stream(synth, reqs, arrivals) -> list[list[np.ndarray]]:
    """Stream `reqs` side by side: call k brings arrivals[i][k] more codes of request i, its last
    piece comes with final=True. Returns what each call gave each request."""
    got = [[] for _ in reqs]
    for k in range(max(len(a) for a in arrivals)):
        jobs, who = [], []
        for i, (req, pieces) in enumerate(zip(reqs, arrivals)):
            if k < len(pieces):
                n = sum(pieces[:k + 1])
                jobs.append(ChunkJob(req, req.prompt_token_ids[:n], sum(map(len, got[i])), k == len(pieces) - 1))
                who.append(i)
        for i, wav in zip(who, synth.stream(jobs)):
            assert wav.dtype == np.float32 and wav.ndim == 1
            got[i].append(wav)
    return got


def test_noise_of_a_prefix_is_the_prefix_of_the_noise():
    """Chunk windows slice the noise the whole decode draws: drawing fewer codes gives its prefix."""
    for seed in (0, 1234, 2 ** 64 - 1, -5):
        full = initial_noise(300, seed)
        assert full.shape == (600, 80)
        for n in (1, 7, 24, 25, 299):
            np.testing.assert_array_equal(initial_noise(n, seed), full[:2 * n])


@pytest.mark.parametrize("limit", [124, 100], ids=["look_ahead_held_back", "final"])
def test_plan_windows_keep_everything_once(limit):
    # codes 30..100 kept, 24 of context each side, starts on 12-code blocks, windows of <= 64
    windows = plan_windows(30, 100, limit, 24, 24, 12, 64)
    assert len(windows) > 1 and windows[0][1] == 30 and windows[-1][2] == 100
    for (start, a, b, end), nxt in zip(windows, windows[1:] + [None]):
        assert start % 12 == 0 and a - start >= 24 and end == min(b + 24, limit) and end - start <= 64
        assert nxt is None or nxt[1] == b
    assert plan_windows(0, 9, 9, 24, 24, 12, 64) == [(0, 0, 9, 9)]  # borders are the request's own
    # A window that reaches the end needs no room for look-ahead: one window, not two.
    assert plan_windows(30, 60, 60, 24, 24, 12, 64) == [(0, 30, 60, 60)]
    assert plan_windows(5, 5, 9, 24, 24, 12, 64) == []
    with pytest.raises(ValueError, match="cannot hold 24 \\+ 24 of context"):
        plan_windows(40, 60, 90, 24, 24, 12, 48)


def test_vocoder_reach_covers_its_receptive_field(synth):
    """A mel frame changes no sample outside the vocoder's reach."""
    left, right = synth.cfg.bigvgan.context_frames()
    assert (left, right) == (34, 34)  # walked from the layer shapes
    hop, f = synth.cfg.bigvgan.hop_length, 40
    mel = (2 * np.random.default_rng(0).standard_normal((80, 80)) - 5).astype(np.float32)  # fits a streamed window
    bumped = mel.copy()
    bumped[f] += 3.0
    base, moved = synth._vocode([mel, bumped])
    changed = np.nonzero(base != moved)[0]
    assert changed.size and hop * (f - right) <= changed[0] and changed[-1] < hop * (f + left + 1)


def test_vocoder_context_is_exact_to_rounding(synth):
    """Windows with the stream's vocoder context (20 frames, not the 34 of its reach) give the
    whole mel's samples within fp32 rounding (measured 2.2e-7; 12 frames: 4.4e-4)."""
    assert synth.vocoder_context == (20, 20)
    hop, (left, right) = synth.cfg.bigvgan.hop_length, synth.vocoder_context
    mel = (2 * np.random.default_rng(1).standard_normal((118, 80)) - 5).astype(np.float32)
    whole = np.asarray(synth.jitted.wave(synth.params, mel[None], np.array([len(mel)], np.int32)))[0]
    windows = plan_windows(0, len(mel), len(mel), left, right, 1, 80)
    assert len(windows) > 1
    wav = np.concatenate([w[hop * (a - s):hop * (b - s)] for w, (s, a, b, _) in
                          zip(synth._vocode([mel[s:e] for s, _, _, e in windows]), windows)])
    assert 0.3 < np.abs(whole).max() and np.abs(wav - whole).max() <= 1e-6


@pytest.mark.parametrize("context", list(STREAM_BOUND), ids=["default", "left24_right24"])
@pytest.mark.parametrize("arrivals", [
    [[10, 25, 25, 4], [10, 25, 6]],        # the engine's pattern: 10, then 25s, then the remainder
    [[3, 17, 30, 9, 5], [20, 1, 20, 0]],   # uneven; the last call of the second brings no codes
    [[64], [41]],                          # all at once: several windows of one request in a call
], ids=["engine_chunks", "uneven", "all_at_once"])
def test_stream_matches_whole_decode(synth, monkeypatch, context, arrivals):
    monkeypatch.setattr(synth, "context", context)  # windows of the same shapes (more of them if longer)
    reqs = [_request("a", sum(arrivals[0]), "Chelsie", 1), _request("b", sum(arrivals[1]), "Ethan", 2)]
    whole = synth(reqs)
    n0 = compilation_count()
    streamed = _stream(synth, reqs, arrivals)
    assert compilation_count() == n0  # warm-up covered every streamed shape
    for req, pieces, ref in zip(reqs, streamed, whole):
        wav = np.concatenate(pieces)
        assert len(wav) == len(ref) == synth.cfg.bigvgan.num_samples(2 * len(req.prompt_token_ids))
        assert 0.3 < np.abs(ref).max() < 1.0  # audible, not clipped: the error below means something
        err = np.abs(wav - ref).max()
        assert err <= STREAM_BOUND[context], f"{req.request_id}: streamed vs whole max abs error {err:.3g}"
    if len(arrivals[0]) > 1:
        assert len(streamed[0][0]) == 0 and any(len(p) for p in streamed[0][:-1])  # audio before the end


def test_more_context_leaves_less_error(synth, monkeypatch):
    """The error is the DiT's truncated look-ahead: measured 3.9e-3, 7.3e-4 and 2.3e-5 with 6, 12
    (the default) and 24 codes of it (more windows of the same shapes for the longer ones)."""
    req = _request("w", 64, "Ethan", 3)
    whole = synth([req])[0]
    errs = []
    for right in (6, 12, 24):
        monkeypatch.setattr(synth, "context", StreamContext(24, right))
        errs.append(np.abs(np.concatenate(_stream(synth, [req], [[10, 25, 25, 4]])[0]) - whole).max())
    assert errs[0] > errs[1] > 10 * errs[2] and errs[2] <= 1e-4, errs


def test_short_request_is_exact(synth):
    """Shorter than the look-ahead: nothing until final, then one window, the whole decode itself."""
    req = _request("s", 20, "Chelsie", 4)
    pieces = _stream(synth, [req], [[10, 10]])[0]
    assert len(pieces[0]) == 0
    np.testing.assert_allclose(pieces[1], synth([req])[0], rtol=0, atol=EXACT)


def test_final_without_new_codes_flushes_the_rest(synth):
    req = _request("f", 50, "Ethan", 5)
    pieces = _stream(synth, [req], [[50, 0]])[0]
    hop, (_, right) = synth.cfg.bigvgan.hop_length, synth.vocoder_context
    # Not final: the last 12 codes wait for look-ahead, and the vocoder's last 20 frames for more mel.
    assert len(pieces[0]) == hop * (2 * (50 - synth.context.right_codes) - right)
    assert len(pieces[0]) + len(pieces[1]) == len(synth([req])[0])


def test_released_request_rebuilds_its_context(synth):
    """Cache dropped mid-stream (e.g. a restarted stage): the rest is rebuilt within the same bound."""
    req = _request("r", 64, "Chelsie", 6)
    first = synth.stream([ChunkJob(req, req.prompt_token_ids[:45], 0, False)])[0]
    synth.release("r")
    rest = synth.stream([ChunkJob(req, req.prompt_token_ids, len(first), True)])[0]
    ref = synth([req])[0]
    assert len(first) > 0 and len(first) + len(rest) == len(ref)
    assert np.abs(np.concatenate([first, rest]) - ref).max() <= STREAM_BOUND[synth.context]
    assert "r" not in synth._streams  # the final job freed it


def _record_shapes(small: Token2WavSynthesizer) -> dict:
    """Stand-ins for the streamed DiT and vocoder calls that record their input shapes (nothing compiles)."""
    shapes, rep = {"dit": [], "vocoder": []}, small.cfg.dit.repeats

    def mel_fn(state, codes, *rest):
        shapes["dit"].append(codes.shape)
        return np.zeros((codes.shape[0], rep * codes.shape[1], small.cfg.dit.mel_dim), np.float32)

    def wave_fn(state, x, frames):
        shapes["vocoder"].append(x.shape)
        return np.zeros((x.shape[0], small.cfg.bigvgan.num_samples(x.shape[1])), np.float32)

    small.jitted.mel, small.jitted.wave = mel_fn, wave_fn
    return shapes


def test_piled_up_codes_take_one_window_up_to_the_whole_bucket(synth):
    """Above the chunk windows come lengths up to the whole-request bucket (if at most twice the
    largest), each at most a fifth longer than the one before: a request whose codes piled up
    goes in one window instead of several of the largest chunk's, each paying its context
    (unless a call has idle parallel workers)."""
    rep, model = synth.cfg.dit.repeats, nnx.merge(synth.graphdef, synth.state)
    small = Token2WavSynthesizer(model, synth.voices, length_buckets=(64, 128), batch_buckets=(1, 2),
                                 stream_chunk_codes=(10, 25))
    first, chunk, top = small.stream_code_buckets[:3]  # the first window, the two chunk windows
    assert small.first_window[0] == first < chunk < top < 128 == small.stream_code_buckets[-1]
    ladder = small.stream_code_buckets[2:]
    assert all(b < a <= 1.2 * b for a, b in zip(ladder[1:], ladder))
    assert {rep * t for t in ladder} <= set(small.stream_frame_buckets)
    # A whole-request bucket more than twice the largest chunk window adds nothing.
    assert Token2WavSynthesizer(model, synth.voices, length_buckets=(64, 256), batch_buckets=(1, 2),
                                stream_chunk_codes=(10, 25)).stream_code_buckets == (first, chunk, top)
    shapes = _record_shapes(small)
    req = _request("p", 128, "Chelsie", 9)
    _stream(small, [req], [[first, 128 - first]])
    assert shapes["dit"] == [(1, first), (1, 128)]
    assert shapes["vocoder"][1] == (1, rep * 128, small.cfg.dit.mel_dim)
    # With two parallel calls (max_num_seqs 4 in batches of at most 2), a lone piece runs as
    # windows of at most the largest chunk's, side by side; two pieces take one window each.
    wide = Token2WavSynthesizer(model, synth.voices, length_buckets=(64, 128), batch_buckets=(1, 2),
                                max_num_seqs=4, stream_chunk_codes=(10, 25))
    shapes = _record_shapes(wide)
    _stream(wide, [req], [[first, 128 - first]])
    assert len(shapes["dit"]) == 3 and all(t <= top for _, t in shapes["dit"][1:])
    shapes["dit"].clear()
    _stream(wide, [req, _request("q", 128, "Ethan", 10)], [[first, 128 - first]] * 2)
    assert shapes["dit"] == [(2, first), (2, 128)]


def test_rows_of_very_different_sizes_go_in_separate_runs(synth):
    """A run is padded to its longest row and its batch bucket: four short windows beside four
    long ones run apart, eight of one size together (a call costs CALL_CELLS more)."""
    small = Token2WavSynthesizer(nnx.merge(synth.graphdef, synth.state), synth.voices, length_buckets=(64,),
                                 batch_buckets=(1, 4, 8), stream_chunk_codes=(10, 25))
    lengths = (40, 100, 150)  # each row's own length: the padding is the batch's
    assert small.size_split([40] * 4 + [150] * 4, lengths) == [(0, 4), (4, 8)]
    assert small.size_split([100] * 8, lengths) == [(0, 8)]
    # Two rows would pad to a batch of 4: two calls of one cost less.
    assert small.size_split([40, 40, 150], lengths) == [(0, 1), (1, 2), (2, 3)]
    assert small.size_split([], lengths) == []


def test_no_call_pads_past_max_batch_codes(synth):
    """A call's memory grows with its padded codes (BigVGAN's: 2.8 GB for 4096 codes on H100), so
    no call of several rows pads past max_batch_codes: warm-up compiles only such shapes, and rows
    that would take one call take more; longer buckets than the longest request go unused
    (shapes recorded from stand-in calls: nothing compiles)."""
    small = Token2WavSynthesizer(nnx.merge(synth.graphdef, synth.state), synth.voices,
                                 length_buckets=(16, 64, 256), batch_buckets=(1, 2, 4), max_codes=62,
                                 max_batch_codes=128, stream_chunk_codes=(10, 25))
    assert small.length_buckets == (16, 64) and small.max_codes == 62
    with pytest.raises(ValueError, match="63 codec tokens exceed this stage's longest request"):
        small.validate(_request("long", 63, "Ethan", 1))
    whole, rep = [], small.cfg.dit.repeats

    def whole_fn(state, codes, *rest):
        whole.append(codes.shape)
        return np.zeros((codes.shape[0], small.cfg.bigvgan.num_samples(rep * codes.shape[1])), np.float32)

    small.jitted.whole = whole_fn
    small.warmup()
    assert whole == [(1, 16), (1, 64), (2, 16), (2, 64), (4, 16)]
    whole.clear()
    # Four rows of 50-62 codes: one call of 4 x 64 costs less padding, but holds 256 codes.
    waves = small([_request(f"r{n}", n, "Chelsie", n) for n in (60, 50, 55, 62)])
    assert sorted(whole) == [(2, 64), (2, 64)] and [len(w) for w in waves] == [
        small.cfg.bigvgan.num_samples(rep * n) for n in (60, 50, 55, 62)]
    shapes = _record_shapes(small)
    _stream(small, [_request(f"s{i}", 120, "Ethan", i) for i in range(4)], [[10, 110]] * 4)
    assert all(b * t <= 128 or b == 1 for b, t in shapes["dit"])
    assert all(b * f <= rep * 128 or b == 1 for b, f, _ in shapes["vocoder"])
    with pytest.raises(ValueError, match="exceeds the largest length bucket"):
        Token2WavSynthesizer(nnx.merge(synth.graphdef, synth.state), synth.voices, length_buckets=(16, 64),
                             batch_buckets=(1,), max_codes=65)


def test_calls_split_by_max_batch_codes_keep_each_requests_audio(synth):
    """Two requests in two calls of one (max_batch_codes 64) give each the audio of the call of
    two the fixture's synthesizer makes, in the order asked."""
    one_by_one = Token2WavSynthesizer(nnx.merge(synth.graphdef, synth.state), synth.voices, length_buckets=(64,),
                                      batch_buckets=(1, 2), max_batch_codes=64)
    reqs = [_request("long", 60, "Chelsie", 11), _request("short", 23, "Ethan", 12)]
    for got, want in zip(one_by_one(reqs), synth(reqs)):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_each_chunk_size_has_its_own_window(synth):
    """Windows are compiled per chunk size (and for the first chunk): a small chunk runs a small
    window, and chunks that piled up run windows of the largest (shapes recorded from stand-in
    calls: nothing compiles)."""
    ctx, rep = synth.context, synth.cfg.dit.repeats
    small = Token2WavSynthesizer(nnx.merge(synth.graphdef, synth.state), synth.voices, length_buckets=(64,),
                                 batch_buckets=(1, 2), stream_chunk_codes=(10, 25))
    reach, first = ctx.left_codes + small.block_codes - 1 + ctx.right_codes, 10 + small.stream_delay_frames
    assert small.stream_code_buckets == (first, reach + 10, reach + 25)
    left, right = small.vocoder_context
    assert small.stream_frame_buckets == (rep * 10 + right, left + right + rep * 10, left + right + rep * 25,
                                          rep * (reach + 25))  # the mel of the largest DiT window
    assert small.first_window == (first, rep * 10 + right)
    shapes = _record_shapes(small)
    req = _request("c", 200, "Chelsie", 7)
    other = _request("d", 200, "Ethan", 8)
    _stream(small, [req, other], [[first, 25, 143], [0, first]])
    # The first chunk (10 codes and what their audio waits for) decoded alone fits the first
    # windows, which start at the first code: no left context. Beside a 25-code chunk, a first
    # chunk rides in the same run (one call of 2 padded rows costs less than two calls). The 143
    # codes that came at once take several windows of the largest shape (the whole-request
    # bucket, 64 codes, is smaller: no window reaches beyond the chunks').
    assert shapes["dit"][0] == (1, first) and shapes["vocoder"][0][:2] == (1, small.first_window[1])
    assert shapes["dit"][1] == (2, reach + 10)
    assert {t for _, t in shapes["dit"][1:]} <= set(small.stream_code_buckets)
    assert {t for _, t, _ in shapes["vocoder"][1:]} <= set(small.stream_frame_buckets)
    assert (2, reach + 25) in shapes["dit"]
