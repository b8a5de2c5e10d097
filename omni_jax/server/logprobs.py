"""Token log probabilities in OpenAI's shape (chat's `logprobs.content`, a transcription's `logprobs`)."""

from __future__ import annotations


def token_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict], top_n: int | None) -> list[dict]:
    """Per token its text, logprob, UTF-8 bytes and the `top_n` alternatives (None: no
    `top_logprobs` key, as a transcription's entries)."""
    def entry(token_id: int, logprob: float) -> dict:
        text = tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    out = []
    for token_id, lp in zip(token_ids, logprobs):
        e = entry(token_id, lp[token_id].logprob)
        if top_n is not None:
            top = sorted(((t, v) for t, v in lp.items() if v.rank <= top_n), key=lambda tv: tv[1].rank)
            e["top_logprobs"] = [entry(t, v.logprob) for t, v in top]
        out.append(e)
    return out
