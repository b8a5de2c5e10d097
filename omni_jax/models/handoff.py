"""Shared plumbing of the families' stage-input functions (models/<family>/pipeline.py).

A stage whose input is another stage's output (talker, vocoder) collects that stage's
`StageData` for each request in an `UpstreamOutputs`; once it is complete, the family's
handoff object builds the stage's own request from it (`handoff.stage_input(kind, control,
upstream)`, in the receiving stage's process), and the hidden states never leave the stages.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..config import ConfigError
from ..engine.protocol import StageData


@dataclasses.dataclass
class UpstreamOutputs:
    """What a stage has received so far of one request's outputs in the stage before it."""

    token_ids: list[int] = dataclasses.field(default_factory=list)
    hidden: dict[int, list[tuple[int, np.ndarray]]] = dataclasses.field(default_factory=dict)  # layer -> pieces
    codes: list[np.ndarray] = dataclasses.field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None

    def add(self, data: StageData) -> None:
        """Append one step's data (arrays are copied: received ones are views of the frames)."""
        self.token_ids.extend(data.token_ids)
        if data.codes is not None:
            self.codes.append(np.array(data.codes))
        for layer, rows in (data.hidden_states or {}).items():
            # (position, rows): a recompute after preemption sends the same positions again.
            self.hidden.setdefault(layer, []).append((data.hidden_offset, np.array(rows)))
        if data.finished:
            self.finished, self.finish_reason = True, data.finish_reason


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
