"""Qwen3-Omni talker, code predictor and code2wav against transformers (tiny random modules).

The HF submodules are built straight from tiny configs (no checkpoint on disk) and
loaded into the JAX modules through their in-memory ``state_dict()`` names.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from conversion.mapping import load_hf_into
from omni_jax.engine.sampling import apply_top_k_top_p
from omni_jax.models.layers.attention import AttentionMetadata
from omni_jax.models.qwen3_omni.code2wav import Code2WavConfig, Qwen3OmniCode2Wav
from omni_jax.models.registry import abstract_module
from omni_jax.models.qwen3_omni.talker import Qwen3OmniTalker, TalkerConfig

pytestmark = pytest.mark.parity

TOL = 1e-4
GROUPS = 4
CODEBOOK = 64                      # code predictor vocab / code2wav codebook
TALKER_VOCAB = CODEBOOK + 1024     # HF generate suppresses the top 1024 ids except eos
CODEC_EOS = CODEBOOK + 2
THINKER_HIDDEN = 24
# MoE weights are drawn wider than initializer_range (0.02) so that experts matter as
# much as attention and router logits are spread enough for top-k not to hinge on
# float rounding: a routing bug then shows up far above the tolerance.
MOE_STD = 0.1


def _close(got, want, tol=TOL, rel=1e-3):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    err = np.abs(got - want).max()
    scale = np.abs(want).max()
    assert np.isfinite(got).all() and scale > 0
    assert err <= tol, f"max abs error {err:.3g} > {tol}"
    assert err <= rel * scale, f"max abs error {err:.3g} > {rel} x max |ref| {scale:.3g}"


def _state(hf_module):
    return {k: v.detach().numpy() for k, v in hf_module.state_dict().items()}


# ---------------------------------------------------------------------------------------
# Talker + code predictor
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_talker():
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeTalkerConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeTalkerForConditionalGeneration)

    torch.manual_seed(0)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2], "mrope_interleaved": True}
    text = dict(vocab_size=TALKER_VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=24,
                num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, shared_expert_intermediate_size=40,
                rope_parameters=rope)
    predictor = dict(vocab_size=CODEBOOK, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_code_groups=GROUPS,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    cfg = Qwen3OmniMoeTalkerConfig(
        text_config=text, code_predictor_config=predictor, num_code_groups=GROUPS,
        thinker_hidden_size=THINKER_HIDDEN, codec_eos_token_id=CODEC_EOS, spatial_merge_size=2,
        speaker_id={"ethan": CODEBOOK + 10})
    cfg._attn_implementation = "eager"
    model = Qwen3OmniMoeTalkerForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name or name.endswith("mlp.gate.weight"):
                # transformers leaves the fused experts uninitialised and the router at zero.
                p.normal_(0.0, MOE_STD)
            elif name.endswith("norm.weight"):
                p.normal_(1.0, 0.1)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.02)
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
    return model


@pytest.fixture(scope="module")
def talker(hf_talker):
    cfg = TalkerConfig.from_hf(hf_talker.config.to_dict())
    model = abstract_module(lambda rngs: Qwen3OmniTalker(cfg, rngs=rngs))  # shapes only: loaded below
    load_hf_into(model, _state(hf_talker), prefix="")
    return model


@nnx.jit(static_argnames=("capture",))
def _talker_forward(model, embeds, positions, segments, capture=()):
    hidden, _, captured = model(embeds, positions, AttentionMetadata.dense(embeds.shape[0], segments),
                                capture_layers=capture)
    return model.compute_logits(hidden), hidden, captured


@nnx.jit
def _residual_greedy(model, hidden, group0):
    return model.predict_residual_codes(hidden, group0, return_logits=True)


@nnx.jit
def _residual_sampled(model, hidden, group0, key, top_k=50, top_p=0.8):
    # top_k / top_p traced: one compilation serves every setting.
    return model.predict_residual_codes(hidden, group0, key, top_k=top_k, top_p=top_p)


@nnx.jit
def _teacher_forced_logits(model, hidden, group0, codes):
    """Logits [B, G-1, V] of every residual step given the earlier (sampled) codes."""
    pred = model.code_predictor
    b, groups = hidden.shape[0], codes.shape[1] + 1
    seq = [hidden, model.model.embed(group0)] + [pred.model.embed(g + 1, codes[:, g]) for g in range(groups - 2)]
    x = jnp.stack(seq, axis=1).reshape(b * groups, -1)
    meta = AttentionMetadata.dense(b * groups, jnp.repeat(jnp.arange(b), groups))
    out = pred.model(x, jnp.tile(jnp.arange(groups), b), meta).reshape(b, groups, -1)
    # Causal: position s sees exactly the prefix the predictor saw at step s.
    return jnp.stack([pred.lm_head[s](out[:, s + 1]) for s in range(groups - 1)], axis=1)


def test_config(talker):
    cfg = talker.cfg
    assert cfg.num_code_groups == GROUPS and cfg.text.shared_expert_intermediate_size == 40
    assert cfg.text.mrope_section == (4, 2, 2) and cfg.code_predictor.mrope_section is None
    assert cfg.code_predictor.num_experts == 0 and cfg.text.num_experts == 4
    assert cfg.suppressed_token_ids == tuple(i for i in range(CODEBOOK, TALKER_VOCAB) if i != CODEC_EOS)
    assert cfg.speaker_id("Ethan") == CODEBOOK + 10


def test_load_from_checkpoint_layout(talker, hf_talker, hf_code2wav):
    """On disk the talker is `talker.*` with per-expert keys, code2wav `code2wav.*`: both load."""
    from omni_jax.models.qwen3_omni.expert_keys import FusedExperts, split_fused_experts

    disk = {}
    for key, value in _state(hf_talker).items():
        if key.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            disk.update({"talker." + k: v for k, v in split_fused_experts(key, value).items()})
        else:
            disk["talker." + key] = value
    disk.update({"code2wav." + k: v for k, v in _state(hf_code2wav).items()})
    assert "talker.model.layers.0.mlp.experts.3.up_proj.weight" in disk
    loaded = abstract_module(lambda rngs: Qwen3OmniTalker(talker.cfg, rngs=rngs))
    load_hf_into(loaded, FusedExperts(disk), prefix="talker.")
    want = dict(nnx.to_flat_state(nnx.state(talker, nnx.Param)))
    got = dict(nnx.to_flat_state(nnx.state(loaded, nnx.Param)))
    assert want.keys() == got.keys()
    for path in want:
        np.testing.assert_array_equal(np.asarray(got[path].get_value()), np.asarray(want[path].get_value()))
    c2w = abstract_module(lambda rngs: Qwen3OmniCode2Wav(Code2WavConfig.from_hf(hf_code2wav.config.to_dict()),
                                                    rngs=rngs))
    load_hf_into(c2w, disk, prefix="code2wav.")


def test_talker_logits_packed_sequences(talker, hf_talker):
    """Two sequences packed in one step, 3-D (T/H/W) positions: logits and hidden states."""
    rng = np.random.default_rng(0)
    lens = (9, 6)
    embeds = [rng.standard_normal((n, 32)).astype(np.float32) for n in lens]
    # Distinct T/H/W rows exercise the interleaved M-RoPE bands.
    positions = [np.stack([np.arange(n), np.arange(n) // 2 + 3, np.arange(n) % 3 + 1]) for n in lens]
    logits, hidden, captured = _talker_forward(
        talker, jnp.asarray(np.concatenate(embeds)), jnp.asarray(np.concatenate(positions, axis=1)),
        jnp.asarray(np.repeat(np.arange(len(lens)), lens)), capture=(0, 1, 2))
    start = 0
    for e, pos, n in zip(embeds, positions, lens):
        with torch.no_grad():
            ref = hf_talker(inputs_embeds=torch.from_numpy(e)[None],
                            position_ids=torch.from_numpy(pos)[:, None].long(), output_hidden_states=True)
        ref_hidden = ref.hidden_states[0]  # (model hidden states, residual codes)
        sl = slice(start, start + n)
        _close(logits[sl], ref.logits[0].numpy())
        _close(captured[1][sl], ref_hidden[1][0].numpy())
        _close(hidden[sl], ref_hidden[-1][0].numpy())
        np.testing.assert_array_equal(np.asarray(captured[0][sl]), e)
        start += n


def test_input_projections(talker, hf_talker):
    x = np.random.default_rng(1).standard_normal((5, THINKER_HIDDEN)).astype(np.float32)
    with torch.no_grad():
        ref_text = hf_talker.text_projection(torch.from_numpy(x)).numpy()
        ref_hidden = hf_talker.hidden_projection(torch.from_numpy(x)).numpy()
    _close(talker.project_text(jnp.asarray(x)), ref_text)
    _close(talker.project_hidden(jnp.asarray(x)), ref_hidden)


def _hf_residuals(hf_talker, hidden, group0, **kwargs):
    """What HF's talker does per step: code predictor generate on [hidden, embed(group0)]."""
    last_id_hidden = hf_talker.get_input_embeddings()(group0[:, None])
    with torch.no_grad():
        return hf_talker.code_predictor.generate(
            inputs_embeds=torch.cat((hidden[:, None], last_id_hidden), dim=1),
            max_new_tokens=GROUPS - 1, output_hidden_states=True, return_dict_in_generate=True,
            output_logits=True, **kwargs)


