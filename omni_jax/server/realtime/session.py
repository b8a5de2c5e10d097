"""A realtime session's settings: OpenAI's `session` object, its defaults and `session.update`.

Only the fields an update sends change anything; `turn_detection: null` turns server VAD
off (manual commits). What this server cannot serve is refused by name, and a refused update
changes nothing. A session is of type "realtime" (a conversation the model answers) or
"transcription" (each committed turn is only transcribed; `?intent=transcription` at connect,
or `session.update` with that type).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import APIError
from ..tools import ToolUse, tool_use
from . import wire_audio
from .events import EventError, ServerVADConfig, SessionFields, TranscriptionConfig, TurnDetection, new_id


# The settings of a session's answers: session.update sets them; a transcription session (which
# answers nothing) refuses them.
ANSWER_SETTINGS = ("instructions", "output_modalities", "max_output_tokens", "temperature", "tools", "tool_choice")


@dataclasses.dataclass
class SessionConfig:
    model: str
    voices: list[str]                       # the model's voices, default first (empty: no speech)
    type: str = "realtime"                  # or "transcription"
    id: str = dataclasses.field(default_factory=lambda: new_id("sess"))
    instructions: str = ""
    output_modalities: list[str] = dataclasses.field(default_factory=lambda: ["audio"])
    voice: str | None = None
    speed: float = 1.0                      # the spoken answers' pace (server/tempo.py)
    input_format: str = wire_audio.PCM      # the audio on the wire (wire_audio.py)
    output_format: str = wire_audio.PCM
    turn_detection: TurnDetection | None = dataclasses.field(
        default_factory=lambda: ServerVADConfig(type="server_vad"))
    transcription: TranscriptionConfig | None = None
    max_output_tokens: int | str = "inf"
    temperature: float | None = None
    tools: list | None = None               # function tools, in the Responses API's flat shape
    tool_choice: Any = None
    include: list[str] = dataclasses.field(default_factory=list)   # "item.input_audio_transcription.logprobs"

    def __post_init__(self):
        if not self.voices:
            self.output_modalities = ["text"]
        self.voice = self.voice or (self.voices[0] if self.voices else None)

    def update(self, s: SessionFields, event_id: str | None = None) -> None:
        """Apply session.update's fields (EventError naming the first one refused; nothing changed then)."""
        sent = s.model_fields_set
        if s.model is not None and s.model != self.model:
            raise EventError(f"this session serves {self.model!r}; it cannot switch to {s.model[:64]!r}",
                             "invalid_value", "session.model", event_id)
        out = s.audio.output if s.audio is not None else None
        if s.output_modalities == ["audio"] and not self.voices:
            raise EventError("this model has no speech output; use output_modalities ['text']", "invalid_value",
                             "session.output_modalities", event_id)
        kind = s.type if "type" in sent else self.type
        if kind == "transcription":
            refused = [f"session.{n}" for n in ANSWER_SETTINGS if n in sent and getattr(s, n) not in (None, "", [])]
            refused += ["session.audio.output"] if out is not None else []
            if refused:
                raise EventError(f"{refused[0]} is not a setting of a transcription session (it makes no "
                                 f"responses); use type 'realtime'", "invalid_value", refused[0], event_id)
        new = dataclasses.replace(self, type=kind)
        if "include" in sent:
            new.include = list(s.include or [])
        for name in ANSWER_SETTINGS:
            if name in sent:
                value = getattr(s, name)
                default = getattr(SessionConfig(self.model, self.voices), name)
                setattr(new, name, default if value is None else value)
        new.tool_use("session", event_id)  # refused now, not at every response
        audio = s.audio
        if audio is not None and audio.input is not None:
            fields = audio.input.model_fields_set
            if "turn_detection" in fields:
                new.turn_detection = audio.input.turn_detection
            if "transcription" in fields:
                new.transcription = audio.input.transcription
            if audio.input.format is not None:
                new.input_format = audio.input.format.type
        if out is not None and out.voice is not None:
            new.voice = self.check_voice(out.voice, "session.audio.output.voice", event_id)
        if out is not None and "speed" in out.model_fields_set:
            new.speed = out.speed
        if out is not None and out.format is not None:
            new.output_format = out.format.type
        self.__dict__.update(new.__dict__)

    def tool_use(self, where: str, event_id: str | None = None, tools: Any = None, choice: Any = None) -> ToolUse:
        """What the session's tools (or a response's own `tools` / `tool_choice`) do; EventError
        naming `where`'s field if they are refused."""
        try:
            return tool_use(self.tools if tools is None else tools, self.tool_choice if choice is None else choice,
                            flat=True)
        except APIError as e:
            raise EventError(e.message, e.code or "invalid_value", f"{where}.{e.param}", event_id) from None

    def check_voice(self, voice: str, param: str, event_id: str | None = None) -> str:
        names = {v.lower(): v for v in self.voices}
        if voice.lower() not in names:
            choice = ", ".join(self.voices) if self.voices else "none: this model has no speech output"
            raise EventError(f"unknown voice {voice[:64]!r}; available voices: {choice}", "invalid_value", param,
                             event_id)
        return names[voice.lower()]

    @property
    def answers(self) -> bool:
        """A realtime session answers its turns; a transcription session only transcribes them."""
        return self.type == "realtime"

    @property
    def transcription_logprobs(self) -> bool:
        """The input transcription's events carry each token's logprob (`include`)."""
        return "item.input_audio_transcription.logprobs" in self.include

    @property
    def transcription_settings(self) -> TranscriptionConfig | None:
        """How committed turns are transcribed; None: they are not (a transcription session always
        transcribes, with the served model when no settings were sent)."""
        if self.transcription is None and not self.answers:
            return TranscriptionConfig(model=self.model)
        return self.transcription

    def as_json(self) -> dict[str, Any]:
        """The `session` object of session.created / session.updated."""
        audio_in = {"format": wire_audio.as_json(self.input_format), "noise_reduction": None,
                    "transcription": None if self.transcription_settings is None else
                    self.transcription_settings.model_dump(),
                    "turn_detection": None if self.turn_detection is None else self.turn_detection.model_dump()}
        if not self.answers:
            return {"type": "transcription", "object": "realtime.transcription_session", "id": self.id,
                    "audio": {"input": audio_in}, "include": self.include or None}
        return {
            "type": "realtime", "object": "realtime.session", "id": self.id, "model": self.model,
            "instructions": self.instructions, "output_modalities": list(self.output_modalities),
            "max_output_tokens": self.max_output_tokens, "tools": self.tools or [],
            "tool_choice": self.tool_choice or "auto",
            "include": self.include or None,
            "audio": {"input": audio_in, "output": {"format": wire_audio.as_json(self.output_format),
                                                    "voice": self.voice, "speed": self.speed}},
        }
