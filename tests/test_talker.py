"""Talkers against transformers: Qwen2.5-Omni and Qwen3-Omni.

Both families: the talker's logits and hidden states on two sequences packed in one step, with
text positions (one row) and M-RoPE positions (distinct T/H/W rows). Qwen2.5-Omni alone: its
thinker -> talker handoff through both engines gives transformers' codec tokens. Qwen3-Omni
alone: its talker config, checkpoint layout and input projections, the code predictor (greedy,
cached, sampled), greedy talker generation, and code2wav; its HF submodules are built straight
from tiny configs (no checkpoint on disk) and loaded into the JAX modules through their
in-memory ``state_dict()`` names.
"""

from __future__ import annotations

import json
import os
import re
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from conversion.mapping import load_hf_into
from omni_jax import load_checkpoint
from omni_jax.checkpoint import eos_token_ids
from omni_jax.engine.protocol import AddRequest, StageInputs
from omni_jax.engine.runner import RunnerConfig
from omni_jax.engine.sampling import apply_top_k_top_p
from omni_jax.engine.sampling_params import SamplingParams
from omni_jax.inputs.rope_index import RopeIndexConfig
from omni_jax.models.layers.attention import AttentionMetadata
from omni_jax.models.qwen2_5_omni.pipeline import Qwen2_5OmniHandoff
from omni_jax.models.qwen2_5_omni.stages import build_talker_engine, build_thinker_engine
from omni_jax.models.qwen2_5_omni.voices import Voices
from omni_jax.models.qwen3_omni.code2wav import Code2WavConfig, Qwen3OmniCode2Wav
from omni_jax.models.qwen3_omni.talker import Qwen3OmniTalker, TalkerConfig
from omni_jax.models.registry import abstract_module
from omni_jax.runtime.stage_loop import to_engine_request

pytestmark = pytest.mark.parity

TOL = 1e-4


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


@nnx.jit(static_argnames=("capture",))
def _talker_forward(model, embeds, positions, segments, capture=()):
    hidden, _, captured = model(embeds, positions, AttentionMetadata.dense(embeds.shape[0], segments),
                                capture_layers=capture)
    return model.compute_logits(hidden), hidden, captured


# ---------------------------------------------------------------------------------------
# Both families: talker logits
# ---------------------------------------------------------------------------------------


class Talker(NamedTuple):
    """A family's talker and its transformers counterpart."""

    model: object
    width: int  # of the talker's input rows
    # (rows [T, width], positions [3, T]) -> (logits, hidden states in transformers' indexing:
    # 0 the decoder's input, i the output of layer i, the last one normed).
    reference: Callable
    decoder_input: Callable  # input rows -> what the decoder's first layer takes


def qwen2_5_talker(request) -> Talker:
    """The converted checkpoint's talker: it projects rows of the thinker's width into its own."""
    model, cfg = load_checkpoint(request.getfixturevalue("converted_thinker_fp32"), stage="talker")
    hf = request.getfixturevalue("qwen2_5_omni_hf_model").talker

    def reference(rows, positions):
        with torch.no_grad():
            out = hf.model(inputs_embeds=hf.thinker_to_talker_proj(torch.from_numpy(rows)[None]),
                           position_ids=torch.from_numpy(positions)[:, None].long(), output_hidden_states=True)
            return hf.codec_head(out.last_hidden_state)[0].numpy(), [h[0].numpy() for h in out.hidden_states]

    return Talker(model, cfg.embedding_size, reference, model.thinker_to_talker_proj)


def qwen3_talker(request) -> Talker:
    """The tiny talker built below from a config: it takes rows of its own width."""
    model, hf = request.getfixturevalue("qwen3_talker"), request.getfixturevalue("qwen3_hf_talker")

    def reference(rows, positions):
        with torch.no_grad():
            out = hf(inputs_embeds=torch.from_numpy(rows)[None],
                     position_ids=torch.from_numpy(positions)[:, None].long(), output_hidden_states=True)
        # hidden_states: (the decoder's, the residual codes)
        return out.logits[0].numpy(), [h[0].numpy() for h in out.hidden_states[0]]

    return Talker(model, model.cfg.text.hidden_size, reference, lambda rows: rows)