def test_code_predictor_greedy(talker, hf_talker):
    rng = np.random.default_rng(2)
    b = 5
    hidden = rng.standard_normal((b, 32)).astype(np.float32)
    group0 = rng.integers(0, CODEBOOK, b)
    ref = _hf_residuals(hf_talker, torch.from_numpy(hidden), torch.from_numpy(group0), do_sample=False)
    codes, logits = _residual_greedy(talker, jnp.asarray(hidden), jnp.asarray(group0, jnp.int32))
    assert codes.shape == (b, GROUPS - 1) and codes.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(codes), ref.sequences.numpy())
    _close(logits, torch.stack(ref.logits, dim=1).numpy())

    # The next talker input: talker embedding of group 0 + the predictor's embeddings of
    # groups 1..G-1, i.e. HF's codec_hiddens (step inputs recorded by generate + the last).
    with torch.no_grad():
        parts = [hf_talker.get_input_embeddings()(torch.from_numpy(group0)[:, None])]
        parts += [h[0] for h in ref.hidden_states[1:]]
        parts.append(hf_talker.code_predictor.get_input_embeddings()[-1](ref.sequences[:, -1:]))
        want = torch.cat(parts, dim=1).sum(1).numpy()
    all_codes = jnp.concatenate([jnp.asarray(group0, jnp.int32)[:, None], codes], axis=1)
    _close(talker.codec_input_embeds(all_codes), want)


