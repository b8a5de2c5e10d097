"""The tokenizer a stage decodes its replies with, read from a converted checkpoint."""

from __future__ import annotations

import json
import os

from tokenizers import AddedToken, Tokenizer


def load_tokenizer(ckpt_dir: str):
    """The stage's detokenizer (it only decodes), or None when the checkpoint has no tokenizer.

    `tokenizer.json` is read with the `tokenizers` library, the one transformers' fast
    tokenizers wrap, with the tokens transformers marks special marked so: importing
    transformers also imports torch, seconds of every thinker start. transformers decodes
    what only it handles (slow-tokenizer files, cleaning up tokenization spaces).
    """
    fast, config_path = os.path.join(ckpt_dir, "tokenizer.json"), os.path.join(ckpt_dir, "tokenizer_config.json")
    config = {}
    if os.path.isfile(config_path):
        with open(config_path) as f:
            config = json.load(f)
    if os.path.isfile(fast) and not config.get("clean_up_tokenization_spaces"):
        tokenizer = Tokenizer.from_file(fast)
        specials = [t for t in _special_tokens(config) if tokenizer.token_to_id(t) is not None]
        tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        return tokenizer
    if not os.path.isfile(fast) and not os.path.isfile(os.path.join(ckpt_dir, "vocab.json")):
        return None
    # Slow-tokenizer files or space clean-up: transformers' own tokenizer (imports torch).
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ckpt_dir)


# tokenizer_config.json keys naming one special token each (transformers' SPECIAL_TOKENS_ATTRIBUTES).
_NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _special_tokens(config: dict) -> set[str]:
    """The tokens `tokenizer_config.json` declares special (skip_special_tokens drops them)."""
    def text(t):
        return t if isinstance(t, str) else t.get("content") if isinstance(t, dict) else None

    def many(v):
        return list(v.values()) if isinstance(v, dict) else list(v or [])

    found = [t for t in config.get("added_tokens_decoder", {}).values() if t.get("special")]
    found += [config.get(k) for k in _NAMED_SPECIALS]
    for key in ("extra_special_tokens", "additional_special_tokens", "model_specific_special_tokens"):
        found += many(config.get(key))
    return {text(t) for t in found} - {None}
