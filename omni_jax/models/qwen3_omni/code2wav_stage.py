"""Qwen3-Omni code2wav as a one-shot serving stage: codec codes -> 24 kHz waveform.

Request format: a request's `prompt_token_ids` are its codec codes flattened
frame-major: frame t's `num_quantizers` (Q) codes sit at `[t*Q:(t+1)*Q]`, group 0 first.

Each request is decoded as transformers' ``Qwen3OmniMoeCode2Wav.chunked_decode`` does:
windows of `chunk_size` frames, each with up to `left_context` frames of left context
whose samples are dropped. Windows carry their own context, so they are independent:
the windows of every request of a step are pooled, sorted by length and packed into
padded (batch bucket, frame-length bucket) calls of one jitted function per bucket.
The model is causal (a transposed conv looks one frame ahead, and transformers drops
the samples that would need it), so right padding leaves a window's real samples
unchanged; each window is cropped to the length decoding it alone gives
(``num_samples``, derived from the model's output shapes). No noise: deterministic.

Streaming (async chunk): `Code2WavSynthesizer.stream` returns the samples of a request's
codes so far that no later frame can change, cut from the same windows the whole-request
decode uses, so a request's streamed pieces join into exactly its whole-request waveform
(see `stream`). The pre-transformer runs over the window so far (cheap: one vector per
frame); the upsampling convolutions (most of the work) run only over the new frames, with
the history each convolution kept from the request's previous chunk
(`Qwen3OmniCode2Wav.convolve_stream`), in calls bucketed by the chunk sizes. That history
is the only per-request state; `release` drops it when the stream ends.

Units: the `OneShotEngine` counts prompt tokens, i.e. Q x frames. The builder takes
its limits in codec frames (the unit of the stage config) and hands the engine Q times
those numbers.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ...engine import program_cache
from ...engine.buckets import pick_bucket
from ...engine.jitted import NO_TRITON_GEMM, Jitted, warm_up
from ...checkpoint import load_checkpoint
from ...engine.oneshot_engine import CHUNK_FRAMES, INITIAL_CHUNK_FRAMES, CallPool, ChunkJob, OneShotEngine, chunk_sizes
from .code2wav import Qwen3OmniCode2Wav


def plan_windows(num_frames: int, chunk_size: int, left_context: int) -> list[tuple[int, int, int]]:
    """(first frame incl. context, context frames, end frame) of each chunk, as transformers' chunked_decode."""
    out, start = [], 0
    while start < num_frames:
        end = min(start + chunk_size, num_frames)
        context = min(start, left_context)  # transformers: the whole prefix when shorter than the context
        out.append((start - context, context, end))
        start = end
    return out


def _padded_calls(items: Sequence[np.ndarray], length_buckets: Sequence[int], batch_buckets: Sequence[int],
                  calls: CallPool, run: Callable[[Any], Any], extras: Sequence[Any] | None = None) -> list[Any]:
    """`run` over every item ([T, ...], T frames), each as if alone: per item its row of `run`'s output.

    The items are sorted by length (similar lengths share a bucket) and packed, zero-padded
    on the right, into (batch bucket, length bucket) calls run side by side by `calls`. Right
    padding changes no real output: everything here is causal. With `extras` (per item a
    pytree of fixed-shape arrays, stacked like the items, zero rows for padding) `run`
    takes (batch, extras) and may return a pytree: each item gets its row of every leaf.
    """
    cap = batch_buckets[-1]
    order = sorted(range(len(items)), key=lambda i: len(items[i]), reverse=True)
    groups = [order[g:g + cap] for g in range(0, len(order), cap)]
    batches = []
    for group in groups:
        first = items[group[0]]
        t = pick_bucket(len(first), length_buckets)
        batch = np.zeros((pick_bucket(len(group), batch_buckets), t, *first.shape[1:]), first.dtype)
        for j, i in enumerate(group):
            batch[j, :len(items[i])] = items[i]
        if extras is None:
            batches.append(batch)
        else:
            rows = [extras[i] for i in group]
            rows += [jax.tree.map(np.zeros_like, rows[0])] * (len(batch) - len(group))
            batches.append((batch, jax.tree.map(lambda *r: np.stack(r), *rows)))
    out: list[Any] = [None] * len(items)
    for group, result in zip(groups, calls.map(run, batches)):
        for j, i in enumerate(group):
            out[i] = jax.tree.map(lambda leaf: leaf[j], result)
    return out