TALKERS = {"qwen2_5_omni": qwen2_5_talker, "qwen3_omni": qwen3_talker}


@pytest.fixture(scope="module", params=list(TALKERS))
def family_talker(request) -> Talker:
    """Each family's talker, built once for the module."""
    return TALKERS[request.param](request)


@pytest.mark.parametrize("rope", ["text", "mrope"])
def test_talker_logits_packed_sequences(family_talker, rope):
    """Two sequences packed in one step: logits and hidden states. Text positions are one row
    (transformers gets it on all three); distinct T/H/W rows exercise the M-RoPE bands."""
    talker = family_talker
    rng = np.random.default_rng(0)
    lens = (9, 6)
    rows = [rng.standard_normal((n, talker.width)).astype(np.float32) for n in lens]
    if rope == "mrope":
        positions = [np.stack([np.arange(n), np.arange(n) // 2 + 3, np.arange(n) % 3 + 1]) for n in lens]
    else:
        positions = [np.tile(np.arange(n), (3, 1)) for n in lens]
    packed = np.concatenate(rows)
    ours = np.concatenate(positions, axis=1)
    logits, hidden, captured = _talker_forward(
        talker.model, jnp.asarray(packed), jnp.asarray(ours if rope == "mrope" else ours[0]),
        jnp.asarray(np.repeat(np.arange(len(lens)), lens)), capture=(0, 1, 2))
    decoder_input = np.asarray(talker.decoder_input(jnp.asarray(packed)))
    start = 0
    for r, pos, n in zip(rows, positions, lens):
        ref_logits, ref_hidden = talker.reference(r, pos)
        sl = slice(start, start + n)
        _close(logits[sl], ref_logits)
        _close(captured[1][sl], ref_hidden[1])
        _close(hidden[sl], ref_hidden[-1])
        np.testing.assert_array_equal(np.asarray(captured[0][sl]), decoder_input[sl])
        start += n


# ---------------------------------------------------------------------------------------
# Qwen2.5-Omni: thinker -> talker handoff
# ---------------------------------------------------------------------------------------


def run_engine(engine, requests):
    """Add (request_id, kwargs) pairs and step to completion; returns {id: (tokens, hidden pieces)}."""
    for kw in requests:
        engine.add_request(**kw)
    toks, hidden = {}, {}
    while engine.has_unfinished():
        for o in engine.step():
            toks.setdefault(o.request_id, []).extend(o.new_token_ids)
            for layer, arr in (o.hidden_states or {}).items():
                hidden.setdefault(o.request_id, {}).setdefault(layer, []).append((o.hidden_offset, arr))
    return toks, hidden


def hf_codes(model, ids, thinker_tokens, talker_tokens):
    """transformers generate(return_audio) with greedy thinker and talker; returns (text ids, codec ids)."""
    captured = {}

    def capture(codes, **kw):
        captured["codes"] = codes[0].tolist()
        return torch.zeros(240 * codes.shape[1])

    orig = model.token2wav.forward
    model.token2wav.forward = capture
    try:
        with torch.no_grad():
            seq, _ = model.generate(input_ids=torch.tensor(ids)[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    speaker="Ethan", thinker_max_new_tokens=thinker_tokens, thinker_do_sample=False,
                                    talker_do_sample=False, talker_max_new_tokens=talker_tokens)
    finally:
        model.token2wav.forward = orig
    return seq[0, len(ids):].tolist(), captured["codes"]


def test_qwen2_5_thinker_talker_handoff_matches_transformers(converted_thinker_fp32, qwen2_5_omni_hf_model):
    runner = RunnerConfig(num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256,
                          capture_layers=(0, 3))
    thinker = build_thinker_engine(converted_thinker_fp32, runner, warmup=False)
    talker = build_talker_engine(converted_thinker_fp32, runner, warmup=False)
    cfg = json.load(open(os.path.join(converted_thinker_fp32, "omni_jax_config.json")))["hf_config"]
    from omni_jax.models.qwen2_5_omni.talker import TalkerConfig as Qwen2_5TalkerConfig

    handoff = Qwen2_5OmniHandoff(Voices.load(converted_thinker_fp32), Qwen2_5TalkerConfig.from_hf(cfg["talker_config"]),
                                 RopeIndexConfig.from_hf(cfg), (151646, 151655, 151656),
                                 eos_token_ids(converted_thinker_fp32), (0, 3))
    ids = np.random.default_rng(3).integers(0, 151000, 21)
    first = AddRequest(request_id="r", prompt_token_ids=ids.astype(np.int32),
                       sampling_params=SamplingParams(temperature=0.0, max_tokens=7))
    toks, hidden = run_engine(thinker, [dict(request_id="r", prompt_token_ids=ids, sampling_params=first.sampling_params,
                                             inputs=StageInputs(capture_hidden=True))])
    talker_params = SamplingParams(temperature=0.0, repetition_penalty=1.05, max_tokens=30)
    msg = handoff.thinker2talker(first, toks["r"], hidden["r"], talker_params, "Ethan", "r")
    codes, _ = run_engine(talker, [to_engine_request(msg)])
    ref_text, ref_codes = hf_codes(qwen2_5_omni_hf_model, ids, 7, 30)
    assert toks["r"] == ref_text
    ours = codes["r"]
    if ours and ours[-1] in handoff.talker.eos_token_ids:
        ours = ours[:-1]  # transformers trims the talker's end token before the vocoder
    assert len(ref_codes) >= 5 and ours == ref_codes


# ---------------------------------------------------------------------------------------
# Qwen3-Omni: talker + code predictor
# ---------------------------------------------------------------------------------------

GROUPS = 4
CODEBOOK = 64                      # code predictor vocab / code2wav codebook
TALKER_VOCAB = CODEBOOK + 1024     # HF generate suppresses the top 1024 ids except eos
CODEC_EOS = CODEBOOK + 2
THINKER_HIDDEN = 24
# MoE weights are drawn wider than initializer_range (0.02) so that experts matter as
# much as attention and router logits are spread enough for top-k not to hinge on
# float rounding: a routing bug then shows up far above the tolerance.
MOE_STD = 0.1


@pytest.fixture(scope="module")
def qwen3_hf_talker():
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
def qwen3_talker(qwen3_hf_talker):
    cfg = TalkerConfig.from_hf(qwen3_hf_talker.config.to_dict())
    model = abstract_module(lambda rngs: Qwen3OmniTalker(cfg, rngs=rngs))  # shapes only: loaded below
    load_hf_into(model, _state(qwen3_hf_talker), prefix="")
    return model



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


def test_qwen3_talker_config(qwen3_talker):
    cfg = qwen3_talker.cfg
    assert cfg.num_code_groups == GROUPS and cfg.text.shared_expert_intermediate_size == 40
    assert cfg.text.mrope_section == (4, 2, 2) and cfg.code_predictor.mrope_section is None
    assert cfg.code_predictor.num_experts == 0 and cfg.text.num_experts == 4
    assert cfg.suppressed_token_ids == tuple(i for i in range(CODEBOOK, TALKER_VOCAB) if i != CODEC_EOS)
    assert cfg.speaker_id("Ethan") == CODEBOOK + 10


def test_qwen3_load_from_checkpoint_layout(qwen3_talker, qwen3_hf_talker, qwen3_hf_code2wav):
    """On disk the talker is `talker.*` with per-expert keys, code2wav `code2wav.*`: both load."""
    from omni_jax.models.qwen3_omni.expert_keys import FusedExperts, split_fused_experts

    disk = {}
    for key, value in _state(qwen3_hf_talker).items():
        if key.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            disk.update({"talker." + k: v for k, v in split_fused_experts(key, value).items()})
        else:
            disk["talker." + key] = value
    disk.update({"code2wav." + k: v for k, v in _state(qwen3_hf_code2wav).items()})
    assert "talker.model.layers.0.mlp.experts.3.up_proj.weight" in disk
    loaded = abstract_module(lambda rngs: Qwen3OmniTalker(qwen3_talker.cfg, rngs=rngs))
    load_hf_into(loaded, FusedExperts(disk), prefix="talker.")
    want = dict(nnx.to_flat_state(nnx.state(qwen3_talker, nnx.Param)))
    got = dict(nnx.to_flat_state(nnx.state(loaded, nnx.Param)))
    assert want.keys() == got.keys()
    for path in want:
        np.testing.assert_array_equal(np.asarray(got[path].get_value()), np.asarray(want[path].get_value()))
    c2w_cfg = Code2WavConfig.from_hf(qwen3_hf_code2wav.config.to_dict())
    c2w = abstract_module(lambda rngs: Qwen3OmniCode2Wav(c2w_cfg, rngs=rngs))
    load_hf_into(c2w, disk, prefix="code2wav.")


def test_qwen3_input_projections(qwen3_talker, qwen3_hf_talker):
    x = np.random.default_rng(1).standard_normal((5, THINKER_HIDDEN)).astype(np.float32)
    with torch.no_grad():
        ref_text = qwen3_hf_talker.text_projection(torch.from_numpy(x)).numpy()
        ref_hidden = qwen3_hf_talker.hidden_projection(torch.from_numpy(x)).numpy()
    _close(qwen3_talker.project_text(jnp.asarray(x)), ref_text)
    _close(qwen3_talker.project_hidden(jnp.asarray(x)), ref_hidden)


def _hf_residuals(qwen3_hf_talker, hidden, group0, **kwargs):
    """What HF's talker does per step: code predictor generate on [hidden, embed(group0)]."""
    last_id_hidden = qwen3_hf_talker.get_input_embeddings()(group0[:, None])
    with torch.no_grad():
        return qwen3_hf_talker.code_predictor.generate(
            inputs_embeds=torch.cat((hidden[:, None], last_id_hidden), dim=1),
            max_new_tokens=GROUPS - 1, output_hidden_states=True, return_dict_in_generate=True,
            output_logits=True, **kwargs)


def test_qwen3_code_predictor_greedy(qwen3_talker, qwen3_hf_talker):
    rng = np.random.default_rng(2)
    b = 5
    hidden = rng.standard_normal((b, 32)).astype(np.float32)
    group0 = rng.integers(0, CODEBOOK, b)
    ref = _hf_residuals(qwen3_hf_talker, torch.from_numpy(hidden), torch.from_numpy(group0), do_sample=False)
    codes, logits = _residual_greedy(qwen3_talker, jnp.asarray(hidden), jnp.asarray(group0, jnp.int32))
    assert codes.shape == (b, GROUPS - 1) and codes.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(codes), ref.sequences.numpy())
    _close(logits, torch.stack(ref.logits, dim=1).numpy())

    # The next talker input: talker embedding of group 0 + the predictor's embeddings of
    # groups 1..G-1, i.e. HF's codec_hiddens (step inputs recorded by generate + the last).
    with torch.no_grad():
        parts = [qwen3_hf_talker.get_input_embeddings()(torch.from_numpy(group0)[:, None])]
        parts += [h[0] for h in ref.hidden_states[1:]]
        parts.append(qwen3_hf_talker.code_predictor.get_input_embeddings()[-1](ref.sequences[:, -1:]))
        want = torch.cat(parts, dim=1).sum(1).numpy()
    all_codes = jnp.concatenate([jnp.asarray(group0, jnp.int32)[:, None], codes], axis=1)
    _close(qwen3_talker.codec_input_embeds(all_codes), want)


def test_qwen3_code_predictor_cache_equals_rerun(qwen3_talker):
    """The paged-KV steps (default) and the whole-sequence rerun give the same codes and logits."""
    rng = np.random.default_rng(4)
    hidden = jnp.asarray(rng.standard_normal((3, 32)).astype(np.float32))
    group0 = jnp.asarray(rng.integers(0, CODEBOOK, 3), jnp.int32)
    cached = nnx.jit(lambda m, h, g: m.predict_residual_codes(h, g, return_logits=True))(qwen3_talker, hidden, group0)
    rerun = nnx.jit(lambda m, h, g: m.predict_residual_codes(h, g, return_logits=True, cache=False))(
        qwen3_talker, hidden, group0)
    np.testing.assert_array_equal(np.asarray(cached[0]), np.asarray(rerun[0]))
    _close(cached[1], rerun[1])


def test_qwen3_code_predictor_on_the_gpu_kernels(qwen3_talker, monkeypatch):
    """A GPU stage's code predictor (backend "pallas": the decode and norm kernels, here in
    interpret mode, the decode kernel over its small cache, and the draws not skipped for an
    all-greedy batch) gives the reference's codes and logits, greedy and sampled."""
    import functools

    import kernels_pallas

    for kernel in ("paged_attention_with_write", "rms_norm"):
        monkeypatch.setattr(kernels_pallas, kernel, functools.partial(getattr(kernels_pallas, kernel), interpret=True))
    rng = np.random.default_rng(5)
    b = 3
    hidden = jnp.asarray(rng.standard_normal((b, 32)).astype(np.float32))
    group0 = jnp.asarray(rng.integers(0, CODEBOOK, b), jnp.int32)
    keys = jax.random.split(jax.random.key(11), b)
    for greedy in (np.ones(b, bool), np.array([True, False, False])):
        want, got = (nnx.jit(lambda m, h, g, k, backend=backend: m.predict_residual_codes(
            h, g, k, greedy=jnp.asarray(greedy), return_logits=True, backend=backend))(qwen3_talker, hidden, group0, keys)
            for backend in ("reference", "pallas"))
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        _close(got[1], want[1])


def test_qwen3_code_predictor_sampling(qwen3_talker):
    rng = np.random.default_rng(3)
    b = 5
    hidden = jnp.asarray(rng.standard_normal((b, 32)).astype(np.float32))
    group0 = jnp.asarray(rng.integers(0, CODEBOOK, b), jnp.int32)
    keys = jax.random.split(jax.random.key(7), b)
    codes = np.asarray(_residual_sampled(qwen3_talker, hidden, group0, keys))
    assert codes.shape == (b, GROUPS - 1) and ((codes >= 0) & (codes < CODEBOOK)).all()
    # Seeded: the same keys draw the same codes, and a row's draw does not depend on its
    # place in the batch (rows and their keys reversed -> codes reversed).
    np.testing.assert_array_equal(codes, np.asarray(_residual_sampled(qwen3_talker, hidden, group0, keys)))
    np.testing.assert_array_equal(codes[::-1], np.asarray(_residual_sampled(qwen3_talker, hidden[::-1], group0[::-1],
                                                                            keys[::-1])))
    assert not (codes == np.asarray(_residual_sampled(qwen3_talker, hidden, group0, jax.random.split(
        jax.random.key(8), b)))).all()
    # Every draw lies in the top-k / top-p set of its step's logits.
    logits = _teacher_forced_logits(qwen3_talker, hidden, group0, jnp.asarray(codes))
    for s in range(GROUPS - 1):
        kept = np.asarray(apply_top_k_top_p(logits[:, s], jnp.full((b,), 50, jnp.int32), jnp.full((b,), 0.8)))
        assert np.isfinite(kept[np.arange(b), codes[:, s]]).all()
    # top_k=1 is greedy.
    greedy = np.asarray(_residual_greedy(qwen3_talker, hidden, group0)[0])
    np.testing.assert_array_equal(np.asarray(_residual_sampled(qwen3_talker, hidden, group0, keys, top_k=1)), greedy)


def test_qwen3_code_predictor_sampling_static_top_k(qwen3_talker):
    """The serving path (static top_k: sampling among the k candidates) draws inside the
    nucleus, reproducibly and independently of the batch."""
    rng = np.random.default_rng(5)
    b = 4
    hidden = jnp.asarray(rng.standard_normal((b, 32)).astype(np.float32))
    group0 = jnp.asarray(rng.integers(0, CODEBOOK, b), jnp.int32)
    keys = jax.random.split(jax.random.key(9), b)
    draw = nnx.jit(lambda m, h, g, k: m.predict_residual_codes(h, g, k, top_k=20, top_p=0.8))
    codes = np.asarray(draw(qwen3_talker, hidden, group0, keys))
    np.testing.assert_array_equal(codes[::-1], np.asarray(draw(qwen3_talker, hidden[::-1], group0[::-1], keys[::-1])))
    logits = _teacher_forced_logits(qwen3_talker, hidden, group0, jnp.asarray(codes))
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


def test_qwen3_row_keys():
    from omni_jax.models.qwen3_omni.talker import _row_keys

    assert _row_keys(jax.random.key(0), 3).shape == (3,)
    assert _row_keys(jax.random.split(jax.random.key(0), 3), 3).shape == (3,)
    assert _row_keys(jax.random.PRNGKey(0), 3).shape == (3, 2)
    assert _row_keys(jax.random.split(jax.random.PRNGKey(0), 3), 3).shape == (3, 2)


def test_qwen3_talker_greedy_generation_matches_hf(qwen3_talker, qwen3_hf_talker):
    """HF talker.generate (greedy) vs a JAX loop: group-0 ids and every step's residual codes."""
    rng = np.random.default_rng(4)
    prompt = rng.standard_normal((1, 7, 32)).astype(np.float32)
    trailing = rng.standard_normal((1, 2, 32)).astype(np.float32)
    tts_pad = rng.standard_normal((1, 1, 32)).astype(np.float32)
    steps = 5
    cfg = qwen3_talker.cfg
    with torch.no_grad():
        ref = qwen3_hf_talker.generate(
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
        logits, hidden, _ = _talker_forward(qwen3_talker, jnp.asarray(embeds), jnp.arange(size),
                                            jnp.where(jnp.arange(size) < n, 0, -1))
        g0 = int(np.argmax(np.where(suppress, -np.inf, np.asarray(logits[n - 1]))))
        group0.append(g0)
        if step == steps - 1:
            break
        residual, _ = _residual_greedy(qwen3_talker, hidden[n - 1:n], jnp.asarray([g0], jnp.int32))
        step_codes = jnp.concatenate([jnp.asarray([[g0]], jnp.int32), residual], axis=1)
        codes.append(np.asarray(step_codes[0]))
        text = trailing[0, step] if step < trailing.shape[1] else tts_pad[0, 0]
        embeds[n] = np.asarray(qwen3_talker.codec_input_embeds(step_codes))[0] + text
    np.testing.assert_array_equal(np.array(group0), ref_group0)
    np.testing.assert_array_equal(np.stack(codes), ref_codes)


# ---------------------------------------------------------------------------------------
# Code2wav
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_hf_code2wav():
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
def qwen3_code2wav(qwen3_hf_code2wav):
    cfg = Code2WavConfig.from_hf(qwen3_hf_code2wav.config.to_dict())
    model = abstract_module(lambda rngs: Qwen3OmniCode2Wav(cfg, rngs=rngs))
    load_hf_into(model, _state(qwen3_hf_code2wav), prefix="")
    return model


@nnx.jit
def _decode(model, codes):
    return model(codes)


def test_qwen3_code2wav_config(qwen3_code2wav):
    assert qwen3_code2wav.total_upsample == 1920 and qwen3_code2wav.cfg.sliding_window == 6


def test_qwen3_code2wav_waveform(qwen3_code2wav, qwen3_hf_code2wav):
    codes = np.random.default_rng(5).integers(0, CODEBOOK, (2, GROUPS, 11))
    with torch.no_grad():
        ref = qwen3_hf_code2wav(torch.from_numpy(codes))[:, 0].numpy()
    wav = np.asarray(_decode(qwen3_code2wav, jnp.asarray(codes, jnp.int32)))
    assert 0.05 < np.abs(ref).mean() and (np.abs(ref) >= 1).mean() < 0.05  # not flat, barely clamped
    _close(wav, ref)


def test_qwen3_code2wav_chunked_decode(qwen3_code2wav, qwen3_hf_code2wav):
    codes = np.random.default_rng(6).integers(0, CODEBOOK, (1, GROUPS, 24))
    decode = lambda c: _decode(qwen3_code2wav, c)  # noqa: E731
    # 8/3 on 24 frames: chunks of 8, 3+8, 3+8 frames; the default 300/25 on 11 frames: one chunk.
    for chunk, context, frames in ((8, 3, 24), (300, 25, 11)):
        codes = codes[..., :frames]
        with torch.no_grad():
            ref = qwen3_hf_code2wav.chunked_decode(torch.from_numpy(codes), chunk_size=chunk,
                                                   left_context_size=context)[:, 0].numpy()
        wav = np.asarray(qwen3_code2wav.chunked_decode(jnp.asarray(codes, jnp.int32), chunk, context, decode_fn=decode))
        _close(wav, ref)
