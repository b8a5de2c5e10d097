"""Parity of the Qwen2.5-Omni token2wav BigVGAN vocoder against transformers."""

from __future__ import annotations

import contextlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conversion.mapping import load_hf_into, transform_for
from omni_jax.models.registry import abstract_module
from omni_jax.models.qwen2_5_omni.token2wav_bigvgan import (
    HF_RENAMES,
    AntiAliasedActivation1d,
    BigVGANConfig,
    Qwen2_5OmniBigVGAN,
    SnakeBeta,
    downsample1d,
    kaiser_sinc_filter1d,
    process_mel_spectrogram,
    upsample1d,
)

pytestmark = [pytest.mark.parity, pytest.mark.torch]  # the reference vocoder is built here with torch

ATOL = 1e-4
RTOL = 1e-4  # of the reference's peak magnitude
PREFIX = "token2wav.code2wav_bigvgan_model."


@contextlib.contextmanager
def torch_single_thread():
    """The HF reference is op-dispatch bound at these sizes; extra threads only contend on shared CPUs."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def hf_run(module, *arrays):
    import torch

    with torch.no_grad(), torch_single_thread():
        return module(*(torch.from_numpy(np.asarray(a)) for a in arrays)).numpy()


def assert_close(out, ref):
    out, ref = np.asarray(out), np.asarray(ref)
    assert out.shape == ref.shape
    err = np.abs(out - ref).max()
    assert err <= ATOL, err
    assert err <= RTOL * np.abs(ref).max(), (err, np.abs(ref).max())


def random_mel(mel_dim: int, frames: int, seed: int) -> np.ndarray:
    """A natural-log mel ``[mel_dim, frames]`` around the DiT's range (some bins below the -115 dB floor)."""
    return (2.0 * np.random.default_rng(seed).standard_normal((mel_dim, frames)) - 5.0).astype(np.float32)


def abstract_vocoder(config: BigVGANConfig) -> Qwen2_5OmniBigVGAN:
    """The module with shape-only parameters: loading fills them all, and eager random init
    (one small compile per parameter shape) would cost more than the whole parity test."""
    return abstract_module(lambda rngs: Qwen2_5OmniBigVGAN(config, rngs=rngs))


@pytest.fixture(scope="module")
def hf_bigvgan_config_dict(qwen2_5_omni_hf_dir) -> dict:
    with open(os.path.join(qwen2_5_omni_hf_dir, "config.json")) as f:
        return json.load(f)["token2wav_config"]["bigvgan_config"]


@pytest.fixture(scope="module")
def config(hf_bigvgan_config_dict) -> BigVGANConfig:
    return BigVGANConfig.from_hf(hf_bigvgan_config_dict)


@pytest.fixture(scope="module")
def hf_vocoder(config):
    """A standalone HF vocoder of the tiny architecture with weights that exercise everything.

    The checkpoint's own random init (SnakeBeta alpha = beta = 0, conv std 0.02) gives a
    near-silent waveform; here every weight is drawn so the output is ~0.1 and unclipped.
    """
    import torch
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniBigVGANConfig
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavBigVGANModel

    torch.manual_seed(0)
    model = Qwen2_5OmniToken2WavBigVGANModel(Qwen2_5OmniBigVGANConfig(**{
        k: [list(v) for v in val] if k == "resblock_dilation_sizes" else list(val) if isinstance(val, tuple) else val
        for k, val in vars(config).items()})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("alpha", "beta")):
                p.copy_(0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn_like(p))
            else:  # ConvTranspose1d weights are [in, out, k], Conv1d [out, in, k]
                fan_in = p.shape[0 if name.startswith("ups.") else 1] * p.shape[2]
                p.copy_(0.85 * torch.randn_like(p) / np.sqrt(fan_in))
    return model


@pytest.fixture(scope="module")
def vocoder(config, hf_vocoder) -> Qwen2_5OmniBigVGAN:
    tensors = {k: v.numpy() for k, v in hf_vocoder.state_dict().items()}
    return load_hf_into(abstract_vocoder(config), tensors, prefix="", renames=HF_RENAMES)


@pytest.fixture(scope="module")
def jitted(vocoder):
    graphdef, state = nnx.split(vocoder)
    plain = jax.jit(lambda state, mel: nnx.merge(graphdef, state)(mel))
    masked = jax.jit(lambda state, mel, lengths: nnx.merge(graphdef, state)(mel, lengths))
    return (lambda mel: np.asarray(plain(state, jnp.asarray(mel))),
            lambda mel, lengths: np.asarray(masked(state, jnp.asarray(mel), jnp.asarray(lengths, jnp.int32))))


