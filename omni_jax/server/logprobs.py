"""Token log probabilities in OpenAI's shapes: chat's and a transcription's entries
(`token_logprobs`), and the legacy completions' four lists (`CompletionLogprobs`)."""

from __future__ import annotations


def _text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)


def token_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict], top_n: int | None) -> list[dict]:
    """Per token its text, logprob, UTF-8 bytes and the `top_n` alternatives (None: no
    `top_logprobs` key, as a transcription's entries)."""
    def entry(token_id: int, logprob: float) -> dict:
        text = _text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    out = []
    for token_id, lp in zip(token_ids, logprobs):
        e = entry(token_id, lp[token_id].logprob)
        if top_n is not None:
            top = sorted(((t, v) for t, v in lp.items() if v.rank <= top_n), key=lambda tv: tv[1].rank)
            e["top_logprobs"] = [entry(t, v.logprob) for t, v in top]
        out.append(e)
    return out


class CompletionLogprobs:
    """A completion choice's `logprobs`, built as its tokens come: `tokens` (their texts),
    `token_logprobs`, `top_logprobs` (text -> logprob of the top `top_n` and the token itself)
    and `text_offset` (where each token's text starts in the choice's text). A position without
    logprobs (a prompt's first token) has None in both."""

    def __init__(self, tokenizer, top_n: int):
        self.tokenizer, self.top_n = tokenizer, top_n
        self.offset = 0

    def add(self, token_ids: list[int], logprobs: list[dict | None]) -> dict:
        """The four lists of these tokens, their offsets following the tokens added before."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, lp in zip(token_ids, logprobs):
            text = _text(self.tokenizer, token_id)
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
            if lp is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(lp[token_id].logprob)
            top = sorted((v.rank, t, v.logprob) for t, v in lp.items() if v.rank <= self.top_n or t == token_id)
            out["top_logprobs"].append({_text(self.tokenizer, t): logprob for _, t, logprob in top})
        return out
