"""Shape buckets: the fixed sizes every jitted step is compiled for.

Inputs are padded up to the next bucket so that, after warm-up, no step ever
compiles again (JAX's counterpart of CUDA graphs).
"""

from __future__ import annotations

import bisect
from typing import Sequence


def pow2_buckets(minimum: int, maximum: int) -> tuple[int, ...]:
    """minimum, 2*minimum, ... up to and including `maximum` (added if not a power step)."""
    if minimum < 1 or maximum < minimum:
        raise ValueError(f"bad bucket range [{minimum}, {maximum}]")
    out, b = [], minimum
    while b < maximum:
        out.append(b)
        b *= 2
    out.append(maximum)
    return tuple(out)


def pick_bucket(n: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= n; a clear error when n exceeds the largest."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"size {n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]
