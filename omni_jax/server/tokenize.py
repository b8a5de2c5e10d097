"""POST /tokenize and /detokenize (vLLM's): a prompt's token ids as the thinker receives them, and
the text of token ids.

A prompt is processed as a request's would be (`generation.prepare`: the prompt workers, the
media limits, the chat template; an image or audio part counts its placeholder tokens), so
`count` is what a request with the same prompt takes of `max_model_len`.
"""

from __future__ import annotations

import asyncio

from fastapi import Request

from .engine import ServedEngine
from .errors import bad_request
from .generation import check_model, prepare
from .messages import MediaPolicy, to_prompt
from .schemas import DetokenizeRequest, TokenizeRequest
from .tools import tool_use

MODALITIES = ["text"]


class TokenizeHandler:
    """Serves /tokenize and /detokenize on one engine."""

    def __init__(self, engine: ServedEngine, policy: MediaPolicy):
        self.engine, self.policy = engine, policy

    async def tokenize(self, req: TokenizeRequest, request: Request) -> dict:
        check_model(self.engine, req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give either prompt (a text) or messages (a chat)", "prompt")
        if req.messages is not None and not req.add_generation_prompt:
            raise bad_request("add_generation_prompt false is not supported: a chat prompt always opens the "
                              "assistant's turn here", "add_generation_prompt", "unsupported_parameter")
        for name in ("tools", "chat_template_kwargs"):
            if getattr(req, name) is not None and req.messages is None:
                raise bad_request(f"{name} go with messages (a chat's prompt carries them)", name)
        if req.prompt is not None:
            prepared = await prepare(self.engine, req.prompt, MODALITIES, request, prompt_param="prompt")
        else:
            prompt = to_prompt(req.messages, self.policy, template_kwargs=req.chat_template_kwargs)
            tools = tool_use(req.tools, None).tools
            if tools is not None:
                prompt["tools"] = tools
            prepared = await prepare(self.engine, prompt, MODALITIES, request)
        ids = prepared.processed.prompt_token_ids.tolist()
        strs = self.engine.omni.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": max_model_len(self.engine), "tokens": ids, "token_strs": strs}

    async def detokenize(self, req: DetokenizeRequest) -> dict:
        check_model(self.engine, req.model)
        tokenizer = self.engine.omni.tokenizer
        bad = [t for t in req.tokens if not 0 <= t < len(tokenizer)]
        if bad:
            raise bad_request(f"tokens: {bad[0]} is not a token id of this model (0 to {len(tokenizer) - 1})",
                              "tokens")
        return {"prompt": await asyncio.to_thread(tokenizer.decode, req.tokens)}


def max_model_len(engine: ServedEngine) -> int:
    """The longest sequence (prompt + reply) the first stage takes."""
    return engine.omni.pipeline.stage(engine.stage_names(MODALITIES)[0]).max_model_len
