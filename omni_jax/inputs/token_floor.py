"""Has a text more tokens than a limit? Answered in bounded time and memory, before tokenizing it.

Tokenizing a text costs memory and time in proportion to the text (about 130 bytes and 2.5 us per
character for Qwen's tokenizer; more for long runs without a break, which BPE handles in
superlinear time: 3.9 M dashes take 53 s), so a 60 MB prompt would cost gigabytes before the
engine could say it does not fit `max_model_len`. `TokenFloor.check` answers first:

1. a token covers at most `longest` bytes (the longest entry of the vocabulary, 128 for Qwen), so a
   text of more than `limit * longest` characters has more than `limit` tokens: refused at once;
2. a text of at most `limit` characters is taken (it costs little to tokenize);
3. otherwise the text is tokenized incrementally, in chunks of `CHUNK_CHARS` characters, counting,
   and the walk stops as soon as the count passes `limit` (a cut between chunks may split a
   pre-tokenizer piece and so miscount by a token or two: `CUT_SLACK` is allowed per cut).
   A piece (a run the pre-tokenizer does not split) longer than `MAX_PIECE_CHARS` is refused:
   no language writes one, and BPE's cost on it grows faster than its length.

Work done is that of at most `limit` tokens' worth of text, plus one chunk. A tokenizer without a
fast backend gets steps 1 and 2 only.
"""

from __future__ import annotations

from typing import Iterable

CHUNK_CHARS = 1 << 16
CUT_SLACK = 4  # tokens a cut between chunks may add (a split piece, a split NFC sequence)
MAX_PIECE_CHARS = 1 << 14


class TokenFloor:
    """`check(texts, limit)`: why the texts cannot fit `limit` tokens, or None when they may."""

    def __init__(self, tokenizer):
        vocab = tokenizer.get_vocab()
        # Vocabulary entries are byte-level strings (one character per byte) or added tokens.
        self.longest = max(1, max(len(t) for t in vocab))
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._normalizer = getattr(backend, "normalizer", None)
        self._pre = getattr(backend, "pre_tokenizer", None)
        self._tokenizer = tokenizer

    def check(self, texts: Iterable[str], limit: int, check_cancel=None) -> str | None:
        """None if the texts may fit `limit` tokens together, else why not (for an error message).
        `check_cancel()` is called between chunks (a cancelled prompt stops there)."""
        texts = [t for t in texts if t]
        chars = sum(map(len, texts))
        if chars > limit * self.longest:
            return f"its {chars} characters make more than {limit} tokens"
        if chars <= limit or self._pre is None:
            return None
        count, cuts = 0, 0
        for text in texts:
            for start in range(0, len(text), CHUNK_CHARS):
                if check_cancel is not None:
                    check_cancel()
                cuts += start > 0
                n, piece = self._chunk_tokens(text[start:start + CHUNK_CHARS])
                if piece > MAX_PIECE_CHARS:
                    return f"it holds a run of {piece}+ characters the tokenizer does not split (at most {MAX_PIECE_CHARS})"
                count += n
                if count - CUT_SLACK * cuts > limit:
                    return f"its first {start + CHUNK_CHARS} characters already make more than {limit} tokens"
        return None

    def _chunk_tokens(self, chunk: str) -> tuple[int, int]:
        """(tokens of the chunk, its longest piece in characters; 0 tokens when that is too long)."""
        text = self._normalizer.normalize_str(chunk) if self._normalizer is not None else chunk
        longest = max((len(p) for p, _ in self._pre.pre_tokenize_str(text)), default=0)
        if longest > MAX_PIECE_CHARS:
            return 0, longest  # refused: not worth tokenizing
        # Special-token strings as one id each: never more ids than the text gives as a chat's text.
        return len(self._tokenizer(chunk, add_special_tokens=False)["input_ids"]), longest