def test_config_from_hf(config, hf_bigvgan_config_dict):
    assert config == BigVGANConfig(mel_dim=80, upsample_initial_channel=128)
    assert config.hop_length == 240
    assert BigVGANConfig.from_hf({}) == BigVGANConfig()  # HF defaults = the real model's
    assert BigVGANConfig().upsample_initial_channel == 1536


def test_checkpoint_keys_map(qwen2_5_omni_hf_dir, config):
    """Every on-disk ``token2wav.code2wav_bigvgan_model.*`` tensor lands on exactly one parameter."""
    from safetensors.numpy import load_file

    tensors = load_file(os.path.join(qwen2_5_omni_hf_dir, "model.safetensors"))
    model = load_hf_into(abstract_vocoder(config), tensors, prefix=PREFIX, renames=HF_RENAMES)
    assert len([k for k in tensors if k.startswith(PREFIX)]) == len(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    np.testing.assert_array_equal(model.ups[0].kernel[...], transform_for("kernel", tensors[PREFIX + "ups.0.0.weight"]))
    np.testing.assert_array_equal(model.resblocks[4].activations[3].act.beta[...],
                                  tensors[PREFIX + "resblocks.4.activations.3.act.beta"])
    assert model.conv_post.bias is None


@pytest.mark.parametrize("cutoff,half_width,size",
                         [(0.25, 0.3, 12), (0.5 / 3, 0.2, 18), (0.2, 0.1, 11), (0.0, 0.3, 12)])
def test_kaiser_sinc_filter(cutoff, half_width, size):
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import kaiser_sinc_filter1d as hf_filter

    ref = hf_filter(cutoff, half_width, size).numpy().reshape(-1)
    np.testing.assert_allclose(kaiser_sinc_filter1d(cutoff, half_width, size), ref, atol=1e-7, rtol=0)


@pytest.mark.parametrize("ratio,kernel", [(2, 12), (3, None)])
def test_resampling(ratio, kernel):
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
        Qwen2_5OmniDownSample1d,
        Qwen2_5OmniUpSample1d,
    )

    x = np.random.default_rng(ratio).standard_normal((2, 5, 23)).astype(np.float32)  # [B, C, T]
    up_ref = hf_run(Qwen2_5OmniUpSample1d(ratio, kernel), x)
    up = np.asarray(upsample1d(jnp.asarray(x.transpose(0, 2, 1)), ratio, kernel)).transpose(0, 2, 1)
    assert up.shape == (2, 5, 23 * ratio)
    np.testing.assert_allclose(up, up_ref, atol=1e-5, rtol=0)

    down_kernel = kernel or 6 * ratio
    down_ref = hf_run(Qwen2_5OmniDownSample1d(ratio, down_kernel), up_ref)
    down = np.asarray(downsample1d(jnp.asarray(up_ref.transpose(0, 2, 1)), ratio, down_kernel)).transpose(0, 2, 1)
    assert down.shape == (2, 5, 23)
    np.testing.assert_allclose(down, down_ref, atol=1e-5, rtol=0)


def _snake_pair(channels: int, seed: int):
    import torch
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniSnakeBeta

    ref = Qwen2_5OmniSnakeBeta(channels)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        ref.alpha.copy_(0.5 * torch.randn(channels, generator=g))
        ref.beta.copy_(0.5 * torch.randn(channels, generator=g))
    ours = SnakeBeta(channels)
    ours.alpha[...] = jnp.asarray(ref.alpha.detach().numpy())
    ours.beta[...] = jnp.asarray(ref.beta.detach().numpy())
    return ref, ours


def test_snake_beta_and_anti_aliased_activation():
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniAntiAliasedActivation1d

    x = 2 * np.random.default_rng(3).standard_normal((2, 6, 31)).astype(np.float32)  # [B, C, T]
    ref_snake, snake = _snake_pair(6, seed=4)
    out = np.asarray(snake(jnp.asarray(x.transpose(0, 2, 1)))).transpose(0, 2, 1)
    np.testing.assert_allclose(out, hf_run(ref_snake, x), atol=1e-5, rtol=0)

    ref_act = Qwen2_5OmniAntiAliasedActivation1d(ref_snake)
    act = AntiAliasedActivation1d(6)
    act.act = snake
    out = np.asarray(act(jnp.asarray(x.transpose(0, 2, 1)))).transpose(0, 2, 1)
    np.testing.assert_allclose(out, hf_run(ref_act, x), atol=1e-5, rtol=0)


