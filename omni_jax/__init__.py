"""OmniJax: serve Qwen-Omni models (text, image, audio, video in; text and speech out) with JAX."""

from .checkpoint import load_checkpoint

__all__ = ["load_checkpoint"]
