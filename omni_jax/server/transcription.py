"""Speech to text through the thinker: `/v1/audio/transcriptions` and `/v1/audio/translations`,
and the prompt that asks the model for it (the realtime API's input transcription uses it too).

Qwen-Omni models recognise speech when asked in their chat format; there is no separate ASR
head, so a transcription is a thinker-only request (text out) and never touches the speech
stages. One request takes at most one call of the thinker's audio encoder
(`audio_seconds_per_call`, which leaves the context room for its transcript); with
`chunking_strategy` the audio is cut at its pauses into pieces of at most that (and 30 s), each
transcribed as its own request (a few at once, their text streamed in order), and the pieces are
the segments of `verbose_json`, `srt` and `vtt` (without it: one segment spanning the audio).
The model gives no word timestamps and no probability of silence (`no_speech_prob` is 0).
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
import zlib
from typing import AsyncIterator

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse

from ..errors import MediaError
from ..inputs.media import TARGET_SAMPLE_RATE, load_audio
from ..inputs.reasoning import ThinkTags
from .audio_pieces import pieces
from .engine import ServedEngine
from .errors import APIError, bad_request, error_body
from .generation import Generation, check_model, failure, open_request, while_connected
from .logprobs import token_logprobs
from .metrics import Metrics
from .reasoning import ReplyReasoning
from .sse import event, event_stream
from .transcription_form import TranscriptionForm, read_form

# The instruction Qwen's cookbooks give the Omni models for speech recognition.
ASR_SYSTEM = "You are a speech recognition model."
# The longest piece `chunking_strategy` cuts (less where the thinker takes less): sentence-sized
# spans, as Whisper's 30 s windows, recognise better than minutes at once.
MAX_PIECE_S = 30.0
# Pieces transcribed at once: enough for the thinker to batch them, few enough that one long
# file does not take every slot of the prompt workers' queue.
PIECES_IN_FLIGHT = 4
# ISO-639-1 codes (what OpenAI's `language` takes) of the languages Qwen-Omni recognises in
# speech, named as the prompt names them; any other value is used as given.
LANGUAGE_NAMES = {
    "ar": "Arabic", "de": "German", "en": "English", "es": "Spanish", "fr": "French", "hi": "Hindi",
    "id": "Indonesian", "it": "Italian", "ja": "Japanese", "ko": "Korean", "ms": "Malay", "nl": "Dutch",
    "pt": "Portuguese", "ru": "Russian", "th": "Thai", "tr": "Turkish", "ur": "Urdu", "vi": "Vietnamese",
    "yue": "Cantonese", "zh": "Chinese",
}


def language_name(language: str) -> str:
    """A language as the prompt names it ("en" -> "English")."""
    return LANGUAGE_NAMES.get(language.strip().lower(), language.strip())


def transcription_prompt(audio: np.ndarray, sample_rate: int, language: str | None = None,
                         prompt: str | None = None, translate: bool = False, keywords=(), languages=()) -> dict:
    """Chat messages asking for the audio's words (`translate`: in English), as plain text;
    `keywords`: words or phrases it may hold, `languages`: the languages it may be in."""
    if translate:
        ask = "Translate the audio into English text. Reply with the translation only."
    else:
        spoken = f" {language_name(language)}" if language else ""
        ask = f"Transcribe the{spoken} audio into text. Reply with the transcript only."
        if languages:
            ask += f" The audio is in one of: {', '.join(language_name(x) for x in languages)}."
        if keywords:
            ask += f" Words it may contain: {', '.join(keywords)}."
    if prompt:
        ask += f" Context: {prompt}"
    return {"messages": [{"role": "system", "content": ASR_SYSTEM},
                         {"role": "user", "content": [{"type": "audio", "audio": (audio, sample_rate)},
                                                      {"type": "text", "text": ask}]}]}


def transcription_params(engine: ServedEngine, temperature: float, logprobs: bool = False) -> list:
    """The thinker's defaults at this temperature, ending at the end of the transcript even where
    the pipeline's replies ignore it (a benchmark's setting); `logprobs`: each token's."""
    extra = {"logprobs": 0} if logprobs else {}
    return [engine.stage_defaults(["thinker"])[0].updated(temperature=temperature, ignore_eos=False, **extra)]


def token_usage(out) -> dict:
    """OpenAI's token usage of a transcription."""
    return _usage(len(out.prompt_token_ids), len(out.token_ids))


def _usage(n_in: int, n_out: int) -> dict:
    return {"type": "tokens", "input_tokens": n_in, "output_tokens": n_out, "total_tokens": n_in + n_out}


