"""ModelRunner: host-side input preparation and the jitted prefill/decode steps of one stage.

Per step the scheduler hands over a list of `ScheduledChunk`s (request, first position,
token count, whether a token is sampled; its `ScheduledRequest`s are ones). The runner packs
them into flat numpy arrays (token ids, 3-row M-RoPE positions, slot mapping, block tables,
query start offsets, logits indices: `StepInputs`, packed into one integer array), pads them
to a shape bucket and calls one of two jitted functions:

* prefill: a packed batch of chunks (T tokens, up to `max_num_seqs` sequences) through
  the ragged paged-attention path, compiled per token bucket;
* decode: one token per sequence through the paged decode path, compiled per batch bucket.

Each comes in a "plain" variant (token embeddings only) and, for stages that need it, a
"rich" one that overlays per-token embeddings (encoder features, prompt embeddings) and
adds per-step extra embeddings (the talker's thinker reply part). Stages whose model takes
DeepStack features (Qwen3-Omni thinker: `deepstack_layers` > 0) also get a "deepstack"
prefill variant, used only by steps that hold visual prompt tokens. The KV cache is donated,
so pages are updated in place. Sampling is a third jitted function over the logits,
which never leave the device. Stages whose model defines `after_sample` (Qwen3-Omni's
talker: its code predictor) also get the hidden state of every sampled row back and a
fourth jitted function, run on the sampled tokens, whose per-row embedding is fed
into that token's input at the next step. Warm-up compiles every variant before serving.
The step's integer inputs and a decode step's outputs keep their device addresses from step
to step (`stable_buffers.py`: a CUDA graph whose buffers move is recorded again).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from kernels_pallas import page_dtype

from ..models.layers.attention import BACKENDS, AttentionMetadata, default_backend
from ..models.layers.parallel import TP, kv_heads_stored, use_mesh
from . import program_cache, sharding
from .buckets import pick_bucket, pow2_buckets
from .jitted import Jitted, stable_temporaries
from .protocol import Request
from .sampling import LogprobsOutput, token_logprobs
from .sampling_params import MAX_LOGPROBS
from .stable_buffers import IntLayout, into, upload_fed


# Block 0 of the KV pages is the dummy block: padding slots write into it, so the KV cache
# manager never hands it out.
DUMMY_BLOCK_ID = 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def compute_slot_mapping(
    block_tables: np.ndarray, req_indices: np.ndarray, positions: np.ndarray, block_size: int
) -> np.ndarray:
    """KV slot of each token: `block_tables[req, pos // block_size] * block_size + pos % block_size`.

    Vectorised over tokens; tokens with a negative request index (padding) map to the dummy
    block's slots.
    """
    req_indices = np.asarray(req_indices)
    positions = np.asarray(positions)
    pad = req_indices < 0
    rows = np.where(pad, 0, req_indices)
    cols = np.where(pad, 0, positions // block_size)
    slots = block_tables[rows, cols].astype(np.int64) * block_size + positions % block_size
    return np.where(pad, DUMMY_BLOCK_ID * block_size + positions % block_size, slots).astype(np.int32)


# ------------------------------------------------------------------ compile counter
class _CompileCounter:
    """Counts every XLA compilation in this process (jax monitoring events), and every
    executable loaded from JAX's persistent compilation cache instead: either is a program
    the warm-up missed."""

    EVENTS = ("/jax/core/compile/backend_compile_duration", "/jax/compilation_cache/cache_retrieval_time_sec")

    def __init__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
        if event in self.EVENTS:
            self.count += 1


_COUNTER: _CompileCounter | None = None


def compilation_count() -> int:
    """Number of XLA compilations so far in this process."""
    global _COUNTER
    if _COUNTER is None:
        _COUNTER = _CompileCounter()
    return _COUNTER.count


compilation_count()  # start counting at import


# ------------------------------------------------------------------ configuration
@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    """Sizes of one stage's KV cache and step shapes (the one place of their defaults: the
    scheduler's and the stage config's refer to these)."""

    num_blocks: int | None = None                  # None: from kv_memory_fraction of free device memory
    block_size: int = 16
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    token_buckets: tuple[int, ...] | None = None   # prefill; default powers of two from 16
    decode_buckets: tuple[int, ...] | None = None  # decode batch sizes; default powers of two from 1
    backend: str | None = None                     # a key of BACKENDS; default from the platform
    capture_layers: tuple[int, ...] = ()           # hidden states returned per token (HF indexing)
    rich_inputs: bool = False                      # compile overlay/extra-embedding variants
    deepstack_layers: int = 0                      # DeepStack feature levels the model takes (0: none)
    after_sample: bool = False                     # run the model's after_sample hook on sampled tokens
    # Send each sampled token's input embedding as its layer-0 row at once (a next stage reading
    # those rows need not wait a step for the token to be fed back); needs 0 in capture_layers.
    sampled_embeddings: bool = False
    kv_dtype: Any = None                           # default: the model's dtype
    kv_memory_fraction: float = 0.9                # share of free device memory for KV, when num_blocks is None
    # Parallelism within the stage (engine/sharding.py): a Mesh ("ep", "tp") over these local
    # devices (None: the first TP * EP); TP = EP = 1 runs on the default device with no mesh.
    devices: tuple[int, ...] | None = None
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1

    def resolved(self) -> "RunnerConfig":
        tb = self.token_buckets or pow2_buckets(min(16, self.max_num_batched_tokens), self.max_num_batched_tokens)
        db = self.decode_buckets or pow2_buckets(1, self.max_num_seqs)
        if tb[-1] < self.max_num_batched_tokens:
            raise ValueError(f"token_buckets {tb} must reach max_num_batched_tokens {self.max_num_batched_tokens}")
        if db[-1] < self.max_num_seqs:
            raise ValueError(f"decode_buckets {db} must reach max_num_seqs {self.max_num_seqs}")
        backend = self.backend or default_backend()
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
        return dataclasses.replace(self, token_buckets=tuple(tb), decode_buckets=tuple(db), backend=backend)

    @property
    def max_blocks_per_seq(self) -> int:
        return cdiv(self.max_model_len, self.block_size)


def resolve_num_blocks(cfg: RunnerConfig, bytes_per_block: int, device=None) -> int:
    """KV blocks that fit `kv_memory_fraction` of the memory still free on `device` (default:
    the first), `bytes_per_block` being what one block takes on each device.

    On a device without memory stats (CPU) the pool holds max_num_seqs full-length
    sequences, which is what the scheduler can ever use. A stage over several processes takes
    the smallest count of theirs: they must schedule alike (runtime/spmd.py).
    """
    stats = (device or jax.local_devices()[0]).memory_stats() or {}
    limit = stats.get("bytes_limit")
    n = cfg.max_num_seqs * cdiv(cfg.max_model_len, cfg.block_size) + 1
    if limit:
        free = limit - stats.get("bytes_in_use", 0)
        fit = int(free * cfg.kv_memory_fraction) // bytes_per_block
        if fit < 2:
            raise ValueError(f"no device memory left for the KV cache ({free / 2**20:.0f} MiB free, "
                             f"{bytes_per_block / 2**20:.2f} MiB per block)")
        n = min(fit, n)
    if jax.process_count() > 1:
        n = int(multihost_utils.process_allgather(np.int64(n)).min())
    return n


@dataclasses.dataclass(slots=True)
class ScheduledChunk:
    """One request's share of a step: tokens [start, start + num_tokens) of all_token_ids.
    The scheduler's `ScheduledRequest` is one, with what the scheduler keeps besides."""

    request: Request
    start: int  # the chunk's first position: tokens already in the KV cache
    num_tokens: int
    needs_logits: bool  # the chunk ends at the last known token, so one token is sampled
    # >= 0: a decode scheduled ahead (async scheduling), whose token the previous step samples
    # for its entry at this index of the step's chunks, still on the device (see execute's `fed`)
    fed_by_row: int = -1