def test_code_predictor_cache_equals_rerun(talker):
    """The paged-KV steps (default) and the whole-sequence rerun give the same codes and logits."""
    rng = np.random.default_rng(4)
    hidden = jnp.asarray(rng.standard_normal((3, 32)).astype(np.float32))
    group0 = jnp.asarray(rng.integers(0, CODEBOOK, 3), jnp.int32)
    cached = nnx.jit(lambda m, h, g: m.predict_residual_codes(h, g, return_logits=True))(talker, hidden, group0)
    rerun = nnx.jit(lambda m, h, g: m.predict_residual_codes(h, g, return_logits=True, cache=False))(
        talker, hidden, group0)
    np.testing.assert_array_equal(np.asarray(cached[0]), np.asarray(rerun[0]))
    _close(cached[1], rerun[1])


def test_code_predictor_sampling(talker):
    rng = np.random.default_rng(3)
    b = 5
    hidden = jnp.asarray(rng.standard_normal((b, 32)).astype(np.float32))
    group0 = jnp.asarray(rng.integers(0, CODEBOOK, b), jnp.int32)
    keys = jax.random.split(jax.random.key(7), b)
    codes = np.asarray(_residual_sampled(talker, hidden, group0, keys))
    assert codes.shape == (b, GROUPS - 1) and ((codes >= 0) & (codes < CODEBOOK)).all()
    # Seeded: the same keys draw the same codes, and a row's draw does not depend on its
    # place in the batch (rows and their keys reversed -> codes reversed).
    np.testing.assert_array_equal(codes, np.asarray(_residual_sampled(talker, hidden, group0, keys)))
    np.testing.assert_array_equal(codes[::-1], np.asarray(_residual_sampled(talker, hidden[::-1], group0[::-1],
                                                                            keys[::-1])))
    assert not (codes == np.asarray(_residual_sampled(talker, hidden, group0, jax.random.split(
        jax.random.key(8), b)))).all()
    # Every draw lies in the top-k / top-p set of its step's logits.
    logits = _teacher_forced_logits(talker, hidden, group0, jnp.asarray(codes))
    for s in range(GROUPS - 1):
        kept = np.asarray(apply_top_k_top_p(logits[:, s], jnp.full((b,), 50, jnp.int32), jnp.full((b,), 0.8)))
        assert np.isfinite(kept[np.arange(b), codes[:, s]]).all()
    # top_k=1 is greedy.
    greedy = np.asarray(_residual_greedy(talker, hidden, group0)[0])
    np.testing.assert_array_equal(np.asarray(_residual_sampled(talker, hidden, group0, keys, top_k=1)), greedy)