def test_mel_preprocessing(hf_vocoder):
    mel = np.linspace(-20.0, 4.0, 80 * 7, dtype=np.float32).reshape(1, 80, 7)  # crosses both clamps
    ref = hf_run(hf_vocoder.process_mel_spectrogram, mel)
    out = np.asarray(process_mel_spectrogram(jnp.asarray(mel)))
    assert ref.min() == -1.0 and ref.max() == 1.0
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)


def test_waveform_parity(config, hf_vocoder, jitted):
    plain, _ = jitted
    mel = random_mel(config.mel_dim, 10, seed=10)[None]
    ref = hf_run(hf_vocoder, mel)  # transformers squeezes the batch axis away
    out = plain(mel)
    assert out.shape == (1, 240 * 10) == (1, config.num_samples(10))
    assert 0.05 < np.abs(ref).max() < 0.9  # meaningful and unclipped
    assert_close(out[0], ref)


def test_other_architecture_and_channels_last():
    """A different (small, eager) architecture: 2 upsamplings, 2 resblock kinds, k % s odd."""
    import torch
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniBigVGANConfig
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavBigVGANModel

    hf_cfg = dict(mel_dim=6, upsample_initial_channel=16, resblock_kernel_sizes=[3, 5],
                  resblock_dilation_sizes=[[1, 2, 4], [1, 3, 2]], upsample_rates=[3, 2], upsample_kernel_sizes=[8, 4])
    torch.manual_seed(1)
    ref_model = Qwen2_5OmniToken2WavBigVGANModel(Qwen2_5OmniBigVGANConfig(**hf_cfg)).eval()
    with torch.no_grad():
        for name, p in ref_model.named_parameters():
            scale = 0.3 if name.endswith(("alpha", "beta", "bias")) else 0.8 / np.sqrt(p[0].numel())
            p.copy_(scale * torch.randn_like(p))
    config = BigVGANConfig.from_hf(hf_cfg)
    model = load_hf_into(abstract_vocoder(config), {k: v.numpy() for k, v in ref_model.state_dict().items()},
                         prefix="", renames=HF_RENAMES)
    mel = random_mel(6, 9, seed=5)[None]
    ref = hf_run(ref_model, mel)
    assert ref.shape == (config.num_samples(9),) == (6 * 9 + 2,)  # (8 - 3) odd: one extra sample at x3

    @jax.jit
    def both_layouts(mel):
        return model(mel), model(mel.swapaxes(1, 2), channels_last=True)

    out, out_channels_last = map(np.asarray, both_layouts(jnp.asarray(mel)))
    assert_close(out[0], ref)
    np.testing.assert_array_equal(out_channels_last, out)


def test_padded_bucket_batch(config, hf_vocoder, jitted):
    """Two mels of 37 and 10 frames in one [2, mel, 37] bucket: exact with ``lengths``."""
    _, masked = jitted
    mel37 = random_mel(config.mel_dim, 37, seed=37)
    mel10 = random_mel(config.mel_dim, 10, seed=10)
    garbage = 3.0 * np.random.default_rng(0).standard_normal((config.mel_dim, 27)).astype(np.float32) + 2.0
    batch = np.stack([mel37, np.concatenate([mel10, garbage], axis=1)])
    ref37, ref10 = hf_run(hf_vocoder, mel37[None]), hf_run(hf_vocoder, mel10[None])
    assert ref37.shape == (240 * 37,) and ref10.shape == (240 * 10,)

    out = masked(batch, [37, 10])
    assert out.shape == (2, 240 * 37)
    assert_close(out[0], ref37)  # full-length row: plain transformers semantics
    assert_close(out[1, : 240 * 10], ref10)  # padded row: valid prefix exact
    assert not out[1, 240 * 10:].any()  # and silence after it

    # Without lengths the padding frames leak into the end of the valid prefix: the
    # vocoder looks ~26 frames ahead (6368 samples), so padding of any value (edge
    # replication included) changes the last samples; in this 10-frame case all of them.
    leaky = masked(np.stack([batch[1], np.concatenate([mel10, np.repeat(mel10[:, -1:], 27, 1)], 1)]), [37, 37])
    for row in leaky:
        assert np.abs(row[: 240 * 10] - ref10).max() > 1e-3