@dataclasses.dataclass
class _Piece:
    """One piece's request: where it lies in the audio (seconds) and what came of it."""

    start: float
    end: float
    text: str = ""
    token_ids: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)   # OpenAI's entries
    prompt_tokens: int = 0

    def segment(self, i: int, temperature: float) -> dict:
        """The piece as a `verbose_json` segment."""
        raw = self.text.encode()
        lps = [e["logprob"] for e in self.logprobs]
        return {"id": i, "seek": int(round(self.start * 100)), "start": self.start, "end": self.end,
                "text": self.text, "tokens": list(self.token_ids), "temperature": temperature,
                "avg_logprob": float(np.mean(lps)) if lps else 0.0,
                # Whisper's: text bytes over their zlib size (a repeating transcript compresses well)
                "compression_ratio": len(raw) / len(zlib.compress(raw)) if raw else 0.0,
                "no_speech_prob": 0.0}


class _Transcript:
    """The pieces' outputs, in order, joined into one text: each piece stripped, one space
    between pieces, and the stream's deltas add up to exactly that text (a reasoning model's
    thinking left out: `tags`, server/reasoning.py)."""

    def __init__(self, spans: list[tuple[float, float]], tokenizer, logprobs: bool, tags: ThinkTags | None = None):
        self.pieces = [_Piece(a, b) for a, b in spans]
        self._said = [ReplyReasoning(tags) for _ in spans]
        self.tokenizer, self.logprobs = tokenizer, logprobs
        self.text = ""
        self._started = False   # the current piece has given text
        self._held = ""         # whitespace held back until text follows it in the same piece
        self._lps: list = []    # logprobs not yet sent with a delta

    def add(self, i: int, out) -> tuple[str, list]:
        """One update of piece `i`: the text it adds to the transcript, and its tokens' logprobs."""
        piece = self.pieces[i]
        _, said = self._said[i].feed(out)
        piece.text += said
        if out.finished:
            piece.text, piece.token_ids, piece.prompt_tokens = piece.text.strip(), list(out.token_ids), \
                len(out.prompt_token_ids)
        new = out.new_token_ids
        if new and out.logprobs and self.logprobs:
            entries = token_logprobs(self.tokenizer, new, out.logprobs[-len(new):], None)
            piece.logprobs += entries
            self._lps += entries
        delta = self._join(said)
        if out.finished:
            self._started, self._held = False, ""
        if not delta:
            return "", []
        lps, self._lps = self._lps, []
        return delta, lps

    def _join(self, delta: str) -> str:
        if not self._started:
            delta = delta.lstrip()
            if not delta:
                return ""
            self._started, self._held = True, " " if self.text else ""
        body = delta.rstrip()
        if not body:
            self._held += delta
            return ""
        out = self._held + body
        self._held = delta[len(body):]
        self.text += out
        return out

    def usage(self) -> dict:
        return _usage(sum(p.prompt_tokens for p in self.pieces), sum(len(p.token_ids) for p in self.pieces))

    def all_logprobs(self) -> list:
        return [e for p in self.pieces for e in p.logprobs]


def _clock(seconds: float, sep: str) -> str:
    ms = int(round(seconds * 1000))
    return f"{ms // 3600000:02d}:{ms // 60000 % 60:02d}:{ms // 1000 % 60:02d}{sep}{ms % 1000:03d}"


def _formatted(form: TranscriptionForm, t: _Transcript, duration: float, task: str):
    fmt, cues = form.response_format, [p for p in t.pieces if p.text]
    if fmt == "text":
        return PlainTextResponse(t.text)
    if fmt == "srt":
        return PlainTextResponse("\n".join(f"{i}\n{_clock(p.start, ',')} --> {_clock(p.end, ',')}\n{p.text}\n"
                                           for i, p in enumerate(cues, 1)))
    if fmt == "vtt":
        return PlainTextResponse("WEBVTT\n\n" + "\n".join(f"{_clock(p.start, '.')} --> {_clock(p.end, '.')}\n{p.text}\n"
                                                           for p in cues), media_type="text/vtt")
    if fmt == "verbose_json":
        language = "english" if task == "translate" else language_name(form.language or "").lower()
        return JSONResponse({"task": task, "language": language, "duration": duration, "text": t.text,
                             "segments": [p.segment(i, form.temperature) for i, p in enumerate(cues)],
                             "usage": {"type": "duration", "seconds": int(np.ceil(duration))}})
    body = {"text": t.text, "usage": t.usage()}
    if form.logprobs:
        body["logprobs"] = t.all_logprobs()
    return JSONResponse(body)


