"""Speech to text through the thinker: `/v1/audio/transcriptions` and `/v1/audio/translations`,
and the prompt that asks the model for it (the realtime API's input transcription uses it too).

Qwen-Omni models recognise speech when asked in their chat format; there is no separate ASR
head, so a transcription is a thinker-only request (text out) and never touches the speech
stages. The model gives no timestamps: `verbose_json`, `srt` and `vtt` carry one segment
spanning the whole audio.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import AsyncIterator

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from ..errors import MediaError
from ..inputs.media import TARGET_SAMPLE_RATE, load_audio
from .engine import ServedEngine
from .errors import bad_request, error_body
from .generation import check_model, failure, open_request
from .metrics import Metrics
from .sse import event

# The instruction Qwen's cookbooks give the Omni models for speech recognition.
ASR_SYSTEM = "You are a speech recognition model."
FORMATS = ("json", "text", "verbose_json", "srt", "vtt")


def transcription_prompt(audio: np.ndarray, sample_rate: int, language: str | None = None,
                         prompt: str | None = None, translate: bool = False) -> dict:
    """Chat messages asking for the audio's words (`translate`: in English), as plain text."""
    if translate:
        ask = "Translate the audio into English text. Reply with the translation only."
    else:
        spoken = f" {language}" if language else ""
        ask = f"Transcribe the{spoken} audio into text. Reply with the transcript only."
    if prompt:
        ask += f" Context: {prompt}"
    return {"messages": [{"role": "system", "content": ASR_SYSTEM},
                         {"role": "user", "content": [{"type": "audio", "audio": (audio, sample_rate)},
                                                      {"type": "text", "text": ask}]}]}


def transcription_params(engine: ServedEngine, temperature: float) -> list:
    """The thinker's defaults at this temperature, ending at the end of the transcript even where
    the pipeline's replies ignore it (a benchmark's setting)."""
    return [engine.stage_defaults(["thinker"])[0].updated(temperature=temperature, ignore_eos=False)]


def _clock(seconds: float, sep: str) -> str:
    ms = int(round(seconds * 1000))
    return f"{ms // 3600000:02d}:{ms // 60000 % 60:02d}:{ms // 1000 % 60:02d}{sep}{ms % 1000:03d}"


def _formatted(fmt: str, text: str, duration: float, language: str | None, task: str, usage: dict):
    if fmt == "text":
        return PlainTextResponse(text)
    if fmt == "srt":
        return PlainTextResponse(f"1\n{_clock(0, ',')} --> {_clock(duration, ',')}\n{text}\n")
    if fmt == "vtt":
        return PlainTextResponse(f"WEBVTT\n\n{_clock(0, '.')} --> {_clock(duration, '.')}\n{text}\n",
                                 media_type="text/vtt")
    if fmt == "verbose_json":
        return JSONResponse({"task": task, "language": language or "", "duration": duration, "text": text,
                             "segments": [{"id": 0, "seek": 0, "start": 0.0, "end": duration, "text": text,
                                           "tokens": [], "temperature": 0.0, "avg_logprob": 0.0,
                                           "compression_ratio": 0.0, "no_speech_prob": 0.0}],
                             "usage": {"type": "duration", "seconds": int(np.ceil(duration))}})
    return JSONResponse({"text": text, "usage": usage})


class TranscriptionHandler:
    """Serves both endpoints on one engine (`translate`: into English)."""

    def __init__(self, engine: ServedEngine, metrics: Metrics, translate: bool = False):
        self.engine, self.metrics, self.translate = engine, metrics, translate

    async def __call__(self, request: Request, file: bytes, model: str, language: str | None, prompt: str | None,
                       response_format: str, temperature: float, stream: bool):
        check_model(self.engine, model)
        if response_format not in FORMATS:
            raise bad_request(f"response_format must be one of {list(FORMATS)}", "response_format")
        if stream and response_format not in ("json", "text"):
            raise bad_request("stream=true gives transcript.text events; use response_format json or text",
                              "stream")
        if not 0.0 <= temperature <= 2.0:
            raise bad_request("temperature must be in [0, 2]", "temperature")
        processor = self.engine.omni.processor
        try:
            wave = await asyncio.to_thread(load_audio, file, processor.max_audio_seconds, "file",
                                           limits=processor.media_limits)
        except MediaError as e:
            raise bad_request(str(e), "file") from None
        duration = len(wave) / TARGET_SAMPLE_RATE
        params = transcription_params(self.engine, temperature)
        rid = f"transcribe-{uuid.uuid4().hex}"
        gen = await open_request(self.engine, transcription_prompt(wave, TARGET_SAMPLE_RATE, language, prompt,
                                                                   self.translate),
                                 params, ["text"], None, rid, request=request)
        if stream:
            return StreamingResponse(self._events(gen), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        out = await gen.result(request)
        if out is None:
            self.metrics.aborted("transcription")
            return JSONResponse({}, status_code=499)
        self.metrics.finished("transcription", out)
        if out.error:
            raise failure(self.engine, out)
        task = "translate" if self.translate else "transcribe"
        return _formatted(response_format, out.text.strip(), duration, "english" if self.translate else language,
                          task, token_usage(out))

    async def _events(self, gen) -> AsyncIterator[bytes]:
        out = None
        try:
            async for out in gen.updates():
                if out.text_delta:
                    yield event({"type": "transcript.text.delta", "delta": out.text_delta})
            self.metrics.finished("transcription", out)
            if out.error:
                err = failure(self.engine, out)
                yield event(err.body())
            else:
                yield event({"type": "transcript.text.done", "text": out.text.strip(), "usage": token_usage(out)})
        except Exception as e:  # end the stream visibly
            yield event(error_body(500, f"internal error: {type(e).__name__}: {e}"))
        finally:
            if out is None or not out.finished:
                self.metrics.aborted("transcription")
            await gen.close()


def token_usage(out) -> dict:
    """OpenAI's token usage of a transcription."""
    n_in, n_out = len(out.prompt_token_ids), len(out.token_ids)
    return {"type": "tokens", "input_tokens": n_in, "output_tokens": n_out, "total_tokens": n_in + n_out}
