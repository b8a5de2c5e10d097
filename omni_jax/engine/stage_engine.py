"""`StageEngine`: what a stage process asks of its engine (`runtime/stage_loop.py`), and all it may.

Two engines provide it: `AREngine` (`ar_engine.py`: thinker and talker, token by token with a
paged KV cache) and `OneShotEngine` (`oneshot_engine.py`: the vocoders, one call per request or
per streamed window). The family's builders (`models/<family>/stages.py`) return one of them.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, runtime_checkable

from .protocol import StageOutput


@runtime_checkable
class StageEngine(Protocol):
    """One stage's engine, driven by one loop: requests in, `step()` until none is unfinished."""

    stats: Mapping[str, float]  # counters for health replies ("failed_steps" among them)

    def add_request(self, request_id: str, prompt_token_ids: Any, sampling_params: Any = None,
                    **inputs: Any) -> None:
        """Queue a request (keyword inputs: `runtime.stage_loop.to_engine_request`); a
        `RequestError` (a ValueError) says why one cannot be served, and nothing is queued."""

    def extend_request(self, request_id: str, more: Any, complete: bool) -> bool:
        """More input for a streamed request (async chunk); False for one it no longer has."""

    def abort(self, request_id: str) -> bool:
        """Drop a request and free what it holds; False if it was not there."""

    def has_unfinished(self) -> bool:
        """Whether a `step()` has work."""

    def step(self) -> list[StageOutput]:
        """Run one step; the outputs of the requests it advanced (a failed step fails its requests)."""

    def warmup(self, progress: bool = True) -> float:
        """Compile every bucket before serving; the seconds it took."""

    @property
    def num_compilations(self) -> int:
        """XLA compilations in this process (constant after warm-up)."""
