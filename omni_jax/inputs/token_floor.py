"""A lower bound on a text's token count, in bounded memory: refuse a long prompt before tokenizing it.

Tokenizing a text costs memory and time in proportion to the text (about 130 bytes and 2.5 us per
character for Qwen's tokenizer), so a 60 MB prompt would cost gigabytes before the engine could say
it does not fit `max_model_len`. `TokenFloor.exceeds` answers "has this text certainly more than
`limit` tokens?" without tokenizing it:

1. a token covers at most `longest` bytes (the longest entry of the vocabulary, 128 for Qwen), so a
   text of more than `limit * longest` characters has more than `limit` tokens: refused at once;
2. otherwise the text is walked in chunks of `CHUNK_CHARS` characters through the tokenizer's
   normalizer and pre-tokenizer (the regex split that BPE never merges across). Every piece gives at
   least ceil(bytes / longest) tokens; a cut between chunks can split one piece (or one combining
   sequence of the normalizer) and so overcount by at most `CUT_SLACK`, which is taken off. The
   walk stops as soon as the bound passes `limit`.

Special-token strings count as one token each (a raw prompt's `<|im_end|>` is one id). A text whose
bound stays under the limit is then tokenized as usual; it is short in tokens, so that costs little.
"""

from __future__ import annotations

import math
import re
from typing import Iterable

CHUNK_CHARS = 1 << 16
CUT_SLACK = 4  # a split piece (+1) and a split NFC sequence (a few pieces), per cut


class TokenFloor:
    """`exceeds(texts, limit)`: whether the texts certainly hold more than `limit` tokens together."""

    def __init__(self, tokenizer, specials: Iterable[str] = ()):
        vocab = tokenizer.get_vocab()
        # Vocabulary entries are byte-level strings (one character per byte) or added tokens.
        self.longest = max(1, max(len(t) for t in vocab))
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._normalizer = getattr(backend, "normalizer", None)
        self._pre = getattr(backend, "pre_tokenizer", None)
        specials = sorted(set(specials), key=len, reverse=True)
        self._specials = re.compile("|".join(map(re.escape, specials))) if specials else None

    def char_bound(self, limit: int) -> int:
        """More characters than this certainly make more than `limit` tokens."""
        return limit * self.longest

    def exceeds(self, texts: Iterable[str], limit: int, check=None) -> bool:
        """True if the texts certainly hold more than `limit` tokens (False: they may fit).
        `check()` is called between chunks (a cancelled prompt stops there)."""
        texts = [t for t in texts if t]
        if sum(map(len, texts)) > self.char_bound(limit):
            return True
        if self._pre is None or sum(map(len, texts)) <= limit:
            return False  # too short to matter, or a tokenizer we cannot pre-split: tokenize it
        floor = 0
        for text in texts:
            floor -= 2  # the text's first and last piece may join the template's text around it
            for start in range(0, len(text), CHUNK_CHARS):
                if check is not None:
                    check()
                floor += self._chunk_floor(text[start:start + CHUNK_CHARS]) - (CUT_SLACK if start else 0)
                if floor > limit:
                    return True
        return False

    def _chunk_floor(self, chunk: str) -> int:
        n, pos = 0, 0
        if self._specials is not None:
            for m in self._specials.finditer(chunk):
                n += 1 + self._plain_floor(chunk[pos:m.start()])
                pos = m.end()
        return n + self._plain_floor(chunk[pos:])

    def _plain_floor(self, text: str) -> int:
        if not text:
            return 0
        if self._normalizer is not None:
            text = self._normalizer.normalize_str(text)
        return sum(math.ceil(len(piece) / self.longest) for piece, _ in self._pre.pre_tokenize_str(text))