@dataclasses.dataclass
class StepResult:
    """Device results of one step, aligned with the scheduled chunks."""

    logits: jax.Array               # [S_pad, V] on device; rows [0, num_sampled) are real
    sample_hidden: jax.Array | None  # [S_pad, H] final hidden state of each logits row (after_sample stages)
    final_hidden: jax.Array | None   # [T_pad, H] final hidden state of every token, left on the device
    sample_rows: list[int]          # index into the step's chunks of each real logits row
    hidden: dict[int, np.ndarray]   # capture layer -> [num_real_tokens, H] on host (if asked)
    token_offsets: np.ndarray       # [len(chunk_indices) + 1] start of each chunk in the packed tokens
    kind: str                       # "prefill" | "decode"
    bucket: int
    chunk_indices: list[int]        # the scheduled chunks in packed order (token_offsets follow them)
    rows_in_order: bool = False     # sample_rows == range(len(chunks)): each chunk has a row, in order
    outputs: Any = None             # the step's device outputs, until released (`ModelRunner.release`)


@dataclasses.dataclass(slots=True)
class StepInputs:
    """One step's chunks packed and padded to a bucket (`ModelRunner.prepare`): the jitted step's
    inputs, and what `execute` needs to read its outputs back."""

    kind: str                      # "prefill" | "decode": the program that runs it
    bucket: int                    # padded tokens (prefill) or sequences (decode)
    layout: IntLayout              # where each integer input lies in `ints`
    ints: np.ndarray               # the integer inputs, packed (`views`); a step scheduled ahead
                                   # has rows of the tokens it is fed where its token ids go
    sample_rows: list[int]         # the chunk of each real logits row
    offsets: np.ndarray            # [num_chunks + 1] start of each chunk in the packed tokens
    total: int                     # real (unpadded) tokens
    rich: bool = False             # the variant with overlay / extra embedding rows
    overlay: np.ndarray | None = None       # [T_pad, H] rows replacing token embeddings (media, prompt embeds)
    overlay_mask: np.ndarray | None = None  # [T_pad] which rows the overlay replaces
    extra: np.ndarray | None = None         # [T_pad, H] rows added to the embeddings (a previous stage's)
    deepstack: bool = False        # the variant that adds DeepStack features
    deepstack_feats: np.ndarray | None = None  # [levels, T_pad, H]

    @property
    def views(self):
        """The integer inputs by name (`stable_buffers.StepInts`)."""
        return self.layout.views(self.ints)


def stage_mesh(cfg: RunnerConfig):
    """The stage's ("ep", "tp") mesh over cfg.devices, or None on one device. The stage builders
    call it too, to restore the checkpoint onto it (load_checkpoint's mesh): Mesh objects are
    interned, so theirs and the runner's are the same mesh."""
    return sharding.build_mesh(cfg.devices, cfg.tensor_parallel_size, cfg.expert_parallel_size)


