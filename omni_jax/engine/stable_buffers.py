"""Device buffers that keep their addresses from step to step, and why.

On a GPU a jitted step runs as a CUDA graph (XLA's command buffers). When a buffer the
graph reads or writes lies at another address than at the graph's last launch, XLA records
every command of the graph again before launching it: on an H200, 3.9 ms of host time per
decode step of the Qwen3-Omni-30B-A3B thinker (~800 commands), more than its kernels take.
Under async scheduling the previous step's inputs and outputs are still alive when the next
step is launched, so without care every one of them moves every step. Hence:

* inputs: a step's integer inputs (token ids, positions, slot mapping, block tables, KV and
  query lengths, logits rows) are packed on the host into one array (`IntLayout`), copied by a
  one-kernel program (`into`, `upload_fed`; too small for a graph) into a buffer kept per
  step shape and donated to that copy each time, so the step always reads the same buffer;
* outputs: a decode step writes its logits and hidden rows over those of the last decode step
  of its bucket, donated to it (`into`) once the engine has released them
  (`ModelRunner.release`).

A donated buffer is only written after the work already queued that reads it (one stream),
so a sampler launched on the last step's logits still reads them first. The step's
temporaries, which XLA allocates per call, are kept in place by XLA itself where it can
(`jitted.stable_temporaries`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class StepInts(NamedTuple):
    """A step's integer inputs: views of one packed array (numpy on the host, traced in the step)."""

    token_ids: np.ndarray       # [T] (a step fed on the device: rows of the tokens it is fed)
    positions: np.ndarray       # [3, T] M-RoPE positions
    slot_mapping: np.ndarray    # [T]
    block_tables: np.ndarray    # [S, W]
    kv_lens: np.ndarray         # [S]
    cu_q_lens: np.ndarray       # [S + 1]
    logits_indices: np.ndarray  # [S] the packed token of each logits row
    num_decodes: np.ndarray     # [] leading one-token sequences (read by prefill steps only)


@dataclasses.dataclass(frozen=True)
class IntLayout:
    """Where each of a step shape's integer inputs lies in its packed array (a static
    argument of the step: one per bucket)."""

    decode: bool
    tokens: int  # T: padded tokens
    seqs: int    # S: sequence slots
    width: int   # W: block table width

    @functools.cached_property
    def _segments(self) -> tuple[tuple[int, int, tuple[int, ...]], ...]:
        """(start, end, shape) of each input, worked out once per layout (not every step)."""
        t, s = self.tokens, self.seqs
        out, start = [], 0
        for shape in ((t,), (3, t), (t,), (s, self.width), (s,), (s + 1,), (s,), ()):
            n = int(np.prod(shape))
            out.append((start, start + n, shape))
            start += n
        return tuple(out)

    @property
    def size(self) -> int:
        return self._segments[-1][1]

    def views(self, flat) -> StepInts:
        """The inputs as views of `flat` [size] (writable ones of a numpy array)."""
        return StepInts(*(flat[a:b].reshape(shape) for a, b, shape in self._segments))

    def new(self) -> tuple[np.ndarray, StepInts]:
        """A zeroed packed array and its views, to fill."""
        flat = np.zeros(self.size, np.int32)
        return flat, self.views(flat)


def into(buf: jax.Array, value: jax.Array) -> jax.Array:
    """`value` written over all of `buf` (donated): the result has `buf`'s address."""
    return jax.lax.dynamic_update_slice(buf, value.astype(buf.dtype), (0,) * buf.ndim)


def upload_fed(buf: jax.Array, ints: jax.Array, fed: jax.Array, *, tokens: int) -> jax.Array:
    """`into` of a step scheduled ahead: its token ids are rows (`ints[:tokens]`) of the
    tokens the step before sampled, still on the device."""
    return into(buf, ints.at[:tokens].set(jnp.take(fed, ints[:tokens], axis=0)))
