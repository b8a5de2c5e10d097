"""Parity of the Qwen2.5-Omni token2wav DiT (speaker encoder, velocity, ODE sampling) with transformers."""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from omni_jax.models.registry import abstract_module
from omni_jax.models.qwen2_5_omni.token2wav_dit import (
    HF_RENAMES, DiTConfig, Qwen2_5OmniDiT, block_attention_mask, time_grid)

pytestmark = pytest.mark.parity

PREFIX = "token2wav.code2wav_dit_model."
ATOL = 1e-4


@pytest.fixture(autouse=True)
def _one_torch_thread():
    # The tiny DiT is far too small for intra-op threads; on a shared CPU they only
    # contend (a 2-thread HF sample took 10-25 s instead of 0.3 s).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def hf_dit(qwen2_5_omni_hf_model):
    return qwen2_5_omni_hf_model.token2wav.code2wav_dit_model


@pytest.fixture(scope="module")
def jax_dit(qwen2_5_omni_hf_dir):
    import safetensors.numpy

    from conversion.mapping import load_hf_into

    with open(os.path.join(qwen2_5_omni_hf_dir, "config.json")) as f:
        cfg = DiTConfig.from_hf(json.load(f)["token2wav_config"]["dit_config"])
    model = Qwen2_5OmniDiT(cfg, rngs=nnx.Rngs(0))
    tensors = safetensors.numpy.load_file(os.path.join(qwen2_5_omni_hf_dir, "model.safetensors"))
    return load_hf_into(model, tensors, prefix=PREFIX, renames=HF_RENAMES)