def _join(pieces: Sequence[np.ndarray], owner: Sequence[int], n: int) -> list[np.ndarray]:
    """Concatenate window pieces per owner (pieces in order within an owner) into n float32 arrays."""
    parts: list[list[np.ndarray]] = [[] for _ in range(n)]
    for i, p in zip(owner, pieces):
        parts[i].append(p)
    return [np.concatenate(p).astype(np.float32, copy=False) if p else np.zeros(0, np.float32) for p in parts]


@dataclasses.dataclass
class _ConvHistory:
    """Where a streamed request's convolutions stopped: window (first frame), frames convolved, histories."""

    window: int
    frames: int
    states: tuple[np.ndarray, ...]


class Code2WavSynthesizer:
    """Bucketed, jitted, chunked decoding of code2wav requests, whole or streamed (see module docstring)."""

    def __init__(self, model: Qwen3OmniCode2Wav, *, length_buckets: Sequence[int], batch_buckets: Sequence[int],
                 chunk_size: int = 300, left_context: int = 25, max_frames: int | None = None,
                 max_num_seqs: int | None = None, stream_chunk_frames: Sequence[int] = (), clip: bool = True):
        self.cfg = model.cfg
        self.clip = clip  # clamp the waveform to [-1, 1] (the stage's clip_audio)
        self.num_quantizers = self.cfg.num_quantizers
        self.tokens_per_frame = self.num_quantizers  # codes are flattened frame-major
        self.codebook_size = self.cfg.codebook_size
        self.total_upsample = self.cfg.total_upsample
        length_buckets, batch_buckets = tuple(int(b) for b in length_buckets), tuple(int(b) for b in batch_buckets)
        for name, b in (("length_buckets", length_buckets), ("batch_buckets", batch_buckets)):
            if not b or b[0] < 1 or list(b) != sorted(set(b)):
                raise ValueError(f"{name} must be positive, increasing and non-empty, got {b}")
        if chunk_size < 1 or left_context < 0:
            raise ValueError(f"need chunk_size >= 1 and left_context >= 0, got {chunk_size}, {left_context}")
        # The longest window: a chunk with its left context, or a whole request when none is that long.
        window = chunk_size + left_context if max_frames is None else min(chunk_size + left_context, max_frames)
        if window > length_buckets[-1]:
            raise ValueError(f"the largest length bucket ({length_buckets[-1]} frames) must hold the longest "
                             f"window: min(chunk {chunk_size} + left context {left_context}, longest request "
                             f"{max_frames}) = {window} frames")
        # No window is longer than chunk + context: larger buckets would only cost compilations.
        self.length_buckets = length_buckets[:length_buckets.index(pick_bucket(window, length_buckets)) + 1]
        self.batch_buckets = batch_buckets
        # Windows per call: a step's calls run side by side when its requests need several.
        self.calls = CallPool(max_num_seqs or batch_buckets[-1], batch_buckets[-1])
        self.chunk_size, self.left_context = chunk_size, left_context
        self.max_frames = max_frames
        self.graphdef, self.state = nnx.split(model)
        # The programs take the parameters as a flat list (a tree the program cache can key).
        self.params, self._params_def = jax.tree.flatten(self.state)
        # A whole window in one call; streamed chunks run the pre-transformer per window and
        # the convolutions per chunk, with their history. A restarted stage reads them back
        # from the program cache instead of tracing them.
        self.jitted = Jitted(
            whole=program_cache.jit("code2wav.whole", self._decode, compiler_options=NO_TRITON_GEMM),
            frame_states=program_cache.jit("code2wav.frame_states", lambda p, codes: self._model(p).frame_states(codes),
                                           compiler_options=NO_TRITON_GEMM),
            convolve_stream=program_cache.jit(
                "code2wav.convolve_stream", lambda p, x, frames, fresh, history: self._model(p).convolve_stream(
                    x, frames, fresh, history, clip=clip), compiler_options=NO_TRITON_GEMM))
        self._trailing = self._trailing_samples()
        # Streamed chunks convolve only their new frames: one bucket per chunk size the engine
        # asks for (`stream_chunk_frames`), and the window buckets for chunks that piled up
        # meanwhile or a window's first chunk (its left context included).
        fits = sorted({n for n in stream_chunk_frames if n < self.length_buckets[-1]})
        self.conv_buckets = tuple(fits + [b for b in self.length_buckets if not fits or b > fits[-1]])
        self._no_history = tuple(np.zeros(shape, np.float32) for shape in model.conv_state_shapes())
        self._histories: dict[str, _ConvHistory] = {}  # request id -> its convolutions' history

    def _model(self, params: list):
        return nnx.merge(self.graphdef, jax.tree.unflatten(self._params_def, params))

    def _decode(self, params, codes):
        return self._model(params)(codes, clip=self.clip)

    def _trailing_samples(self) -> int:
        """Samples a decode of T frames falls short of T * total_upsample, from the model's output shapes.

        Every stage maps a length L to a*L or a*(L - 1), so the output length is affine in T;
        the slope is checked, and every padded call checks the result again.
        """
        lens = [jax.eval_shape(self._decode, self.params,
                               jax.ShapeDtypeStruct((1, self.num_quantizers, t), jnp.int32)).shape[-1]
                for t in (1, 2)]
        if lens[1] - lens[0] != self.total_upsample:
            raise RuntimeError(f"code2wav output lengths {lens} for 1 and 2 frames do not grow by "
                               f"total_upsample ({self.total_upsample})")
        return self.total_upsample - lens[0]

    def num_samples(self, num_frames: int) -> int:
        """Waveform samples of decoding `num_frames` frames in one call (as transformers' forward)."""
        return num_frames * self.total_upsample - self._trailing

    def request_samples(self, num_frames: int) -> int:
        """Waveform samples of a whole request of `num_frames` frames (each chunk falls a little short)."""
        return sum(self.num_samples(e - a) - c * self.total_upsample
                   for a, c, e in plan_windows(num_frames, self.chunk_size, self.left_context))

    def validate(self, req) -> None:
        """ValueError naming the problem when a request is not a servable code sequence."""
        n, q = req.num_prompt_tokens, self.num_quantizers
        if n % q:
            raise ValueError(f"{n} codec tokens are not whole frames: the length must be a multiple of "
                             f"num_quantizers={q} (frame t's codes at [t*{q}:(t+1)*{q}])")
        if self.max_frames is not None and n // q > self.max_frames:
            raise ValueError(f"{n // q} codec frames exceed this stage's longest request ({self.max_frames} frames)")
        ids = np.asarray(req.prompt_token_ids)
        bad = np.flatnonzero((ids < 0) | (ids >= self.codebook_size))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"code {int(ids[i])} (frame {i // q}, group {i % q}) is outside the codebook "
                             f"[0, {self.codebook_size})")

    def frames(self, token_ids) -> np.ndarray:
        """Frame-major flat codes -> [Q, frames] int32 (a view, no copy)."""
        return np.asarray(token_ids, np.int32).reshape(-1, self.num_quantizers).T

    def __call__(self, reqs) -> list[np.ndarray]:
        """One float32 waveform per request, equal to chunked_decode of that request alone."""
        windows, owner = [], []
        for i, r in enumerate(reqs):
            codes = self.frames(r.prompt_token_ids)
            for a, c, e in plan_windows(codes.shape[1], self.chunk_size, self.left_context):
                # The context's samples are dropped: they belong to the window before.
                windows.append((codes[:, a:e], c * self.total_upsample, self.num_samples(e - a)))
                owner.append(i)
        return _join(self.decode_windows(windows), owner, len(reqs))

    def stream(self, jobs: Sequence[ChunkJob]) -> list[np.ndarray]:
        """Per streamed chunk the samples [emitted, n) of its request's waveform, n as far as it is final.

        Exact by construction: a piece is cut from a decode of the same window (context
        included) the whole-request decode uses, up to the last frame received. The model
        is causal and each window already drops the samples that would look one frame
        ahead, so the first `num_samples(T)` samples of T frames never change when more
        frames come: with F frames the waveform is final up to `request_samples(F)`, and
        `final` changes nothing. The pre-transformer re-runs over the window so far; the
        convolutions go on from where the request's previous chunk left them (its
        `_ConvHistory`), or start the window afresh (its first chunk, or a history that
        does not end where this piece starts). Only float rounding may differ from the
        whole decode (other call shapes; ~1e-7 seen on CPU).
        """
        rows, owner = [], []  # (request id, window's first frame, window codes so far, lo, hi)
        for i, job in enumerate(jobs):
            for a, codes, lo, hi in self._unsent_windows(job):
                rows.append((job.request.request_id, a, codes, lo, hi))
                owner.append(i)
        states = _padded_calls([codes.T for _, _, codes, _, _ in rows], self.length_buckets, self.batch_buckets,
                               self.calls, lambda batch: self._frame_states(batch.transpose(0, 2, 1)))
        u, lag = self.total_upsample, self._trailing
        segments, extras, starts = [], [], []
        for (rid, a, codes, lo, _), st in zip(rows, states):
            held = self._histories.get(rid)
            # Convolved frames [n, m) give window samples from n * u - lag on (a fresh start: -lag).
            n = held.frames if held is not None and held.window == a and held.frames * u - lag == lo else 0
            segments.append(st[n:codes.shape[1]])
            extras.append((np.int32(codes.shape[1] - n), np.bool_(n == 0), held.states if n else self._no_history))
            starts.append(n * u - lag)
        convolved = _padded_calls(segments, self.conv_buckets, self.batch_buckets, self.calls,
                                  lambda packed: self._convolve_stream(*packed), extras)
        pieces = []
        for (rid, a, codes, lo, hi), start, (wav, history) in zip(rows, starts, convolved):
            pieces.append(wav[lo - start:hi - start])
            self._histories[rid] = _ConvHistory(a, codes.shape[1], history)  # windows in order: the last stays
        return _join(pieces, owner, len(jobs))

    def release(self, request_id: str) -> None:
        """Forget a stream's convolution history (the engine calls this however the stream ends)."""
        self._histories.pop(request_id, None)

    def _frame_states(self, codes: np.ndarray) -> np.ndarray:
        return np.asarray(self.jitted.frame_states(self.params, codes))

    def _convolve_stream(self, x: np.ndarray, extras) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
        frames, fresh, history = extras
        wav, history = jax.device_get(self.jitted.convolve_stream(self.params, x, frames, fresh, history))
        if wav.shape[-1] != x.shape[1] * self.total_upsample:
            raise RuntimeError(f"code2wav gave {wav.shape[-1]} samples for a streamed chunk of {x.shape[1]} frames, "
                               f"expected {x.shape[1] * self.total_upsample}")
        return wav, history

    def _unsent_windows(self, job: ChunkJob) -> list[tuple[int, np.ndarray, int, int]]:
        """The windows (first frame, codes, lo, hi) holding samples of `job` not sent yet, the last one
        cut at its last frame; [lo, hi) are the unsent samples of the window's own decode."""
        codes, u = self.frames(job.codes), self.total_upsample
        out, start = [], 0  # start: the request's sample where the window's kept samples begin
        for a, c, e in plan_windows(codes.shape[1], self.chunk_size, self.left_context):
            kept = self.num_samples(e - a) - c * u
            if job.emitted < start + kept:
                out.append((a, codes[:, a:e], c * u + max(job.emitted - start, 0), c * u + kept))
            start += kept
        if job.emitted > start:
            raise ValueError(f"request {job.request.request_id!r}: {job.emitted} samples already sent, but "
                             f"{codes.shape[1]} frames make only {start}")
        return out

    def decode_windows(self, windows: Sequence[tuple[np.ndarray, int, int]]) -> list[np.ndarray]:
        """Samples [lo, hi) of each window's waveform, each window ([Q, frames] codes, lo, hi) decoded alone."""
        # Codes go time-last into the model; padded calls take time first, hence the transposes.
        wavs = _padded_calls([codes.T for codes, _, _ in windows], self.length_buckets, self.batch_buckets,
                             self.calls, lambda batch: self._run(batch.transpose(0, 2, 1)))
        return [w[lo:hi] for w, (_, lo, hi) in zip(wavs, windows)]

    def _run(self, batch: np.ndarray) -> np.ndarray:
        """The whole decode of a padded batch, checked: padded calls rely on its sample count."""
        wav, frames = np.asarray(self.jitted.whole(self.params, batch)), batch.shape[-1]
        if wav.shape[-1] != self.num_samples(frames):
            raise RuntimeError(f"code2wav gave {wav.shape[-1]} samples for {frames} frames, "
                               f"expected {self.num_samples(frames)}")
        return wav

    # Warm-up calls the programs themselves (what the GPU tier records): their sample counts
    # were checked against the model's output shapes at construction (`_trailing_samples`),
    # and every serving call checks its own.
    def warmup(self) -> None:
        """Compile every (batch, length) bucket."""
        warm_up((self.jitted.whole, (self.params, self._zero_codes(b, t)))
                for b in self.batch_buckets for t in self.length_buckets)

    def warmup_stream(self) -> None:
        """Compile the streamed calls: pre-transformer per window bucket, convolutions per chunk bucket."""
        calls = []
        for b in self.batch_buckets:
            calls += [(self.jitted.frame_states, (self.params, self._zero_codes(b, t))) for t in self.length_buckets]
            for t in self.conv_buckets:
                x, (frames, fresh, history) = self.stream_call_args(b, t)
                calls.append((self.jitted.convolve_stream, (self.params, x, frames, fresh, history)))
        warm_up(calls)

    def _zero_codes(self, batch: int, length: int) -> np.ndarray:
        return np.zeros((batch, self.num_quantizers, length), np.int32)

    def stream_call_args(self, batch: int, frames: int) -> tuple:
        """Zero arguments (x, (frames, fresh, history)) of a streamed convolution call."""
        history = tuple(np.zeros((batch, *h.shape), np.float32) for h in self._no_history)
        return (np.zeros((batch, frames, self.cfg.hidden_size), np.float32),
                (np.zeros((batch,), np.int32), np.zeros((batch,), np.bool_), history))


