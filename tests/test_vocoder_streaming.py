"""Streaming a vocoder stage ("async chunk"): codec codes arrive piece by piece, audio leaves in chunks.

Qwen3's code2wav with small windows (chunk_size 16, left context 4, so a 45-frame request
crosses two window boundaries) and chunk sizes that do not divide the window (first chunk
3 frames, then 7). The streamed pieces of a request must join into its whole-request
waveform; the engine must batch the chunks of different streams, keep whole requests
going, and free a stream's state however it ends. The checkpoint with expressive vocoder
weights comes from the code2wav stage tests (its waveform moves with every code).
"""

from __future__ import annotations

import types

import jax
import numpy as np
import pytest
from flax import nnx

import hf_tiny_qwen3 as tiny
from omni_jax.engine.jitted import COMPILE_WORKERS_ENV
from omni_jax.errors import RequestError
from omni_jax.engine.oneshot_engine import ChunkJob, OneShotRequestData, next_chunk_frames
from omni_jax.engine.protocol import Request
from omni_jax.engine.sampling_params import SamplingParams
from omni_jax.models.qwen2_5_omni import family as qwen2_5_family
from omni_jax.models.qwen3_omni import family as qwen3_family
from omni_jax.models.qwen3_omni.code2wav_stage import build_code2wav_engine
from test_qwen3_code2wav_stage import converted, flat, hf_chunked, hf_code2wav, random_codes  # noqa: F401 (fixtures)

pytestmark = pytest.mark.engine

Q = tiny.NUM_CODE_GROUPS
WINDOW, CONTEXT = 16, 4          # the synthesizer's chunk_size / left_context (windows of 20 frames)
FIRST, CHUNK = 3, 7              # codec frames of the first streamed chunk and of the later ones
TOL = 1e-5


@pytest.fixture(scope="module")
def engine(converted):  # noqa: F811 (the imported fixture)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(COMPILE_WORKERS_ENV, "2")  # its warm-ups compile on threads, as served (conftest: one)
        engine = build_code2wav_engine(converted, length_buckets=(8, 20), batch_buckets=(1, 2), chunk_size=WINDOW,
                                       left_context=CONTEXT, max_num_batched_tokens=120, max_model_len=60,
                                       codec_chunk_frames=CHUNK, initial_codec_chunk_frames=FIRST, streamed=True)
        engine.synthesizer.warmup()  # whole requests go beside the streams here: both paths compiled
    return engine


@pytest.fixture(autouse=True)
def fresh_engine(request):
    """Each test starts from an idle engine: a failed one leaves no stream or output behind."""
    yield
    if "engine" in request.fixturenames:
        engine = request.getfixturevalue("engine")
        for rid in list(engine.streams):
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()


def whole(engine, codes: np.ndarray) -> np.ndarray:
    """The synthesizer's whole-request waveform (the reference of every stream)."""
    req = Request("ref", flat(codes), SamplingParams(seed=0), data=OneShotRequestData())
    return engine.synthesizer([req])[0]


def assert_same(got: np.ndarray, ref: np.ndarray) -> None:
    assert got.dtype == np.float32 and got.shape == ref.shape
    assert ref.std() > 0.02  # a waveform that moves with the codes, not a flat line
    assert np.abs(got - ref).max() <= TOL


