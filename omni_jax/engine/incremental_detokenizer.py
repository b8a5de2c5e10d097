"""Incremental detokenization of one request's output, with its stop strings (the AR engine
makes one per request of a stage that has a tokenizer)."""

from __future__ import annotations

from typing import Sequence


class IncrementalDetokenizer:
    """Incremental detokenization of one request and its stop strings.

    A step decodes only a window of recent tokens, as vLLM does: the tokens whose text
    is not out yet, after a few earlier ones decoded again for context (a byte-level
    piece may start a character that the next one completes). Decoding the whole
    output every step would cost time quadratic in its length.
    """

    def __init__(self, tokenizer, stops: Sequence[str], include_stop: bool):
        self.tokenizer, self.stops, self.include_stop = tokenizer, list(stops), include_stop
        # Text held back while it may still grow into a stop string.
        self.hold = max((len(s) - 1 for s in self.stops), default=0)
        # Its own copy of the output ids: a request that finishes is released by the
        # scheduler before its last token's text is made.
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # the window starts here: context tokens, text already out
        self.read_offset = 0    # the tokens before this one are in `text`
        self.text = ""
        self.sent = 0   # text[:sent] is out
        self.ready = 0  # text[:ready] may go out

    def _read(self, final: bool = False) -> None:
        """Append the text of the tokens past read_offset once it is whole."""
        ids = self.token_ids
        if self.read_offset >= len(ids):
            return
        decode = self.tokenizer.decode
        prefix = decode(ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        window = decode(ids[self.prefix_offset:], skip_special_tokens=True)
        if window.endswith("\ufffd"):
            if not final:
                return  # an incomplete multi-byte character: wait for the next token
            window = window[:-1]
        if len(window) > len(prefix) or final:
            self.text += window[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)

    def update(self, new_token_ids: Sequence[int], check_stops: bool = True) -> str | None:
        """Take these tokens; the stop string their text reaches, if `check_stops` (the
        scheduler's finish check calls this). Text stays held back while it may still grow
        into a stop string; `take` hands out the rest."""
        self.token_ids.extend(new_token_ids)
        self._read()
        full = self.text
        if check_stops:
            for stop in self.stops:
                at = full.find(stop, max(0, self.sent - len(stop) + 1))
                if at >= 0:
                    self.ready = at + len(stop) if self.include_stop else at
                    return stop
        self.ready = max(self.ready, len(full) - self.hold)
        return None

    def take(self) -> str:
        """The text ready since the last call."""
        delta, self.sent = self.text[self.sent:self.ready], max(self.sent, self.ready)
        return delta

    def flush(self) -> str:
        """The text not out yet, at the end of the request."""
        self._read(final=True)
        delta, self.sent = self.text[self.sent:], len(self.text)
        self.ready = self.sent
        return delta