def test_code_predictor_sampling_static_top_k(talker):
    """The serving path (static top_k: sampling among the k candidates) draws inside the
    nucleus, reproducibly and independently of the batch."""
    rng = np.random.default_rng(5)
    b = 4
    hidden = jnp.asarray(rng.standard_normal((b, 32)).astype(np.float32))
    group0 = jnp.asarray(rng.integers(0, CODEBOOK, b), jnp.int32)
    keys = jax.random.split(jax.random.key(9), b)
    draw = nnx.jit(lambda m, h, g, k: m.predict_residual_codes(h, g, k, top_k=20, top_p=0.8))
    codes = np.asarray(draw(talker, hidden, group0, keys))
    np.testing.assert_array_equal(codes[::-1], np.asarray(draw(talker, hidden[::-1], group0[::-1], keys[::-1])))
    logits = _teacher_forced_logits(talker, hidden, group0, jnp.asarray(codes))
    for s in range(GROUPS - 1):
        kept = np.asarray(apply_top_k_top_p(logits[:, s], jnp.full((b,), 20, jnp.int32), jnp.full((b,), 0.8)))
        assert np.isfinite(kept[np.arange(b), codes[:, s]]).all()


def test_top_k_top_p_candidates_equal_the_full_mask():
    from omni_jax.engine.sampling import top_k_top_p_candidates

    logits = jnp.asarray(np.random.default_rng(6).standard_normal((6, 300)).astype(np.float32) * 3)
    top_p = jnp.asarray([1.0, 0.9, 0.5, 0.1, 0.8, 0.99], jnp.float32)
    full = np.asarray(apply_top_k_top_p(logits, jnp.full((6,), 40, jnp.int32), top_p))
    vals, ids = top_k_top_p_candidates(logits, 40, top_p)
    want = np.full_like(full, -np.inf)
    np.put_along_axis(want, np.asarray(ids), np.asarray(vals), axis=-1)
    np.testing.assert_array_equal(want, full)


def test_row_keys():
    from omni_jax.models.qwen3_omni.talker import _row_keys

    assert _row_keys(jax.random.key(0), 3).shape == (3,)
    assert _row_keys(jax.random.split(jax.random.key(0), 3), 3).shape == (3,)
    assert _row_keys(jax.random.PRNGKey(0), 3).shape == (3, 2)
    assert _row_keys(jax.random.split(jax.random.PRNGKey(0), 3), 3).shape == (3, 2)


def test_talker_greedy_generation_matches_hf(talker, hf_talker):
    """HF talker.generate (greedy) vs a JAX loop: group-0 ids and every step's residual codes."""
    rng = np.random.default_rng(4)
    prompt = rng.standard_normal((1, 7, 32)).astype(np.float32)
    trailing = rng.standard_normal((1, 2, 32)).astype(np.float32)
    tts_pad = rng.standard_normal((1, 1, 32)).astype(np.float32)
    steps = 5
    cfg = talker.cfg
    with torch.no_grad():
        ref = hf_talker.generate(
            inputs_embeds=torch.from_numpy(prompt), trailing_text_hidden=torch.from_numpy(trailing),
            tts_pad_embed=torch.from_numpy(tts_pad), talker_input_ids=torch.zeros(1, 7, dtype=torch.long),
            attention_mask=torch.ones(1, 7, dtype=torch.long), max_new_tokens=steps, min_new_tokens=steps,
            do_sample=False, repetition_penalty=1.0, eos_token_id=cfg.codec_eos_token_id,
            suppress_tokens=list(cfg.suppressed_token_ids), output_hidden_states=True,
            return_dict_in_generate=True)
    ref_group0 = ref.sequences[0].numpy()
    ref_codes = torch.stack([h[-1] for h in ref.hidden_states if h[-1] is not None], dim=1)[0].numpy()
    assert ref_codes.shape == (steps - 1, GROUPS)

    suppress = np.zeros(cfg.text.vocab_size, bool)
    suppress[list(cfg.suppressed_token_ids)] = True
    # One fixed-size buffer re-run densely every step (segment -1 = not yet generated).
    size = prompt.shape[1] + steps - 1
    embeds = np.zeros((size, 32), np.float32)
    embeds[:prompt.shape[1]] = prompt[0]
    group0, codes = [], []
    for step in range(steps):
        n = prompt.shape[1] + step
        logits, hidden, _ = _talker_forward(talker, jnp.asarray(embeds), jnp.arange(size),
                                            jnp.where(jnp.arange(size) < n, 0, -1))
        g0 = int(np.argmax(np.where(suppress, -np.inf, np.asarray(logits[n - 1]))))
        group0.append(g0)
        if step == steps - 1:
            break
        residual, _ = _residual_greedy(talker, hidden[n - 1:n], jnp.asarray([g0], jnp.int32))
        step_codes = jnp.concatenate([jnp.asarray([[g0]], jnp.int32), residual], axis=1)
        codes.append(np.asarray(step_codes[0]))
        text = trailing[0, step] if step < trailing.shape[1] else tts_pad[0, 0]
        embeds[n] = np.asarray(talker.codec_input_embeds(step_codes))[0] + text
    np.testing.assert_array_equal(np.array(group0), ref_group0)
    np.testing.assert_array_equal(np.stack(codes), ref_codes)


