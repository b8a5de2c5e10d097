"""Token2wav stage: codec tokens -> mel (DiT flow matching) -> 24 kHz waveform (BigVGAN).

`Qwen2_5OmniToken2Wav` holds both models under their checkpoint names
(`token2wav.code2wav_dit_model`, `token2wav.code2wav_bigvgan_model`).
`Token2WavSynthesizer` serves batches of whole requests for the `OneShotEngine`:
requests are padded to a (batch, code length) bucket and run through one jitted
function; padded frames are masked in the DiT's attention and BigVGAN's borders,
so every request's waveform equals its unpadded result. A call holds at most
`max_batch_codes` padded codes (one request alone excepted): its temporaries grow with
them, BigVGAN's above all (about 0.7 MB per code: 2.8 GB for one 4096-code request on
H100). Each request's initial noise is drawn from its own seed for its own length (or
passed in explicitly), so batching never changes its audio. Speaker embeddings are
computed once per voice.

Streaming (async chunk): `Token2WavSynthesizer.stream` turns the codes received so far
into the part of the waveform that no later code can change.

* DiT: a frame's exact context is most of the request. Attention is block-local (24
  frames = 12 codes); a look-back layer widens a frame's reach by a block behind, a
  look-ahead layer by one ahead, and the ODE runs the DiT 36 times (9 RK4 intervals x 4
  stages), so the real model (2 look-back layers, 1 look-ahead) reaches 72 blocks back and
  36 ahead. Each streamed chunk therefore solves a window instead: the codes it keeps plus
  `left_codes` before them (the start rounded down to a block, so the window's blocks and
  mask are the whole decode's) and `right_codes` after, on the same slice of the noise the
  whole decode draws (`initial_noise` of a prefix is the prefix of the noise). Only the
  kept frames are used (cropped, no cross-fade); a kept code waits for `right_codes` of
  look-ahead unless the request is final.
* BigVGAN is convolutional with a finite reach, `BigVGANConfig.context_frames()` (34 mel
  frames each side), but in fp32 a frame's influence fades below rounding long before that:
  each vocoder window reads `StreamContext.vocoder_frames` (20) of final mel beyond what it
  keeps, or the request's own border. The final mel it still needs stays cached per request;
  its last 20 frames wait for the next chunk (or the end).

The default context is the one the model's authors stream with (Qwen2.5-Omni's own
streaming token2wav: 2 blocks of DiT context behind a chunk, 1 ahead, 20 mel frames of
vocoder context). Measured on the tiny checkpoint with unit-gain DiT weights and an audible
vocoder (with its own init the waveform peaks at 2e-4 and even no context errs by only
2e-10): max abs error of 64- and 41-code requests streamed in 10-then-25-code and uneven
pieces, waveform peak 0.62:

    DiT left / right codes   24 / 24   24 / 12   12 / 12   24 / 6    24 / 0
    max abs error            4.1e-5    2.1e-3    2.1e-3    5.6e-3    1.1e-2

and of the vocoder alone (118 mel frames in windows, against the whole): 20 frames of
context 2.5e-7, 16 6.5e-6, 12 4.4e-4, 10 2.8e-3. Earlier, on 203- and 131-code requests:
24 / 24 6.8e-5, 36 / 36 1.4e-6. So the default (24 / 12) errs by about 2e-3 at a 0.6 peak
(-49 dB) and holds audio back by 12 + 10 codes, where 24 / 24 errs by under 1e-4 and holds
it back by 24 + 10 (the stage's `codec_right_context_frames` chooses). A 25-code chunk runs
a window of 24 + up to 11 (its start rounded down to a block) + 25 + 12 codes. In the real
model two look-back layers give more paths into the past, so expect its left error to be
somewhat larger. A request's audio depends (within that error) on how its codes were split.

How far a code's influence reaches depends on the weights (the built-in tiny model's DiT
couples blocks far more strongly than a transformers-initialised one; the look-ahead is what
counts): README "Streamed speech" has the figures. `clip=False` returns the waveform before the
clamp to [-1, 1].
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ...engine import program_cache
from ...engine.buckets import pick_bucket
from ...engine.jitted import NO_TRITON_GEMM, Jitted, warm_up
from ...engine.oneshot_engine import CallPool
from .token2wav_bigvgan import BigVGANConfig, Qwen2_5OmniBigVGAN
from .token2wav_dit import DiTConfig, Qwen2_5OmniDiT
from .voices import Voices


@dataclasses.dataclass(frozen=True)
class Token2WavConfig:
    dit: DiTConfig
    bigvgan: BigVGANConfig

    @classmethod
    def from_hf(cls, d: dict) -> "Token2WavConfig":
        return cls(DiTConfig.from_hf(d["dit_config"]), BigVGANConfig.from_hf(d["bigvgan_config"]))


def initial_noise(num_codes: int, seed: int, repeats: int = 2, mel_dim: int = 80) -> np.ndarray:
    """A request's initial noise [repeats * num_codes, mel_dim] from its seed (independent of batching).

    Drawn with numpy: a jax.random draw compiles once per distinct length, i.e. while serving.
    """
    rng = np.random.Generator(np.random.Philox(seed % (2 ** 64)))
    return rng.standard_normal((num_codes * repeats, mel_dim), dtype=np.float32)


class Qwen2_5OmniToken2Wav(nnx.Module):
    """DiT + BigVGAN, always in fp32 (as transformers runs them)."""

    def __init__(self, cfg: Token2WavConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        self.code2wav_dit_model = Qwen2_5OmniDiT(cfg.dit, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.code2wav_bigvgan_model = Qwen2_5OmniBigVGAN(cfg.bigvgan, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, codes, code_lens, cond, spk, spk_uncond, noise, *, clip: bool = True, **solver):
        """codes [B, T] (padded), code_lens [B], cond [B, E], spk/spk_uncond [B, enc_dim],
        noise [B, repeats*T, mel] -> waveform [B, samples] (zero past each row's length)."""
        mel = self.mel(codes, code_lens, cond, spk, spk_uncond, noise, **solver)
        return self.waveform(mel, code_lens * self.cfg.dit.repeats, clip=clip)

    def mel(self, codes, code_lens, cond, spk, spk_uncond, noise, *, num_steps: int = 10,
            guidance_scale: float = 0.5, sway_coefficient: float = -1.0):
        """The DiT's flow-matching solve: the same inputs as __call__ -> mel [B, repeats*T, mel_dim]."""
        frames = code_lens * self.cfg.dit.repeats
        frame_mask = jnp.arange(noise.shape[1])[None, :] < frames[:, None]
        return self.code2wav_dit_model.solve(codes, cond, None, noise, num_steps=num_steps,
                                             guidance_scale=guidance_scale, sway_coefficient=sway_coefficient,
                                             frame_mask=frame_mask, speaker_embeds=(spk, spk_uncond))

    def waveform(self, mel, frames, *, clip: bool = True):
        """BigVGAN: mel [B, F, mel_dim] with `frames` [B] valid -> waveform [B, samples] (in [-1, 1]
        unless not `clip`)."""
        return self.code2wav_bigvgan_model(mel, frames, channels_last=True, clip=clip)


# What a device call costs beyond its padded cells, in cells (codes of a DiT row, frames of a
# vocoder row): about 10 ms on CPU, the time of 30-45 cells (benchmarks/e2e_speech.py's model).
CALL_CELLS = 32


@dataclasses.dataclass(frozen=True)
class StreamContext:
    """Context around what a streamed chunk keeps (see the module docstring for the error each leaves).

    `left_codes`: DiT codes at least this many before them (the window start is rounded down
    to an attention block, so up to one block more); `right_codes`: the DiT's look-ahead
    after them; `vocoder_frames`: mel frames the vocoder reads on each side (at most its reach).
    """

    left_codes: int = 24
    right_codes: int = 12
    vocoder_frames: int = 20

    @classmethod
    def given(cls, left_codes: int | None = None, right_codes: int | None = None) -> "StreamContext":
        """The defaults, with the DiT context (codes) a stage config gives where it is not None."""
        given = dict(left_codes=left_codes, right_codes=right_codes)
        return cls(**{k: v for k, v in given.items() if v is not None})


def plan_windows(lo: int, hi: int, limit: int, left: int, right: int, align: int,
                 max_len: int) -> list[tuple[int, int, int, int]]:
    """Windows (start, keep_start, keep_end, end) that together keep [lo, hi), in order.

    Each reads [start, end) and keeps [keep_start, keep_end): start is keep_start - left
    rounded down to a multiple of `align` (or 0), end is keep_end + right (or `limit`, where
    the input ends: a window that reaches it needs no room for look-ahead); no window is
    longer than `max_len`.
    """
    out, a = [], lo
    while a < hi:
        start = max(0, a - left) // align * align
        b = hi if hi == limit and limit - start <= max_len else min(hi, start + max_len - right)
        if b <= a:
            raise ValueError(f"a window of at most {max_len} cannot hold {left} + {right} of context "
                             f"(start rounded down to a multiple of {align}) and keep anything")
        out.append((start, a, b, min(b + right, limit)))
        a = b
    return out


@dataclasses.dataclass(frozen=True)
class _CodeRow:
    """One DiT input row: codes, their slice of the request's noise, and the voice."""

    codes: np.ndarray  # [n] int32
    noise: np.ndarray  # [repeats * n, mel_dim]
    voice: str | None


@dataclasses.dataclass
class _StreamState:
    """What `stream` keeps of a request between calls: its final mel still in the vocoder's reach."""

    code_end: int     # codes whose mel frames are final
    mel_start: int    # frame index of mel[0]
    mel: np.ndarray   # [frames, mel_dim]: the final frames [mel_start, repeats * code_end)


class Token2WavSynthesizer:
    """Bucketed, jitted batches of token2wav requests: whole (`__call__`) or streamed (`stream`);
    `clip`: clamp the waveform to [-1, 1] (the stage's clip_audio)."""

    # Codec tokens per streamed frame (Qwen2.5 has one code group per step).
    tokens_per_frame = 1

    def __init__(self, model: Qwen2_5OmniToken2Wav, voices: Voices, *, length_buckets, batch_buckets,
                 num_steps: int = 10, guidance_scale: float = 0.5, sway_coefficient: float = -1.0,
                 max_num_seqs: int | None = None, max_codes: int | None = None, max_batch_codes: int | None = None,
                 stream_context: StreamContext = StreamContext(), stream_chunk_codes: Sequence[int] = (25,),
                 clip: bool = True):
        """`max_codes`: the longest request (default the largest length bucket; larger buckets are
        dropped); `max_batch_codes`: padded codes per call, a call of one row excepted (None: as
        many as the buckets allow)."""
        self.cfg = model.cfg
        self.voices = voices
        length_buckets = tuple(length_buckets)
        self.max_codes = max_codes or length_buckets[-1]
        if self.max_codes > length_buckets[-1]:
            raise ValueError(f"the longest request ({self.max_codes} codes) exceeds the largest length bucket "
                             f"({length_buckets[-1]})")
        self.length_buckets = length_buckets[:length_buckets.index(pick_bucket(self.max_codes, length_buckets)) + 1]
        self.batch_buckets = tuple(batch_buckets)
        self.max_batch_codes = max_batch_codes
        # The streamed vocoder's rows are mel frames: `repeats` per code.
        self._max_batch_frames = None if max_batch_codes is None else self.cfg.dit.repeats * max_batch_codes
        # Requests per call: one call per batch run of a step, side by side when there are several.
        self.calls = CallPool(max_num_seqs or self.batch_buckets[-1], self.batch_buckets[-1])
        self.kw = dict(num_steps=num_steps, guidance_scale=guidance_scale, sway_coefficient=sway_coefficient)
        self.graphdef, self.state = nnx.split(model)
        # The programs take the parameters as a flat list (a tree the program cache can key).
        self.params, self._params_def = jax.tree.flatten(self.state)
        # A whole request in one call; streaming runs the two halves apart (its vocoder
        # windows are not its DiT windows). A restarted stage reads them back from the program
        # cache instead of tracing them (half of the tiny vocoder's warm start).
        self.jitted = Jitted(
            whole=program_cache.jit("token2wav.whole", lambda p, *a: self._model(p)(*a, clip=clip, **self.kw),
                                    compiler_options=NO_TRITON_GEMM),
            mel=program_cache.jit("token2wav.mel", lambda p, *a: self._model(p).mel(*a, **self.kw),
                                  compiler_options=NO_TRITON_GEMM),
            wave=program_cache.jit("token2wav.wave", lambda p, mel, frames: self._model(p).waveform(
                mel, frames, clip=clip), compiler_options=NO_TRITON_GEMM))
        self.context = stream_context
        reach = self.cfg.bigvgan.context_frames()
        self.vocoder_context = tuple(min(stream_context.vocoder_frames, r) for r in reach)
        block, rep = self.cfg.dit.block_size, self.cfg.dit.repeats
        self.block_codes = block // math.gcd(block, rep)  # windows start on an attention block
        # Streamed calls have a shape per chunk size the engine asks for (`stream_chunk_codes`):
        # that many new codes with their context, so a small first chunk costs a small window
        # (the whole-request buckets are coarse: the real preset's smallest is 256 codes).
        # The vocoder's largest holds the mel of the largest DiT window. The first chunk's
        # windows start at the request's first code, so they need no left context: first chunks
        # (what the time to first audio waits for; the engine decodes no more codes in them)
        # get their own smaller shapes, `first_window` (codes, frames), among the buckets.
        first = min(stream_chunk_codes)
        self.first_window = (first + self.stream_delay_frames, rep * first + self.vocoder_context[1])
        windows = {stream_context.left_codes + self.block_codes - 1 + k + stream_context.right_codes
                   for k in stream_chunk_codes}
        # Codes that piled up (under load, and a stream's last piece) take windows up to the
        # smallest whole-request bucket above the chunk windows, if at most twice the largest:
        # most of a request in one window, where windows of the largest chunk would each pay
        # their context again. Lengths in between step by at most a fifth: a padded code costs
        # as much as a real one.
        self.chunk_window = top = max(windows)
        for whole in [t for t in self.length_buckets if top < t <= 2 * top][:1]:
            steps = math.ceil(math.log(whole / top) / math.log(1.2))
            windows |= {top + (whole - top) * i // steps for i in range(1, steps + 1)}
        self.stream_code_buckets = tuple(sorted(windows | {self.first_window[0]}))
        self.stream_frame_buckets = tuple(sorted({sum(self.vocoder_context) + rep * k for k in stream_chunk_codes}
                                                 | {rep * t for t in windows if t >= top} | {self.first_window[1]}))
        self._streams: dict[str, _StreamState] = {}
        dit = model.code2wav_dit_model
        spk_fn = jax.jit(lambda s, m: nnx.merge(*nnx.split(dit)[:1], s).speaker_embedding(m),
                         compiler_options=NO_TRITON_GEMM)
        dit_state = nnx.split(dit)[1]
        self._speakers = {}
        for name in voices.names:
            v = voices.get(name)
            self._speakers[name] = (v.cond[0], np.asarray(spk_fn(dit_state, v.ref_mel))[0],
                                    np.asarray(spk_fn(dit_state, np.zeros_like(v.ref_mel)))[0])

    def _model(self, params: list) -> Qwen2_5OmniToken2Wav:
        return nnx.merge(self.graphdef, jax.tree.unflatten(self._params_def, params))

    @property
    def stream_delay_frames(self) -> int:
        """Codes a streamed request's audio trails the codes received by: the DiT's look-ahead
        plus the vocoder's right reach (the engine counts chunks of audio from there)."""
        return self.context.right_codes + -(-self.vocoder_context[1] // self.cfg.dit.repeats)

    def validate(self, req) -> None:
        if req.num_prompt_tokens > self.max_codes:
            raise ValueError(f"{req.num_prompt_tokens} codec tokens exceed this stage's longest request "
                             f"({self.max_codes} codes)")
        self.voices.get(req.data.voice)  # unknown voice -> ValueError listing the voices
        if req.data.noise is not None and req.data.noise.shape != (req.num_prompt_tokens * self.cfg.dit.repeats,
                                                                    self.cfg.dit.mel_dim):
            raise ValueError(f"noise of shape {req.data.noise.shape} does not fit {req.num_prompt_tokens} codes")

    # -- whole requests ------------------------------------------------------------------
    def __call__(self, reqs) -> list[np.ndarray]:
        """Waveforms of whole requests, batched by bucket."""
        rows = [_CodeRow(r.prompt_token_ids, self._noise(r, r.num_prompt_tokens), r.data.voice) for r in reqs]
        return self._map(rows, self._waveforms, lambda r: len(r.codes), self.length_buckets, self.max_batch_codes)

    def size_split(self, sizes: Sequence[int], buckets: Sequence[int], max_cells: int | None = None
                   ) -> list[tuple[int, int]]:
        """(start, end) of the runs that serve rows of ascending `sizes` at the least padded cost.

        A run of n rows, the longest m, costs its padded cells (batch bucket x m's bucket among
        `buckets`) plus CALL_CELLS: on CPU a padded cell costs as much as a real one (a batch of
        8 windows of 130 codes padded to one of 318 took twice its due), so rows of very
        different sizes go in separate runs. No run of several rows pads to more than
        `max_cells` (a call's memory grows with them).
        """
        best, cut = [0.0] + [math.inf] * len(sizes), [0] * (len(sizes) + 1)
        for i in range(1, len(sizes) + 1):
            length = pick_bucket(sizes[i - 1], buckets)  # of every run ending at row i
            for j in range(max(0, i - self.batch_buckets[-1]), i):
                batch = pick_bucket(i - j, self.batch_buckets)
                if not self._fits(batch, length, max_cells):
                    continue
                cost = best[j] + CALL_CELLS + batch * length
                if cost < best[i]:
                    best[i], cut[i] = cost, j
        runs, i = [], len(sizes)
        while i:
            runs.append((cut[i], i))
            i = cut[i]
        return runs[::-1]

    def _fits(self, batch: int, length: int, max_cells: int | None) -> bool:
        """Whether a call of `batch` rows padded to `length` stays within `max_cells` (one row always does)."""
        return max_cells is None or batch == self.batch_buckets[0] or batch * length <= max_cells

    def _map(self, rows: list, run, size, buckets, max_cells: int | None) -> list:
        """`run` over runs of `rows` of similar size (`size_split` over the length `buckets` the
        rows are padded to, at most `max_cells` padded a call), side by side; one result per
        row, in order."""
        order = sorted(range(len(rows)), key=lambda i: size(rows[i]))
        split = self.size_split([size(rows[i]) for i in order], buckets, max_cells)
        runs = self.calls.map(lambda r: run([rows[i] for i in order[r[0]:r[1]]]), split)
        out = [None] * len(rows)
        for i, res in zip(order, (res for run_out in runs for res in run_out)):
            out[i] = res
        return out

    def _pack(self, rows: list[_CodeRow], t: int | None = None) -> tuple[np.ndarray, ...]:
        """DiT inputs (codes, lens, cond, spk, spk_uncond, noise) padded to a batch bucket and
        length `t` (default: the length bucket of the longest row)."""
        b = pick_bucket(len(rows), self.batch_buckets)
        t = t or pick_bucket(max(len(r.codes) for r in rows), self.length_buckets)
        rep, mel_dim = self.cfg.dit.repeats, self.cfg.dit.mel_dim
        codes = np.zeros((b, t), np.int32)
        lens = np.ones(b, np.int32)
        noise = np.zeros((b, t * rep, mel_dim), np.float32)
        cond = np.zeros((b, self.cfg.dit.enc_emb_dim), np.float32)
        spk = np.zeros((b, self.cfg.dit.enc_dim), np.float32)
        spk_u = np.zeros_like(spk)
        for j, r in enumerate(rows):
            n = len(r.codes)
            codes[j, :n] = r.codes
            lens[j] = n
            noise[j, :n * rep] = r.noise
            cond[j], spk[j], spk_u[j] = self._speakers[self.voices.get(r.voice).name]
        return codes, lens, cond, spk, spk_u, noise

    def _waveforms(self, rows: list[_CodeRow]) -> list[np.ndarray]:
        """DiT and vocoder in one call: each row's whole waveform."""
        args = self._pack(rows)
        wav = np.asarray(self.jitted.whole(self.params, *args))
        return [wav[j, :self.cfg.bigvgan.num_samples(args[1][j] * self.cfg.dit.repeats)] for j in range(len(rows))]

    def _mels(self, rows: list[_CodeRow]) -> list[np.ndarray]:
        """The streamed DiT call: each row's mel [repeats * n, mel_dim]."""
        t = pick_bucket(max(len(r.codes) for r in rows), self.stream_code_buckets)
        mel = np.asarray(self.jitted.mel(self.params, *self._pack(rows, t)))
        return [mel[j, :len(r.codes) * self.cfg.dit.repeats] for j, r in enumerate(rows)]

    def _vocode(self, mels: list[np.ndarray]) -> list[np.ndarray]:
        """The streamed vocoder call: each mel's waveform (mels of at most the largest frame bucket)."""
        b = pick_bucket(len(mels), self.batch_buckets)
        t = pick_bucket(max(len(m) for m in mels), self.stream_frame_buckets)
        x = np.zeros((b, t, self.cfg.dit.mel_dim), np.float32)
        frames = np.ones(b, np.int32)
        for j, m in enumerate(mels):
            x[j, :len(m)] = m
            frames[j] = len(m)
        wav = np.asarray(self.jitted.wave(self.params, x, frames))
        return [wav[j, :self.cfg.bigvgan.num_samples(frames[j])] for j in range(len(mels))]

    def _noise(self, req, num_codes: int) -> np.ndarray:
        """The request's initial noise for its first `num_codes` codes (its own, or drawn from its seed)."""
        rep, mel_dim = self.cfg.dit.repeats, self.cfg.dit.mel_dim
        if req.data.noise is None:
            return initial_noise(num_codes, req.sampling_params.seed, rep, mel_dim)
        if len(req.data.noise) < rep * num_codes:
            raise ValueError(f"request {req.request_id!r}: noise for {len(req.data.noise) // rep} codes, "
                             f"{num_codes} arrived")
        return req.data.noise[:rep * num_codes]

    # -- streaming -----------------------------------------------------------------------
    def stream(self, jobs) -> list[np.ndarray]:
        """Per ChunkJob, float32 samples [emitted, n): the waveform no later code can change, all of it when final.

        The DiT windows of every job run as bucketed batches, then the vocoder windows (module
        docstring). A request's final mel stays cached between calls until `release` or its final job.
        """
        if self.cfg.bigvgan.num_samples(2) != 2 * self.cfg.bigvgan.hop_length:
            raise NotImplementedError("streaming needs a vocoder with exactly hop_length samples per frame")
        states = [self._stream_state(job) for job in jobs]
        self._extend_mel(jobs, states)
        pieces = self._vocode_final(jobs, states)
        for job in jobs:
            if job.final:
                self.release(job.request.request_id)
        return pieces

    def release(self, request_id: str) -> None:
        """Forget a streamed request's cached mel (finished or aborted)."""
        self._streams.pop(request_id, None)

    def _stream_state(self, job) -> _StreamState:
        rep = self.cfg.dit.repeats
        # The first mel frame the vocoder reads next: its left context before the emitted samples.
        first = max(0, job.emitted // self.cfg.bigvgan.hop_length - self.vocoder_context[0])
        st = self._streams.get(job.request.request_id)
        if st is None or first < st.mel_start:
            # New, or released: the mel is rebuilt from there (within the DiT's bound of the old one).
            c0 = first // rep
            st = _StreamState(c0, rep * c0, np.zeros((0, self.cfg.dit.mel_dim), np.float32))
            self._streams[job.request.request_id] = st
        if len(job.codes) < st.code_end:
            raise ValueError(f"request {job.request.request_id!r}: {len(job.codes)} codes, "
                             f"fewer than the {st.code_end} already decoded")
        return st

    def _extend_mel(self, jobs, states: list[_StreamState]) -> None:
        """Make final the mel of every code with `right_codes` of look-ahead (all of them when final)."""
        rep, ctx = self.cfg.dit.repeats, self.context
        # Fewer pieces than parallel calls: windows no longer than the largest chunk's, so a
        # long piece runs as several side by side (the DiT's many small ops run on one core).
        cap = self.stream_code_buckets[-1] if len(jobs) >= self.calls.workers else self.chunk_window
        rows, keep = [], []
        for job, st in zip(jobs, states):
            n = len(job.codes)
            windows = plan_windows(st.code_end, n if job.final else n - ctx.right_codes, n, ctx.left_codes,
                                   ctx.right_codes, self.block_codes, cap)
            noise = self._noise(job.request, n) if windows else None
            for start, a, b, end in windows:
                rows.append(_CodeRow(np.asarray(job.codes[start:end], np.int32), noise[rep * start:rep * end],
                                     job.request.data.voice))
                keep.append((st, rep * (a - start), rep * (b - start), b))
        mels = self._map(rows, self._mels, lambda r: len(r.codes), self.stream_code_buckets, self.max_batch_codes)
        for mel, (st, k0, k1, code_end) in zip(mels, keep):
            st.mel = np.concatenate([st.mel, mel[k0:k1]])
            st.code_end = code_end

    def _vocode_final(self, jobs, states: list[_StreamState]) -> list[np.ndarray]:
        """Vocode each job's final mel from its emitted samples to `right` frames before the mel ends."""
        hop, (left, right) = self.cfg.bigvgan.hop_length, self.vocoder_context
        rows, keep = [], []
        for i, (job, st) in enumerate(zip(jobs, states)):
            mel_end = st.mel_start + len(st.mel)
            # A final job's mel ends where the request does: its own border, nothing held back.
            windows = plan_windows(job.emitted // hop, mel_end if job.final else mel_end - right, mel_end, left,
                                   right, 1, self.stream_frame_buckets[-1])
            for start, a, b, end in windows:
                rows.append(st.mel[start - st.mel_start:end - st.mel_start])
                keep.append((i, hop * (a - start), hop * (b - start)))
        pieces = [[np.zeros(0, np.float32)] for _ in jobs]
        wavs = self._map(rows, self._vocode, len, self.stream_frame_buckets, self._max_batch_frames)
        for wav, (i, s0, s1) in zip(wavs, keep):
            pieces[i].append(wav[s0:s1])
        out = []
        for job, st, ps in zip(jobs, states, pieces):
            wav = np.concatenate(ps)
            if len(ps) > 1:
                wav = wav[job.emitted % hop:]  # an emitted count inside a frame
            out.append(wav)
            # Keep only the mel the vocoder's left context still needs.
            cut = max(0, (job.emitted + len(wav)) // hop - left) - st.mel_start
            if cut > 0:
                st.mel, st.mel_start = st.mel[cut:], st.mel_start + cut
        return out

    # -- warm-up -------------------------------------------------------------------------
    def warmup(self) -> None:
        """Compile the whole-request call at every (batch, length) bucket a call can take."""
        warm_up((self.jitted.whole, (self.params, *self._zeros(b, t)))
                for b, t in self._shapes(self.length_buckets, self.max_batch_codes))

    def warmup_stream(self) -> None:
        """Compile the streamed DiT and vocoder calls (the first window, a length per chunk size
        and the lengths above) at every batch bucket a call can take."""
        mel = [(self.jitted.mel, (self.params, *self._zeros(b, t)))
               for b, t in self._shapes(self.stream_code_buckets, self.max_batch_codes)]
        wave = [(self.jitted.wave, (self.params, np.zeros((b, f, self.cfg.dit.mel_dim), np.float32),
                                    np.ones(b, np.int32)))
                for b, f in self._shapes(self.stream_frame_buckets, self._max_batch_frames)]
        warm_up(mel + wave)

    def _shapes(self, lengths: Sequence[int], max_cells: int | None) -> list[tuple[int, int]]:
        """The (batch, length) buckets of the calls `_map` makes over `lengths` within `max_cells`."""
        return [(b, t) for b in self.batch_buckets for t in lengths if self._fits(b, t, max_cells)]

    def _zeros(self, b: int, t: int) -> tuple[np.ndarray, ...]:
        """Zero DiT inputs of a (batch, length) bucket."""
        d = self.cfg.dit
        return (np.zeros((b, t), np.int32), np.ones(b, np.int32), np.zeros((b, d.enc_emb_dim), np.float32),
                np.zeros((b, d.enc_dim), np.float32), np.zeros((b, d.enc_dim), np.float32),
                np.zeros((b, t * d.repeats, d.mel_dim), np.float32))
