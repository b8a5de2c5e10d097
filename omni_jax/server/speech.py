"""POST /v1/audio/speech: text to speech through the thinker and talker.

The prompt is a chat turn whose assistant reply is prefilled with the input text (a raw
prompt: the chat template up to the open assistant turn, then the input), so the thinker
continues from "having said" the input and the talker speaks the reply it is handed: the
families' handoffs take a reply begun in the prompt as the reply (`handoff.reply_start`).
`stream_format: "sse"` sends `speech.audio.delta` events (base64 of the audio:
raw pcm chunks as they come for `pcm`, one encoded file at the end for other formats) and
a `speech.audio.done` event with usage; `stream_format: "audio"` sends the file (pcm: its
chunks as they come). `speed` paces the speech without changing its pitch (`tempo.py`), streamed
chunks included.
"""

from __future__ import annotations

import base64
import uuid

import numpy as np

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from . import audio as audio_codec
from .engine import ServedEngine
from .errors import bad_request, error_body
from .generation import Generation, check_model, failure, finished_outputs, open_request
from .metrics import Metrics
from .schemas import SpeechRequest
from .stage_params import stage_params
from .sse import event, event_stream
from .tempo import Tempo, stretch

MODALITIES = ["text", "audio"]


def speech_prompt(processor, text: str, instructions: str | None = None) -> dict:
    """The prompt of a speech request: the chat template with the assistant turn begun with the
    text, which the talker speaks as the reply (see the families' handoffs). `instructions`
    (OpenAI's directions for the voice) are a system message after the family's speech system
    prompt: the talker hears the reply in their context. Qwen-Omni was not trained on voice
    directions, so how far they change the delivery is the model's."""
    messages = [{"role": "user", "content": text}]
    if instructions:
        messages = [*processor.speech_messages([]), {"role": "system", "content": instructions}, *messages]
    ids = processor.chat_token_ids(messages, speech_output=True, assistant_prefix=text)
    return {"prompt_token_ids": ids}


class SpeechHandler:
    """Serves text to speech on one engine."""

    def __init__(self, engine: ServedEngine, metrics: Metrics):
        self.engine, self.metrics = engine, metrics

    async def __call__(self, req: SpeechRequest, request: Request):
        check_model(self.engine, req.model)
        if "audio" not in self.engine.output_modalities:
            raise bad_request(self.engine.no_audio_reason, "model")
        params = stage_params(self.engine.stage_defaults(self.engine.stage_names(MODALITIES)), req)
        # The input is the reply, begun in the prompt: the talker speaks it, and whatever the
        # thinker would add is not wanted (its one token ends the reply; the last token is never spoken).
        params[0] = params[0].updated(max_tokens=1, min_tokens=0)
        try:
            prompt = speech_prompt(self.engine.omni.processor, req.input, req.instructions)
        except ValueError as e:  # PromptError: text the tokenizer cannot take (a lone surrogate...)
            raise bad_request(str(e), "input") from None
        gen = await open_request(self.engine, prompt, params, MODALITIES, req.voice, f"speech-{uuid.uuid4().hex}",
                                 request=request)
        self.metrics.in_flight.inc()
        media_type = audio_codec.MEDIA_TYPES[req.response_format]
        if req.stream_format == "sse":
            return event_stream(self._sse(req, gen))
        if req.response_format == "pcm":
            return StreamingResponse(self._pcm(req, gen), media_type=media_type)
        outs = await finished_outputs([gen], request, self.metrics, "speech")
        if outs is None:
            return Response(status_code=499)
        out = outs[0]
        if out.error:
            raise failure(self.engine, out)
        return Response(audio_codec.encode(stretch(out.audio, req.speed), out.sample_rate, req.response_format),
                        media_type=media_type)

    @staticmethod
    async def _chunks(req: SpeechRequest, gen: Generation):
        """(the reply's next audio at the asked speed, the update it came with), then (the rest,
        the last update) once it finished."""
        tempo = Tempo(req.speed) if req.speed != 1.0 else None
        out = None
        async for out in gen.updates():
            audio = out.audio_delta if out.audio_delta is not None else np.zeros(0, np.float32)
            yield (tempo.push(audio) if tempo is not None else audio), out
        if tempo is not None and out is not None and out.finished and not out.error:
            yield tempo.flush(), out

    async def _pcm(self, req: SpeechRequest, gen: Generation):
        out = None
        try:
            async for audio, out in self._chunks(req, gen):
                if len(audio):
                    yield audio_codec.to_pcm16(audio)
            self.metrics.finished("speech", out)
        finally:
            self.metrics.in_flight.dec()
            if out is None or not out.finished:  # the client left mid-stream
                self.metrics.aborted("speech")
            await gen.close()

    async def _sse(self, req: SpeechRequest, gen: Generation):
        chunked = req.response_format == "pcm"
        out = None
        try:
            async for audio, out in self._chunks(req, gen):
                if chunked and len(audio):
                    data = base64.b64encode(audio_codec.to_pcm16(audio)).decode()
                    yield event({"type": "speech.audio.delta", "audio": data})
            self.metrics.finished("speech", out)
            if out.error:
                err = failure(self.engine, out)
                self.metrics.error(err.status)
                yield event({"type": "error", **error_body(err.status, err.message, err.param, err.code)})
                return
            if not chunked:
                data = audio_codec.encode(stretch(out.audio, req.speed), out.sample_rate, req.response_format)
                yield event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
            n_in, n_out = len(out.prompt_token_ids), len(out.token_ids)
            yield event({"type": "speech.audio.done",
                         "usage": {"input_tokens": n_in, "output_tokens": n_out, "total_tokens": n_in + n_out}})
        finally:
            self.metrics.in_flight.dec()
            if out is None or not out.finished:  # the client left mid-stream
                self.metrics.aborted("speech")
            await gen.close()
