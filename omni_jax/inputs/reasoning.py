"""A reasoning model's reply: its thinking apart from its answer.

Qwen's reasoning models (Qwen3-Omni-30B-A3B-Thinking) think before they answer, in the reply
itself: `<think>\\n...\\n</think>\\n\\n` and then the answer, the tags single tokens of the
vocabulary. A reply thinks when its first token is `<think>` or when its prompt has opened it
already (a template that starts the assistant's turn thinking); a reply that opens otherwise is all
answer.
`ReasoningReader` takes the reply's text as it comes and gives back its reasoning (the text inside
the tags, without the whitespace around it) and its content (what follows, without the blank
line after the tag), so a streamed reply and a whole one read the same.
"""

from __future__ import annotations

import dataclasses

from ..engine.structured_output import thinking_opened

START, END = "<think>", "</think>"


@dataclasses.dataclass(frozen=True)
class ThinkTags:
    """The reasoning tags' token ids in a vocabulary."""

    start: int
    end: int

    @classmethod
    def of(cls, tokenizer) -> "ThinkTags | None":
        """The tags' ids, or None where the tokenizer does not have each as one token (a model
        that does not reason, as Qwen2.5-Omni)."""
        if tokenizer is None:
            return None
        ids = [tokenizer.convert_tokens_to_ids(tag) for tag in (START, END)]
        unk = getattr(tokenizer, "unk_token_id", None)
        if any(not isinstance(i, int) or i == unk for i in ids):
            return None
        if any(tokenizer.encode(tag, add_special_tokens=False) != [i] for tag, i in zip((START, END), ids)):
            return None
        return cls(*ids)

    @property
    def ids(self) -> tuple[int, int]:
        return self.start, self.end

    def opened(self, prompt_token_ids) -> bool:
        """Whether the prompt ends inside a thinking (the reply starts in it)."""
        return thinking_opened(prompt_token_ids, self.ids)

    def reasoning_tokens(self, token_ids, opened: bool) -> int:
        """How many of a reply's tokens are its thinking, the tags included."""
        ids = list(token_ids)
        if not opened and (not ids or ids[0] != self.start):
            return 0
        return ids.index(self.end) + 1 if self.end in ids else len(ids)


class ReasoningReader:
    """A reply's reasoning and content, read from its text piece by piece (module docstring)."""

    def __init__(self, opened: bool = False):
        self._phase = "thinking" if opened else "opening"
        self._held = ""
        self._began = False  # whether the reasoning's first words have come
        self.thought = opened  # whether the reply thinks (known once it has opened)

    @property
    def thinking(self) -> bool:
        """Whether the reply is inside its thinking (the end tag has not come)."""
        return self._phase == "thinking"

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and the content that `text` adds."""
        buf, reasoning = self._held + text, ""
        self._held = ""
        if self._phase == "opening":
            if buf.startswith(START):
                self._phase, self.thought, buf = "thinking", True, buf[len(START):]
            elif START.startswith(buf):  # all of it may yet be the tag
                self._held = buf
                return "", ""
            else:
                self._phase = "answer"
        if self._phase == "thinking":
            if not self._began:
                buf = buf.lstrip()  # the newline after the tag is not reasoning
                self._began = bool(buf)
            cut = buf.find(END)
            if cut < 0:
                body = buf[:len(buf) - _tag_prefix(buf, END)]
                body = body[:len(body.rstrip())]  # whitespace that may come before the end tag is held
                self._held = buf[len(body):]
                return body, ""
            reasoning, buf, self._phase = buf[:cut].rstrip(), buf[cut + len(END):], "after"
        if self._phase == "after":
            buf = buf.lstrip()  # nor the blank line after the end tag content
            if not buf:
                return reasoning, ""
            self._phase = "answer"
        return reasoning, buf

    def finish(self) -> tuple[str, str]:
        """What the held text ends as when the reply ends (a thinking cut by max_tokens is reasoning)."""
        held, self._held = self._held, ""
        if self._phase == "opening":
            return "", held
        if self._phase == "thinking":
            return held.rstrip(), ""
        return "", ""


def _tag_prefix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def split_reasoning(text: str, opened: bool = False) -> tuple[str | None, str]:
    """A whole reply's reasoning (None if it did not think) and content."""
    reader = ReasoningReader(opened)
    reasoning, content = reader.feed(text)
    more, rest = reader.finish()
    return (reasoning + more if reader.thought else None), content + rest
