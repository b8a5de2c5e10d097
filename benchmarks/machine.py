"""What a benchmark prints about the machine it ran on, beside its figures."""

from __future__ import annotations


def cpu_model() -> str:
    """The CPU's model name (figures on an AVX2-only EPYC and an AVX-512 Intel differ)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"
