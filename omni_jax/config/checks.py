"""The checks a pipeline config's values pass: each returns the normalised value or raises
`invalid(field, problem)`; the caller adds the location ("stage 'x'", "pipeline 'p', stages[i]
(x)") once, in one place."""

from __future__ import annotations

import difflib
import numbers
from typing import Any, Mapping, Sequence

import msgspec.structs

from ..engine.sampling_params import SamplingParams
from ..errors import ConfigError

def invalid(field: str, problem: str) -> ConfigError:
    return ConfigError(f"{field}: {problem}", field=field, problem=problem)


def is_int(x: Any) -> bool:
    # bool is an int subclass: `max_num_seqs: yes` must not pass as 1.
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def positive_int(field: str, value: Any) -> int:
    if not is_int(value) or value < 1:
        raise invalid(field, f"must be a positive integer, got {value!r}")
    return int(value)


def fraction(field: str, value: Any, *, optional: bool) -> float | None:
    if value is None and optional:
        return None
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not 0.0 < value <= 1.0:
        what = "null or a number" if optional else "a number"
        raise invalid(field, f"must be {what} in (0, 1], got {value!r}")
    return float(value)


def choice(field: str, value: Any, choices: Sequence[Any]) -> Any:
    if value not in choices or isinstance(value, bool):
        shown = ", ".join("null" if c is None else repr(c) for c in choices)
        raise invalid(field, f"must be one of {shown}, got {value!r}")
    return value


def int_tuple(field: str, value: Any, *, increasing: bool, minimum: int) -> tuple[int, ...]:
    """A list of ints >= minimum; strictly increasing when `increasing`, else distinct."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise invalid(field, f"must be a list of integers, got {value!r}")
    for v in value:
        if not is_int(v) or v < minimum:
            need = "positive integers" if minimum == 1 else f"integers >= {minimum}"
            raise invalid(field, f"must contain only {need}, got {v!r} in {list(value)!r}")
    out = tuple(int(v) for v in value)
    if increasing and any(a >= b for a, b in zip(out, out[1:])):
        raise invalid(field, f"must be strictly increasing, got {list(out)!r}")
    if not increasing and len(set(out)) != len(out):
        raise invalid(field, f"must not repeat a value, got {list(out)!r}")
    return out


def buckets(field: str, value: Any, *, reach: int, reach_name: str) -> tuple[int, ...]:
    out = int_tuple(field, value, increasing=True, minimum=1)
    if not out:
        raise invalid(field, "must not be empty (use null for the default buckets)")
    # A step larger than the last bucket could not be padded to any compiled shape.
    if out[-1] < reach:
        raise invalid(field, f"the last bucket ({out[-1]}) must be >= {reach_name} ({reach}), "
                              f"got {list(out)!r}")
    return out


def pow2_up_to(minimum: int, maximum: int) -> tuple[int, ...]:
    """minimum, 2*minimum, ... and finally `maximum` itself (as engine.buckets.pow2_buckets)."""
    out, b = [], minimum
    while b < maximum:
        out.append(b)
        b *= 2
    return (*out, maximum)


def suggest(key: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    return f" (did you mean {close[0]}?)" if close else f" (known fields: {', '.join(known)})"


def check_keys(d: Mapping[str, Any], known: Sequence[str]) -> None:
    for key in d:
        if not isinstance(key, str):
            raise invalid(repr(key), "field names must be strings")
        if key not in known:
            raise invalid(key, "unknown field" + suggest(key, known))


def _sampling_field_names() -> tuple[str, ...]:
    return tuple(f.name for f in msgspec.structs.fields(SamplingParams))


def default_sampling(value: Any) -> dict[str, Any]:
    field = "default_sampling"
    if not isinstance(value, Mapping):
        raise invalid(field, f"must be a mapping of SamplingParams fields, got {value!r}")
    names = _sampling_field_names()
    for key in value:
        if key not in names:
            problem = f"unknown SamplingParams field {key!r}" + suggest(str(key), names)
            raise invalid(field, problem)
    try:
        SamplingParams(**value)
    except (ValueError, TypeError) as e:
        raise invalid(field, str(e)) from None
    return dict(value)
