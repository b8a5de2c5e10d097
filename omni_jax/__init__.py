"""OmniJax: serve Qwen-Omni models (text, image, audio, video in; text and speech out) with JAX."""

import os

# OmniJax takes only tokenizers and processors from transformers, never its models: its advice,
# on import without torch, that "models won't be available" would only confuse (the demo's
# output stays clean on a machine without torch). Other advisory warnings are off with it.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from .checkpoint import load_checkpoint
from .engine.sampling_params import SamplingParams, StructuredOutputs
from .inputs.reasoning import ThinkTags, split_reasoning
from .inputs.tool_calls import ToolCall, call_grammar, read_tool_calls
from .runtime.outputs import Logprob, OmniRequestOutput

__all__ = ["OmniJax", "AsyncOmniJax", "SamplingParams", "StructuredOutputs", "OmniRequestOutput", "Logprob",
           "ToolCall", "call_grammar", "read_tool_calls", "ThinkTags", "split_reasoning", "load_checkpoint"]


def __getattr__(name):
    if name in ("OmniJax", "AsyncOmniJax"):
        # The front ends pull in ZMQ and the process machinery: imported on first use.
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'omni_jax' has no attribute {name!r}")
