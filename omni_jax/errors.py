"""Errors users see, each naming what is wrong."""

from __future__ import annotations

from typing import Any, Mapping


class CheckpointError(ValueError):
    """A checkpoint (HF or converted) is missing, damaged, or does not match the model."""


class ConfigKeyError(CheckpointError):
    """A value the model needs is missing from the checkpoint's config (never replaced by a built-in number)."""


def require(d: Mapping[str, Any], *keys: str, section: str) -> Any:
    """`d[key]` for the first of `keys` present (HF renamed some between versions), else
    ConfigKeyError naming the keys and the config section; the loader adds the file."""
    for key in keys:
        if key in d and d[key] is not None:
            return d[key]
    names = " or ".join(repr(k) for k in keys)
    raise ConfigKeyError(f"{section}: missing {names}")
