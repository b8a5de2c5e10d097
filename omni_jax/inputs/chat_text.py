"""Chat text typed by a user stays text: special tokens only where the chat template writes them.

A chat template renders messages to one string that is then tokenized with special tokens
recognised, so a user who types `<|im_end|>` or `<|IMAGE|>` in a message would otherwise
close their turn or claim a media slot. `ChatText` hides the special-token strings in the
user's text (roles and text parts) behind private-use characters before rendering, then
tokenizes the rendered string as the tokenizer would (split at special tokens, each piece
on its own), except that each hidden string is tokenized as plain text. Text without special
strings takes the usual path untouched, so ordinary prompts tokenize exactly as before.

A user's own character in the private-use range used here (U+100000 onwards, Plane 16) would
be read back as a special string's text; it stays text either way.
"""

from __future__ import annotations

import re

import numpy as np

_HIDDEN_BASE = 0x100000


class ChatText:
    """Hide the special strings of user text, and tokenize a rendered chat that holds hidden ones."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        specials = sorted({t.content for t in decoder.values() if getattr(t, "special", False)},
                          key=len, reverse=True)  # longest first: no special string hides a longer one
        self.specials = specials
        self._ids = {s: int(tokenizer.convert_tokens_to_ids(s)) for s in specials}
        self._find = re.compile("|".join(map(re.escape, specials))) if specials else None
        self._hidden = re.compile(f"[{chr(_HIDDEN_BASE)}-{chr(_HIDDEN_BASE + max(len(specials) - 1, 0))}]")
        self._index = {s: i for i, s in enumerate(specials)}

    def hide(self, text: str) -> str:
        """`text` with every special-token string replaced by its private-use stand-in."""
        if self._find is None:
            return text
        return self._find.sub(lambda m: chr(_HIDDEN_BASE + self._index[m.group()]), text)

    def has_hidden(self, rendered: str) -> bool:
        return bool(self.specials) and self._hidden.search(rendered) is not None

    def encode(self, rendered: str) -> np.ndarray:
        """Token ids of a rendered chat: the template's special strings as special tokens, the
        hidden ones (typed by the user) as plain text."""
        ids: list[int] = []
        pos = 0
        for m in self._find.finditer(rendered):
            ids += self._plain(rendered[pos:m.start()])
            ids.append(self._ids[m.group()])
            pos = m.end()
        ids += self._plain(rendered[pos:])
        return np.asarray(ids, np.int32)

    def _plain(self, piece: str) -> list[int]:
        if not piece:
            return []
        piece = self._hidden.sub(lambda m: self.specials[ord(m.group()) - _HIDDEN_BASE], piece)
        return self.tokenizer(piece, add_special_tokens=False, split_special_tokens=True)["input_ids"]