def code2wav_engine(model, *, length_buckets=(64, 256, 325), batch_buckets=(1, 2, 4),
                    chunk_size: int = 300, left_context: int = 25, max_num_batched_tokens: int | None = None,
                    max_model_len: int | None = None, max_num_seqs: int | None = None,
                    codec_chunk_frames: int = CHUNK_FRAMES, initial_codec_chunk_frames: int = INITIAL_CHUNK_FRAMES,
                    streamed: bool = False, clip: bool = True) -> OneShotEngine:
    """The Qwen3-Omni vocoder's engine: whole or streamed requests chunk-decoded in padded batches
    (fp32, no KV cache); its synthesizer is `engine.synthesizer`.

    `length_buckets` are window lengths in codec frames (the largest must hold
    chunk_size + left_context; larger ones are dropped as unused), `batch_buckets`
    windows per call. Requests longer than a chunk are decoded chunk by chunk.
    `max_num_seqs` requests per step (default batch_buckets[-1]; more take several calls,
    run side by side). `max_num_batched_tokens` (codec frames per step, default
    max_num_seqs * length_buckets[-1]) and `max_model_len` (codec frames of the longest
    request, default max_num_batched_tokens) are in frames, as in the stage config; the
    engine, which counts prompt tokens, gets num_quantizers times them.
    `codec_chunk_frames` / `initial_codec_chunk_frames`: the frames a streamed request
    gathers before each chunk (the first) is decoded (see `OneShotEngine`). `streamed`:
    requests arrive streamed (the pipeline's async_chunk), so warm-up compiles the streamed
    calls instead of the whole-request ones (the other path still works, compiling on first use).
    `clip`: clamp the waveform to [-1, 1] (the stage's clip_audio).
    """
    max_num_seqs = max_num_seqs or batch_buckets[-1]
    frames_per_step = max_num_batched_tokens or max_num_seqs * length_buckets[-1]
    max_frames = max_model_len or frames_per_step
    if max_frames > frames_per_step:
        raise ValueError(f"max_model_len ({max_frames} frames) exceeds max_num_batched_tokens "
                         f"({frames_per_step} frames): such a request could never be scheduled")
    synth = Code2WavSynthesizer(model, length_buckets=length_buckets, batch_buckets=batch_buckets,
                                chunk_size=chunk_size, left_context=left_context, max_frames=max_frames,
                                max_num_seqs=max_num_seqs,
                                stream_chunk_frames=chunk_sizes(initial_codec_chunk_frames, codec_chunk_frames),
                                clip=clip)
    q = model.cfg.num_quantizers
    # vocab_size=0: `validate` checks the code range itself and names the offending frame and group.
    engine = OneShotEngine(synth, max_num_seqs=max_num_seqs, max_num_batched_tokens=q * frames_per_step,
                           max_model_len=q * max_frames, vocab_size=0, validate=synth.validate,
                           warmup_fn=synth.warmup_stream if streamed else synth.warmup, chunk_frames=codec_chunk_frames,
                           initial_chunk_frames=initial_codec_chunk_frames)
    engine.synthesizer = synth
    return engine


def build_code2wav_engine(ckpt_dir: str, *, warmup: bool = True, **kw) -> OneShotEngine:
    """Load the vocoder stage (`code2wav_engine`'s arguments) and warm it up."""
    model, _ = load_checkpoint(ckpt_dir, stage="code2wav", dtype="float32")
    engine = code2wav_engine(model, **kw)
    if warmup:
        engine.warmup()
    return engine