class TranscriptionHandler:
    """Serves both endpoints on one engine (`translate`: into English)."""

    def __init__(self, engine: ServedEngine, metrics: Metrics, translate: bool = False):
        self.engine, self.metrics, self.translate = engine, metrics, translate
        self.task = "translate" if translate else "transcribe"

    async def __call__(self, request: Request):
        form = await read_form(request, self.translate)
        check_model(self.engine, form.model)
        processor = self.engine.omni.processor
        try:
            wave = await asyncio.to_thread(load_audio, form.file, processor.max_audio_seconds, "file",
                                           limits=processor.media_limits)
        except MediaError as e:
            raise bad_request(str(e), "file") from None
        rate, duration = TARGET_SAMPLE_RATE, len(wave) / TARGET_SAMPLE_RATE
        most = self.engine.omni.audio_seconds_per_call
        if form.chunking is None:
            if duration > most:
                raise bad_request(f"the audio lasts {duration:.1f} s; this model transcribes at most {most:.1f} s in "
                                  "one request: send chunking_strategy=auto to transcribe it in pieces", "file",
                                  "context_length_exceeded")
            spans = [(0, len(wave))]
        else:
            vad = form.chunking
            spans = await asyncio.to_thread(pieces, wave, int(min(most, MAX_PIECE_S) * rate), vad.threshold,
                                            vad.prefix_padding_ms, vad.silence_duration_ms)
        prompts = [transcription_prompt(wave[a:b], rate, form.language, form.prompt, self.translate, form.keywords,
                                        form.languages) for a, b in spans]
        # verbose_json's segments give their tokens' mean logprob
        with_logprobs = form.logprobs or form.response_format == "verbose_json"
        params = transcription_params(self.engine, form.temperature, with_logprobs)
        t = _Transcript([(a / rate, b / rate) for a, b in spans], self.engine.omni.tokenizer, with_logprobs,
                        self.engine.reasoning)
        rid = f"transcribe-{uuid.uuid4().hex}"
        # The first piece is submitted before anything is answered: a prompt it refuses is a clean 400.
        first = await open_request(self.engine, prompts[0], params, ["text"], None, f"{rid}-0",
                                   request=request) if prompts else None
        updates = self._updates(first, prompts, params, rid)
        if form.stream:
            return event_stream(self._events(updates, t, form))

        async def collect():
            async for i, out in updates:
                t.add(i, out)
            return t

        try:
            done = await while_connected(request, collect())
        finally:
            await updates.aclose()
        if done is None:
            self.metrics.aborted("transcription")
            return JSONResponse({}, status_code=499)
        return _formatted(form, t, duration, self.task)

    async def _updates(self, first: Generation | None, prompts: list, params: list,
                       rid: str) -> AsyncIterator[tuple[int, object]]:
        """(piece, update) of every piece's request, in piece order, at most PIECES_IN_FLIGHT
        running at once; a failed piece raises (its APIError, or what broke its stream) and aborts
        the others: nothing waits on a piece that will not finish."""
        slots = asyncio.Semaphore(PIECES_IN_FLIGHT)   # FIFO: the pieces start in order
        queues = [asyncio.Queue() for _ in prompts]

        async def pump(i: int):
            try:
                async with slots:
                    gen = first if i == 0 else await open_request(self.engine, prompts[i], params, ["text"], None,
                                                                  f"{rid}-{i}")
                    async for out in gen.updates():
                        queues[i].put_nowait(out)
            except Exception as e:   # refused to start (APIError), or its stream broke: raised in its turn
                queues[i].put_nowait(e)

        tasks = [asyncio.ensure_future(pump(i)) for i in range(len(prompts))]
        ended = 0
        try:
            for i, q in enumerate(queues):
                while True:
                    out = await q.get()
                    if isinstance(out, Exception):
                        raise out
                    if out.finished:
                        ended += 1
                        # one client request, however many pieces: the last (or a failed) one counts it
                        self.metrics.finished("transcription", out,
                                              counted=i == len(prompts) - 1 or bool(out.error))
                        if out.error:
                            raise failure(self.engine, out)
                    yield i, out
                    if out.finished:
                        break
        finally:
            for i in range(ended, len(tasks)):
                tasks[i].cancel()
                # Aborted here, not only by the pump's generator: the awaits below may be cut short
                # (a streamed reply's client gone), and a pump cancelled before it began never closes its own.
                self.engine.omni.abort(f"{rid}-{i}")
            await asyncio.gather(*tasks, return_exceptions=True)
            if first is not None:
                await first.close()

    async def _events(self, updates, t: _Transcript, form: TranscriptionForm) -> AsyncIterator[bytes]:
        finished = False
        try:
            async for i, out in updates:
                delta, lps = t.add(i, out)
                if delta:
                    yield event({"type": "transcript.text.delta", "delta": delta}
                                | ({"logprobs": lps} if form.logprobs else {}))
            done = {"type": "transcript.text.done", "text": t.text, "usage": t.usage()}
            yield event(done | ({"logprobs": t.all_logprobs()} if form.logprobs else {}))
            finished = True
        except APIError as e:
            finished = True
            yield event(e.body())
        except Exception as e:  # end the stream visibly
            finished = True
            yield event(error_body(500, f"internal error: {type(e).__name__}: {e}"))
        finally:
            if not finished:
                self.metrics.aborted("transcription")
            await updates.aclose()
