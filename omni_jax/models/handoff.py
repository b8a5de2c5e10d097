"""Shared plumbing of the families' stage-input functions (models/<family>/pipeline.py).

A stage whose input is another stage's output (talker, vocoder) collects that stage's
`StageData` for each request in an `UpstreamOutputs`; the family's handoff object builds the
stage's own request from it in the receiving stage's process, so hidden states never leave
the stages:

    handoff.stage_input(kind, control, upstream) -> AddRequest | None
    handoff.more_input(kind, control, upstream, have) -> (new rows or codes, complete)

Without async chunk the stage calls `stage_input` once, when the upstream request finished,
and gets the whole request. With async chunk it calls it on every arrival until it returns a
request (None: not enough yet), which then carries only what is final so far; `more_input`
gives what became final since (`have` = rows or codec tokens already given) and whether the
input is complete. Both paths compute every row with the same functions, so streaming
changes when a row is used, never its value.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
from tokenizers import Tokenizer

from ..errors import ConfigError
from ..engine.protocol import StageData


class PositionRows:
    """Rows by absolute position, received in pieces (a recompute after preemption resends
    positions, which overwrite); growing buffers, so each arrival costs its own size."""

    def __init__(self):
        self._buf: np.ndarray | None = None
        self._seen = np.zeros(0, bool)
        self.end = 0  # one past the highest position received

    def put(self, offset: int, rows: np.ndarray) -> None:
        end = offset + len(rows)
        if self._buf is None or end > len(self._buf):
            cap = max(64, 2 * end)
            buf = np.zeros((cap, *rows.shape[1:]), rows.dtype)
            seen = np.zeros(cap, bool)
            if self._buf is not None:
                buf[:len(self._buf)], seen[:len(self._seen)] = self._buf, self._seen
            self._buf, self._seen = buf, seen
        self._buf[offset:end] = rows
        self._seen[offset:end] = True
        self.end = max(self.end, end)

    def get(self, positions: np.ndarray | slice) -> np.ndarray:
        """The rows at `positions` (a copy); ValueError naming the first missing ones."""
        idx = np.arange(self.end)[positions] if isinstance(positions, slice) else np.asarray(positions, np.int64)
        ok = (idx < self.end) & self._seen[np.minimum(idx, len(self._seen) - 1)] if len(self._seen) else idx < 0
        if not ok.all():
            raise ValueError(f"hidden states are missing for positions {idx[~ok][:5].tolist()}...")
        return self._buf[idx]

    def __len__(self) -> int:
        return self.end


@dataclasses.dataclass
class UpstreamOutputs:
    """What a stage has received so far of one request's outputs in the stage before it."""

    token_ids: list[int] = dataclasses.field(default_factory=list)
    hidden: dict[int, PositionRows] = dataclasses.field(default_factory=dict)  # layer -> rows by position
    codes: PositionRows = dataclasses.field(default_factory=PositionRows)      # row k: token k's residual codes
    finished: bool = False
    finish_reason: str | None = None

    def add(self, data: StageData) -> None:
        """Append one step's data (arrays are copied: received ones are views of the frames)."""
        if data.codes is not None:
            # Residual codes come one row per new token, aligned with the tokens.
            self.codes.put(len(self.token_ids), np.asarray(data.codes))
        self.token_ids.extend(data.token_ids)
        for layer, rows in (data.hidden_states or {}).items():
            self.hidden.setdefault(layer, PositionRows()).put(data.hidden_offset, np.asarray(rows, np.float32))
        if data.finished:
            self.finished, self.finish_reason = True, data.finish_reason

    @classmethod
    def complete(cls, token_ids, hidden: dict | None = None, codes: list | None = None) -> "UpstreamOutputs":
        """A finished request's outputs at once: hidden as layer -> [(position, rows)] pieces and
        codes as per-step arrays, the shapes an engine's outputs come in (tests, benchmarks)."""
        up = cls(token_ids=list(token_ids), finished=True, finish_reason="stop")
        for layer, pieces in (hidden or {}).items():
            rows = up.hidden.setdefault(layer, PositionRows())
            for offset, r in pieces:
                rows.put(offset, np.asarray(r, np.float32))
        if codes:
            up.codes.put(0, np.concatenate(codes))
        return up


def reply_rows(token_ids: list[int], finished: bool, eos_ids, rows_at_sampling: bool = False) -> tuple[int, bool]:
    """How many of the talker's per-step reply rows are final, and whether the reply is complete.

    Both families feed the talker one row per step after its prompt: row j comes from the
    thinker's generated token j + 1 (j < m - 1), row m - 1 is the text-end row, later rows
    the pad row, where m = min(first eos index, N - 1) (at least 1) for N generated tokens:
    the last token is never fed back, and nothing after an eos is spoken. While the thinker
    runs (not `finished`, no eos yet), its tokens so far are not the last, so row j is final
    once token j + 1 and the row's hidden state exist: a hidden state computed when the token
    is fed back comes with token j + 2 (N > j + 2); `rows_at_sampling` (the row is the token's
    input embedding, sent with it: engine/ar_engine.py) with token j + 1 (N > j + 1).
    Returns (number of token rows final so far, complete); once complete the text-end row
    follows them.
    """
    gen = np.asarray(token_ids)
    eos = np.flatnonzero(np.isin(gen, list(eos_ids))) if len(gen) else np.zeros(0, int)
    if eos.size:
        return max(int(eos[0]), 1) - 1, True
    if finished:
        return max(len(gen) - 1, 1) - 1, True
    return max(len(gen) - (1 if rows_at_sampling else 2), 0), False


def assistant_turn_ids(ckpt_dir: str) -> tuple[int, ...] | None:
    """The token ids of "<|im_start|>assistant\\n" by the checkpoint's own tokenizer (None if
    it has none: a token-id-only checkpoint has no chat turns to find)."""
    path = os.path.join(ckpt_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    return tuple(Tokenizer.from_file(path).encode("<|im_start|>assistant\n", add_special_tokens=False).ids)


def reply_start(prompt: np.ndarray, turn_ids: tuple[int, ...] | None, media_ids=()) -> int:
    """Where the spoken reply begins in a thinker prompt: after its last assistant turn start
    when the prompt ends inside that turn (the reply was begun in the prompt, as the speech
    endpoint does with the text to say), else at the end of the prompt. A turn holding media or
    a later turn's start is not a begun reply."""
    p = len(prompt)
    if not turn_ids or p < len(turn_ids):
        return p
    k = len(turn_ids)
    windows = np.lib.stride_tricks.sliding_window_view(prompt, k)
    starts = np.flatnonzero((windows == np.asarray(turn_ids)).all(axis=1))
    if starts.size == 0:
        return p
    a = int(starts[-1]) + k
    if np.isin(prompt[a:], [turn_ids[0], *media_ids]).any():
        return p
    return a


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
