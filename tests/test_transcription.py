"""`/v1/audio/transcriptions` and `/v1/audio/translations` as OpenAI's client uses them, against
a real `omni-jax serve` (test_server's fixtures: the same tiny pipeline, with a thinker that takes
1.6 s of audio per request), checked against `OmniJax.generate` on the same prompts; first the
pieces `chunking_strategy` cuts long audio into and how their texts join, on their own.
"""

from __future__ import annotations

import asyncio
import io
import types
import wave

import httpx
import numpy as np
import openai
import pytest
import soxr

from omni_jax import SamplingParams
from omni_jax.inputs.media import load_audio
from omni_jax.models.qwen2_5_omni.processor import Qwen2_5InputProcessor
from omni_jax.models.qwen2_5_omni.tiny import tiny_checkpoint
from omni_jax.models.qwen3_omni.processor import Qwen3InputProcessor
from omni_jax.models.registry import prompt_processor
from omni_jax.server.audio_pieces import pieces, speech_spans
from omni_jax.server.errors import APIError
from omni_jax.server.generation import open_request
from omni_jax.server.transcription import TranscriptionHandler, _Transcript, transcription_prompt
from test_realtime import SR, _speech
from test_server import (MODEL, _auth, _idle, client, env, library, media_dir, server,  # noqa: F401
                         with_audio_buckets)
from test_server import pipeline_yaml as server_pipeline_yaml

pytestmark = pytest.mark.server

RATE = 16000
# The served thinker's audio per request: audio_chunk_buckets [1, 4, 8] of the tiny encoder's 0.2 s.
PIECE_S = 1.6
# The pieces' limit in the tests of the pieces alone: less than one word with the default padding.
SHORT_S = 0.8
# Turn rules that keep each spoken word in a piece of its own.
TIGHT_VAD = {"type": "server_vad", "prefix_padding_ms": 0, "silence_duration_ms": 100}
WORDS = ("Yes.", "Hello.", "Seven.")


@pytest.fixture(scope="module")
def pipeline_yaml(server_pipeline_yaml) -> str:
    """test_server's pipeline with one audio bucket more: 1.6 s per request."""
    return with_audio_buckets(server_pipeline_yaml, [1, 4, 8], "transcription")


