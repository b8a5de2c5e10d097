"""Prompts into token ids, in the caller's process: what both model families share.

A family's rules (defaults, placeholders, audio token counts, the audio-in-video layout) are
its `models/<family>/processor.py`, a subclass of `processor.InputProcessor`; this package
holds the rest: the prompt's parts (`prompt_parts.py`), a chat's messages, tools and template
variables as the template reads them (`chat_messages.py`), the built-in chat template
(`chat_template.py`), function calls and a reasoning model's thinking read out of a reply
(`tool_calls.py`, `reasoning.py`), media loading with limits checked
before decoding (`media.py`), chat text that stays text (`chat_text.py`), a too-long text
refused in bounded time (`token_floor.py`), cancelled prompts stopping (`cancel.py`), the
M-RoPE walk (`rope_index.py`), the detokenizer's files (`detokenizer.py`) and the offline
tokenizers of the built-in tiny models (`qwen_tokenizer.py`). Every problem is a
`PromptError` naming it.
"""
