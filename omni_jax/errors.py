"""Errors users see, each naming what is wrong."""


class CheckpointError(ValueError):
    """A checkpoint (HF or converted) is missing, damaged, or does not match the model."""