def _inputs(cfg: DiTConfig, batch: int, n_codes: int, ref_frames: int = 40, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return dict(
        codes=torch.randint(0, cfg.num_embeds, (batch, n_codes), generator=g),
        cond=torch.randn(batch, cfg.enc_emb_dim, generator=g),
        ref_mel=torch.randn(batch, ref_frames, cfg.mel_dim, generator=g),
        x=torch.randn(batch, n_codes * cfg.repeats, cfg.mel_dim, generator=g),
    )


@functools.lru_cache(maxsize=None)
def _jitted_method(graphdef, method: str, static: tuple):
    def fn(state, dyn_args, static_vals):
        it, st = iter(dyn_args), dict(static_vals)
        full = [st[i] if i in st else next(it) for i in range(len(dyn_args) + len(st))]
        return getattr(nnx.merge(graphdef, state), method)(*full)

    return jax.jit(fn, static_argnums=2)


def _jit_call(module, method: str, *args, static=()):
    """module.method(*args) under jit, compiled once per shape (eager op-by-op dispatch is slow)."""
    graphdef, state = nnx.split(module)
    dyn = tuple(a for i, a in enumerate(args) if i not in static)
    static_vals = tuple((i, args[i]) for i in static)
    return np.asarray(_jitted_method(graphdef, method, tuple(static))(state, dyn, static_vals))


def _close(got, want, atol=ATOL, rtol_of_max=1e-4):
    """Absolute bound, plus a bound relative to the output's scale so small outputs still count."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    err = float(np.abs(got - want).max())
    scale = float(np.abs(want).max())
    assert err <= atol, f"max abs err {err:.3g} (output scale {scale:.3g})"
    assert err <= rtol_of_max * max(scale, 1e-3) + 1e-7, f"max abs err {err:.3g} vs output scale {scale:.3g}"
    return err


def _hf_sample(hf_dit, monkeypatch, cond, ref_mel, codes, **kw):
    """HF `sample` plus the initial noise it drew with torch.randn ([B, L, mel_dim])."""
    captured = []
    real_randn = torch.randn

    def randn(*args, **kwargs):
        out = real_randn(*args, **kwargs)
        captured.append(out.clone())
        return out

    with monkeypatch.context() as m:
        m.setattr(torch, "randn", randn)
        with torch.no_grad():
            mel = hf_dit.sample(cond, ref_mel, codes, **kw)
    assert len(captured) == 1
    return mel.numpy(), captured[0].numpy()


@pytest.mark.parametrize("ref_frames", [40, 37])
def test_speaker_embedding_matches_hf(hf_dit, jax_dit, ref_frames):
    inp = _inputs(jax_dit.config, 2, 4, ref_frames=ref_frames, seed=1)
    with torch.no_grad():
        want = hf_dit.input_embed.spk_encoder(inp["ref_mel"]).numpy()
        want_zero = hf_dit.input_embed.spk_encoder(torch.zeros_like(inp["ref_mel"])).numpy()
    _close(_jit_call(jax_dit, "speaker_embedding", inp["ref_mel"].numpy()), want)
    # The CFG branch embeds an all-zero mel (std clamps at eps there).
    _close(_jit_call(jax_dit, "speaker_embedding", np.zeros(inp["ref_mel"].shape, np.float32)), want_zero)


def test_velocity_matches_hf(hf_dit, jax_dit):
    cfg = jax_dit.config
    inp = _inputs(cfg, 2, 25, seed=2)  # 50 frames: two full blocks of 24 and a partial one
    length = inp["x"].shape[1]
    spk = _jit_call(jax_dit, "speaker_embedding", inp["ref_mel"].numpy())
    t = torch.tensor([0.37, 0.81])
    with torch.no_grad():
        want = hf_dit(hidden_states=inp["x"], condition_vector=inp["ref_mel"],
                      speaker_embedding=inp["cond"][:, None].repeat(1, length, 1),
                      quantized_code=inp["codes"], time_step=t, apply_cfg=False).numpy()
        both = hf_dit(hidden_states=inp["x"], condition_vector=inp["ref_mel"],
                      speaker_embedding=inp["cond"][:, None].repeat(1, length, 1),
                      quantized_code=inp["codes"], time_step=torch.tensor(0.6), apply_cfg=True)
        cond_v, null_v = torch.chunk(both, 2, dim=0)
        want_guided = (cond_v + (cond_v - null_v) * 0.5).numpy()
    got = _jit_call(jax_dit, "__call__", inp["x"].numpy(), t.numpy(), inp["codes"].numpy(), inp["cond"].numpy(), spk)
    _close(got, want)
    spk_uncond = _jit_call(jax_dit, "speaker_embedding", np.zeros(inp["ref_mel"].shape, np.float32))
    got_guided = _jit_call(jax_dit, "guided_velocity", inp["x"].numpy(), np.float32(0.6), inp["codes"].numpy(),
                           inp["cond"].numpy(), spk, spk_uncond, 0.5, static=(6,))
    _close(got_guided, want_guided)


WINDOWS = [(0, 0), (1, 0), (0, 1), (1, 1), (2, 1)]  # (look_backward, look_ahead) blocks


def _hf_block_mask(hf_dit, length, look_backward, look_ahead):
    with torch.no_grad():
        block_diff = hf_dit._create_block_diff(torch.zeros(1, length, 1))[0, 0]
    return (block_diff >= -float(look_backward)) & (block_diff <= float(look_ahead))


@pytest.mark.parametrize("length", [50, 73, 24, 5])
@pytest.mark.parametrize("window", WINDOWS)
def test_block_mask_matches_hf(hf_dit, jax_dit, length, window):
    """The mask the blockwise attention implements is HF's dense block-difference mask."""
    np.testing.assert_array_equal(block_attention_mask(length, jax_dit.config.block_size, *window),
                                  _hf_block_mask(hf_dit, length, *window).numpy())


@pytest.mark.parametrize("length", [50, 73])  # not multiples of block_size 24
def test_block_attention_matches_hf(hf_dit, jax_dit, length):
    """Blockwise attention (RoPE on head 0) vs HF's DiTAttention with the dense mask, per window."""
    cfg = jax_dit.config
    hidden = torch.randn(2, length, cfg.hidden_size, generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        cos, sin = hf_dit.rotary_embed(hidden, torch.arange(length)[None].repeat(2, 1))
    attn = jax_dit.transformer_blocks[0].attn
    for window in WINDOWS:
        mask = _hf_block_mask(hf_dit, length, *window)
        with torch.no_grad():
            want = hf_dit.transformer_blocks[0].attn(
                hidden, position_embeddings=(cos, sin),
                attention_mask=mask[None, None].expand(2, cfg.num_attention_heads, length, length)).numpy()
        got = _jit_call(attn, "__call__", hidden.numpy(), cos[0].numpy(), sin[0].numpy(), *window, static=(3, 4))
        _close(got, want)


def test_time_grid_matches_hf():
    t = torch.linspace(0, 1, 10, dtype=torch.float32)
    t += -1.0 * (torch.cos(torch.pi / 2 * t) - 1 + t)
    np.testing.assert_allclose(time_grid(10, -1.0), t.numpy(), rtol=0, atol=1e-7)
    np.testing.assert_allclose(time_grid(10, None), np.linspace(0, 1, 10), rtol=0, atol=1e-7)


def test_sample_matches_hf(hf_dit, jax_dit, monkeypatch):
    """Full RK4 + sway + CFG solve (9 intervals, 36 velocity evaluations), B=2, 50 frames."""
    inp = _inputs(jax_dit.config, 2, 25, seed=3)
    want, noise = _hf_sample(hf_dit, monkeypatch, inp["cond"], inp["ref_mel"], inp["codes"],
                             num_steps=10, guidance_scale=0.5, sway_coefficient=-1.0)
    assert noise.shape == inp["x"].shape  # HF draws randn([B, L, mel_dim])
    got = jax_dit.sample(inp["codes"].numpy(), inp["cond"].numpy(), inp["ref_mel"].numpy(), noise,
                         num_steps=10, guidance_scale=0.5, sway_coefficient=-1.0)
    _close(got, want.transpose(0, 2, 1))  # HF returns [B, mel_dim, L]


def test_padded_batch_matches_unpadded_hf(hf_dit, jax_dit, monkeypatch):
    """Two lengths in one padded call: each valid segment equals HF's own unpadded B=1 run."""
    cfg = jax_dit.config
    lens = [25, 13]
    inp = _inputs(cfg, 2, max(lens), seed=4)
    wants, noise = [], np.array(
        jax.random.normal(jax.random.key(0), inp["x"].shape, jnp.float32))  # padding frames' noise is arbitrary
    for i, n in enumerate(lens):
        want, hf_noise = _hf_sample(hf_dit, monkeypatch, inp["cond"][i:i + 1], inp["ref_mel"][i:i + 1],
                                    inp["codes"][i:i + 1, :n])
        noise[i, : n * cfg.repeats] = hf_noise[0]
        wants.append(want[0].T)
    codes = inp["codes"].numpy().copy()
    codes[1, lens[1]:] = 0  # padding ids must not matter
    got = np.asarray(jax_dit.sample(codes, inp["cond"].numpy(), inp["ref_mel"].numpy(), noise, code_lens=lens))
    for i, n in enumerate(lens):
        _close(got[i, : n * cfg.repeats], wants[i])


def test_sample_from_key(jax_dit):
    cfg = jax_dit.config
    inp = _inputs(cfg, 2, 25, seed=5)
    args = (inp["codes"].numpy(), inp["cond"].numpy(), inp["ref_mel"].numpy())
    a = np.asarray(jax_dit.sample(*args, jax.random.key(7)))
    b = np.asarray(jax_dit.sample(*args, key=jax.random.key(7)))
    noise = jax.random.normal(jax.random.key(7), (2, 50, cfg.mel_dim), jnp.float32)
    c = np.asarray(jax_dit.sample(*args, noise))
    assert a.shape == (2, 50, cfg.mel_dim) and np.isfinite(a).all()
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)


def test_real_size_checkpoint_layout():
    """Every tensor of a real-size (default config) HF DiT maps onto a parameter of the right shape."""
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniDiTConfig
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavDiTModel

    from conversion.mapping import map_hf_tensors, transform_for

    hf_config = Qwen2_5OmniDiTConfig()
    with torch.device("meta"):
        hf_shapes = {k: tuple(v.shape) for k, v in Qwen2_5OmniToken2WavDiTModel(hf_config).state_dict().items()}
    cfg = DiTConfig.from_hf(hf_config.to_dict())
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.look_backward_layers) == (22, 1024, (0, 20))
    _, params, _ = nnx.split(abstract_module(lambda rngs: Qwen2_5OmniDiT(cfg, rngs=rngs)), nnx.Param, ...)
    shapes = {p: tuple(v.get_value().shape) for p, v in nnx.to_flat_state(params)}
    plan = map_hf_tensors(hf_shapes, shapes, "", HF_RENAMES)
    for path, (key, leaf) in plan.items():
        assert transform_for(leaf, np.broadcast_to(np.float32(0), hf_shapes[key])).shape == shapes[path], key