# ---------------------------------------------------------------------------------------
# Code2wav
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_code2wav():
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

    torch.manual_seed(1)
    # The real upsampling (8*5*4*3 * 2*2 = 1920 samples per frame) with toy widths.
    cfg = Qwen3OmniMoeCode2WavConfig(
        codebook_size=CODEBOOK, hidden_size=32, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=48, num_hidden_layers=2, num_quantizers=GROUPS, sliding_window=6,
        upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2], decoder_dim=32)
    cfg._attn_implementation = "eager"
    model = Qwen3OmniMoeCode2Wav(cfg).eval()
    # Defaults (zero SnakeBeta logs, 0.01 layer scale, 1e-6 ConvNeXt gamma) would make most
    # branches vanish; draw everything so each part shows in the waveform, scaled so the
    # output mostly stays inside the final clamp to [-1, 1].
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("alpha", "beta")):
                p.normal_(0.0, 0.3)
            elif name.endswith(("layer_scale.scale", "gamma")):
                p.normal_(0.5, 0.1)
            elif "norm" in name and name.endswith("weight"):
                p.normal_(1.0, 0.1)
            elif name == "code_embedding.weight":
                p.normal_(0.0, 1.0)
            elif p.ndim >= 2:
                # ConvTranspose1d weights are [in, out, k], the others [out, in, (k)].
                transposed = re.fullmatch(r"(upsample\.\d+\.0|decoder\.\d+\.block\.1)\.conv\.weight", name)
                fan_in = p.shape[0] if transposed else int(np.prod(p.shape[1:]))
                p.normal_(0.0, 0.5 / np.sqrt(fan_in))
            else:
                p.normal_(0.0, 0.05)
        model.decoder[-1].conv.weight.mul_(0.2)
    return model


@pytest.fixture(scope="module")
def code2wav(hf_code2wav):
    cfg = Code2WavConfig.from_hf(hf_code2wav.config.to_dict())
    model = abstract_module(lambda rngs: Qwen3OmniCode2Wav(cfg, rngs=rngs))
    load_hf_into(model, _state(hf_code2wav), prefix="")
    return model


@nnx.jit
def _decode(model, codes):
    return model(codes)


def test_code2wav_config(code2wav):
    assert code2wav.total_upsample == 1920 and code2wav.cfg.sliding_window == 6


def test_code2wav_waveform(code2wav, hf_code2wav):
    codes = np.random.default_rng(5).integers(0, CODEBOOK, (2, GROUPS, 11))
    with torch.no_grad():
        ref = hf_code2wav(torch.from_numpy(codes))[:, 0].numpy()
    wav = np.asarray(_decode(code2wav, jnp.asarray(codes, jnp.int32)))
    assert 0.05 < np.abs(ref).mean() and (np.abs(ref) >= 1).mean() < 0.05  # not flat, barely clamped
    _close(wav, ref)


def test_code2wav_chunked_decode(code2wav, hf_code2wav):
    codes = np.random.default_rng(6).integers(0, CODEBOOK, (1, GROUPS, 24))
    decode = lambda c: _decode(code2wav, c)  # noqa: E731
    # 8/3 on 24 frames: chunks of 8, 3+8, 3+8 frames; the default 300/25 on 11 frames: one chunk.
    for chunk, context, frames in ((8, 3, 24), (300, 25, 11)):
        codes = codes[..., :frames]
        with torch.no_grad():
            ref = hf_code2wav.chunked_decode(torch.from_numpy(codes), chunk_size=chunk,
                                             left_context_size=context)[:, 0].numpy()
        wav = np.asarray(code2wav.chunked_decode(jnp.asarray(codes, jnp.int32), chunk, context, decode_fn=decode))
        _close(wav, ref)
