"""Structured outputs on the host: a request's grammar, and the tokens it allows each step. A
reasoning model's thinking budget is held the same way, with or without a grammar (`Grammar`).

`grammar_of(spec)` turns a `StructuredOutputs` into an llguidance grammar, or a ValueError
saying what is wrong with it (the server calls it to answer a bad schema with a 400 before the
request is sent). `Grammars` belongs to one engine: on a thread of its own it wraps the stage's
tokenizer for llguidance once (about a second for Qwen's 152k tokens, at the first structured
request, not at every stage start) and builds each request's `Grammar` (milliseconds, up to a
second for a large schema); the engine's loop goes on meanwhile, and the request waits for its
grammar as a streamed request waits for input. It also packs the allowed tokens of a step's
rows into the bitmask the sampler's `apply_token_bitmask` reads (bit t % 32 of word t // 32
set: token t allowed).

llguidance (guidance-ai's, one of vLLM's structured-output backends) computes a mask from the
tokenizer's byte strings and a lazily built lexer, in tens of microseconds per step for JSON;
it needs neither torch nor the tokenizer's Python object, only its `tokenizer.json` text.
A request's mask depends on its last token: a step launched ahead of its tokens (async
scheduling) runs its model call at once and its sampler once they are applied (as penalties).
"""

from __future__ import annotations

import functools
import json
import re
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from .sampling_params import SamplingParams, StructuredOutputs


# JSON's whitespace between two tokens: enough to pretty-print a deep reply, bounded so that a
# model cannot pad a reply without end (outlines bounds it for the same reason); or none at all.
MAX_JSON_WHITESPACE = 64
_FLEXIBLE = {"whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{MAX_JSON_WHITESPACE}}}"}
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_of(spec: StructuredOutputs) -> str:
    """The llguidance grammar of `spec`; ValueError with llguidance's reason if it does not compile."""
    from llguidance import LLMatcher, grammar_from

    try:
        if spec.json is not None or spec.json_object:
            options = _COMPACT if spec.disable_any_whitespace else _FLEXIBLE
            grammar = LLMatcher.grammar_from_json_schema(spec.json or '{"type": "object"}', overrides=options)
        elif spec.regex is not None:
            grammar = LLMatcher.grammar_from_regex(spec.regex)
        elif spec.choice is not None:
            grammar = grammar_from("choice", json.dumps(list(spec.choice)))
        else:
            grammar = grammar_from("grammar", spec.grammar)
    except ValueError as e:
        raise ValueError(f"{_kind(spec)} is not valid: {_one_line(str(e))}") from None
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"{_kind(spec)} is not valid: {_one_line(error)}")
    return grammar


def _one_line(reason: str) -> str:
    """llguidance's multi-line reason as one line, without its carets and its echo of the
    grammar it made (the request's own text is what a reader knows)."""
    lines = (line.strip() for line in reason.splitlines())
    text = " ".join(line for line in lines if line and set(line) != {"^"} and not re.match(r"\d+ \|", line))
    return text if len(text) <= _MAX_REASON else text[:_MAX_REASON] + "..."


_MAX_REASON = 300  # llguidance may list every special token of the vocabulary
_KINDS = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex", "choice": "choice",
          "grammar": "grammar"}


def _kind(spec: StructuredOutputs) -> str:
    return next(label for k, label in _KINDS.items() if getattr(spec, k) not in (None, False))


class Grammar:
    """One request's position in its grammar, and, for a reasoning model, in its thinking
    (SamplingParams.reasoning_tokens): the thinking is free, or held to `budget` tokens, and the
    grammar, if any, holds the reply after it."""

    HOLDS, OPENING, THINKING = "holds", "opening", "thinking"

    def __init__(self, matcher=None, lltokenizer=None, reasoning: tuple[int, int] | None = None,
                 prompt_token_ids=(), budget: int | None = None):
        self.matcher = matcher  # llguidance's LLMatcher; None: a thinking budget alone
        self._lltokenizer = lltokenizer
        self.reasoning, self.budget = reasoning, budget
        self.thought = 0  # thinking tokens so far, the tags not counted
        self.phase = self.HOLDS
        if reasoning is not None:
            self.phase = self.THINKING if thinking_opened(prompt_token_ids, reasoning) else self.OPENING

    @property
    def constrains(self) -> bool:
        """Whether the request's next tokens may be masked (a budget alone stops once its thinking
        is over: its request samples on the device again)."""
        return self.matcher is not None or self.phase != self.HOLDS

    @property
    def forcing(self) -> bool:
        """Whether the thinking spent its budget: its next token is the end tag."""
        return self.phase == self.THINKING and self.budget is not None and self.thought >= self.budget

    def accept(self, token_ids) -> tuple[str, str] | None:
        """Advance over the request's new tokens; when they do not fit, the reason and its error
        code (invalid_request: the grammar's own doing; internal: llguidance's limits), else None."""
        m = self.matcher
        for t in map(int, token_ids):
            if self.phase != self.HOLDS:
                start, end = self.reasoning
                opens = self.phase == self.OPENING and t == start
                if self.phase == self.THINKING or opens:
                    self.thought += not opens and t != end
                    self.phase = self.HOLDS if t == end else self.THINKING
                    continue
                self.phase = self.HOLDS  # the reply did not open with its thinking: the grammar holds it all
            if m is None:
                continue
            if m.is_stopped():  # complete: only an end token was allowed, which ended the request
                return None
            if m.consume_token(t):
                continue
            tok = self._lltokenizer
            if tok is not None and tok.is_special_token(t):
                # llguidance's forced-text path can allow an added token where the grammar spells
                # its text (a quoted "<tool_call>"), which its parser then refuses.
                name = tok.decode_str([t])
                return (f"structured output: the grammar spells the text of {name!r}, which this tokenizer has as "
                        f"one token ({t}); a Lark grammar names such a token unquoted ({name}) where it may come",
                        "invalid_request")
            reason = _one_line(m.get_error() or "a sampled token does not fit the grammar")
            return f"structured output: {reason}", "internal"
        return None


