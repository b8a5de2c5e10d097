"""OmniJax: serve Qwen-Omni models (text, image, audio, video in; text and speech out) with JAX."""

from .checkpoint import load_checkpoint
from .engine.sampling import SamplingParams
from .runtime.orchestrator import Logprob, OmniRequestOutput

__all__ = ["OmniJax", "AsyncOmniJax", "SamplingParams", "OmniRequestOutput", "Logprob", "load_checkpoint"]


def __getattr__(name):
    if name in ("OmniJax", "AsyncOmniJax"):
        # The front ends pull in ZMQ and the process machinery: imported on first use.
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'omni_jax' has no attribute {name!r}")
