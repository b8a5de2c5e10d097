"""Turn a user prompt into what the first stage needs, in the caller's process.

Accepted prompt forms (as vLLM):
* a plain string: the raw prompt, tokenized as is (no chat template);
* {"prompt_token_ids": [...]}: already tokenized;
* {"prompt": str} or {"prompt_token_ids": ...} with "multi_modal_data": a
  `MultiModalPayload` of processed encoder inputs;
* {"messages": [...]}: chat messages, rendered with the checkpoint's chat template
  (text content; media parts arrive with the omni inputs issue).
Every problem raises `PromptError` naming it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


class PromptError(ValueError):
    """A prompt cannot be turned into model inputs: the message says why."""


@dataclasses.dataclass
class ProcessedPrompt:
    """Token ids (int32) and the encoder inputs of one prompt."""

    prompt_token_ids: np.ndarray
    multi_modal: Any = None


class InputProcessor:
    """Prompt -> ProcessedPrompt for one checkpoint (its tokenizer and chat template)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    def _need_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise PromptError(f"{what} needs a tokenizer, and this checkpoint has none; "
                              f"pass {{'prompt_token_ids': [...]}} instead")
        return self.tokenizer

    def _encode(self, text: str) -> np.ndarray:
        ids = self._need_tokenizer("a text prompt")(text, add_special_tokens=False)["input_ids"]
        return np.asarray(ids, np.int32)

    def render_chat(self, messages: list) -> str:
        """The chat template applied to text-only messages, with the assistant turn opened."""
        tok = self._need_tokenizer("a chat prompt")
        if not isinstance(messages, list) or not messages:
            raise PromptError("'messages' must be a non-empty list of {'role', 'content'} dicts")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise PromptError(f"messages[{i}] must be a dict with 'role' and 'content'")
            content = m["content"]
            if isinstance(content, list):
                for j, part in enumerate(content):
                    if not isinstance(part, dict) or part.get("type") != "text":
                        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                        raise PromptError(f"messages[{i}].content[{j}]: {kind!r} parts are not supported yet; "
                                          f"pass processed media in 'multi_modal_data'")
            elif not isinstance(content, str):
                raise PromptError(f"messages[{i}].content must be a string or a list of parts")
        return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def process(self, prompt: Any) -> ProcessedPrompt:
        """Validate and tokenize one prompt (see module docstring)."""
        mm = None
        if isinstance(prompt, str):
            ids = self._encode(prompt)
        elif isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "messages", "multi_modal_data"}
            if unknown:
                raise PromptError(f"unknown prompt key(s) {sorted(unknown)}; use 'prompt', "
                                  f"'prompt_token_ids', 'messages' or 'multi_modal_data'")
            given = [k for k in ("prompt", "prompt_token_ids", "messages") if k in prompt]
            if len(given) != 1:
                raise PromptError(f"a prompt dict needs exactly one of 'prompt', 'prompt_token_ids', "
                                  f"'messages'; got {given or 'none'}")
            if "messages" in prompt:
                ids = self._encode(self.render_chat(prompt["messages"]))
            elif "prompt" in prompt:
                if not isinstance(prompt["prompt"], str):
                    raise PromptError("'prompt' must be a string")
                ids = self._encode(prompt["prompt"])
            else:
                raw = prompt["prompt_token_ids"]
                try:
                    ids = np.asarray(raw)
                except Exception:
                    raise PromptError("'prompt_token_ids' must be a list of ints") from None
                if ids.size and (ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer)):
                    raise PromptError("'prompt_token_ids' must be a flat list of ints")
                ids = ids.astype(np.int32) if ids.size else np.zeros(0, np.int32)
            mm = prompt.get("multi_modal_data")
        else:
            raise PromptError(f"a prompt must be a string or a dict, got {type(prompt).__name__}")
        if ids.size == 0:
            raise PromptError("empty prompt")
        bad = (ids < 0) | (ids >= self.vocab_size)
        if bad.any():
            raise PromptError(f"token id {int(ids[bad][0])} is out of range [0, {self.vocab_size})")
        return ProcessedPrompt(ids, mm)