@pytest.fixture
def spy(engine, monkeypatch):
    """Records the jobs of every `stream` call and every `release`."""
    synth = engine.synthesizer
    calls, released = [], []
    real_stream, real_release = synth.stream, synth.release

    def stream(jobs):
        calls.append([(j.request.request_id, len(j.codes) // Q, j.final) for j in jobs])
        return real_stream(jobs)

    def release(rid):
        released.append(rid)
        real_release(rid)

    monkeypatch.setattr(synth, "stream", stream)
    monkeypatch.setattr(synth, "release", release)
    return types.SimpleNamespace(calls=calls, released=released)


@pytest.fixture
def convolved(engine, monkeypatch):
    """The real frames of every row of every streamed convolution call, with its `fresh` flag."""
    synth, rows = engine.synthesizer, []
    real = synth._convolve_stream

    def convolve(x, extras):
        frames, fresh, _ = extras
        rows.extend((int(f), bool(s)) for f, s in zip(frames, fresh) if f)
        return real(x, extras)

    monkeypatch.setattr(synth, "_convolve_stream", convolve)
    return rows


def feed(engine, codes: dict, sent: dict, events: list, outs: dict, frames_at: dict) -> None:
    """Send each event's (stream, frames) next codes, the last ones completing it; step after each."""
    for rid, n in events:
        piece = codes[rid][:, sent[rid]:sent[rid] + n]
        sent[rid] += n
        assert engine.extend_request(rid, flat(piece), complete=sent[rid] == codes[rid].shape[1])
        step_all(engine, outs, frames_at, sent)


def step_all(engine, outs: dict, frames_at: dict, frames: dict) -> None:
    """Step while there is work; record each output and the frames its stream had then."""
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
            frames_at.setdefault(o.request_id, []).append(frames.get(o.request_id))


def test_streamed_pieces_join_into_the_whole_request(engine, hf_code2wav, convolved):  # noqa: F811
    """Uneven arrivals, chunks not dividing the window, two window boundaries crossed: same waveform,
    each frame convolved once (plus the left context of each window after the first)."""
    synth = engine.synthesizer
    codes = random_codes(20, 45)  # windows [0,16) [12,32) [28,45)
    ref = whole(engine, codes)
    np.testing.assert_allclose(ref, hf_chunked(hf_code2wav, codes, WINDOW, CONTEXT), atol=1e-4)
    req = Request("s", [], SamplingParams(seed=0), data=OneShotRequestData())
    pieces, frames, decoded = [], 0, 0
    for n in (1, 2, 5, 3, 9, 1, 4, 11, 6, 3):
        frames += n
        final = frames == codes.shape[1]
        if frames - decoded < next_chunk_frames(decoded, FIRST, CHUNK) and not final:
            continue
        emitted = sum(len(p) for p in pieces)
        piece = synth.stream([ChunkJob(req, np.asarray(flat(codes[:, :frames]), np.int32), emitted, final)])[0]
        # Everything that is final is sent: the whole-request waveform of the frames so far.
        assert emitted + len(piece) == synth.request_samples(frames)
        pieces.append(piece)
        decoded = frames
    assert frames == codes.shape[1] and len(pieces) >= 5
    assert_same(np.concatenate(pieces), ref)
    # Windows [0,16) [12,32) [28,45): each window's first chunk starts it afresh from its context.
    assert sum(f for f, _ in convolved) == 45 + 2 * CONTEXT and sum(fresh for _, fresh in convolved) == 3
    synth.release("s")
    assert not synth._histories


def test_convolutions_carry_their_history(engine):
    """A streamed convolution call takes only new frames: with the history of the call before,
    a continued row equals the whole decode's samples, beside a fresh row in the same call;
    without it (zero history) it does not."""
    synth = engine.synthesizer
    assert synth.conv_buckets == (3, 6, 7, 8, 20)  # chunk sizes 3, 6, 7, then the window buckets
    u, lag = synth.total_upsample, synth._trailing
    x = np.random.default_rng(5).normal(size=(2, 17, synth.cfg.hidden_size)).astype(np.float32)
    ref = np.asarray(jax.jit(nnx.merge(synth.graphdef, synth.state).convolve)(x))

    def call(rows, length):
        """rows: (frame states [n, hidden], fresh, history or None) -> per row (samples, history)."""
        batch = np.zeros((len(rows), length, x.shape[-1]), np.float32)
        for j, (xs, _, _) in enumerate(rows):
            batch[j, :len(xs)] = xs
        histories = [h if h is not None else synth._no_history for _, _, h in rows]
        wav, new = synth._convolve_stream(batch, (np.array([len(xs) for xs, _, _ in rows], np.int32),
                                                  np.array([f for _, f, _ in rows]),
                                                  tuple(np.stack(h) for h in zip(*histories))))
        return [(wav[j, :len(xs) * u], tuple(h[j] for h in new)) for j, (xs, _, _) in enumerate(rows)]

    # Row 0 in chunks of 5, 7 and 5 frames; row 1 starts beside row 0's second chunk.
    [(a, ha)] = call([(x[0, :5], True, None)], 6)
    (b, hb), (fresh, _) = call([(x[0, 5:12], False, ha), (x[1, :8], True, None)], 8)
    [(c, _)] = call([(x[0, 12:], False, hb)], 6)
    assert a.shape == (5 * u,) and lag < u  # a fresh row leads with the samples the whole decode lacks
    np.testing.assert_allclose(np.concatenate([a, b, c])[lag:], ref[0], atol=TOL)
    np.testing.assert_allclose(fresh[lag:], ref[1, :8 * u - lag], atol=TOL)
    # The history is needed: without it the chunk's first samples differ.
    [(blind, _)] = call([(x[0, 5:12], False, None)], 8)
    assert np.abs(blind[:u] - b[:u]).max() > 1e-3


def test_engine_streams_beside_whole_requests(engine, spy):
    """Two streams and a whole request: chunks batched in one call, early first audio, exact joins."""
    before = engine.num_compilations
    a, b, w = random_codes(21, 40), random_codes(22, 23), random_codes(23, 9)
    engine.add_request("a", [], stream=True)
    # b sets its own first chunk and comes with two frames already.
    engine.add_request("b", flat(b[:, :2]), SamplingParams(extra_args={"initial_codec_chunk_frames": 5}), stream=True)
    engine.add_request("w", flat(w))
    outs, frames_at = {}, {}
    step_all(engine, outs, frames_at, {})
    assert [o.finished for o in outs["w"]] == [True] and "a" not in outs and "b" not in outs
    assert_same(outs["w"][0].audio, whole(engine, w))
    # Both streams wait for codes: no busy loop in the stage.
    assert not engine.has_unfinished() and engine.stats["num_streams_waiting_for_codes"] == 2
    # a: 2 frames (< first chunk of 3); b: 2 + 2 = 4 (< its own 5): nothing due.
    engine.extend_request("a", flat(a[:, :2]), complete=False)
    engine.extend_request("b", flat(b[:, 2:4]), complete=False)
    assert not engine.has_unfinished()
    # a: 4 frames, b: 5: both due, one stream call. A first chunk takes only its own frames
    # (a: 3 of its 4), so that its window is the smallest.
    engine.extend_request("a", flat(a[:, 2:4]), complete=False)
    engine.extend_request("b", flat(b[:, 4:5]), complete=False)
    step_all(engine, outs, frames_at, {"a": 4, "b": 5})
    assert spy.calls[-1] == [("a", 3, False), ("b", 5, False)]
    assert len(outs["a"]) == len(outs["b"]) == 1 and not outs["a"][0].finished
    # The rest in uneven pieces, interleaved, with another whole request on the way.
    sent = {"a": 4, "b": 5}
    feed(engine, {"a": a, "b": b}, sent, [("a", 3), ("b", 6), ("a", 5), ("b", 1), ("a", 9)], outs, frames_at)
    engine.add_request("w2", flat(w[:, :5]))
    feed(engine, {"a": a, "b": b}, sent, [("b", 11), ("a", 1), ("a", 18)], outs, frames_at)
    assert outs["w2"][0].finished and len(outs["w2"][0].audio) == engine.synthesizer.request_samples(5)
    for rid, codes in (("a", a), ("b", b)):
        got = outs[rid]
        assert len(got) >= 3 and not any(o.finished for o in got[:-1])
        assert got[-1].finished and got[-1].finish_reason == "stop" and got[-1].error is None
        assert all(o.audio is not None and o.audio.dtype == np.float32 for o in got)
        assert_same(np.concatenate([o.audio for o in got]), whole(engine, codes))
    # A chunk is due at 3 new frames first (b: its own 5), then at as many as are audio already,
    # within [first, 7]: a's first at 4 (decoding 3), then 3 more (6; arrivals give 7), then 7
    # (14; arrivals give 21); b at 5, then 5 (10; arrivals give 11).
    assert (frames_at["a"], frames_at["b"]) == ([4, 7, 21, 40], [5, 11, 23])
    assert [len(call) for call in spy.calls] == [2, 1, 1, 1, 1, 1] and spy.calls[1] == [("a", 7, False)]
    assert not engine.streams and sorted(spy.released) == ["a", "b"] and not engine.synthesizer._histories
    assert engine.num_compilations == before


def test_due_chunks_respect_max_num_seqs(engine, spy):
    """Three streams due, two per step (max_num_seqs): the one left out goes first next step."""
    assert engine.scheduler.max_num_seqs == 2
    for k, rid in enumerate("pqr"):
        engine.add_request(rid, flat(random_codes(30 + k, FIRST)), stream=True)
    assert len(engine.step()) == 2 and engine.has_unfinished()
    for rid in "pq":  # due again, but r waited longer
        engine.extend_request(rid, flat(random_codes(40, CHUNK)), complete=False)
    assert len(engine.step()) == 2 and len(engine.step()) == 1 and not engine.has_unfinished()
    assert [[j[0] for j in call] for call in spy.calls] == [["p", "q"], ["r", "p"], ["q"]]
    assert all(engine.abort(rid) for rid in "pqr") and not engine.streams


def test_abort_mid_stream_frees_it(engine, spy):
    engine.add_request("x", flat(random_codes(24, 4)), stream=True)
    out = engine.step()
    assert [o.request_id for o in out] == ["x"] and not out[0].finished
    assert engine.abort("x")
    assert "x" not in engine.streams and spy.released == ["x"] and not engine.synthesizer._histories
    assert not engine.extend_request("x", flat(random_codes(25, 2)), complete=False)  # late data: dropped
    assert not engine.extend_request("x", [], complete=True)
    assert not engine.has_unfinished() and not engine.abort("x")


def test_stream_without_codes_ends_in_error(engine, spy):
    engine.add_request("empty", [], stream=True)
    assert engine.extend_request("empty", [], complete=True)
    assert not engine.extend_request("empty", [], complete=True)
    assert engine.has_unfinished()  # the error output is pending
    [out] = engine.step()
    assert out.finished and out.finish_reason == "error" and "no codec frames" in out.error
    assert out.error_code == "invalid_request"
    assert spy.calls == [] and spy.released == ["empty"] and not engine.has_unfinished()


def test_bad_code_fails_only_its_stream(engine, spy):
    good, bad = random_codes(26, 12), random_codes(27, 2)
    bad[1, 1] = tiny.CODEBOOK
    engine.add_request("good", [], stream=True)
    engine.add_request("bad", [], stream=True)
    assert engine.extend_request("good", flat(good[:, :5]), complete=False)
    assert engine.extend_request("bad", flat(bad), complete=False)  # taken, then failed
    assert engine.extend_request("good", flat(good[:, 5:]), complete=True)
    outs, frames_at = {}, {}
    step_all(engine, outs, frames_at, {})
    [err] = outs["bad"]
    assert err.finish_reason == "error" and "'bad'" in err.error and "frame 1, group 1" in err.error
    assert err.error_code == "invalid_request"
    assert outs["good"][-1].finish_reason == "stop"
    assert_same(np.concatenate([o.audio for o in outs["good"]]), whole(engine, good))
    # A piece of a frame is refused too.
    engine.add_request("part", [], stream=True)
    assert engine.extend_request("part", list(range(Q + 1)), complete=False)
    [out] = engine.step()
    assert out.finish_reason == "error" and "not whole frames" in out.error and not engine.streams


def test_stream_call_failure_fails_its_streams(engine, spy, monkeypatch):
    def broken(jobs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.synthesizer, "stream", broken)
    engine.add_request("f", flat(random_codes(28, 3)), stream=True)
    [out] = engine.step()
    assert out.finish_reason == "error" and "device lost" in out.error and not engine.streams
    assert out.error_code == "internal"
    monkeypatch.undo()
    engine.add_request("ok", flat(random_codes(29, 3)), stream=True)
    engine.extend_request("ok", [], complete=True)
    [out] = engine.step()
    assert out.finish_reason == "stop" and len(out.audio) == engine.synthesizer.request_samples(3)


def test_bad_requests_refused(engine):
    for value in (0, -2, "3", True, 2.5):
        with pytest.raises(RequestError, match="initial_codec_chunk_frames"):
            engine.add_request("opt", [], SamplingParams(extra_args={"initial_codec_chunk_frames": value}), stream=True)
    with pytest.raises(RequestError, match="outside the codebook"):
        engine.add_request("range", [tiny.CODEBOOK] * Q, stream=True)
    with pytest.raises(RequestError, match="no codec tokens"):
        engine.add_request("whole", [])  # only a stream may start empty
    engine.add_request("dup", [], stream=True)
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request("dup", [], stream=True)
    assert engine.abort("dup") and not engine.streams


def test_family_passes_chunk_sizes(monkeypatch):
    seen = {}
    monkeypatch.setattr(qwen3_family, "build_code2wav_engine", lambda ckpt, **kw: seen.update(kw))
    stage = types.SimpleNamespace(token_buckets=None, decode_buckets=None, max_num_batched_tokens=None,
                                  max_model_len=None, max_num_seqs=None, codec_chunk_frames=12,
                                  initial_codec_chunk_frames=4, clip_audio=False)
    qwen3_family.FAMILY.engines["code2wav"](stage, "ckpt", True)
    assert seen["codec_chunk_frames"] == 12 and seen["initial_codec_chunk_frames"] == 4
    assert seen["clip"] is False


@pytest.mark.parametrize("async_chunk", [False, True])
def test_token2wav_stage_compiles_its_pipelines_path(monkeypatch, async_chunk):
    """Qwen2.5's streamed and whole calls differ in shape: a stage compiles the one its pipeline uses."""
    seen = {}
    monkeypatch.setattr(qwen2_5_family, "build_token2wav_engine", lambda ckpt, **kw: seen.update(kw))
    stage = types.SimpleNamespace(token_buckets=None, decode_buckets=None, max_num_seqs=None,
                                  max_num_batched_tokens=2048, max_model_len=512,
                                  codec_chunk_frames=12, initial_codec_chunk_frames=4,
                                  codec_left_context_frames=None, codec_right_context_frames=24, clip_audio=True)
    qwen2_5_family.FAMILY.engines["token2wav"](stage, "ckpt", async_chunk)
    assert seen["streamed"] is async_chunk and seen["chunk_frames"] == 12
    assert seen["max_num_batched_tokens"] == 2048 and seen["max_model_len"] == 512
    assert seen["left_context"] is None and seen["right_context"] == 24 and seen["clip"] is True


def test_token2wav_longest_request_must_fit_a_step():
    """A request longer than a step's codes could never be scheduled: the stage refuses to start
    (checked before the model is touched)."""
    from omni_jax.models.qwen2_5_omni.stages import token2wav_engine

    with pytest.raises(ValueError, match=r"requests of up to 512 codes .* exceed max_num_batched_tokens \(256\)"):
        token2wav_engine(None, None, length_buckets=(64, 512), max_model_len=4096, max_num_batched_tokens=256)


class _DelayedSynth:
    """A synthesizer whose audio trails its codes by 5 frames (as Qwen2.5's token2wav, by 22):
    one sample per frame that no later code can change."""

    tokens_per_frame = 1
    stream_delay_frames = 5

    def __init__(self):
        self.calls = []

    def __call__(self, reqs):
        return [np.zeros(r.num_prompt_tokens, np.float32) for r in reqs]

    def stream(self, jobs):
        self.calls.append([len(j.codes) for j in jobs])
        return [np.ones((len(j.codes) if j.final else max(len(j.codes) - 5, 0)) - j.emitted, np.float32)
                for j in jobs]


def test_chunks_count_the_audio_a_delayed_synthesizer_can_make():
    """First and later chunks are sizes of audio: a synthesizer that trails its codes is first
    called when the delay plus the first chunk arrived, not with nothing to give."""
    from omni_jax.engine.oneshot_engine import OneShotEngine

    synth = _DelayedSynth()
    engine = OneShotEngine(synth, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64,
                           chunk_frames=4, initial_chunk_frames=3)
    engine.add_request("r", np.zeros(0, np.int32), stream=True)
    sizes = []
    for _ in range(20):
        engine.extend_request("r", np.zeros(1, np.int32), complete=False)
        while engine.has_unfinished():
            sizes += [len(o.audio) for o in engine.step() if o.audio is not None]
    # 5 + 3; then as much as was made (3), then the steady 4.
    assert synth.calls[:4] == [[8], [11], [15], [19]]
    assert sizes[:4] == [3, 3, 4, 4]
    engine.extend_request("r", np.zeros(0, np.int32), complete=True)
    out = engine.step()
    assert out[-1].finished and sum(sizes) + len(out[-1].audio) == 20


def test_a_first_chunk_takes_only_its_own_codes():
    """Codes that piled up while the stage was busy: the first chunk still decodes only the
    delay plus its first frames (the smallest window, the earliest audio); the rest comes in
    the next step. A stream that is complete at its first chunk decodes everything at once."""
    from omni_jax.engine.oneshot_engine import OneShotEngine

    synth = _DelayedSynth()
    engine = OneShotEngine(synth, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64,
                           chunk_frames=4, initial_chunk_frames=3)
    engine.add_request("r", np.zeros(30, np.int32), stream=True)
    engine.add_request("c", np.zeros(30, np.int32), stream=True)
    engine.extend_request("c", np.zeros(0, np.int32), complete=True)
    first = engine.step()
    assert synth.calls == [[8, 30]]
    assert [len(o.audio) for o in first] == [3, 30] and first[1].finished
    assert [len(o.audio) for o in engine.step()] == [22] and synth.calls[1] == [30]


def test_chunks_grow_from_the_first_to_the_steady_size():
    """Each chunk is as long as the audio made before it, within [initial, steady]: the one
    being made never takes longer than what is queued to play (at faster than real time)."""
    sizes, done = [], 0
    while done < 100:
        sizes.append(next_chunk_frames(done, 4, 25))
        done += sizes[-1]
    assert sizes == [4, 4, 8, 16, 25, 25, 25]
    assert [next_chunk_frames(d, 10, 25) for d in (0, 10, 20, 40)] == [10, 10, 20, 25]
    assert [next_chunk_frames(d, 30, 25) for d in (0, 30)] == [30, 25]  # a first chunk above the steady one
