"""Function calls in a spoken reply: its words are spoken, its calls are not.

The talker speaks whatever the thinker writes, so a spoken reply with tools ends where the model
opens a call: Qwen's `<tool_call>` tag is a stop token of the spoken request's thinker. The calls
are then written by the thinker alone, on the same conversation continued with the words and the
tag (the prefix cache holds all of it but the words), held to the tools' schemas, within what is
left of max_tokens. Chat completions with audio and the realtime API speak so.
"""

from __future__ import annotations

from ..engine.sampling_params import SamplingParams
from ..inputs.tool_calls import OPEN, ToolCall, read_tool_calls
from .engine import ServedEngine
from .errors import bad_request
from .generation import open_request
from .tools import ToolUse


class SpokenCalls:
    """The calls of one spoken request with tools (module docstring)."""

    def __init__(self, engine: ServedEngine, tools: ToolUse, params: list[SamplingParams],
                 template_kwargs: dict | None = None):
        """`params`: the spoken request's, per stage; `self.params` are they with the tag a stop token.
        `template_kwargs`: the spoken request's chat_template_kwargs (its calls' prompt has them too)."""
        self.engine, self.tools, self.template_kwargs = engine, tools, template_kwargs
        self.tag = engine.omni.tokenizer.convert_tokens_to_ids(OPEN)
        if not isinstance(self.tag, int) or engine.omni.tokenizer.convert_ids_to_tokens(self.tag) != OPEN:
            raise bad_request(f"this model's tokenizer has no {OPEN} token, so a spoken reply cannot make calls; "
                              f"ask for a text reply", "tools")
        thinker = params[0]
        self.params = [thinker.updated(stop_token_ids=(*thinker.stop_token_ids, self.tag)), *params[1:]]
        # the calls follow the words, so any thinking is over: their grammar holds from the first token
        self._calls = thinker.updated(structured_outputs=tools.call_constraint(), min_tokens=0, reasoning_tokens=None,
                                      thinking_token_budget=None)

    def opened(self, out) -> bool:
        """Whether the spoken reply stopped where the model opened a call."""
        return out.finish_reason == "stop" and bool(out.token_ids) and out.token_ids[-1] == self.tag

    async def write(self, messages: list[dict], spoken, request_id: str, request=None) -> tuple[object, list[ToolCall]]:
        """The calls the `spoken` reply (its finished output) to `messages` opened: the calls'
        request's last output, and the calls (none if it failed)."""
        params = self._calls
        if params.max_tokens is not None:
            params = params.updated(max_tokens=max(params.max_tokens - len(spoken.token_ids), 1))
        said = spoken.text.removesuffix(OPEN)  # its words as written (the tag's text, if decoded, off)
        # the spoken request's conversation: its prompt had the speech system prompt, if any
        begun = [*self.engine.omni.processor.speech_messages(messages), {"role": "assistant", "content": said + OPEN}]
        prompt = {"messages": begun, "continue_final_message": True, "tools": self.tools.tools}
        if self.template_kwargs is not None:
            prompt["chat_template_kwargs"] = self.template_kwargs
        gen = await open_request(self.engine, prompt, [params], ["text"], None, request_id, request=request)
        text, out = OPEN, None
        try:
            async for out in gen.updates():
                text += out.text_delta
        finally:
            await gen.close()  # a cancel aborts it too
        return out, [] if out.error else read_tool_calls(text)[1]
