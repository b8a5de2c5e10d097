"""`SamplingParams`: how one request's tokens are chosen and when its generation stops.

A frozen msgspec Struct, so it crosses process boundaries as msgpack and can be cached by
identity on the host (`sampling_metadata`). Every field is checked when it is made: a bad
value is a ValueError naming the field.
"""

from __future__ import annotations

import numbers
import secrets
from typing import Any

import msgspec
import msgspec.structs
import numpy as np

# Temperatures below this are treated as greedy (as vLLM's _SAMPLING_EPS): dividing by
# them only amplifies float noise.
_SAMPLING_EPS = 1e-5
MAX_LOGPROBS = 20
INT32_MAX = 2**31 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)
FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def is_utf8(s: str) -> bool:
    """False for text with lone surrogates (no UTF-8 form: msgpack cannot carry it to a stage)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _token_key(k: Any) -> Any:
    """A logit_bias key as an int: JSON's "15" is token 15 (other keys stay, to be refused)."""
    if isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 10:
        return int(k)
    return int(k) if _is_int(k) else k


def _bad(field: str, value: Any, requirement: str) -> ValueError:
    return ValueError(f"SamplingParams.{field} must be {requirement}, got {value!r}")


MAX_LOGIT_BIAS = 300  # token ids one request may bias (OpenAI's logit_bias); the sampler's padded width
MAX_GRAMMAR_CHARS = 1 << 16  # a schema, regex, grammar or the choices together: each request compiles its own


