"""Token2wav stage: codec tokens -> mel (DiT flow matching) -> 24 kHz waveform (BigVGAN).

`Qwen2_5OmniToken2Wav` holds both models under their checkpoint names
(`token2wav.code2wav_dit_model`, `token2wav.code2wav_bigvgan_model`).
`Token2WavSynthesizer` serves batches of whole requests for the `OneShotEngine`:
requests are padded to a (batch, code length) bucket and run through one jitted
function; padded frames are masked in the DiT's attention and BigVGAN's borders,
so every request's waveform equals its unpadded result. Each request's initial
noise is drawn from its own seed for its own length (or passed in explicitly),
so batching never changes its audio. Speaker embeddings are computed once per voice.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ...engine.buckets import pick_bucket
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

    def __call__(self, codes, code_lens, cond, spk, spk_uncond, noise, **solver):
        """codes [B, T] (padded), code_lens [B], cond [B, E], spk/spk_uncond [B, enc_dim],
        noise [B, repeats*T, mel] -> waveform [B, samples] (zero past each row's length)."""
        mel = self.mel(codes, code_lens, cond, spk, spk_uncond, noise, **solver)
        return self.waveform(mel, code_lens * self.cfg.dit.repeats)

    def mel(self, codes, code_lens, cond, spk, spk_uncond, noise, *, num_steps: int = 10,
            guidance_scale: float = 0.5, sway_coefficient: float = -1.0):
        """The DiT's flow-matching solve: the same inputs as __call__ -> mel [B, repeats*T, mel_dim]."""
        frames = code_lens * self.cfg.dit.repeats
        frame_mask = jnp.arange(noise.shape[1])[None, :] < frames[:, None]
        return self.code2wav_dit_model.solve(codes, cond, None, noise, num_steps=num_steps,
                                             guidance_scale=guidance_scale, sway_coefficient=sway_coefficient,
                                             frame_mask=frame_mask, speaker_embeds=(spk, spk_uncond))

    def waveform(self, mel, frames):
        """BigVGAN: mel [B, F, mel_dim] with `frames` [B] valid -> waveform [B, samples]."""
        return self.code2wav_bigvgan_model(mel, frames, channels_last=True)


# See Token2WavSynthesizer.batch_split.
MIN_BUCKET_FILL = 0.75


@dataclasses.dataclass(frozen=True)
class _CodeRow:
    """One DiT input row: codes, their slice of the request's noise, and the voice."""

    codes: np.ndarray  # [n] int32
    noise: np.ndarray  # [repeats * n, mel_dim]
    voice: str | None


class Token2WavSynthesizer:
    """Bucketed, jitted batches of whole token2wav requests (see module docstring)."""

    def __init__(self, model: Qwen2_5OmniToken2Wav, voices: Voices, *, length_buckets, batch_buckets,
                 num_steps: int = 10, guidance_scale: float = 0.5, sway_coefficient: float = -1.0,
                 max_num_seqs: int | None = None):
        self.cfg = model.cfg
        self.voices = voices
        self.length_buckets = tuple(length_buckets)
        self.batch_buckets = tuple(batch_buckets)
        # Requests per call: one call per batch run of a step, side by side when there are several.
        self.calls = CallPool(max_num_seqs or self.batch_buckets[-1], self.batch_buckets[-1])
        self.kw = dict(num_steps=num_steps, guidance_scale=guidance_scale, sway_coefficient=sway_coefficient)
        self.graphdef, self.state = nnx.split(model)
        self._fn = jax.jit(lambda s, *a: nnx.merge(self.graphdef, s)(*a, **self.kw))
        dit = model.code2wav_dit_model
        spk_fn = jax.jit(lambda s, m: nnx.merge(*nnx.split(dit)[:1], s).speaker_embedding(m))
        dit_state = nnx.split(dit)[1]
        self._speakers = {}
        for name in voices.names:
            v = voices.get(name)
            self._speakers[name] = (v.cond[0], np.asarray(spk_fn(dit_state, v.ref_mel))[0],
                                    np.asarray(spk_fn(dit_state, np.zeros_like(v.ref_mel)))[0])

    @property
    def max_codes(self) -> int:
        return self.length_buckets[-1]

    def validate(self, req) -> None:
        if req.num_prompt_tokens > self.max_codes:
            raise ValueError(f"{req.num_prompt_tokens} codec tokens exceed the largest vocoder bucket "
                             f"({self.max_codes})")
        self.voices.get(req.data.voice)  # unknown voice -> ValueError listing the voices
        if req.data.noise is not None and req.data.noise.shape != (req.num_prompt_tokens * self.cfg.dit.repeats,
                                                                    self.cfg.dit.mel_dim):
            raise ValueError(f"noise of shape {req.data.noise.shape} does not fit {req.num_prompt_tokens} codes")

    # -- whole requests ------------------------------------------------------------------
    def __call__(self, reqs) -> list[np.ndarray]:
        """Waveforms of whole requests, batched by bucket."""
        rows = [_CodeRow(r.prompt_token_ids, self._noise(r, r.num_prompt_tokens), r.data.voice) for r in reqs]
        return self._map(rows, self._waveforms)

    def batch_split(self, n: int) -> list[tuple[int, int]]:
        """(start, end) of the runs that serve n requests.

        A padding row costs as much as a real one (on CPU the vocoder's time grows linearly
        with the batch), so a run pads up to a bucket only when it fills at least
        MIN_BUCKET_FILL of it, and otherwise takes the largest bucket that fits.
        """
        runs, i = [], 0
        while i < n:
            left = n - i
            up = pick_bucket(min(left, self.batch_buckets[-1]), self.batch_buckets)
            down = max([b for b in self.batch_buckets if b <= left], default=None)
            take = min(left, up) if down is None or min(left, up) >= MIN_BUCKET_FILL * up else down
            runs.append((i, i + take))
            i += take
        return runs

    def _map(self, rows: list, run) -> list:
        """`run` over the bucket-sized runs of `rows` (side by side); one result per row, in order."""
        runs = self.calls.map(lambda r: run(rows[r[0]:r[1]]), self.batch_split(len(rows)))
        return [out for run_out in runs for out in run_out]

    def _pack(self, rows: list[_CodeRow]) -> tuple[np.ndarray, ...]:
        """DiT inputs (codes, lens, cond, spk, spk_uncond, noise) padded to a (batch, length) bucket."""
        b = pick_bucket(len(rows), self.batch_buckets)
        t = pick_bucket(max(len(r.codes) for r in rows), self.length_buckets)
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
        wav = np.asarray(self._fn(self.state, *args))
        return [wav[j, :self.cfg.bigvgan.num_samples(args[1][j] * self.cfg.dit.repeats)] for j in range(len(rows))]

    def _noise(self, req, num_codes: int) -> np.ndarray:
        """The request's initial noise for its first `num_codes` codes (its own, or drawn from its seed)."""
        rep, mel_dim = self.cfg.dit.repeats, self.cfg.dit.mel_dim
        if req.data.noise is None:
            return initial_noise(num_codes, req.sampling_params.seed, rep, mel_dim)
        if len(req.data.noise) < rep * num_codes:
            raise ValueError(f"request {req.request_id!r}: noise for {len(req.data.noise) // rep} codes, "
                             f"{num_codes} arrived")
        return req.data.noise[:rep * num_codes]

    # -- warm-up -------------------------------------------------------------------------
    def warmup(self) -> None:
        """Compile the whole-request call at every (batch, length) bucket."""
        for b in self.batch_buckets:
            for t in self.length_buckets:
                jax.block_until_ready(self._fn(self.state, *self._zeros(b, t)))

    def _zeros(self, b: int, t: int) -> tuple[np.ndarray, ...]:
        """Zero DiT inputs of a (batch, length) bucket."""
        d = self.cfg.dit
        return (np.zeros((b, t), np.int32), np.ones(b, np.int32), np.zeros((b, d.enc_emb_dim), np.float32),
                np.zeros((b, d.enc_dim), np.float32), np.zeros((b, d.enc_dim), np.float32),
                np.zeros((b, t * d.repeats, d.mel_dim), np.float32))
