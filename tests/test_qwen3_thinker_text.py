"""Qwen3-Omni thinker text decoder, MoE block and expert-key fusion against transformers."""

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
from safetensors.numpy import load_file

import hf_tiny_qwen3 as tiny
from conversion.mapping import load_hf_into, map_hf_tensors
from omni_jax.models.qwen3_omni.expert_keys import FusedExperts, fuse_expert_keys, fused_expert_getter, split_fused_experts
from omni_jax.errors import CheckpointError
from omni_jax.models.layers.attention import AttentionMetadata
from omni_jax.models.layers.moe import MoEConfig, SparseMoeBlock, dense_moe_reference
from omni_jax.models.registry import abstract_module  # shape-only parameters: load_hf_into fills them
from omni_jax.models.qwen3_omni.thinker_text import Qwen3TextConfig, Qwen3TextDecoder

pytestmark = pytest.mark.parity

TOL = 1e-4


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    return tiny.build_qwen3_omni(str(tmp_path_factory.mktemp("qwen3_omni_hf")))


@pytest.fixture(scope="module")
def hf_model(hf_dir):
    return tiny.load_qwen3_omni(hf_dir)


@pytest.fixture(scope="module")
def disk_tensors(hf_dir) -> dict:
    return load_file(os.path.join(hf_dir, "model.safetensors"))


@pytest.fixture(scope="module")
def text_cfg(hf_dir) -> Qwen3TextConfig:
    with open(os.path.join(hf_dir, "config.json")) as f:
        return Qwen3TextConfig.from_hf(json.load(f)["thinker_config"]["text_config"])


@functools.partial(jax.jit, static_argnames=("capture",))
def _forward(model, x, positions, meta, caches=None, capture=(), deepstack=None):
    return model(x, positions, meta, caches, capture, deepstack)


_apply = jax.jit(lambda module, x: module(x))


@pytest.fixture(scope="module")
def decoder(text_cfg, disk_tensors):
    model = abstract_module(lambda rngs: Qwen3TextDecoder(text_cfg, rngs=rngs))
    load_hf_into(model, FusedExperts(disk_tensors), prefix="thinker.model.",
                 ignore=(r"^audio_tower\.", r"^visual\."))
    lm_head = abstract_module(lambda rngs: nnx.Linear(text_cfg.hidden_size, text_cfg.vocab_size, use_bias=False,
                                                              rngs=rngs))
    load_hf_into(lm_head, disk_tensors, prefix="thinker.lm_head.")
    return model, lm_head


