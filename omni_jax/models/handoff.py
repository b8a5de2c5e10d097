"""Shared plumbing of the families' stage-input functions (models/<family>/pipeline.py).

A family's `make_router` returns the orchestrator's `route(request, from_stage, to_stage)`;
what differs per family is how each next-stage request is built, given the request, what
the previous stage produced (its accumulated outputs) and the next stage's sampling
params. `kind_router` does the dispatch on the next stage's model kind.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..config import ConfigError
from ..engine.protocol import AddRequest


def assemble_hidden(chunks: list[tuple[int, np.ndarray]]) -> np.ndarray:
    """Rows sent in (position, rows) pieces -> one array; resent positions overwrite."""
    end = max(off + len(rows) for off, rows in chunks)
    out = np.zeros((end, chunks[0][1].shape[1]), np.float32)
    seen = np.zeros(end, bool)
    for off, rows in chunks:
        out[off:off + len(rows)] = rows
        seen[off:off + len(rows)] = True
    if not seen.all():
        raise ValueError(f"thinker hidden states are missing for positions {np.flatnonzero(~seen)[:5].tolist()}...")
    return out


def media_positions(text_ids: np.ndarray, mm, rope_index, **kw) -> tuple[np.ndarray | None, int]:
    """M-RoPE positions of a next-stage prompt given the request's media (`MultiModalPayload`)
    through the family's `rope_index(ids, image_grid_thw=..., ...)`; (None, 0) without media."""
    if mm is None:
        return None, 0
    lens = np.array([a.shape[1] for a in mm.audio_features], np.int64) if mm.audio_features else None
    positions, delta = rope_index(text_ids, image_grid_thw=mm.image_grid_thw, video_grid_thw=mm.video_grid_thw,
                                  audio_seqlens=lens, second_per_grids=mm.video_second_per_grid,
                                  use_audio_in_video=mm.use_audio_in_video, **kw)
    return positions.astype(np.int32), int(delta)


def require_thinker_layers(pipeline, layers: set[int], why: str) -> None:
    """ConfigError unless every thinker stage returns the hidden `layers` the talker needs."""
    for s in pipeline.stages:
        if (s.model_stage or s.name) == "thinker" and not layers <= set(s.hidden_layers):
            raise ConfigError(f"stage {s.name!r}: hidden_layers must include {sorted(layers)} ({why}), "
                              f"got {list(s.hidden_layers)}")


def kind_router(pipeline, builders: dict[str, Callable[..., AddRequest]]):
    """route(req, from_stage, to_stage) calling `builders[kind of to_stage](req, outputs, params)`."""
    kinds = {s.name: (s.model_stage or s.name) for s in pipeline.stages}

    def route(req, from_stage: str, to_stage: str) -> AddRequest:
        build = builders.get(kinds[to_stage])
        if build is None:
            raise ValueError(f"no route from {from_stage!r} to {to_stage!r}")
        return build(req, req.stage_outputs[from_stage], req.stage_params[req.chain.index(to_stage)])

    return route