# ------------------------------------------------------------------ the runner
class ModelRunner:
    """Owns the stage model's device state, its KV cache and the jitted steps."""

    def __init__(self, model: nnx.Module, cfg: RunnerConfig, *, num_layers: int, num_kv_heads: int,
                 head_dim: int, hidden_size: int, dtype=None):
        self.cfg = cfg.resolved()
        self.graphdef, self.state = nnx.split(model)
        # Several devices: parameters and KV pages placed over the stage's mesh (engine/sharding.py);
        # one device: no mesh, the programs are the single-device ones.
        self.mesh = stage_mesh(self.cfg)
        tp = 1
        if self.mesh is not None:
            sharding.check_kv_heads(self.mesh, num_kv_heads)
            self.state = sharding.shard_params(self.state, self.mesh, num_kv_heads)
            tp = int(self.mesh.shape[TP])
        # Where step inputs are committed (on_stage): replicated over the mesh, or the one device
        # the caller committed the parameters to; None: uncommitted, on the default device.
        self.placement = (sharding.replicated(self.mesh) if self.mesh is not None
                          else sharding.committed_device(self.state))
        if self.placement is None and program_cache.active() is not None:
            # A step read from the program cache returns committed outputs (as any exported
            # program's): commit every step input to the default device alike (on_stage).
            self.placement = jax.sharding.make_single_device_sharding(jnp.zeros(()).devices().pop())
        # The step takes the parameters as a flat list of arrays: flattening the NNX state
        # (one Variable node per parameter) on every call costs milliseconds of host time.
        self._param_leaves, self._param_def = jax.tree.flatten(self.state)
        self.hidden_size = hidden_size
        self.dtype = dtype or jax.tree_util.tree_leaves(self.state)[0].dtype
        stored_dtype = page_dtype(self.cfg.kv_dtype or self.dtype, self.cfg.backend)
        kv_heads = kv_heads_stored(num_kv_heads, tp)
        if self.cfg.num_blocks is None:
            per_block = 2 * num_layers * self.cfg.block_size * (kv_heads // tp) * head_dim * jnp.dtype(stored_dtype).itemsize
            first = (self.mesh.local_devices[0] if self.mesh is not None
                     else None if self.placement is None else next(iter(self.placement.device_set)))
            self.cfg = dataclasses.replace(self.cfg, num_blocks=resolve_num_blocks(self.cfg, per_block, first))
        shape = (self.cfg.num_blocks, self.cfg.block_size, kv_heads, head_dim)
        if self.mesh is None:
            self.kv_caches = [(jnp.zeros(shape, stored_dtype, device=self.placement),
                               jnp.zeros(shape, stored_dtype, device=self.placement)) for _ in range(num_layers)]
        else:
            # Made in place, shard by shard: never a whole cache on one device.
            zeros = jax.jit(lambda: jnp.zeros(shape, stored_dtype), out_shardings=sharding.kv_cache_sharding(self.mesh))
            self.kv_caches = [(zeros(), zeros()) for _ in range(num_layers)]
        self.kv_bytes = 2 * num_layers * int(np.prod(shape)) * jnp.dtype(stored_dtype).itemsize  # all devices
        self.jitted = Jitted(
            step=self.step_program(),
            upload=jax.jit(into, donate_argnums=0),
            upload_fed=jax.jit(upload_fed, donate_argnums=0, static_argnames=("tokens",)),
            after_sample=jax.jit(self._after_sample),
            embed=jax.jit(self._embed),
            prompt_logprobs=jax.jit(self._prompt_logprobs))
        self._decode_rows = None  # (requests, prompt lengths, position offsets) of the last decode step
        # stable_buffers.py: the integer inputs' layout and buffer of each step shape, the released outputs
        # of the last decode step of each bucket, and the decode outputs' shapes at bucket 1.
        self._layouts: dict[tuple[bool, int], IntLayout] = {}
        self._int_buffers: dict[IntLayout, jax.Array] = {}
        self._released: dict[int, Any] = {}
        self._decode_outputs = None
        # The parameter leaves the step reads (indices into _param_leaves) and those arrays: a
        # stage module may hold more (a thinker's media encoders, a talker's code predictor),
        # and every array handed to a jitted call costs host time (~0.8 us), read or not.
        self._step_params: list[int] | None = None
        self._step_leaves: list[jax.Array] | None = None

    def step_program(self, temporaries_in_place: bool = True):
        """The jitted step (also compiled by the GPU tier over a mesh: omni_jax/gpu/programs.py).
        The KV cache and the outputs of the step before are donated; its temporaries keep their
        addresses where XLA can (jitted.stable_temporaries; False: the GPU check's comparison)."""
        options = (stable_temporaries() or None) if temporaries_in_place else None
        static = ("layout", "rich", "deepstack")
        cache = program_cache.active()
        if cache is not None and self.mesh is None and temporaries_in_place:  # a restart skips its traces
            return cache.jit("step", self._forward, static_argnames=static, donate_argnums=(1, 2),
                             compiler_options=options)
        return jax.jit(self._forward, static_argnames=static, donate_argnums=(1, 2), compiler_options=options)

    # -------------------------------------------------------------- jitted body
    def _forward(self, step_leaves, kv_caches, released, ints, overlay, overlay_mask, extra, deepstack_feats,
                 *, layout: IntLayout, rich: bool, deepstack: bool = False):
        leaves = step_leaves
        if self._step_params is not None:  # the leaves it does not read stand in as shapes only
            leaves = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in self._param_leaves]
            for i, x in zip(self._step_params, step_leaves):
                leaves[i] = x
        model = nnx.merge(self.graphdef, jax.tree.unflatten(self._param_def, leaves))
        v = layout.views(ints)
        meta = AttentionMetadata(mode="paged", backend=self.cfg.backend, decode_only=layout.decode,
                                 slot_mapping=v.slot_mapping, block_tables=v.block_tables, kv_lens=v.kv_lens,
                                 cu_q_lens=v.cu_q_lens, num_decodes=None if layout.decode else v.num_decodes)
        positions = v.positions
        x = model.embed(v.token_ids)
        if rich:
            x = jnp.where(overlay_mask[:, None], overlay.astype(x.dtype), x) + extra.astype(x.dtype)
        kw = {"deepstack": (overlay_mask, deepstack_feats)} if deepstack else {}
        with use_mesh(self.mesh):  # attention and MoE run per shard (models/layers/parallel.py)
            hidden, kv_caches, captured = model(x, positions, meta, kv_caches, self.cfg.capture_layers, **kw)
        sample_hidden = jnp.take(hidden, v.logits_indices, axis=0)
        logits = model.compute_logits(sample_hidden)
        if self.mesh is not None:
            # Vocab-split logits are gathered, so the sampler sees whole rows; the final hidden
            # rows are whole too (as the residual stream is), in the layout prompt logprobs are
            # compiled for ahead (warmup_programs); the pages keep their layout from step to step
            # (a changed one would be another program).
            logits, hidden = jax.lax.with_sharding_constraint((logits, hidden), sharding.replicated(self.mesh))
            kv_caches = jax.lax.with_sharding_constraint(kv_caches, sharding.kv_cache_sharding(self.mesh))
        if self.cfg.after_sample:
            captured = dict(captured, sample_hidden=sample_hidden)
        if released is not None:  # a decode step: its outputs over those of the step before
            if self.mesh is not None:  # as the buffers it goes into were made (on_stage), as logits and hidden are
                captured = jax.lax.with_sharding_constraint(captured, sharding.replicated(self.mesh))
            logits, captured, hidden = jax.tree.map(into, released, (logits, captured, hidden))
        # The final hidden states are returned, not copied to the host: only prompt logprobs read them.
        return logits, kv_caches, captured, hidden

    def _prompt_logprobs(self, param_leaves, final_hidden, targets):
        model = nnx.merge(self.graphdef, jax.tree.unflatten(self._param_def, param_leaves))
        return token_logprobs(model.compute_logits(final_hidden), targets, MAX_LOGPROBS)

    def prompt_logprobs(self, final_hidden: jax.Array, targets: np.ndarray) -> LogprobsOutput:
        """Logprobs (on the device) of `targets` [T_pad] (each token's next prompt token) under the
        logits of every row of a step's `final_hidden` [T_pad, H], with the top MAX_LOGPROBS.

        A separate call, so steps without prompt logprobs compute no [T, V] logits."""
        return self.jitted.prompt_logprobs(self._param_leaves, final_hidden, targets)

    def _embed(self, param_leaves, token_ids):
        return nnx.merge(self.graphdef, jax.tree.unflatten(self._param_def, param_leaves)).embed(token_ids)

    def embed_tokens(self, token_ids: jax.Array) -> np.ndarray:
        """The input embeddings [S_pad, H] (on the host) of a step's sampled tokens [S_pad], still on
        the device: a text token's layer-0 hidden state, known before the token is fed back."""
        return np.asarray(self.jitted.embed(self._param_leaves, token_ids))

    def on_stage(self, tree):
        """`tree` committed where the stage runs (`placement`; as is when uncommitted). Step outputs
        that feed other programs (logits, sampled tokens, hidden rows) are committed there, and
        host arrays are not: inputs committed alike make warm-up compile the programs serving runs."""
        return tree if self.placement is None else jax.device_put(tree, self.placement)

    def _after_sample(self, param_leaves, sample_hidden, token_ids, greedy, seeds, steps):
        model = nnx.merge(self.graphdef, jax.tree.unflatten(self._param_def, param_leaves))
        return model.after_sample(sample_hidden, token_ids, greedy, seeds, steps, backend=self.cfg.backend)

    def after_sample(self, sample_hidden, token_ids, greedy, seeds, steps):
        """The model's after-sample hook on one step's sampled rows (all [S_pad] arrays).

        Returns (per-row codes [S_pad, K] int32, per-row next-input embeddings [S_pad, H]),
        on the host. `greedy` [S_pad] bool, `seeds` / `steps` [S_pad] int: a sampled row's
        randomness is a function of its request's seed and output index alone.
        """
        fn, args, _ = self.after_sample_call(sample_hidden, token_ids, greedy, seeds, steps)
        codes, embeds = fn(*args)
        return np.asarray(codes), np.asarray(embeds)

    def after_sample_call(self, sample_hidden, token_ids, greedy, seeds, steps) -> tuple:
        """(program, args, kwargs) of `after_sample` on these rows (also for `compile_ahead`)."""
        return self.jitted.after_sample, (self._param_leaves, *self.on_stage((sample_hidden, token_ids, greedy, seeds, steps))), {}

    # -------------------------------------------------------------- host-side packing
    def _positions(self, chunk: ScheduledChunk) -> np.ndarray:
        req, inp = chunk.request, chunk.request.data
        idx = np.arange(chunk.start, chunk.start + chunk.num_tokens)
        p = req.num_prompt_tokens
        if inp is None or inp.mrope_positions is None:
            delta = 0 if inp is None else inp.mrope_delta
            pos = np.where(idx < p, idx, idx + delta)
            return np.broadcast_to(pos, (3, idx.size))
        out = np.empty((3, idx.size), np.int64)
        in_prompt = idx < p
        out[:, in_prompt] = inp.mrope_positions[:, idx[in_prompt]]
        out[:, ~in_prompt] = (idx[~in_prompt] + inp.mrope_delta)[None]
        return out

    def _has_deepstack(self, chunk: ScheduledChunk) -> bool:
        """Whether the chunk holds prompt tokens with DeepStack features (visual placeholders)."""
        inp = chunk.request.data
        if not (self.cfg.deepstack_layers and self.cfg.rich_inputs) or inp is None or inp.deepstack_rows is None:
            return False
        p = chunk.request.num_prompt_tokens
        if chunk.start >= p:
            return False
        return bool((inp.overlay_index[chunk.start:min(chunk.start + chunk.num_tokens, p)] >= 0).any())

    def _rich_rows(self, chunk: ScheduledChunk, overlay, overlay_mask, extra, offset: int,
                   deepstack=None) -> None:
        req, inp = chunk.request, chunk.request.data
        if inp is None:
            return
        idx = np.arange(chunk.start, chunk.start + chunk.num_tokens)
        p = req.num_prompt_tokens
        if inp.overlay_rows is not None:
            in_prompt = idx < p
            rows = np.full(idx.size, -1, np.int64)
            rows[in_prompt] = inp.overlay_index[idx[in_prompt]]
            sel = rows >= 0
            overlay[offset + np.nonzero(sel)[0]] = inp.overlay_rows[rows[sel]]
            overlay_mask[offset:offset + idx.size] = sel
            if deepstack is not None and inp.deepstack_rows is not None:
                deepstack[:, offset + np.nonzero(sel)[0]] = inp.deepstack_rows[:, rows[sel]]
        if inp.extra_embeds is not None or inp.extra_embeds_pad is not None:
            k = idx - p
            gen = k >= 0
            if gen.any():
                n_extra = 0 if inp.extra_embeds is None else len(inp.extra_embeds)
                kk = k[gen]
                vals = np.empty((kk.size, self.hidden_size), np.float32)
                have = kk < n_extra
                if have.any():
                    vals[have] = inp.extra_embeds[kk[have]]
                if (~have).any():
                    if inp.extra_embeds_pad is None:
                        vals[~have] = 0.0
                    else:
                        vals[~have] = inp.extra_embeds_pad
                extra[offset + np.nonzero(gen)[0]] = vals
        if inp.num_feedback:
            k = idx - p
            fed = (k >= 0) & (k < inp.num_feedback)
            if fed.any():
                extra[offset + np.nonzero(fed)[0]] += inp.feedback_embeds[k[fed]]

    def _prepare_decode(self, chunks: Sequence[ScheduledChunk], block_tables: np.ndarray, bucket: int,
                        fed: bool = False):
        """`prepare` of a step of one-token chunks without embedding inputs: the hot path.

        A few whole-array operations and one pass over the chunks: host time per step is
        what bounds a small model. The requests' position offsets are kept from the previous
        decode step while it had the same requests in the same rows (the steady state).
        """
        cfg, n = self.cfg, len(chunks)
        reqs = [c.request for c in chunks]
        starts = np.fromiter([c.start for c in chunks], np.int64, n)
        rows = self._decode_rows
        if rows is None or len(rows[0]) != n or any(a is not b for a, b in zip(rows[0], reqs)):
            prompt_lens = np.fromiter([r.num_prompt_tokens for r in reqs], np.int64, n)
            deltas = np.fromiter([0 if r.data is None else r.data.mrope_delta for r in reqs], np.int64, n)
            rows = self._decode_rows = (reqs, prompt_lens, deltas)
        layout = self._layout(True, bucket)
        ints, v = layout.new()
        v.positions[:, :n] = starts + rows[2]
        for i in np.flatnonzero(starts < rows[1]).tolist():  # a one-token prompt chunk
            v.positions[:, i] = self._positions(chunks[i])[:, 0]
        if fed:  # a step scheduled ahead: its tokens are still on the device (`execute`); their rows
            v.token_ids[:n] = [c.fed_by_row for c in chunks]
        else:
            v.token_ids[:n] = [r.token_id(c.start) for r, c in zip(reqs, chunks)]
        tables = v.block_tables
        tables[:n, :block_tables.shape[1]] = block_tables[:, :cfg.max_blocks_per_seq]
        bs = cfg.block_size
        v.slot_mapping[n:] = DUMMY_BLOCK_ID * bs + np.arange(n, bucket, dtype=np.int32) % bs
        v.slot_mapping[:n] = tables[np.arange(n), starts // bs] * bs + starts % bs
        v.kv_lens[:n] = starts + 1
        v.cu_q_lens[:] = n
        v.cu_q_lens[:n + 1] = np.arange(n + 1)
        sample_rows = list(range(n)) if fed else [i for i, c in enumerate(chunks) if c.needs_logits]
        v.logits_indices[:len(sample_rows)] = sample_rows
        return StepInputs(kind="decode", bucket=bucket, layout=layout, ints=ints, sample_rows=sample_rows,
                          offsets=np.arange(n + 1), total=n)

    def _layout(self, decode: bool, bucket: int) -> IntLayout:
        """The integer inputs' layout of a decode step of `bucket` sequences or a prefill step of
        `bucket` tokens: one object per step shape, whose offsets are worked out once."""
        layout = self._layouts.get((decode, bucket))
        if layout is None:
            layout = self._layouts[decode, bucket] = IntLayout(
                decode=decode, tokens=bucket, seqs=bucket if decode else self.cfg.max_num_seqs,
                width=self.cfg.max_blocks_per_seq)
        return layout

    def prepare(self, chunks: Sequence[ScheduledChunk], block_tables: np.ndarray, num_decodes: int = 0,
                fed: bool = False) -> StepInputs:
        """Pack and pad one step's chunks. `block_tables[i]` belongs to chunks[i]; the first
        `num_decodes` chunks are one-token chunks for the decode kernel (see `execute`).
        `fed`: a step scheduled ahead, whose tokens `execute` takes from the device (then
        the token ids' place holds the rows they are taken from: each chunk's `fed_by_row`)."""
        cfg = self.cfg
        n_chunks = len(chunks)
        decode = num_decodes == n_chunks
        rich = cfg.rich_inputs and any(c.request.data is not None and c.request.data.is_rich for c in chunks)
        if decode:
            bucket = pick_bucket(n_chunks, cfg.decode_buckets)
            if not rich:
                return self._prepare_decode(chunks, block_tables, bucket, fed)
        lens = np.fromiter((c.num_tokens for c in chunks), np.int64, n_chunks)
        total = int(lens.sum())
        if decode:
            t_pad, s_pad = bucket, bucket
        else:
            bucket = pick_bucket(total, cfg.token_buckets)
            t_pad, s_pad = bucket, cfg.max_num_seqs
        if n_chunks > s_pad:
            raise ValueError(f"{n_chunks} sequences exceed the step's {s_pad} slots")
        offsets = np.zeros(n_chunks + 1, np.int64)
        np.cumsum(lens, out=offsets[1:])

        layout = self._layout(decode, bucket)
        ints, v = layout.new()
        token_ids, positions = v.token_ids, v.positions
        req_index = np.full(t_pad, -1, np.int64)
        abs_pos = np.zeros(t_pad, np.int64)
        overlay = np.zeros((t_pad, self.hidden_size), np.float32) if rich else None
        overlay_mask = np.zeros(t_pad, bool) if rich else None
        extra = np.zeros((t_pad, self.hidden_size), np.float32) if rich else None
        deepstack = rich and any(self._has_deepstack(c) for c in chunks)
        ds = np.zeros((cfg.deepstack_layers, t_pad, self.hidden_size), np.float32) if deepstack else None
        for i, c in enumerate(chunks):
            a, b = offsets[i], offsets[i + 1]
            token_ids[a:b] = c.fed_by_row if fed else c.request.all_token_ids[c.start:c.start + c.num_tokens]
            positions[:, a:b] = self._positions(c)
            req_index[a:b] = i
            abs_pos[a:b] = np.arange(c.start, c.start + c.num_tokens)
            if rich:
                self._rich_rows(c, overlay, overlay_mask, extra, a, ds)

        width = cfg.max_blocks_per_seq
        v.block_tables[:n_chunks, :block_tables.shape[1]] = block_tables[:, :width]
        v.slot_mapping[:] = compute_slot_mapping(v.block_tables, req_index, abs_pos, cfg.block_size)
        v.kv_lens[:n_chunks] = [c.start + c.num_tokens for c in chunks]
        v.cu_q_lens[:] = total
        v.cu_q_lens[:n_chunks + 1] = offsets
        v.num_decodes[...] = num_decodes

        sample_rows = [i for i, c in enumerate(chunks) if c.needs_logits]
        if sample_rows:
            v.logits_indices[:len(sample_rows)] = offsets[np.asarray(sample_rows, np.int64) + 1] - 1
        return StepInputs(kind="decode" if decode else "prefill", bucket=bucket, layout=layout, ints=ints,
                          sample_rows=sample_rows, offsets=offsets, total=total, rich=rich, overlay=overlay,
                          overlay_mask=overlay_mask, extra=extra, deepstack=deepstack, deepstack_feats=ds)

    # -------------------------------------------------------------- execution
    def execute(self, chunks: Sequence[ScheduledChunk], block_tables: np.ndarray,
                want_hidden: bool = False, fed: jax.Array | None = None) -> StepResult:
        """Run one step on the device, as one call; the KV cache is updated in place.

        One-token chunks (decodes) are packed first and attend through the decode kernel,
        longer chunks through the ragged one, in the same program (AttentionMetadata.num_decodes):
        the ragged path would score every decode row against a whole block of rows. The
        result's `chunk_indices` give that packed order; its `sample_rows` index into `chunks`.

        `fed`: the previous step's sampled tokens, still on the device, for a step
        scheduled ahead (async scheduling): chunk i's token is `fed[chunks[i].fed_by_row]`
        (then every chunk is such a decode).

        The result's device outputs are written over by a later decode step of its bucket once
        the caller `release`s it.
        """
        n = len(chunks)
        if fed is not None:  # scheduled ahead: one-token decodes only, already in packed order
            order, packed, num_decodes = None, chunks, n
        else:
            # A one-token prompt chunk at a visual token needs DeepStack: the ragged path's rows.
            if self.cfg.deepstack_layers and self.cfg.rich_inputs:
                single = [i for i, c in enumerate(chunks) if c.num_tokens == 1 and not self._has_deepstack(c)]
            else:
                single = [i for i, c in enumerate(chunks) if c.num_tokens == 1]
            num_decodes = len(single)
            if num_decodes == n:  # a decode step: already in packed order
                order, packed = None, chunks
            else:
                order = single + sorted(set(range(n)) - set(single))
                packed = [chunks[i] for i in order]
                block_tables = block_tables[order]
        b = self.prepare(packed, block_tables, num_decodes=num_decodes, fed=fed is not None)
        outputs = self._run(b, fed)
        logits, captured, final_hidden = outputs
        captured = dict(captured)
        sample_hidden = captured.pop("sample_hidden", None)
        hidden = {}
        if want_hidden and captured:
            hidden = {k: np.asarray(v)[:b.total] for k, v in captured.items()}
        if order is None:
            sample_rows, order = b.sample_rows, list(range(n))
        else:
            sample_rows = [order[j] for j in b.sample_rows]
        # A step scheduled ahead samples every chunk (all are decodes) in its row.
        in_order = len(sample_rows) == n and (fed is not None or sample_rows == list(range(n)))
        return StepResult(logits=logits, sample_hidden=sample_hidden, final_hidden=final_hidden,
                          sample_rows=sample_rows, hidden=hidden, token_offsets=b.offsets, kind=b.kind,
                          bucket=b.bucket, chunk_indices=order, rows_in_order=in_order, outputs=outputs)

    def release(self, result: StepResult) -> None:
        """The caller is done with `result`'s device outputs (the sampler and prompt logprobs
        that read them are launched): the next decode step of its bucket writes over them
        (stable_buffers.py). Once is enough; later calls do nothing."""
        if result.kind == "decode" and result.outputs is not None:
            self._released[result.bucket] = result.outputs
        result.outputs = None

    def _ints_buffer(self, layout: IntLayout, take: bool = False) -> jax.Array:
        """The device buffer of `layout`'s integer inputs: the one kept (`take`: no longer kept), or a blank one."""
        buf = self._int_buffers.pop(layout, None) if take else self._int_buffers.get(layout)
        return self._blank_ints(layout.size) if buf is None else buf

    def _blank_ints(self, n: int) -> jax.Array:
        """`n` zeros (int32) where the stage runs: a fresh integer buffer, warm-up's token ids."""
        return self.on_stage(jnp.zeros(n, jnp.int32))

    def _upload(self, b: StepInputs, fed: jax.Array | None = None) -> jax.Array:
        """`b`'s integer inputs in the device buffer of its layout (the fed tokens taken in)."""
        fn, args, kwargs = self._upload_call(b, self._ints_buffer(b.layout, take=True), fed)
        buf = self._int_buffers[b.layout] = fn(*args, **kwargs)
        return buf

    def _upload_call(self, b: StepInputs, buf: jax.Array, fed: jax.Array | None = None):
        """(upload program, args, kwargs) that put `b`'s integer inputs (and the fed tokens) into `buf`."""
        # Every call's inputs committed alike (host arrays and the fed tokens): one program per bucket.
        ints = self.on_stage(b.ints)
        if fed is None:
            return self.jitted.upload, (buf, ints), {}
        return self.jitted.upload_fed, (buf, ints, self.on_stage(fed)), dict(tokens=b.layout.tokens)

    def _run(self, b: StepInputs, fed: jax.Array | None = None):
        """One call of the step program on packed inputs; (logits, captured, final hidden)."""
        buf = self._upload(b, fed)
        released = self._released.pop(b.bucket, None) if b.kind == "decode" else None
        fn, args, kwargs = self._step_call(b, buf, released)
        logits, self.kv_caches, captured, final_hidden = fn(*args, **kwargs)
        return logits, captured, final_hidden

    def _step_call(self, b: StepInputs, buf: jax.Array, released):
        """(step program, args, kwargs) of a step on `b`'s uploaded integer inputs `buf`; a decode
        step writes over `released` (the outputs of its bucket's step before), else over blanks."""
        if b.kind == "decode" and released is None:
            released = self._blank_decode_outputs(b.bucket)
        rest = self.on_stage(((b.overlay, b.overlay_mask, b.extra) if b.rich else (None, None, None),
                              b.deepstack_feats if b.deepstack else None))
        if self._step_leaves is None:
            self._probe_step()
        return (self.jitted.step, (self._step_leaves, self.kv_caches, released, buf, *rest[0], rest[1]),
                dict(layout=b.layout, rich=b.rich, deepstack=b.deepstack))

    def _probe_step(self) -> None:
        """One trace (no compile) of a plain decode step of bucket 1 with every parameter leaf:
        the leaves it reads (every variant reads the same: a leaf left out would fail its
        warm-up trace as a bare shape), and its outputs' shapes (`_blank_decode_outputs`)."""
        cache = program_cache.active()
        if cache is not None and self.mesh is None:  # what the trace found, kept beside the step programs
            found = cache.fact("step-probe", self._probed, params=[(x.shape, str(x.dtype)) for x in self._param_leaves],
                               kv=[(x.shape, str(x.dtype)) for x in jax.tree.leaves(self.kv_caches)])
        else:
            found = self._probed()
        self._step_params = found["step_params"]
        self._step_leaves = [self._param_leaves[i] for i in self._step_params]
        shapes = [jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype)) for shape, dtype in found["decode_outputs"]]
        self._decode_outputs = jax.tree.unflatten(program_cache.decode_tree(found["decode_tree"]), shapes)

    def _probed(self) -> dict:
        """`_probe_step`'s trace: the leaves read, and the decode outputs' tree and shapes (JSON)."""
        b = self._dummy_batch("decode", 1, False)
        closed, shapes = jax.make_jaxpr(functools.partial(self._forward, layout=b.layout, rich=False),
                                        return_shape=True)(
            self._param_leaves, self.kv_caches, None, jax.ShapeDtypeStruct(b.ints.shape, b.ints.dtype),
            None, None, None, None)
        jaxpr = closed.jaxpr
        read = {id(v) for eqn in jaxpr.eqns for v in eqn.invars} | {id(v) for v in jaxpr.outvars}
        outputs, tree = jax.tree.flatten((shapes[0], shapes[2], shapes[3]))
        return {"step_params": [i for i, v in enumerate(jaxpr.invars[:len(self._param_leaves)]) if id(v) in read],
                "decode_tree": program_cache.encode_tree(tree),
                "decode_outputs": [(x.shape, str(x.dtype)) for x in outputs]}

    def _blank_decode_outputs(self, bucket: int):
        """Buffers for a decode step's outputs where no released ones are at hand (its bucket's
        first step, or a step whose outputs were not released): laid out as its outputs, whose
        rows are all the bucket's (shapes from `_probe_step`, the same for every variant)."""
        if self._decode_outputs is None:
            self._probe_step()
        return self.on_stage(jax.tree.map(lambda x: jnp.zeros((bucket, *x.shape[1:]), x.dtype),
                                          self._decode_outputs))

    # -------------------------------------------------------------- warm-up
    def _warmup_jobs(self) -> list[tuple]:
        """(kind, size, rich, deepstack) of every program warm-up runs (`warmup`)."""
        cfg = self.cfg
        variants = [False, True] if cfg.rich_inputs else [False]
        # Every bucket of one variant before the next variant's: the variants of a bucket share
        # their matmuls, whose autotuning on a GPU (timed on the device) a program compiled after
        # another finds done (XLA keeps it for the process), where side by side both would run it.
        jobs = [(kind, size, r, False) for r in variants
                for kind, sizes in (("prefill", cfg.token_buckets), ("decode", cfg.decode_buckets)) for size in sizes]
        if cfg.rich_inputs and cfg.deepstack_layers:
            jobs += [("prefill", t, True, True) for t in cfg.token_buckets]
        # Async scheduling feeds a decode step of bucket b from the sampled tokens of one of
        # bucket >= b: requests only leave between the two.
        jobs += [("fed", (p, b), False, False) for p in cfg.decode_buckets for b in cfg.decode_buckets if b <= p]
        if cfg.sampled_embeddings:  # embeddings of sampled tokens, per sampler batch (decode or prefill step)
            jobs += [("embed", b, False, False) for b in sorted({*cfg.decode_buckets, cfg.max_num_seqs})]
        return jobs

    def warmup_programs(self):
        """(jitted fn, args, kwargs) of the programs `warmup` runs (every step bucket and variant with
        its upload, prompt logprobs, sampled-token embeddings), on the arguments it runs them with,
        one after the other: for `compile_ahead`."""
        uploads = set()  # one upload program per layout, whatever the variant
        for kind, size, rich, ds in self._warmup_jobs():
            if kind == "embed":
                yield self.jitted.embed, (self._param_leaves, self._blank_ints(size)), {}
            elif kind == "fed":
                b = self._dummy_batch("decode", size[1], False)
                yield self._upload_call(b, self._ints_buffer(b.layout), self._blank_ints(size[0]))
            else:
                b = self._dummy_batch(kind, size, rich, ds)
                if b.layout not in uploads:
                    uploads.add(b.layout)
                    yield self._upload_call(b, self._ints_buffer(b.layout))
                yield self._step_call(b, self._ints_buffer(b.layout), self._released.get(size) if kind == "decode" else None)
                if not rich:
                    hidden = self._decode_outputs[-1]
                    yield self.jitted.prompt_logprobs, (
                        self._param_leaves, self.on_stage(jnp.zeros((size, *hidden.shape[1:]), hidden.dtype)),
                        np.zeros(size, np.int32)), {}

    def warmup(self, progress: bool = True) -> float:
        """Run every bucket and variant once before serving (compiling what `compile_ahead` has
        not: `warmup_programs`); returns seconds spent."""
        from tqdm import tqdm

        t0 = time.perf_counter()
        for kind, size, rich, ds in tqdm(self._warmup_jobs(), desc="warming up buckets", unit="bucket",
                                         disable=not progress):
            if kind == "fed":
                self._upload(self._dummy_batch("decode", size[1], False), self._blank_ints(size[0]))
                continue
            if kind == "embed":
                self.embed_tokens(self._blank_ints(size))
                continue
            _, _, final_hidden = self._run(self._dummy_batch(kind, size, rich, ds))
            if not rich:  # prompt logprobs of a step of this bucket (any variant: same shapes)
                jax.block_until_ready(self.prompt_logprobs(final_hidden, np.zeros(size, np.int32)))
        jax.block_until_ready(self.kv_caches)
        return time.perf_counter() - t0

    def _dummy_batch(self, kind: str, size: int, rich: bool, deepstack: bool = False) -> StepInputs:
        """All-padding inputs of one bucket: every write lands in the dummy block."""
        cfg = self.cfg
        decode = kind == "decode"
        layout = self._layout(decode, size)
        ints, v = layout.new()
        v.slot_mapping[:] = np.arange(size) % cfg.block_size
        h = self.hidden_size
        return StepInputs(kind=kind, bucket=size, layout=layout, ints=ints, sample_rows=[], offsets=np.zeros(1, np.int64),
                          total=0, rich=rich, overlay=np.zeros((size, h), np.float32) if rich else None,
                          overlay_mask=np.zeros(size, bool) if rich else None,
                          extra=np.zeros((size, h), np.float32) if rich else None, deepstack=deepstack,
                          deepstack_feats=np.zeros((cfg.deepstack_layers, size, h), np.float32) if deepstack else None)
