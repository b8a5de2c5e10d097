"""`POST /v1/realtime/client_secrets`: short-lived keys a browser may hold instead of the API key.

A backend that holds the API key asks for one (OpenAI's ephemeral keys, `ek_...`: 10 s to 2 h,
600 s by default), with the settings its client's sessions should start with, and hands it to
the client, which connects to `/v1/realtime` with it (`Authorization: Bearer ek_...`, or the
`openai-insecure-api-key.ek_...` subprotocol in a browser). The key admits realtime sessions
only, any number of them until it expires, each starting with its settings (which the client may
still change with session.update, as OpenAI's may). At most `max_live` keys are live at once;
expired ones are forgotten as new ones are made.
"""

from __future__ import annotations

import copy
import dataclasses
import secrets
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import APIError, bad_request
from .events import EventError, SessionFields, new_id, param_of
from .session import SessionConfig


class ExpiresAfter(BaseModel):
    model_config = ConfigDict(extra="ignore")
    anchor: Literal["created_at"] = "created_at"
    seconds: int = Field(default=600, ge=10, le=7200)


class ClientSecretRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    expires_after: ExpiresAfter = ExpiresAfter()
    session: SessionFields | None = None


def validated(model: type[BaseModel], body: Any):
    """`body` as `model`, or a 400 naming its first bad field."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        param = param_of(first, body)
        raise bad_request(f"{param}: {first['msg']}" if param else first["msg"], param or None) from None


def session_config(engine, fields: SessionFields | None) -> SessionConfig:
    """The settings a session starts with, from a request's `session` object (400 naming a bad one)."""
    config = SessionConfig(engine.served_name, engine.voices, type=fields.type if fields else "realtime")
    if fields is not None:
        try:
            config.update(fields)
        except EventError as e:
            raise bad_request(e.message, e.param) from None
    return config


@dataclasses.dataclass(frozen=True)
class _Secret:
    expires_at: float
    config: SessionConfig


class ClientSecrets:
    """The live client secrets of one server and the session settings each was made with."""

    def __init__(self, engine, max_live: int = 1024, clock=time.time):
        self.engine, self.max_live, self.clock = engine, max_live, clock
        self._live: dict[str, _Secret] = {}

    def create(self, body: Any) -> dict:
        """OpenAI's response: the key, when it expires, the session it starts (APIError 400 naming
        a bad field, 429 with `max_live` keys live, 503 while the model cannot serve)."""
        ok, why = self.engine.check()
        if not ok:
            raise APIError(503, why, None, "service_unavailable")
        req = validated(ClientSecretRequest, body)
        config = session_config(self.engine, req.session)
        now = self.clock()
        self._live = {k: s for k, s in self._live.items() if s.expires_at > now}
        if len(self._live) >= self.max_live:
            raise APIError(429, f"{self.max_live} client secrets are live, the most this server keeps; try again "
                                f"when one expires", None, "rate_limit_exceeded", retry_after=60)
        value = "ek_" + secrets.token_urlsafe(24)
        expires_at = int(now) + req.expires_after.seconds
        self._live[value] = _Secret(expires_at, config)
        return {"value": value, "expires_at": expires_at, "session": config.as_json()}

    def session(self, key: str) -> SessionConfig | None:
        """The settings a session started with `key` begins with (a fresh copy); None if `key` is
        no live client secret."""
        secret = self._live.get(key)
        if secret is None or secret.expires_at <= self.clock():
            return None
        return dataclasses.replace(copy.deepcopy(secret.config), id=new_id("sess"))