def thinking_opened(prompt_token_ids, reasoning: tuple[int, int]) -> bool:
    """Whether the prompt ends inside a thinking (its template opened the reply's `start`)."""
    ids = np.asarray(prompt_token_ids).reshape(-1)
    start, end = reasoning
    opened, closed = np.flatnonzero(ids == start), np.flatnonzero(ids == end)
    return opened.size > 0 and (closed.size == 0 or opened[-1] > closed[-1])


class Grammars:
    """The structured-output side of one engine (see module docstring)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = [int(t) for t in eos_token_ids]
        self._pool: ThreadPoolExecutor | None = None

    @functools.cached_property
    def _lltokenizer(self):
        from llguidance import LLTokenizer

        fast = getattr(self._tokenizer, "backend_tokenizer", self._tokenizer)  # transformers' wraps one
        if not hasattr(fast, "to_str"):
            raise ValueError("structured outputs need the checkpoint's tokenizer.json (a fast tokenizer)")
        # The model's vocabulary (its logits' width) may exceed the tokenizer's: ids past the
        # tokenizer's are never allowed.
        return LLTokenizer(fast.to_str(), n_vocab=self.vocab_size, eos_token=self._eos or None)

    def build(self, params: SamplingParams, prompt_token_ids=()) -> Future:
        """Start building the Grammar of a request with these params (structured outputs, or a
        thinking budget) and prompt: a Future of it, or of the ValueError saying why it does not
        compile. What needs no tokenizer is checked here and now (ValueError)."""
        spec, reasoning, budget = params.structured_outputs, params.reasoning_tokens, params.thinking_token_budget
        if spec is None:  # a thinking budget alone: nothing to compile
            done = Future()
            done.set_result(Grammar(None, None, reasoning, prompt_token_ids, budget))
            return done
        grammar = grammar_of(spec)
        if self._pool is None:  # llguidance releases the GIL while it builds
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammars")
        return self._pool.submit(self._build, grammar, _kind(spec), reasoning, prompt_token_ids, budget)

    def _build(self, grammar: str, kind: str, reasoning, prompt_token_ids, budget) -> Grammar:
        from llguidance import LLMatcher

        matcher = LLMatcher(self._lltokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"{kind} is not valid: {_one_line(matcher.get_error())}")
        return Grammar(matcher, self._lltokenizer, reasoning, prompt_token_ids, budget)

    def bitmask(self, grammars: list[Grammar | None], rows: int) -> np.ndarray:
        """[rows, words] int32: each grammar's allowed tokens in its row, every token elsewhere.
        Rows are filled in parallel on llguidance's own threads (a row takes 0.1 to 1 ms of CPU
        for JSON; a batch of them would otherwise add up on the step's path)."""
        bits = allow_all(rows, self.vocab_size)
        jobs = [(g.matcher, j) for j, g in enumerate(grammars)
                if g is not None and g.matcher is not None and g.phase != Grammar.THINKING]
        if jobs:
            self._executor.unsafe_compute_mask_ptr(jobs, bits.ctypes.data, bits.shape[1] * 4, rows)
        words = bits.view(np.uint32)
        for j, g in enumerate(grammars):
            if g is None:
                continue
            if g.phase == Grammar.OPENING and g.matcher is not None:  # the reply may also open its thinking
                _allow(words[j], g.reasoning[0])
            elif g.forcing:
                words[j] = 0
                _allow(words[j], g.reasoning[1])
        return bits

    @functools.cached_property
    def _executor(self):
        from llguidance import LLExecutor

        return LLExecutor()


def _allow(row: np.ndarray, token: int) -> None:
    row[token // 32] |= np.uint32(1 << (token % 32))


def allow_all(rows: int, vocab_size: int) -> np.ndarray:
    """The bitmask that allows every token of every row."""
    return np.full((rows, (vocab_size + 31) // 32), -1, np.int32)
