"""A reasoning model's replies in the server's APIs (`--reasoning-parser`, inputs/reasoning.py).

Where the served engine reads replies for reasoning (`ServedEngine.reasoning`, the tags' ids), a
reply's thinking comes apart from its answer: chat's `message.reasoning_content` (and
`delta.reasoning_content` streamed; `reasoning` beside it, the newer name clients read), the
Responses API's `reasoning` item; structured outputs and tool-call grammars hold only the answer
(the engine lets the thinking run free, SamplingParams.reasoning_tokens), a thinking budget
(vLLM's `thinking_token_budget`) ends the thinking after that many tokens, tool calls are read
from the answer, and usage counts the thinking's tokens as `reasoning_tokens`.
"""

from __future__ import annotations

from ..engine.sampling_params import StructuredOutputs
from ..inputs.reasoning import END, START, ReasoningReader, ThinkTags
from .engine import ServedEngine
from .errors import bad_request

BUDGET = "thinking_token_budget"


def thinking_fields(engine: ServedEngine, constraint: StructuredOutputs | None, budget: int | None = None) -> dict:
    """The thinker's sampling fields (those set) for a reply's constraint and thinking budget: on a
    reasoning model, the tags' ids with them, so that the constraint holds only what follows the
    thinking and the budget can end it. A grammar that names the tags (`<think>`, llguidance's
    token syntax) holds the whole reply, its thinking included."""
    fields = {k: v for k, v in (("structured_outputs", constraint), (BUDGET, budget)) if v is not None}
    if engine.reasoning is None:
        if budget is not None:
            raise bad_request(f"{BUDGET} needs a reasoning model's thinking, and this server reads none "
                              f"(--reasoning-parser)", BUDGET)
        return fields
    if constraint is not None and constraint.grammar is not None and (START in constraint.grammar
                                                                      or END in constraint.grammar):
        if budget is not None:
            raise bad_request(f"{BUDGET} cannot go with a grammar that holds the thinking itself (it names "
                              f"{START} or {END})", BUDGET)
        return fields
    if fields:
        fields["reasoning_tokens"] = engine.reasoning.ids
    return fields


class ReplyReasoning:
    """One reply's reasoning and content as its updates come (both as given where the engine does
    not read reasoning)."""

    def __init__(self, tags: ThinkTags | None):
        self.tags = tags
        self._reader: ReasoningReader | None = None

    @property
    def on(self) -> bool:
        return self.tags is not None

    def feed(self, out, text: str | None = None) -> tuple[str, str]:
        """The reasoning and content an update's `text_delta` (or `text`) adds, with what was held
        once it is the last."""
        text = out.text_delta if text is None else text
        if self.tags is None:
            return "", text
        if self._reader is None:
            self._reader = ReasoningReader(self.tags.opened(out.prompt_token_ids))
        reasoning, content = self._reader.feed(text)
        if out.finished:
            more, rest = self._reader.finish()
            reasoning, content = reasoning + more, content + rest
        return reasoning, content

    @property
    def thought(self) -> bool:
        """Whether the reply thinks (so far)."""
        return self._reader is not None and self._reader.thought

    @property
    def ended(self) -> bool:
        """Whether the reply's thinking is over (its end tag came)."""
        return self.thought and not self._reader.thinking

    def tokens(self, out) -> int:
        """How many of a finished reply's tokens were its thinking."""
        return thinking_tokens(self.tags, out)


def thinking_tokens(tags: ThinkTags | None, out) -> int:
    """How many of a finished reply's tokens were its thinking, the tags included."""
    return 0 if tags is None else tags.reasoning_tokens(out.token_ids, tags.opened(out.prompt_token_ids))


def whole(tags: ThinkTags | None, out) -> tuple[str | None, str]:
    """A finished reply's reasoning (None if it did not think, or the engine does not read
    reasoning) and content."""
    reply = ReplyReasoning(tags)
    reasoning, content = reply.feed(out, out.text)
    return (reasoning if reply.thought else None), content


def reasoning_fields(reasoning: str | None) -> dict:
    """A chat message's or delta's reasoning fields: vLLM's `reasoning_content` and the newer
    `reasoning` (the same text)."""
    return {"reasoning_content": reasoning, "reasoning": reasoning}