def _wav_file(audio: np.ndarray, rate: int = SR) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(rate)
        w.writeframes((np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def _words(lead_s: float = 0.5, gap_s: float = 0.6) -> np.ndarray:
    """The three words spoken with pauses between them (4.3 s at 24 kHz): more than one request takes."""
    parts = [_speech(w, lead_s if i == 0 else 0.0, gap_s) for i, w in enumerate(WORDS)]
    return np.concatenate(parts)


def _at_16k(audio: np.ndarray) -> np.ndarray:
    return soxr.resample(audio, SR, RATE).astype(np.float32)


# ---------------------------------------------------------------------------------------- pieces

def test_pieces_are_the_spoken_spans_packed_up_to_the_limit():
    wave16 = _at_16k(_words())
    spans = speech_spans(wave16, 0.5, 0, 100)
    assert len(spans) == len(WORDS)
    loud = np.flatnonzero(np.abs(wave16) > 0.01)
    for a, b in spans:  # each span holds its word's voice, and the pauses are outside every span
        assert np.abs(wave16[a:b]).max() > 0.1
    assert spans[0][0] <= loud[0] and spans[-1][1] >= loud[-1] - RATE // 20
    for limit_s in (SHORT_S, 2.0, 30.0):
        for vad in ((0.5, 0, 100), (0.5, 300, 500)):
            got = pieces(wave16, int(limit_s * RATE), *vad)
            assert got and all(0 < b - a <= limit_s * RATE for a, b in got), (limit_s, vad, got)
            assert all(b0 <= a1 for (_, b0), (a1, _) in zip(got, got[1:])), got  # in order, no overlap
            for a, b in speech_spans(wave16, *vad):  # every spoken sample is in a piece
                covered = sum(max(0, min(b, pb) - max(a, pa)) for pa, pb in got)
                assert covered == b - a, (limit_s, vad, got)
    # One piece from the first voice to the last when it fits; the pauses between pieces left out.
    assert pieces(wave16, 30 * RATE, 0.5, 0, 100) == [(spans[0][0], spans[-1][1])]
    assert pieces(wave16, int(SHORT_S * RATE), 0.5, 0, 100) == spans
    # Loudness is normalised first: a quiet recording is cut the same; silence is no piece.
    assert pieces(wave16 * 0.01, int(SHORT_S * RATE), 0.5, 0, 100) == spans
    assert pieces(np.zeros(RATE, np.float32), RATE) == []
    with pytest.raises(ValueError, match="at least"):
        pieces(wave16, 100)


def test_pieces_cut_a_long_span_at_its_quietest():
    sentence = _at_16k(_speech("Hello there, what is the weather like by the sea today?", 0.0, 0.0))
    limit = int(SHORT_S * RATE)
    got = pieces(sentence, limit, 0.5, 0, 100)
    assert len(got) >= 3 and all(b - a <= limit for a, b in got)
    assert all(b0 == a1 for (_, b0), (a1, _) in zip(got, got[1:]))  # one span: cut, nothing left out
    for _, cut in got[:-1]:  # each cut is in the quietest frame of its piece's last quarter
        frame = sentence[cut - 240:cut + 240]
        assert np.sqrt((frame ** 2).mean()) <= np.sqrt((sentence ** 2).mean())


def test_one_request_takes_the_thinkers_largest_audio_bucket():
    """The limit a transcription without chunking_strategy is held to (and its pieces' length):
    encoder chunks of 2 * n_window mel frames at 100 a second."""
    assert Qwen2_5InputProcessor(None, 1000).audio_seconds(64) == 128.0  # the presets' [.., 64]
    assert Qwen3InputProcessor(None, 1000).audio_seconds(64) == 64.0
    assert prompt_processor(tiny_checkpoint()).audio_seconds(4) == SHORT_S  # 4 chunks of the tiny encoder


def _update(text: str, delta: str, finished: bool = False, ids=(), new=()):
    times = types.SimpleNamespace(ttft=0.1, tpot=None, time_to_first_audio=None, rtf=None, e2e_latency=0.2)
    return types.SimpleNamespace(text=text, text_delta=delta, finished=finished, token_ids=list(ids),
                                 new_token_ids=list(new), prompt_token_ids=[1, 2], logprobs=None,
                                 num_cached_tokens=0, metrics=times)


def test_pieces_texts_join_as_their_stream_does():
    """Each piece stripped, one space between pieces that said something, and the streamed
    deltas add up to exactly the joined text."""
    streams = [[" Hello", " world ", "\n"], ["  ", ""], ["Bye", "."], ["\n", " ok  then", " "]]
    t = _Transcript([(0, 1), (1, 2), (2, 3), (3, 4)], None, logprobs=False)
    sent = []
    for i, deltas in enumerate(streams):
        text = ""
        for k, d in enumerate(deltas):
            text += d
            sent.append(t.add(i, _update(text, d, finished=k == len(deltas) - 1, ids=[7] * (k + 1)))[0])
    joined = " ".join(s for s in ("".join(d).strip() for d in streams) if s)
    assert "".join(sent) == t.text == joined == "Hello world Bye. ok  then"
    assert [p.text for p in t.pieces] == ["Hello world", "", "Bye.", "ok  then"]
    assert t.usage() == {"type": "tokens", "input_tokens": 8, "output_tokens": 3 + 2 + 2 + 3, "total_tokens": 18}


class _PiecesEngine:
    """A served engine whose requests write one token each and finish, except those named in
    `breaks` (their stream raises after the first token) and `refuses` (they cannot start)."""

    def __init__(self, breaks=(), refuses=()):
        self.breaks, self.refuses, self.aborted = set(breaks), set(refuses), []
        self.omni = self

    def generate(self, prompt, sampling_params_list, request_id, output_modalities, voice):
        async def stream():
            if request_id in self.refuses:
                raise ValueError("bad prompt")
            yield _update("a", "a", ids=[1], new=[1])
            if request_id in self.breaks:
                raise RuntimeError("the stream broke")
            out = _update("a.", ".", finished=True, ids=[1, 2], new=[2])
            out.error, out.finish_reason = None, "stop"
            yield out
        return stream()

    def abort(self, request_id):
        self.aborted.append(request_id)

    def mark_dead(self, why):
        pass


@pytest.mark.parametrize("engine, raised", [
    (_PiecesEngine(breaks={"r-1"}), RuntimeError), (_PiecesEngine(refuses={"r-2"}), APIError)])
def test_a_broken_piece_ends_the_transcription_and_aborts_the_rest(engine, raised):
    """Nothing waits on a piece that will not finish: its error is raised in its turn, and every
    piece not finished is aborted (the earlier ones were read to their end)."""
    metrics = types.SimpleNamespace(finished=lambda *a, **k: None, aborted=lambda *a: None)
    handler = TranscriptionHandler(engine, metrics)

    async def run():
        first = await open_request(engine, "p", [], ["text"], None, "r-0")
        got = []
        with pytest.raises(raised):
            async for i, out in handler._updates(first, ["p"] * 4, [], "r"):
                got.append((i, out.finished))
        return got

    got = asyncio.run(asyncio.wait_for(run(), 10))
    stop = 1 if raised is RuntimeError else 2
    assert [i for i, done in got if done] == list(range(stop))
    assert engine.aborted == [f"r-{i}" for i in range(stop, 4)]


def test_a_transcription_in_pieces_counts_as_one_request():
    """The Prometheus request counter sees one request per transcription, whatever its pieces; each
    piece's tokens and times are still recorded."""
    from omni_jax.server.metrics import Metrics

    engine, metrics = _PiecesEngine(), Metrics()
    handler = TranscriptionHandler(engine, metrics)

    async def run():
        first = await open_request(engine, "p", [], ["text"], None, "r-0")
        return [i async for i, out in handler._updates(first, ["p"] * 4, [], "r") if out.finished]

    assert asyncio.run(asyncio.wait_for(run(), 10)) == [0, 1, 2, 3]
    assert metrics.requests.labels("transcription", "stop")._value.get() == 1
    assert metrics.prompt_tokens.labels("computed")._value.get() == 8  # each piece's two prompt tokens
    assert metrics.ttft._sum.get() == pytest.approx(0.4)  # and its time to first token


# ---------------------------------------------------------------------------------------- the endpoints

def _greedy(library, logprobs: bool = False) -> SamplingParams:
    """The server's thinker params for a transcription (its defaults, greedy)."""
    extra = {"logprobs": 0} if logprobs else {}
    return library.pipeline.stage("thinker").sampling_params().updated(temperature=0.0, **extra)


def test_transcriptions_through_the_thinker(client, library):
    data = _wav_file(_speech("Good morning.", lead_s=0.1, tail_s=0.1))
    wave16 = load_audio(data)
    want = library.generate(transcription_prompt(wave16, RATE, "English"), _greedy(library),
                            output_modalities=["text"])[0]
    r = client.audio.transcriptions.create(model=MODEL, file=("hello.wav", data), language="English")
    assert r.text == want.text.strip() and r.text
    assert r.usage.input_tokens == len(want.prompt_token_ids) and r.usage.output_tokens == len(want.token_ids)
    # ISO-639-1 codes, as OpenAI's `language` takes, are named in the prompt as the model reads them
    assert transcription_prompt(wave16, RATE, "en") == transcription_prompt(wave16, RATE, "English")
    coded = client.audio.transcriptions.create(model=MODEL, file=("hello.wav", data), language="en",
                                               response_format="verbose_json")
    assert coded.text == r.text and coded.language == "english"
    srt = client.audio.transcriptions.create(model=MODEL, file=("hello.wav", data), language="English",
                                             response_format="srt")
    assert srt.startswith("1\n00:00:00,000 --> 00:00:0") and srt.rstrip().endswith(want.text.strip())
    verbose = client.audio.transcriptions.create(model=MODEL, file=("hello.wav", data), language="English",
                                                 response_format="verbose_json")
    assert abs(verbose.duration - len(wave16) / RATE) < 1e-3 and verbose.segments[0].end == verbose.duration
    assert verbose.segments[0].tokens == list(want.token_ids)
    events = list(client.audio.transcriptions.create(model=MODEL, file=("hello.wav", data), language="English",
                                                     stream=True))
    assert [e.type for e in events][-1] == "transcript.text.done"
    assert "".join(e.delta for e in events if e.type == "transcript.text.delta") == events[-1].text == r.text
    translated = client.audio.translations.create(model=MODEL, file=("hello.wav", data))
    want_en = library.generate(transcription_prompt(wave16, RATE, translate=True), _greedy(library),
                               output_modalities=["text"])[0]
    assert translated.text == want_en.text.strip()
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.transcriptions.create(model=MODEL, file=("x.wav", b"not audio at all"))
    assert e.value.body["param"] == "file"


def test_long_audio_is_refused_whole_and_transcribed_in_pieces(client, library):
    data = _wav_file(_words())
    wave16 = load_audio(data)  # as the server decodes it
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.transcriptions.create(model=MODEL, file=("words.wav", data))
    assert (e.value.body["param"], e.value.body["code"]) == ("file", "context_length_exceeded")
    assert "chunking_strategy" in e.value.body["message"] and "1.6 s" in e.value.body["message"]

    spans = pieces(wave16, int(PIECE_S * RATE), 0.5, TIGHT_VAD["prefix_padding_ms"], TIGHT_VAD["silence_duration_ms"])
    assert len(spans) == len(WORDS)
    want = library.generate([transcription_prompt(wave16[a:b], RATE) for a, b in spans], _greedy(library, True),
                            output_modalities=["text"])
    assert not any(w.error for w in want)
    text = " ".join(w.text.strip() for w in want if w.text.strip())
    want_lps = [lp[t].logprob for w in want for t, lp in zip(w.token_ids, w.logprobs)]

    r = client.audio.transcriptions.create(model=MODEL, file=("words.wav", data), chunking_strategy=TIGHT_VAD,
                                           include=["logprobs"])
    assert r.text == text and text
    assert r.usage.input_tokens == sum(len(w.prompt_token_ids) for w in want)
    assert r.usage.output_tokens == len(r.logprobs) == len(want_lps)
    np.testing.assert_allclose([x.logprob for x in r.logprobs], want_lps, atol=1e-4)
    assert all(bytes(int(b) for b in x.bytes).decode() == x.token for x in r.logprobs)

    verbose = client.audio.transcriptions.create(model=MODEL, file=("words.wav", data), chunking_strategy=TIGHT_VAD,
                                                 response_format="verbose_json", timestamp_granularities=["segment"])
    said = [(span, w) for span, w in zip(spans, want) if w.text.strip()]
    assert verbose.text == text and len(verbose.segments) == len(said)
    for seg, ((a, b), w) in zip(verbose.segments, said):  # a segment is a piece: its times and its words
        assert (seg.start, seg.end, seg.text, seg.tokens) == (a / RATE, b / RATE, w.text.strip(), list(w.token_ids))
        assert abs(seg.avg_logprob - np.mean([lp[t].logprob for t, lp in zip(w.token_ids, w.logprobs)])) < 1e-4
    vtt = client.audio.transcriptions.create(model=MODEL, file=("words.wav", data), chunking_strategy=TIGHT_VAD,
                                             response_format="vtt")
    assert vtt.startswith("WEBVTT") and vtt.count(" --> ") == len(said)

    events = list(client.audio.transcriptions.create(model=MODEL, file=("words.wav", data), stream=True,
                                                     chunking_strategy=TIGHT_VAD, include=["logprobs"]))
    deltas = [e for e in events if e.type == "transcript.text.delta"]
    done = events[-1]
    assert done.type == "transcript.text.done" and "".join(e.delta for e in deltas) == done.text == text
    assert [x.logprob for e in deltas for x in e.logprobs] == [x.logprob for x in done.logprobs]
    np.testing.assert_allclose([x.logprob for x in done.logprobs], want_lps, atol=1e-4)

    # "auto": the server VAD's default turn rules, pieces of at most the thinker's 1.6 s
    auto = pieces(wave16, int(PIECE_S * RATE))
    want_auto = library.generate([transcription_prompt(wave16[a:b], RATE) for a, b in auto], _greedy(library),
                                 output_modalities=["text"])
    r = client.audio.transcriptions.create(model=MODEL, file=("words.wav", data), chunking_strategy="auto")
    assert r.text == " ".join(w.text.strip() for w in want_auto if w.text.strip())
    silence = client.audio.transcriptions.create(model=MODEL, file=("quiet.wav", _wav_file(np.zeros(3 * SR))),
                                                 chunking_strategy="auto", response_format="verbose_json")
    assert silence.text == "" and silence.segments == []


def test_a_client_leaving_a_transcription_in_pieces_aborts_every_piece(server):
    """The stream closed after its first delta: no piece keeps running, no KV block stays held."""
    form = {"model": MODEL, "stream": "true", "chunking_strategy": "auto"}
    with httpx.stream("POST", f"{server.url}/v1/audio/transcriptions", headers=_auth(), data=form,
                      files={"file": ("words.wav", _wav_file(_words()))}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:"):
                break
    _idle(server, timeout=30)


@pytest.mark.parametrize("fields, param, code", [
    ({"include[]": "segments"}, "include", "invalid_value"),
    ({"include[]": "logprobs", "response_format": "text"}, "include", "invalid_value"),
    ({"timestamp_granularities[]": "segment"}, "timestamp_granularities", "invalid_value"),
    ({"timestamp_granularities[]": "word", "response_format": "verbose_json"}, "timestamp_granularities",
     "unsupported_parameter"),
    ({"known_speaker_names[]": "agent"}, "known_speaker_names", "unsupported_parameter"),
    ({"response_format": "diarized_json"}, "response_format", "invalid_value"),
    ({"chunking_strategy": "sometimes"}, "chunking_strategy", "invalid_value"),
    ({"chunking_strategy": "[1, 2]"}, "chunking_strategy", "invalid_value"),
    ({"chunking_strategy[type]": "server_vad", "chunking_strategy[threshold]": "2"}, "chunking_strategy.threshold",
     "invalid_value"),
    ({"chunking_strategy": '{"type": "semantic_vad"}'}, "chunking_strategy.type", "invalid_value"),
    ({"temperature": "hot"}, "temperature", "invalid_value"),
    ({"stream": "maybe"}, "stream", "invalid_value"),
    ({"stream": "true", "response_format": "srt"}, "stream", "invalid_value"),
    ({"keywords[]": "x" * 5000}, "keywords", "invalid_value"),
    ({"model": ""}, "model", "invalid_value"),
])
def test_bad_transcription_fields_are_refused_by_name(server, fields, param, code):
    form = {"model": MODEL, **fields}
    r = httpx.post(f"{server.url}/v1/audio/transcriptions", headers=_auth(), data=form, timeout=60,
                   files={"file": ("hello.wav", _wav_file(_speech("Yes.", 0.1, 0.1)))})
    err = r.json()["error"]
    assert (r.status_code, err["param"], err["code"], err["type"]) == (400, param, code, "invalid_request_error"), err


def test_hostile_transcription_forms_are_400s(server):
    """Two files, hundreds of fields, a JSON body: OpenAI's error shape, and the server goes on."""
    url, wav = f"{server.url}/v1/audio/transcriptions", _wav_file(_speech("Yes.", 0.1, 0.1))
    replies = [
        httpx.post(url, headers=_auth(), data={"model": MODEL}, timeout=60,
                   files=[("file", ("a.wav", wav)), ("file", ("b.wav", wav))]),
        httpx.post(url, headers=_auth(), data={"model": MODEL, **{f"x{i}": "1" for i in range(300)}}, timeout=60,
                   files={"file": ("a.wav", wav)}),
        httpx.post(url, headers=_auth(), json={"model": MODEL, "file": "aGk="}, timeout=60),
    ]
    for r in replies:
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert replies[-1].json()["error"]["param"] == "file"
    ok = httpx.post(url, headers=_auth(), data={"model": MODEL}, files={"file": ("a.wav", wav)}, timeout=60)
    assert ok.status_code == 200 and "text" in ok.json()


def test_a_transcription_without_a_file_is_refused_by_name(server):
    r = httpx.post(f"{server.url}/v1/audio/transcriptions", headers=_auth(), data={"model": MODEL},
                   files={"other": ("x.txt", b"x")}, timeout=60)
    assert (r.status_code, r.json()["error"]["param"]) == (400, "file")
    r = httpx.post(f"{server.url}/v1/audio/translations", headers=_auth(), data={"model": MODEL, "file": "text"},
                   timeout=60)
    assert (r.status_code, r.json()["error"]["param"]) == (400, "file")