def _close(ours, ref, tol=TOL, rel=1e-3):
    """Max abs error within tol, and small against the reference's scale too."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    err = np.abs(ours - ref).max()
    assert err <= tol, f"max abs error {err:.3g} > {tol}"
    assert err <= rel * np.abs(ref).max(), f"max abs error {err:.3g} vs reference scale {np.abs(ref).max():.3g}"


def _block_from_hf(hf_block, cfg: MoEConfig) -> SparseMoeBlock:
    block = abstract_module(lambda rngs: SparseMoeBlock(cfg, rngs=rngs))
    return load_hf_into(block, {k: v.numpy() for k, v in hf_block.state_dict().items()}, prefix="")


# --- MoE block ---------------------------------------------------------------------------


def test_thinker_moe_block_matches_hf_and_dense_reference(hf_model, text_cfg):
    hf_block = hf_model.thinker.model.language_model.layers[0].mlp
    block = _block_from_hf(hf_block, text_cfg.moe)
    x = np.random.default_rng(0).standard_normal((23, text_cfg.hidden_size)).astype(np.float32)
    with torch.no_grad():
        ref = hf_block(torch.from_numpy(x)[None])[0].numpy()
    out = _apply(block, jnp.asarray(x))
    _close(out, ref)
    # Routing math on its own: every expert on every token, weighted by the top-k weights.
    dense = dense_moe_reference(jnp.asarray(x), block.gate.kernel[...].T, block.experts.gate_up_proj[...],
                                block.experts.down_proj[...], text_cfg.num_experts_per_tok, True)
    _close(out, dense)
    assert np.abs(ref).max() > 0.1  # the experts matter: a wrong route would show


def test_talker_moe_block_with_shared_expert_matches_hf(hf_model, hf_dir):
    with open(os.path.join(hf_dir, "config.json")) as f:
        talker_cfg = Qwen3TextConfig.from_hf(json.load(f)["talker_config"]["text_config"])
    assert talker_cfg.shared_expert_intermediate_size > 0
    hf_block = hf_model.talker.model.layers[1].mlp
    block = _block_from_hf(hf_block, talker_cfg.moe)
    x = np.random.default_rng(1).standard_normal((17, talker_cfg.hidden_size)).astype(np.float32)
    with torch.no_grad():
        ref = hf_block(torch.from_numpy(x)[None])[0].numpy()
    _close(_apply(block, jnp.asarray(x)), ref)


def test_moe_padding_tokens_route_nowhere(text_cfg):
    block = SparseMoeBlock(text_cfg.moe, rngs=nnx.Rngs(3))
    x = jnp.asarray(np.random.default_rng(2).standard_normal((9, text_cfg.hidden_size)), jnp.float32)
    valid = jnp.asarray([True] * 6 + [False] * 3)
    full = _apply(block, x)
    masked = jax.jit(lambda m, v, ok: m(v, ok))(block, x, valid)
    np.testing.assert_allclose(masked[:6], full[:6], atol=1e-6)
    assert np.all(np.asarray(masked[6:]) == 0)


@pytest.mark.lowering
def test_moe_block_lowers_for_cuda(text_cfg):
    block = abstract_module(lambda rngs: SparseMoeBlock(text_cfg.moe, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                                                              rngs=rngs))
    graph, state = nnx.split(block)

    def f(state, x):
        return nnx.merge(graph, state)(x)

    x = jax.ShapeDtypeStruct((64, text_cfg.hidden_size), jnp.bfloat16)
    text = jax.jit(f).trace(state, x).lower(lowering_platforms=("cuda",)).as_text()
    # The GPU dispatch is the router's partial products (skinny kernel), the routing kernel (a
    # decode step's 64 tokens) and the Pallas grouped matmul, twice, and no loop: a while loop
    # (as the blocked CPU path's, or a binary search in the block plan) runs from the host on a GPU.
    assert text.count("@__gpu$xla.gpu.triton(") == 4 and text.count('name = "moe_route"') == 1
    assert text.count('name = "skinny_matmul') == 1
    assert "stablehlo.while" not in text and "ragged_dot" not in text


# --- text decoder ------------------------------------------------------------------------


def _run(decoder, ids, positions, capture=(), deepstack=None, embeds=None):
    model, lm_head = decoder
    x = model.embed(jnp.asarray(ids, jnp.int32)) if embeds is None else jnp.asarray(embeds)
    h, _, captured = _forward(model, x, jnp.asarray(positions), AttentionMetadata.dense(x.shape[0]),
                              capture=tuple(capture), deepstack=deepstack)
    return np.asarray(_apply(lm_head, h)), {k: np.asarray(v) for k, v in captured.items()}


def test_config_reads_real_structure(text_cfg):
    assert text_cfg.mrope_section == (4, 2, 2) and text_cfg.head_dim == 16
    assert all(text_cfg.is_moe_layer(i) for i in range(text_cfg.num_layers))
    assert text_cfg.shared_expert_intermediate_size == 0 and text_cfg.norm_topk_prob
    assert not text_cfg.attention_bias


def test_text_logits_and_hidden_states_match_hf(decoder, hf_model, text_cfg):
    ids = np.array(tiny.text_prompt_ids() + [1207, 3555, 13, 151645, 198], np.int64)
    n = text_cfg.num_layers
    with torch.no_grad():
        ref = hf_model.thinker(input_ids=torch.tensor(ids)[None], output_hidden_states=True)
    logits, hidden = _run(decoder, ids, np.arange(len(ids)), capture=tuple(range(n + 1)))
    _close(logits, ref.logits[0].numpy())
    for i in range(n + 1):
        _close(hidden[i], ref.hidden_states[i][0].numpy())


def test_interleaved_mrope_positions_match_hf(decoder, hf_model):
    """Distinct T/H/W rows (as an image grid gives) exercise every rotary band's row."""
    rng = np.random.default_rng(4)
    t = 21
    ids = rng.integers(0, 151000, t)
    positions = np.stack([np.arange(t), np.arange(t) // 3 + 5, np.arange(t) % 7 + 2])
    with torch.no_grad():
        ref = hf_model.thinker(input_ids=torch.tensor(ids)[None],
                               position_ids=torch.tensor(positions)[:, None, :])
    logits, _ = _run(decoder, ids, positions)
    _close(logits, ref.logits[0].numpy())
    # And the rows really matter: collapsing them to 1-D positions changes the logits.
    flat, _ = _run(decoder, ids, np.arange(t))
    assert np.abs(flat - logits).max() > 10 * TOL


def test_deepstack_matches_hf(decoder, hf_model, text_cfg):
    rng = np.random.default_rng(5)
    t, h = 19, text_cfg.hidden_size
    visual = np.zeros(t, bool)
    visual[4:12] = True
    n_levels = 2
    embeds = (0.05 * rng.standard_normal((t, h))).astype(np.float32)
    features = rng.standard_normal((n_levels, int(visual.sum()), h)).astype(np.float32)
    positions = np.stack([np.arange(t)] * 3)
    lm = hf_model.thinker.model.language_model
    with torch.no_grad():
        ref = lm(inputs_embeds=torch.from_numpy(embeds)[None],
                 position_ids=torch.tensor(positions)[:, None, :],
                 visual_pos_masks=torch.from_numpy(visual)[None],
                 deepstack_visual_embeds=[torch.from_numpy(f) for f in features],
                 output_hidden_states=True)
    # Scatter the per-visual-token features to token positions; non-visual rows hold junk.
    per_token = rng.standard_normal((n_levels, t, h)).astype(np.float32)
    per_token[:, visual] = features
    model, _ = decoder
    out, _, captured = _forward(model, jnp.asarray(embeds), jnp.asarray(positions), AttentionMetadata.dense(t),
                                capture=tuple(range(text_cfg.num_layers + 1)),
                                deepstack=(jnp.asarray(visual), jnp.asarray(per_token)))
    _close(out, ref.last_hidden_state[0].numpy())
    for i in range(text_cfg.num_layers + 1):
        _close(captured[i], ref.hidden_states[i][0].numpy())


def test_paged_prefill_then_decode_matches_dense(decoder, text_cfg):
    model, lm_head = decoder
    ids = np.array(tiny.text_prompt_ids(), np.int32)
    t, block_size, num_blocks = len(ids), 4, 16
    dense, _ = _run(decoder, ids, np.arange(t))
    cache_shape = (num_blocks, block_size, text_cfg.num_kv_heads, text_cfg.head_dim)
    caches = [(jnp.zeros(cache_shape), jnp.zeros(cache_shape)) for _ in range(text_cfg.num_layers)]
    table = jnp.arange(1, 1 + (t + block_size - 1) // block_size, dtype=jnp.int32)[None]
    pad = jnp.zeros((1, num_blocks - 1 - table.shape[1]), jnp.int32)
    table = jnp.concatenate([table, pad], axis=1)

    def meta(start, n, decode):
        pos = np.arange(start, start + n)
        slots = np.asarray(table[0])[pos // block_size] * block_size + pos % block_size
        return AttentionMetadata(mode="paged", backend="reference", decode_only=decode,
                                 slot_mapping=jnp.asarray(slots, jnp.int32), block_tables=table,
                                 kv_lens=jnp.asarray([start + n], jnp.int32),
                                 cu_q_lens=jnp.asarray([0, n], jnp.int32))

    split = t - 3
    h, caches, _ = _forward(model, model.embed(jnp.asarray(ids[:split])), jnp.arange(split),
                            meta(0, split, False), caches)
    outs = [np.asarray(_apply(lm_head, h))]
    for p in range(split, t):
        h, caches, _ = _forward(model, model.embed(jnp.asarray(ids[p:p + 1])), jnp.asarray([p]),
                                meta(p, 1, True), caches)
        outs.append(np.asarray(_apply(lm_head, h)))
    np.testing.assert_allclose(np.concatenate(outs), dense, atol=TOL)


def test_dense_layers_and_unnormalised_routing_match_hf():
    """Config variants the tiny checkpoint lacks: mlp_only_layers, norm_topk_prob False,
    num_heads * head_dim != hidden (as in the real 32 x 128 vs 2048), section [3, 3, 2]."""
    from transformers import Qwen3OmniMoeTextConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerTextModel

    d = dict(vocab_size=256, hidden_size=48, intermediate_size=40, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=24,
             num_experts=6, num_experts_per_tok=3, norm_topk_prob=False, mlp_only_layers=[1],
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [3, 3, 2],
                              "interleaved": True})
    torch.manual_seed(0)
    hf = Qwen3OmniMoeThinkerTextModel(Qwen3OmniMoeTextConfig(**d)).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            std = 0.1 if ("experts" in name or "mlp.gate.weight" in name) else 0.05
            p.copy_((1.0 if "norm" in name else 0.0) + std * torch.randn(p.shape, generator=g))
    cfg = Qwen3TextConfig.from_hf(d)
    assert not cfg.is_moe_layer(1) and cfg.is_moe_layer(0)
    model = abstract_module(lambda rngs: Qwen3TextDecoder(cfg, rngs=rngs))
    load_hf_into(model, {k: v.numpy() for k, v in hf.state_dict().items()}, prefix="")
    ids = np.random.default_rng(6).integers(0, 256, 15)
    positions = np.stack([np.arange(15), np.arange(15) // 2, np.arange(15) % 4])
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids)[None], position_ids=torch.tensor(positions)[:, None, :])
    out, _, _ = _forward(model, model.embed(jnp.asarray(ids)), jnp.asarray(positions), AttentionMetadata.dense(15))
    _close(out, ref.last_hidden_state[0].numpy())


# --- per-expert keys <-> fused tensors -----------------------------------------------------


def test_fused_expert_keys_roundtrip(disk_tensors, hf_model, text_cfg):
    keys = list(disk_tensors)
    fused_keys = fuse_expert_keys(keys)
    assert not any(".experts.0." in k for k in fused_keys)
    block = "thinker.model.layers.2.mlp.experts"
    assert f"{block}.gate_up_proj" in fused_keys and f"{block}.down_proj" in fused_keys
    assert "thinker.model.layers.2.mlp.gate.weight" in fused_keys
    assert "talker.model.layers.0.mlp.shared_expert.gate_proj.weight" in fused_keys
    get = fused_expert_getter(keys, disk_tensors.__getitem__)
    gate_up, down = get(f"{block}.gate_up_proj"), get(f"{block}.down_proj")
    e, i, h = text_cfg.num_experts, text_cfg.moe_intermediate_size, text_cfg.hidden_size
    assert gate_up.shape == (e, 2 * i, h) and down.shape == (e, h, i)
    # Same layout as transformers' own fusion when it loaded the checkpoint.
    hf_experts = hf_model.thinker.model.language_model.layers[2].mlp.experts
    np.testing.assert_array_equal(gate_up, hf_experts.gate_up_proj.detach().numpy())
    np.testing.assert_array_equal(down, hf_experts.down_proj.detach().numpy())
    # Inverse gives back exactly the on-disk tensors; other keys pass through untouched.
    back = {**split_fused_experts(f"{block}.gate_up_proj", gate_up), **split_fused_experts(f"{block}.down_proj", down)}
    assert len(back) == 3 * e
    for k, v in back.items():
        np.testing.assert_array_equal(v, disk_tensors[k])
    assert get("thinker.lm_head.weight") is disk_tensors["thinker.lm_head.weight"]


def test_fused_view_plans_the_generic_mapping(disk_tensors, text_cfg):
    model = abstract_module(lambda rngs: Qwen3TextDecoder(text_cfg, rngs=rngs))
    _, state, _ = nnx.split(model, nnx.Param, ...)
    shapes = {p: tuple(v.get_value().shape) for p, v in nnx.to_flat_state(state)}
    plan = map_hf_tensors(FusedExperts(disk_tensors), shapes, "thinker.model.",
                          ignore=(r"^audio_tower\.", r"^visual\."))
    assert plan[("layers", 0, "mlp", "experts", "gate_up_proj")] == (
        "thinker.model.layers.0.mlp.experts.gate_up_proj", "gate_up_proj")
    assert plan[("layers", 0, "mlp", "gate", "kernel")][0] == "thinker.model.layers.0.mlp.gate.weight"
    # Without the fused view the per-expert tensors match nothing.
    with pytest.raises(CheckpointError):
        map_hf_tensors(disk_tensors, shapes, "thinker.model.", ignore=(r"^audio_tower\.", r"^visual\."))


def test_missing_expert_tensor_is_named(disk_tensors):
    partial = {k: v for k, v in disk_tensors.items() if k != "thinker.model.layers.1.mlp.experts.5.up_proj.weight"}
    with pytest.raises(CheckpointError, match=r"layers\.1\.mlp\.experts\.5\.up_proj"):
        FusedExperts(partial)


# --- the tiny checkpoint itself ------------------------------------------------------------


def test_tiny_checkpoint_generates_text_and_audio(hf_model):
    ids = torch.tensor([tiny.text_prompt_ids()])
    torch.manual_seed(0)
    with torch.no_grad():
        seq, wav = hf_model.generate(ids, return_audio=True, thinker_max_new_tokens=4, thinker_do_sample=False,
                                     thinker_eos_token_id=tiny.IM_END, talker_max_new_tokens=6)
    assert seq.shape[1] > ids.shape[1]
    assert wav.ndim == 3 and wav.shape[-1] > 0 and torch.isfinite(wav).all()


def test_tiny_checkpoint_generates_audio_from_audio_and_image(hf_model):
    """Audio + image in, audio out: the talker's rope index needs `audio_config` (set by the loader)."""
    frames, grid = 250, (1, 4, 4)  # 2.5 s of mel -> 13 + 13 + 7 audio tokens; 4 x 4 patches -> 4 tokens
    n_audio = 2 * 13 + 7
    ids = ([tiny.IM_START, tiny.USER_TOKEN, 198, tiny.AUDIO_START] + [tiny.AUDIO_TOKEN] * n_audio
           + [tiny.AUDIO_END, tiny.VISION_START] + [tiny.IMAGE_TOKEN] * 4 + [tiny.VISION_END, tiny.IM_END, 198,
              tiny.IM_START, tiny.ASSISTANT_TOKEN, 198])
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    with torch.no_grad():
        seq, wav = hf_model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            input_features=torch.randn(1, 128, frames, generator=g),
            feature_attention_mask=torch.ones(1, frames, dtype=torch.long),
            pixel_values=torch.randn(16, 3 * 2 * 16 * 16, generator=g), image_grid_thw=torch.tensor([grid]),
            return_audio=True, thinker_max_new_tokens=3, thinker_do_sample=False, talker_max_new_tokens=4)
    assert seq.shape[1] > len(ids) and torch.isfinite(wav).all()