class StructuredOutputs(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """What a reply must match (vLLM's structured outputs): exactly one of a JSON schema (`json`,
    a dict or its JSON text), any JSON object (`json_object`), a regular expression (`regex`),
    one of some strings (`choice`) or a Lark / GBNF grammar (`grammar`). JSON may hold up to
    64 whitespace characters between its tokens, none with `disable_any_whitespace`.

    Each step masks the tokens that cannot continue a match (`engine/structured_output.py`);
    once the match is complete only an end-of-reply token is allowed. A reply cut by
    `max_tokens` may still be incomplete. Whether the grammar itself compiles is checked where
    the request is served (`structured_output.grammar_of`). With `SamplingParams.reasoning_tokens`
    the match holds what follows the reply's thinking.
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    # JSON without whitespace between tokens (", " and ": " separate): a model cannot pad it.
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        set_ = msgspec.structs.force_setattr
        if isinstance(self.json, dict):  # kept as text: a frozen value, as the wire carries it
            set_(self, "json", msgspec.json.encode(self.json).decode())
        if isinstance(self.choice, list):
            set_(self, "choice", tuple(self.choice))
        for name in ("json_object", "disable_any_whitespace"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"StructuredOutputs.{name} must be a bool, got {getattr(self, name)!r}")
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object is True else []
        if len(given) != 1:
            raise ValueError(f"StructuredOutputs needs exactly one of json, json_object, regex, choice or "
                             f"grammar, got {given or 'none'}")
        for name in ("json", "regex", "grammar"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, str) and v and is_utf8(v)):
                raise ValueError(f"StructuredOutputs.{name} must be a non-empty string of UTF-8 text, got {v!r:.80}")
        size = sum(len(v) for v in (self.json, self.regex, self.grammar) if v is not None)
        size += sum(len(c) for c in self.choice or () if isinstance(c, str))
        if size > MAX_GRAMMAR_CHARS:
            raise ValueError(f"StructuredOutputs: at most {MAX_GRAMMAR_CHARS} characters of schema, regex, choices "
                             f"or grammar, got {size}")
        if self.choice is not None and not (
                self.choice and all(isinstance(c, str) and c and is_utf8(c) for c in self.choice)):
            raise ValueError(f"StructuredOutputs.choice must be a non-empty list of non-empty strings, "
                             f"got {self.choice!r:.80}")


class SamplingParams(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """How one request's tokens are chosen and when its generation stops.

    Frozen: derive variants with `updated(**changes)`. List-valued fields accept any
    sequence and are stored as tuples, so an instance never changes after validation (the
    host-side batch builder caches per-instance data by identity).

    `top_k` 0 or -1 means off; `top_k == 1` or `temperature == 0` (below 1e-5) is greedy.
    `logprobs=n` returns the sampled token's logprob plus the top `n` (0 = sampled only).
    `prompt_logprobs=n` returns, per prompt position after the first, the prompt token's
    logprob plus the top `n` (computed in prefill; such a request reads no prefix cache).
    `structured_outputs` constrains the reply to a JSON schema, regex, choice or grammar.
    `reasoning_tokens` (start, end): a reasoning model's token ids that enclose its thinking
    (Qwen3's `<think>`, `</think>`); the reply may open with `start`, or its prompt has opened it.
    With them, structured outputs leave the thinking free and hold what follows `end`, and
    `thinking_token_budget` (vLLM's) ends a thinking that reaches that many tokens (the tags not
    counted) with `end`. Other requests ignore them.
    `logit_bias` adds to a token's logit (OpenAI's: at most 300 ids, each bias in [-100, 100];
    -100 in effect bans a token, 100 all but forces it), before penalties and masks.
    `seed=None` draws fresh randomness every step; `with_seed()` / `assign_seed` fixes a
    random seed at request creation so the request can be replayed.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    suppress_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputs | None = None
    logit_bias: dict[int, float] | None = None
    reasoning_tokens: tuple[int, int] | None = None
    thinking_token_budget: int | None = None
    # Stage-specific options beyond sampling (vLLM's name), e.g. a vocoder stage's
    # "initial_codec_chunk_frames"; the stage that reads a key validates its value.
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        # Normalise before validating: a bare string for `stop`, lists for the id fields,
        # numpy scalars (msgpack cannot encode them) to Python numbers.
        set_ = msgspec.structs.force_setattr
        if isinstance(self.stop, str):
            set_(self, "stop", (self.stop,))
        if isinstance(self.logit_bias, dict):  # JSON's keys are strings
            set_(self, "logit_bias", {_token_key(k): (float(v) if _is_real(v) else v)
                                      for k, v in self.logit_bias.items()})
        if isinstance(self.structured_outputs, dict):  # as JSON gives it (sampling_params_list)
            try:
                set_(self, "structured_outputs", StructuredOutputs(**self.structured_outputs))
            except (TypeError, ValueError) as e:
                raise ValueError(f"SamplingParams.structured_outputs: {e}") from None
        for name in ("stop", "stop_token_ids", "suppress_token_ids", "reasoning_tokens"):
            value = getattr(self, name)
            if isinstance(value, (list, np.ndarray)):
                value = tuple(value)
                set_(self, name, value)
            if name != "stop" and isinstance(value, tuple) and all(_is_int(t) for t in value):
                set_(self, name, tuple(int(t) for t in value))
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if _is_real(value) and type(value) is not float:
                set_(self, name, float(value))
        for name in ("top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
                     "thinking_token_budget"):
            value = getattr(self, name)
            if _is_int(value) and type(value) is not int:
                set_(self, name, int(value))
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first field whose value is out of range."""
        # Floats are checked in the dtype the sampler uses them in (float32): 1e308 is finite in
        # Python but inf there, and 1e-46 is > 0 but 0 there.
        t = self.temperature
        if not _is_real(t) or not (0.0 <= t <= FLOAT32_MAX):
            raise _bad("temperature", t, f"a number in [0, {FLOAT32_MAX:.4g}] (finite in float32)")
        # Counts and ids go to the device as int32 and seeds through msgpack as uint64: a
        # larger value must fail here, not wrap or fail to encode inside the engine.
        if not _is_int(self.top_k) or not -1 <= self.top_k <= INT32_MAX:
            raise _bad("top_k", self.top_k, f"an int in [-1, {INT32_MAX}] (0 or -1 disables it)")
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise _bad("top_p", self.top_p, "a number in (0, 1]")
        if not _is_real(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise _bad("min_p", self.min_p, "a number in [0, 1]")
        r = self.repetition_penalty
        if not _is_real(r) or not (FLOAT32_TINY <= r <= FLOAT32_MAX):
            raise _bad("repetition_penalty", r, f"a number in [{FLOAT32_TINY:.4g}, {FLOAT32_MAX:.4g}] (> 0 and "
                                                f"finite in float32)")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not (-2.0 <= v <= 2.0):
                raise _bad(name, v, "a number in [-2, 2]")
        if self.seed is not None and (not _is_int(self.seed) or not -(2**63) <= self.seed < 2**64):
            raise _bad("seed", self.seed, "None or an int in [-2**63, 2**64)")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s and is_utf8(s) for s in self.stop):
            raise _bad("stop", self.stop, "a list of non-empty strings of UTF-8 text")
        for name in ("stop_token_ids", "suppress_token_ids"):
            ids = getattr(self, name)
            if not isinstance(ids, tuple) or not all(_is_int(i) and 0 <= i <= INT32_MAX for i in ids):
                raise _bad(name, ids, f"a list of token ids (ints in [0, {INT32_MAX}])")
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= INT32_MAX:
            raise _bad("max_tokens", self.max_tokens, f"an int in [1, {INT32_MAX}]")
        if not _is_int(self.min_tokens) or not (0 <= self.min_tokens <= self.max_tokens):
            raise _bad("min_tokens", self.min_tokens,
                       f"an int in [0, max_tokens={self.max_tokens}]")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and (not _is_int(n) or not 0 <= n <= MAX_LOGPROBS):
                raise _bad(name, n, f"None or an int in [0, {MAX_LOGPROBS}]")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, getattr(self, name), "a bool")
        if self.logit_bias is not None:
            bias = self.logit_bias
            why = "SamplingParams.logit_bias must be"
            if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
                size = len(bias) if isinstance(bias, dict) else type(bias).__name__
                raise ValueError(f"{why} None or a dict of at most {MAX_LOGIT_BIAS} token ids, got {size}")
            for k, v in bias.items():
                if not _is_int(k) or not 0 <= k <= INT32_MAX:
                    raise ValueError(f"{why} keyed by token ids (ints in [0, {INT32_MAX}]), got key {k!r:.40}")
                if not _is_real(v) or not -100.0 <= v <= 100.0:
                    raise ValueError(f"{why} a bias in [-100, 100] per token, got {v!r:.40} for token {k}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputs):
                raise _bad("structured_outputs", self.structured_outputs, "None or a StructuredOutputs")
            if self.min_tokens:  # the grammar says where the reply ends; min_tokens could contradict it
                raise _bad("min_tokens", self.min_tokens, "0 with structured_outputs")
        ids = self.reasoning_tokens
        if ids is not None and (not isinstance(ids, tuple) or len(ids) != 2 or ids[0] == ids[1]
                                or not all(_is_int(t) and 0 <= t <= INT32_MAX for t in ids)):
            raise _bad("reasoning_tokens", ids, "None or two different token ids (start, end)")
        budget = self.thinking_token_budget
        if budget is not None:
            if not _is_int(budget) or not 0 <= budget <= INT32_MAX:
                raise _bad("thinking_token_budget", budget, f"None or an int in [0, {INT32_MAX}]")
            if ids is None:
                raise _bad("thinking_token_budget", budget, "given with reasoning_tokens (the ids that enclose "
                                                            "the thinking)")
        if self.extra_args is not None and (not isinstance(self.extra_args, dict)
                                            or not all(isinstance(k, str) for k in self.extra_args)):
            raise _bad("extra_args", self.extra_args, "None or a dict with string keys")

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Raise ValueError if a stop, suppressed or biased token id is outside the vocabulary."""
        for name in ("stop_token_ids", "suppress_token_ids", "logit_bias", "reasoning_tokens"):
            bad = [i for i in getattr(self, name) or () if i >= vocab_size]
            if bad:
                raise ValueError(
                    f"SamplingParams.{name} must be token ids < vocab_size={vocab_size}, "
                    f"got {bad[:8]!r}"
                )

    @property
    def is_greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature ~0 or top_k == 1)."""
        return self.temperature < _SAMPLING_EPS or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        """True when any repetition / presence / frequency penalty is active."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def updated(self, **changes: Any) -> "SamplingParams":
        """A validated copy with `changes` applied."""
        return msgspec.structs.replace(self, **changes)

    def with_seed(self) -> "SamplingParams":
        """This instance if it has a seed, else a copy with a fresh random 32-bit seed."""
        return self if self.seed is not None else self.updated(seed=secrets.randbits(32))


def assign_seed(params: SamplingParams) -> SamplingParams:
    """Give an unseeded request a random seed at creation, so its draws are replayable."""
    return params.with_seed()
