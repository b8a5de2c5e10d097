"""Qwen2.5-Omni token2wav BigVGAN vocoder (mel -> 24 kHz waveform) in Flax NNX.

Port of transformers' ``Qwen2_5OmniToken2WavBigVGANModel``:

* mel preprocessing: the DiT's natural-log mel is turned into dB
  (``20 log10(max(exp(mel), 10^(-115/20))) - 20``) and mapped linearly from
  ``[-115, 0]`` dB to ``[-1, 1]`` (clamped);
* ``conv_pre`` (k7), then per upsampling stage a ``ConvTranspose1d`` (``ups.N.0`` in
  the checkpoint) followed by the mean of ``len(resblock_kernel_sizes)`` AMP blocks;
* AMP blocks: three (dilated conv, conv) pairs with residuals, each conv preceded by
  an anti-aliased SnakeBeta (x2 kaiser-sinc upsampling, SnakeBeta with log-scale
  ``alpha``/``beta``, x2 kaiser-sinc downsampling, edge-replicated borders);
* ``activation_post``, ``conv_post`` (k7, no bias) and a clamp to ``[-1, 1]``.

With the real config the waveform has ``prod(upsample_rates) = 240`` samples per mel
frame (transformers additionally squeezes the batch axis away; here it stays). The
kaiser-sinc filters are constants derived from the config (cached numpy arrays, never
parameters), applied as sums of shifted slices times scalar taps (XLA fuses them; a
depthwise convolution is several times slower on CPU), the x2 upsampler in polyphase
form so no multiply hits a stuffed zero. Inside the anti-aliased activation the
upsampled signal stays split into its two phases, and sin^2 is a short polynomial:
XLA's CPU sine was most of the vocoder's time. A stage's AMP blocks run side by side, their
channels stacked, so each activation is compiled once for the three blocks: the program is
half as long to compile (tiny vocoder on CPU: about 12 s -> 6.5 s; the real one for H100:
40 s -> 27 s), at some cost on CPU (the tiny vocoder runs 10-30% slower: the per-block
convolutions read and write slices of the stacked channels).

Layouts: the public call takes the mel as transformers does, ``[B, mel_dim, T]``
(``channels_last=True`` for ``[B, T, mel_dim]``), and returns ``[B, num_samples(T)]``;
inside everything is channels-last (NWC).

Padding to shape buckets: the vocoder is convolutional and non-causal, so frames past
the end of a mel influence the last samples of its waveform. Passing ``lengths [B]``
(valid frames per row) re-creates, after every layer, the borders transformers sees on
the unpadded input (zeros before each zero-padded convolution, the last valid sample
before each edge-replicated resampling filter): the first ``num_samples(lengths[b])``
samples of row ``b`` then equal the unpadded result whatever the padding frames hold,
and the samples after them are zero. Without ``lengths`` every frame counts, as in
transformers, and padding leaks backwards: one frame reaches 6368 samples (26.5 frames)
before its own start (real and tiny configs share the kernel sizes, dilations and rates
that set this), and with random weights edge-replicated padding changes the last ~3.9k
samples of the valid part by more than 1e-6 (~3.1k by more than 1e-4); no padding value
makes it exact.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# Checkpoint key renames, relative to ``token2wav.code2wav_bigvgan_model.``: transformers
# wraps each ConvTranspose1d in a one-element ModuleList (``ups.N.0``); here ``ups`` is a
# flat list.
HF_RENAMES = [(r"^ups\.(\d+)\.0\.", r"ups.\1.")]

# transformers' anti-aliased activation: x2 up, x2 down, 12-tap filters.
_AA_RATIO = 2
_AA_KERNEL = 12
_SNAKE_EPS = 1e-9
# conv_pre and conv_post: kernel 7, zero padding 3 each side.
_EDGE_CONV_KERNEL = 7
_EDGE_CONV_PAD = 3
# process_mel_spectrogram constants.
_MIN_DB = -115.0
_DB_OFFSET = -20.0
_MAX_VALUE = 1.0


@dataclasses.dataclass(frozen=True)
class BigVGANConfig:
    """Hyper-parameters of the vocoder (the HF ``token2wav_config.bigvgan_config``)."""

    mel_dim: int = 80
    upsample_initial_channel: int = 1536
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    upsample_rates: tuple[int, ...] = (5, 3, 2, 2, 2, 2)
    upsample_kernel_sizes: tuple[int, ...] = (11, 7, 4, 4, 4, 4)

    @classmethod
    def from_hf(cls, d: dict) -> "BigVGANConfig":
        """Build from the ``bigvgan_config`` dict of an HF config.json (missing keys take HF defaults)."""
        kw = {}
        for f in dataclasses.fields(cls):
            if f.name not in d or d[f.name] is None:
                continue
            v = d[f.name]
            if f.name == "resblock_dilation_sizes":
                v = tuple(tuple(int(x) for x in dil) for dil in v)
            elif isinstance(v, (list, tuple)):
                v = tuple(int(x) for x in v)
            kw[f.name] = v
        cfg = cls(**kw)
        if len(cfg.upsample_rates) != len(cfg.upsample_kernel_sizes):
            raise ValueError("upsample_rates and upsample_kernel_sizes differ in length")
        if len(cfg.resblock_kernel_sizes) != len(cfg.resblock_dilation_sizes):
            raise ValueError("resblock_kernel_sizes and resblock_dilation_sizes differ in length")
        return cfg

    @property
    def hop_length(self) -> int:
        """Nominal waveform samples per mel frame (``prod(upsample_rates)``; 240 for the real model)."""
        return math.prod(self.upsample_rates)

    def context_frames(self) -> tuple[int, int]:
        """(left, right) mel frames beyond its own that one frame's samples depend on.

        The receptive field, walked back from one frame's samples through every layer's
        kernel (34 and 34 for the real and tiny configs; in fp32 the influence past ~26.5
        frames is below rounding). Vocoding a window with this much context on each side,
        or the sequence's own border, gives exactly the samples of the whole mel.
        """
        aa_back, aa_ahead = _anti_aliased_reach(_AA_RATIO, _AA_KERNEL)
        amp_back = amp_ahead = 0
        for k, dils in zip(self.resblock_kernel_sizes, self.resblock_dilation_sizes):
            pads = [(_resblock_padding(k, d), d * (k - 1)) for d in dils[:3]] + [((k - 1) // 2, k - 1)] * 3
            amp_back = max(amp_back, 6 * aa_back + sum(p for p, _ in pads))
            amp_ahead = max(amp_ahead, 6 * aa_ahead + sum(span - p for p, span in pads))
        lo, hi = -_EDGE_CONV_PAD - aa_back, self.hop_length - 1 + _EDGE_CONV_PAD + aa_ahead  # conv_post, act
        for rate, k in reversed(list(zip(self.upsample_rates, self.upsample_kernel_sizes))):
            lo, hi = lo - amp_back, hi + amp_ahead
            # Input i of the transposed conv reaches outputs [rate*i - p, rate*i - p + k - 1].
            p = (k - rate) // 2
            lo, hi = -((k - 1 - p - lo) // rate), (hi + p) // rate
        return _EDGE_CONV_PAD - lo, hi + _EDGE_CONV_PAD  # conv_pre

    def num_samples(self, num_frames):
        """Waveform length for ``num_frames`` mel frames (int or integer array)."""
        n = num_frames
        for rate, k in zip(self.upsample_rates, self.upsample_kernel_sizes):
            n = _conv_transpose_len(n, k, rate)
        return n


def _conv_transpose_len(n, kernel: int, stride: int):
    # torch ConvTranspose1d length with padding (k - s) // 2, no output_padding.
    return (n - 1) * stride - 2 * ((kernel - stride) // 2) + kernel


def _resblock_padding(kernel: int, dilation: int) -> int:
    return int((kernel * dilation - dilation) / 2)


def _anti_aliased_reach(ratio: int, kernel: int) -> tuple[int, int]:
    """(back, ahead) input samples one output of the anti-aliased activation depends on.

    The upsampler spreads input i over [ratio*i - a, ratio*i + kernel - 1 - a] (a = its
    crop, (kernel - ratio) // 2); downsampled output o reads [ratio*o - d, ratio*o + kernel - 1 - d]
    (d = its left padding).
    """
    a, d = (kernel - ratio) // 2, _downsample_plan(ratio, kernel)[1]
    return (kernel - 1 - a + d) // ratio, (kernel - 1 - d + a) // ratio


# ---------------------------------------------------------------------------
# Mel preprocessing
# ---------------------------------------------------------------------------


def process_mel_spectrogram(mel: jax.Array) -> jax.Array:
    """Natural-log mel -> normalised dB spectrogram in ``[-1, 1]`` (transformers' preprocessing)."""
    min_level = np.exp(np.float32(_MIN_DB / 20.0 * np.log(10.0)), dtype=np.float32)
    amplitude = jnp.exp(mel)
    db = 20.0 * jnp.log10(jnp.maximum(amplitude, jnp.asarray(min_level, mel.dtype))) + _DB_OFFSET
    out = (2.0 * _MAX_VALUE) * ((db - _MIN_DB) / (-_MIN_DB)) - _MAX_VALUE
    return jnp.clip(out, -_MAX_VALUE, _MAX_VALUE)


# ---------------------------------------------------------------------------
# Anti-aliased resampling (constant kaiser-sinc FIR filters)
# ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def kaiser_sinc_filter1d(cutoff: float, half_width: float, kernel_size: int) -> np.ndarray:
    """Kaiser-windowed sinc low-pass filter ``[kernel_size]`` (float32, sums to 1; read-only)."""
    half = kernel_size // 2
    delta_f = 4 * half_width
    attenuation = 2.285 * (half - 1) * math.pi * delta_f + 7.95
    if attenuation > 50.0:
        beta = 0.1102 * (attenuation - 8.7)
    elif attenuation >= 21.0:
        beta = 0.5842 * (attenuation - 21) ** 0.4 + 0.07886 * (attenuation - 21.0)
    else:
        beta = 0.0
    window = np.kaiser(kernel_size, beta)  # symmetric window, as torch's periodic=False
    if kernel_size % 2 == 0:
        t = np.arange(-half, half) + 0.5
    else:
        t = np.arange(kernel_size) - half
    if cutoff == 0:
        taps = np.zeros(kernel_size)
    else:
        taps = 2 * cutoff * window * np.sinc(2 * cutoff * t)
        taps = taps / taps.sum()
    taps = taps.astype(np.float32)
    taps.setflags(write=False)
    return taps


def _edge_pad(x: jax.Array, left: int, right: int) -> jax.Array:
    return jnp.pad(x, ((0, 0), (left, right), (0, 0)), mode="edge")


def _fir(x: jax.Array, taps: np.ndarray, stride: int = 1) -> jax.Array:
    """Valid correlation of every channel of ``x [B, T, C]`` with the host constant ``taps [k]``.

    Written as a sum of shifted (strided) slices times scalars rather than a grouped
    convolution: XLA fuses it into one elementwise loop, where a depthwise convolution
    with a handful of taps is several times slower on CPU.
    """
    k = len(taps)
    n_out = (x.shape[1] - k) // stride + 1
    y = None
    for j, tap in enumerate(np.asarray(taps, np.float32).tolist()):
        term = jax.lax.slice_in_dim(x, j, j + (n_out - 1) * stride + 1, stride=stride, axis=1) * \
            jnp.asarray(tap, x.dtype)
        y = term if y is None else y + term
    return y


@functools.lru_cache(maxsize=None)
def _upsample_plan(ratio: int, kernel_size: int):
    """Polyphase form of the x``ratio`` transposed-conv filter: (pad, crop_left, [L, ratio] taps)."""
    if kernel_size % ratio:
        raise ValueError(f"upsampling kernel {kernel_size} is not a multiple of the ratio {ratio}")
    taps = kaiser_sinc_filter1d(0.5 / ratio, 0.6 / ratio, kernel_size)
    L = kernel_size // ratio
    # Output n = m*ratio + q of the full transposed conv is ratio * sum_l xp[m - l] f[q + l*ratio];
    # as a correlation over xp[m - L + 1 .. m] the phase-q taps are reversed.
    phases = (ratio * taps.astype(np.float64)).reshape(L, ratio)[::-1]  # [l', q]
    pad = kernel_size // ratio - 1
    crop_left = pad * ratio + (kernel_size - ratio) // 2
    return pad, crop_left, phases.astype(np.float32)


def upsample1d(x: jax.Array, ratio: int = _AA_RATIO, kernel_size: int | None = None) -> jax.Array:
    """transformers' ``UpSample1d`` on ``[B, T, C]`` -> ``[B, ratio * T, C]``.

    Edge-replicate ``kernel_size // ratio - 1`` samples each side, depthwise transposed
    convolution (stride ``ratio``) with the kaiser-sinc filter times ``ratio``, then crop;
    computed in polyphase form (``ratio`` short filters on the input rate, interleaved).
    """
    k = int(6 * ratio // 2) * 2 if kernel_size is None else kernel_size
    pad, crop_left, phases = _upsample_plan(ratio, k)
    B, T, C = x.shape
    L = phases.shape[0]
    xp = jnp.pad(_edge_pad(x, pad, pad), ((0, 0), (L - 1, L - 1), (0, 0)))
    y = jnp.stack([_fir(xp, phases[:, q]) for q in range(ratio)], axis=2)  # [B, M, ratio, C]
    M = y.shape[1]
    y = y.reshape(B, M * ratio, C)
    return jax.lax.slice_in_dim(y, crop_left, crop_left + ratio * T, axis=1)


@functools.lru_cache(maxsize=None)
def _downsample_plan(ratio: int, kernel_size: int):
    """transformers' DownSample1d filter: (kaiser-sinc taps, left and right edge padding)."""
    taps = kaiser_sinc_filter1d(0.5 / ratio, 0.6 / ratio, kernel_size)
    return taps, kernel_size // 2 - int(kernel_size % 2 == 0), kernel_size // 2


def downsample1d(x: jax.Array, ratio: int = _AA_RATIO, kernel_size: int = _AA_KERNEL) -> jax.Array:
    """transformers' ``DownSample1d`` on ``[B, T, C]``: edge padding, low-pass, stride ``ratio``."""
    taps, pad_left, pad_right = _downsample_plan(ratio, kernel_size)
    return _fir(_edge_pad(x, pad_left, pad_right), taps, ratio)


# ---------------------------------------------------------------------------
# Valid-length masks (bucket padding)
# ---------------------------------------------------------------------------


def _zero_tail(x: jax.Array, n: jax.Array | None) -> jax.Array:
    """Zero the positions at or past ``n[b]`` (what a zero-padded conv sees past the end)."""
    if n is None:
        return x
    idx = jnp.arange(x.shape[1], dtype=jnp.int32)
    return jnp.where(idx[None, :, None] < n[:, None, None], x, jnp.zeros((), x.dtype))


def _edge_tail(x: jax.Array, n: jax.Array | None) -> jax.Array:
    """Replace the positions at or past ``n[b]`` with sample ``n[b] - 1`` (edge padding past the end)."""
    if n is None:
        return x
    last_idx = jnp.clip(n - 1, 0, x.shape[1] - 1)[:, None, None]
    last = jnp.take_along_axis(x, jnp.broadcast_to(last_idx, (x.shape[0], 1, x.shape[2])), axis=1)
    idx = jnp.arange(x.shape[1], dtype=jnp.int32)
    return jnp.where(idx[None, :, None] < n[:, None, None], x, last)


# ---------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------


# pi in three float32 parts (the first two have few mantissa bits, so k * part is exact).
_PI_PARTS = (np.float32(3.140625), np.float32(9.67502593994140625e-4),
             np.float32(np.pi - 3.140625 - 9.67502593994140625e-4))
# Taylor coefficients of sin(r) / r in r^2, highest first.
_SIN_COEFFS = (1.6059044e-10, -2.5052108e-08, 2.7557319e-06, -1.9841270e-04, 8.3333333e-03, -1.6666667e-01, 1.0)


def sin_squared(z: jax.Array) -> jax.Array:
    """``sin(z) ** 2`` within ~5e-7 (absolute) of the exact value, as a short polynomial.

    sin^2 has period pi and is even, so one reduction by pi and an odd polynomial on
    [-pi/2, pi/2] suffice. XLA's CPU ``sin`` costs ~10 ns an element and was most of the
    vocoder's time; this is ~8x cheaper and cheap on GPU too.
    """
    k = jnp.round(z * np.float32(1 / np.pi))
    r = z
    for part in _PI_PARTS:
        r = r - k * jnp.asarray(part, z.dtype)
    r2 = r * r
    p = jnp.asarray(_SIN_COEFFS[0], z.dtype)
    for c in _SIN_COEFFS[1:]:
        p = p * r2 + jnp.asarray(c, z.dtype)
    return jnp.square(r * p)


class SnakeBeta(nnx.Module):
    """SnakeBeta activation ``x + sin^2(x e^alpha) / (e^beta + 1e-9)``, per channel (last axis).

    ``alpha`` and ``beta`` are stored in log scale, as in the checkpoint.
    """

    def __init__(self, channels: int, *, param_dtype=jnp.float32):
        self.alpha = nnx.Param(jnp.zeros((channels,), param_dtype))
        self.beta = nnx.Param(jnp.zeros((channels,), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        return snake_beta(x, self.alpha[...], self.beta[...])


def snake_beta(x: jax.Array, log_alpha: jax.Array, log_beta: jax.Array) -> jax.Array:
    """SnakeBeta on the last axis with per-channel log-scale parameters."""
    alpha = jnp.exp(log_alpha).astype(x.dtype)
    beta = jnp.exp(log_beta).astype(x.dtype)
    return x + (1.0 / (beta + _SNAKE_EPS)) * sin_squared(x * alpha)


class AntiAliasedActivation1d(nnx.Module):
    """x2 kaiser-sinc upsampling -> SnakeBeta -> x2 kaiser-sinc downsampling (length preserved)."""

    def __init__(self, channels: int, *, param_dtype=jnp.float32):
        self.act = SnakeBeta(channels, param_dtype=param_dtype)

    def __call__(self, x: jax.Array, n: jax.Array | None = None) -> jax.Array:
        return snake_anti_aliased(x, self.act.alpha[...], self.act.beta[...], n)


@jax.jit
def snake_anti_aliased(x: jax.Array, log_alpha: jax.Array, log_beta: jax.Array,
                       n: jax.Array | None = None) -> jax.Array:
    """`anti_aliased` SnakeBeta. Its own jit: the vocoder calls it six times per stage on one
    shape, and a nested jit is traced and lowered once per shape (XLA inlines the calls)."""
    return anti_aliased(x, lambda v: snake_beta(v, log_alpha, log_beta), n)


def anti_aliased(x: jax.Array, act, n: jax.Array | None = None, ratio: int = _AA_RATIO,
                 kernel_size: int = _AA_KERNEL) -> jax.Array:
    """``downsample1d(act(upsample1d(x)))`` on ``[B, T, C]`` with the ``n`` borders, in polyphase form.

    The upsampled signal is kept as ``ratio`` phase streams of length T (``u[ratio*t + r]``
    in stream r) and the down-sampler reads them directly, so the 2T-long signal is never
    interleaved: everything is shifted slices and elementwise math that XLA fuses.
    """
    B, T, C = x.shape
    x = _edge_tail(x, n)
    pad, crop_left, phases = _upsample_plan(ratio, kernel_size)
    L = phases.shape[0]
    xp = jnp.pad(_edge_pad(x, pad, pad), ((0, 0), (L - 1, L - 1), (0, 0)))
    streams = []
    for r in range(ratio):
        # Sample ratio*t + r of the cropped output is phase q of full position m0 + t.
        m0, q = divmod(crop_left + r, ratio)
        streams.append(act(_fir(jax.lax.slice_in_dim(xp, m0, m0 + T + L - 1, axis=1), phases[:, q])))
    if n is not None:
        # Edge-replicate past sample ratio*n - 1 (the last phase's element n - 1): the borders
        # transformers sees on the unpadded input.
        last_idx = jnp.broadcast_to(jnp.clip(n - 1, 0, T - 1)[:, None, None], (B, 1, C))
        last = jnp.take_along_axis(streams[-1], last_idx, axis=1)
        keep = jnp.arange(T, dtype=jnp.int32)[None, :, None] < n[:, None, None]
        streams = [jnp.where(keep, s, last) for s in streams]
    taps, pad_left, _ = _downsample_plan(ratio, kernel_size)
    # The down-sampler's edge padding repeats the first and last sample of the whole signal,
    # which are stream 0's first and the last stream's last element.
    lo = -((-pad_left) // ratio)
    hi = (ratio * (T - 1) + kernel_size - 1 - pad_left) // ratio - (T - 1)
    first = jnp.broadcast_to(streams[0][:, :1], (B, lo, C))
    end = jnp.broadcast_to(streams[-1][:, T - 1:], (B, hi, C))
    streams = [jnp.concatenate([first, s, end], axis=1) for s in streams]
    # Materialise the streams once: fused into the 12 taps below, XLA would recompute the
    # activation (its sines) for every tap.
    streams = jax.lax.optimization_barrier(streams)
    y = None
    for j, tap in enumerate(taps.tolist()):
        r, off = (j - pad_left) % ratio, (j - pad_left) // ratio  # input ratio*m + j - pad_left
        term = jax.lax.slice_in_dim(streams[r], lo + off, lo + off + T, axis=1) * jnp.asarray(tap, x.dtype)
        y = term if y is None else y + term
    return y


class AMPBlock(nnx.Module):
    """BigVGAN residual block: per dilation, act -> dilated conv -> act -> conv, plus residual.

    The vocoder runs a stage's blocks together (:func:`amp_blocks_mean`).
    """

    def __init__(self, channels: int, kernel_size: int, dilations, *, dtype, param_dtype, precision,
                 rngs: nnx.Rngs):
        if len(dilations) < 3:
            raise ValueError(f"an AMP block needs 3 dilations, got {tuple(dilations)}")
        dilations = tuple(dilations)[:3]  # transformers builds exactly three pairs and ignores the rest
        common = dict(dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)

        def conv(d):
            p = _resblock_padding(kernel_size, d)
            return nnx.Conv(channels, channels, kernel_size=(kernel_size,), kernel_dilation=(d,),
                            padding=((p, p),), **common)

        self.convs1 = nnx.List([conv(d) for d in dilations])
        self.convs2 = nnx.List([conv(1) for _ in dilations])
        # Interleaved like transformers: activations[2i] before convs1[i], [2i+1] before convs2[i].
        self.activations = nnx.List([AntiAliasedActivation1d(channels, param_dtype=param_dtype)
                                     for _ in range(2 * len(dilations))])

    def __call__(self, x: jax.Array, n: jax.Array | None = None) -> jax.Array:
        return amp_blocks_mean([self], x, n)


def amp_blocks_mean(blocks, x: jax.Array, n: jax.Array | None = None) -> jax.Array:
    """``mean(block(x) for block in blocks)``: one upsampling stage's AMP blocks on the same input.

    The blocks run side by side with their channels stacked, ``[B, T, len(blocks) * C]``, so
    each anti-aliased activation (per channel: FIR, SnakeBeta, FIR) runs once for all of them;
    only the convolutions run per block. Every value is the block's own: what changes is the
    program, with a third of the activation code that was most of what XLA compiled.
    """
    c, k = x.shape[-1], len(blocks)

    def act(h, i):  # activations[i] of every block, on the stacked channels
        log_alpha = jnp.concatenate([b.activations[i].act.alpha[...] for b in blocks])
        log_beta = jnp.concatenate([b.activations[i].act.beta[...] for b in blocks])
        return snake_anti_aliased(h, log_alpha, log_beta, n)

    def conv(h, convs):  # each block's conv on its own channels
        h = _zero_tail(h, n)
        return jnp.concatenate([cv(h[..., j * c:(j + 1) * c]) for j, cv in enumerate(convs)], axis=-1)

    xs = jnp.concatenate([x] * k, axis=-1)
    for i in range(len(blocks[0].convs1)):
        h = conv(act(xs, 2 * i), [b.convs1[i] for b in blocks])
        h = conv(act(h, 2 * i + 1), [b.convs2[i] for b in blocks])
        xs = xs + h
    acc = xs[..., :c]
    for j in range(1, k):
        acc = acc + xs[..., j * c:(j + 1) * c]
    return acc / k


class Qwen2_5OmniBigVGAN(nnx.Module):
    """The token2wav BigVGAN vocoder: mel ``[B, mel_dim, T]`` -> waveform ``[B, num_samples(T)]``.

    Attribute names mirror ``token2wav.code2wav_bigvgan_model`` (apply :data:`HF_RENAMES`).
    ``precision`` applies to every convolution; the default is HIGHEST for float32 compute
    (parity, and no TF32 on GPU) and the backend default otherwise.
    """

    def __init__(self, config: BigVGANConfig, *, dtype=jnp.float32, param_dtype=jnp.float32,
                 precision=None, rngs: nnx.Rngs):
        if precision is None and jnp.dtype(dtype) == jnp.float32:
            precision = jax.lax.Precision.HIGHEST
        self.config = config
        self.dtype = dtype
        common = dict(dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        c0 = config.upsample_initial_channel
        self.conv_pre = nnx.Conv(config.mel_dim, c0, kernel_size=(_EDGE_CONV_KERNEL,),
                                 padding=((_EDGE_CONV_PAD, _EDGE_CONV_PAD),), **common)
        ups = []
        for i, (rate, k) in enumerate(zip(config.upsample_rates, config.upsample_kernel_sizes)):
            p = (k - rate) // 2
            # torch ConvTranspose1d(weight [in, out, k], padding p) == lax.conv_transpose with the
            # kernel read as the forward conv's (transpose_kernel) and k-1-p padding on the
            # dilated input; the mapping's [out, in, k] -> [k, in, out] move gives exactly the
            # [k, C_out, C_in] kernel nnx.ConvTranspose(transpose_kernel=True) stores.
            ups.append(nnx.ConvTranspose(c0 // 2**i, c0 // 2 ** (i + 1), kernel_size=(k,), strides=(rate,),
                                         padding=((k - 1 - p, k - 1 - p),), transpose_kernel=True, **common))
        self.ups = nnx.List(ups)
        self.resblocks = nnx.List([
            AMPBlock(c0 // 2 ** (i + 1), k, dil, **common)
            for i in range(len(config.upsample_rates))
            for k, dil in zip(config.resblock_kernel_sizes, config.resblock_dilation_sizes)
        ])
        c_last = c0 // 2 ** len(config.upsample_rates)
        self.activation_post = AntiAliasedActivation1d(c_last, param_dtype=param_dtype)
        self.conv_post = nnx.Conv(c_last, 1, kernel_size=(_EDGE_CONV_KERNEL,),
                                  padding=((_EDGE_CONV_PAD, _EDGE_CONV_PAD),), use_bias=False, **common)

    def __call__(self, mel: jax.Array, lengths: jax.Array | None = None, *,
                 channels_last: bool = False, clip: bool = True) -> jax.Array:
        """Natural-log mel -> waveform clamped to ``[-1, 1]`` (as transformers does; ``clip=False``:
        as the last convolution left it).

        ``mel``: ``[B, mel_dim, T]`` as transformers takes it (``[B, T, mel_dim]`` with
        ``channels_last``). ``lengths``: optional int ``[B]`` valid frames per row (>= 1) for
        bucket-padded input; row ``b``'s first ``num_samples(lengths[b])`` samples are then
        exactly the unpadded result and the rest are zero. Returns ``[B, num_samples(T)]``.
        """
        cfg = self.config
        x = mel if channels_last else jnp.swapaxes(mel, 1, 2)
        x = process_mel_spectrogram(x.astype(jnp.float32)).astype(self.dtype)
        n = None if lengths is None else jnp.asarray(lengths, jnp.int32).reshape(-1)
        x = self.conv_pre(_zero_tail(x, n))
        nblocks = len(cfg.resblock_kernel_sizes)
        for i, (rate, k) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernel_sizes)):
            x = self.ups[i](_zero_tail(x, n))
            n = None if n is None else _conv_transpose_len(n, k, rate)
            x = amp_blocks_mean(self.resblocks[i * nblocks:(i + 1) * nblocks], x, n)
        x = self.activation_post(x, n)
        x = self.conv_post(_zero_tail(x, n))
        wav = jnp.clip(x[..., 0], -1.0, 1.0) if clip else x[..., 0]
        if n is not None:
            wav = jnp.where(jnp.arange(wav.shape[1])[None, :] < n[:, None], wav, jnp.zeros((), wav.dtype))
        return wav
