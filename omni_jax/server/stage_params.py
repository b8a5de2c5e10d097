"""Request fields -> one SamplingParams per stage of the request's chain.

Stage defaults come from the pipeline config; `sampling_params_list` (vLLM-Omni's shape:
one dict of SamplingParams fields per stage, in chain order, null keeps the default) is
applied first, then the OpenAI fields of the request on top for the thinker.
"""

from __future__ import annotations

import re

from omni_jax import SamplingParams

from .errors import bad_request

_FIELD = re.compile(r"SamplingParams\.(\w+)")


def _updated(params: SamplingParams, changes: dict, param: str) -> SamplingParams:
    """params with changes, or a 400 naming the bad field (under `param`)."""
    try:
        return params.updated(**changes)
    except TypeError as e:
        raise bad_request(f"{param}: {e}", param) from None
    except ValueError as e:
        m = _FIELD.search(str(e))
        field = f"{param}.{m.group(1)}" if m and param.startswith("sampling_params_list") else (
            m.group(1) if m else param)
        raise bad_request(str(e), field) from None


def stage_params(defaults: list[SamplingParams], req, **thinker) -> list[SamplingParams]:
    """The per-stage params of a request (`defaults`: the chain's stage defaults); `thinker`:
    fields the handler sets on the first stage's on top of the request's (None: left as is)."""
    params = list(defaults)
    given = getattr(req, "sampling_params_list", None) or []
    if len(given) > len(params):
        raise bad_request(f"sampling_params_list has {len(given)} entries but this request runs "
                          f"{len(params)} stage(s)", "sampling_params_list")
    for i, changes in enumerate(given):
        if changes is not None:
            params[i] = _updated(params[i], changes, f"sampling_params_list[{i}]")
    top = {}
    for name in ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k",
                 "repetition_penalty", "min_tokens", "ignore_eos", "logit_bias"):
        value = getattr(req, name, None)
        if value is not None:
            top[name] = value
    max_tokens = getattr(req, "max_completion_tokens", None) or getattr(req, "max_tokens", None)
    if max_tokens is not None:
        top["max_tokens"] = max_tokens
    stop = getattr(req, "stop", None)
    if stop is not None:
        top["stop"] = [stop] if isinstance(stop, str) else stop
    top.update((k, v) for k, v in thinker.items() if v is not None)
    if top:
        params[0] = _updated(params[0], top, "")
    return params


def sample_params(params: list[SamplingParams], seed: int | None, j: int) -> list[SamplingParams]:
    """The params of a request's j-th sample (`n` > 1): a seeded request's sample j takes seed + j,
    as vLLM's, or every sample would be the same."""
    if j == 0 or seed is None:
        return params
    return [params[0].updated(seed=seed + j), *params[1:]]
