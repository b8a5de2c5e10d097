"""The Qwen3-Omni thinker end to end against transformers.

Conversion of the tiny checkpoint (every thinker tensor round-trips through the fused
expert view), M-RoPE positions against `get_rope_index`, logits on text / audio /
image (+ video) prompts with DeepStack, in-process engine greedy generation (chunked
prefill, concurrent text and media requests, no compilation after warm-up) and one
multi-process `OmniJax` run.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy as stnp
import torch

import hf_tiny_qwen3 as tiny
from qwen3_prompt import Prompt
from omni_jax import load_checkpoint
from omni_jax.engine.protocol import MultiModalPayload
from omni_jax.engine.runner import RunnerConfig
from omni_jax.engine.sampling_params import SamplingParams
from omni_jax.models.qwen3_omni.rope_index import get_rope_index_qwen3
from omni_jax.models.layers.attention import AttentionMetadata
from omni_jax.models.qwen3_omni.media_encoder import Qwen3ThinkerMediaEncoder
from omni_jax.models.thinker_media import EncoderCache, MediaBuckets

pytestmark = pytest.mark.parity

TOL = 1e-4
MAX_TOKENS = 6
BUCKETS = MediaBuckets(audio_chunks=(4,), vision_patches=(256,))
T_PAD = 128  # every logits test runs one compiled shape; the rest is junk padding


@pytest.fixture(scope="module")
def converted(qwen3_omni_hf_dir, tmp_path_factory) -> str:
    from conversion.convert import convert

    return convert(qwen3_omni_hf_dir, str(tmp_path_factory.mktemp("omni_jax_q3") / "tiny_fp32"),
                   dtype="float32", progress=False)


@pytest.fixture(scope="module")
def thinker(converted):
    model, cfg = load_checkpoint(converted, stage="thinker")
    return model, cfg, Qwen3ThinkerMediaEncoder(model, cfg, BUCKETS)


# ---------------------------------------------------------------- prompts
def _close(ours, ref, tol=TOL, rel=1e-3):
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    err = np.abs(ours - ref).max()
    assert err <= tol, f"max abs error {err:.3g} > {tol}"
    assert err <= rel * np.abs(ref).max(), f"max abs error {err:.3g} vs reference scale {np.abs(ref).max():.3g}"
    return err


# ---------------------------------------------------------------- conversion
def test_conversion_round_trips_every_tensor(converted, qwen3_omni_hf_dir):
    """Thinker, talker (per-expert keys fused) and code2wav: every HF tensor comes back."""
    import orbax.checkpoint as ocp

    from conversion.mapping import inverse_transform_for, map_hf_tensors
    from omni_jax.models.qwen3_omni.expert_keys import FusedExperts, split_fused_experts
    from omni_jax.checkpoint import read_config
    from omni_jax.models.registry import abstract_stage, param_shapes, stages_of

    cfg = read_config(converted)
    assert cfg["family"] == "qwen3_omni" and sorted(cfg["stages"]) == ["code2wav", "talker", "thinker"]
    disk = stnp.load_file(os.path.join(qwen3_omni_hf_dir, "model.safetensors"))
    view = FusedExperts(disk)
    seen = set()
    for name in cfg["stages"]:
        spec = stages_of("qwen3_omni")[name]
        shapes = param_shapes(abstract_stage(spec, spec.parse_config(cfg["hf_config"][spec.config_key])))
        plan = map_hf_tensors(view.keys(), shapes, spec.hf_prefix, spec.renames)
        stored = ocp.StandardCheckpointer().restore(os.path.abspath(os.path.join(converted, name)))
        assert len(stored) == len(plan), name
        for path, (key, leaf) in plan.items():
            back = inverse_transform_for(leaf, np.asarray(stored[".".join(map(str, path))]))
            pieces = split_fused_experts(key, back) if key.endswith(("experts.gate_up_proj", "experts.down_proj")) \
                else {key: back}
            for k, v in pieces.items():
                np.testing.assert_array_equal(v, disk[k], err_msg=k)
                seen.add(k)
    assert seen == set(disk)


# ---------------------------------------------------------------- positions
@pytest.mark.parametrize("case", ["mixed", "audio_in_video", "audio_in_video_long_video"])
def test_rope_index_matches_transformers(case, thinker, qwen3_omni_hf_model):
    _, cfg, _ = thinker
    p = Prompt(seed=1).text(3)
    if case == "mixed":
        p.image((1, 8, 12)).text(2).audio(250).text(4).video((2, 4, 8)).image((2, 4, 4)).text(1)
    elif case == "audio_in_video":
        p.video((3, 4, 4), with_audio_frames=300).text(2).audio(130)
    else:  # the video outlasts its audio: the end tokens follow a video run
        p.image((1, 4, 4)).video((4, 4, 4), with_audio_frames=100).text(3)
    p.done()
    mm = p.mm
    frames = [f.shape[1] for f in mm.audio_features]
    ours, delta = get_rope_index_qwen3(
        np.array(p.ids), cfg.rope_index, image_grid_thw=mm.image_grid_thw, video_grid_thw=mm.video_grid_thw,
        audio_seqlens=np.array(frames), second_per_grids=mm.video_second_per_grid,
        use_audio_in_video=mm.use_audio_in_video, n_window=cfg.audio.n_window)

    def t(a):
        return None if a is None else torch.tensor(a)

    ref, ref_delta = qwen3_omni_hf_model.thinker.get_rope_index(
        torch.tensor(p.ids)[None], t(mm.image_grid_thw), t(mm.video_grid_thw),
        torch.ones(1, len(p.ids), dtype=torch.long), mm.use_audio_in_video, torch.tensor(frames),
        t(mm.video_second_per_grid))
    np.testing.assert_array_equal(ours, ref[:, 0].numpy())
    assert delta == int(ref_delta.item())


# ---------------------------------------------------------------- logits
@functools.partial(jax.jit, static_argnames=("capture",))
def _forward(model, ids, overlay, overlay_mask, positions, segment_ids, ds_mask, ds_feats, capture):
    x = jnp.where(overlay_mask[:, None], overlay, model.embed(ids))
    h, _, captured = model(x, positions, AttentionMetadata.dense(ids.shape[0], segment_ids),
                           capture_layers=capture, deepstack=(ds_mask, ds_feats))
    return model.compute_logits(h), captured


def _logits(thinker, ids, mm=None, deepstack=True, pad_seed=0):
    """Logits and hidden states (0, last) of one prompt, run as the first segment of T_PAD tokens."""
    model, cfg, media = thinker
    ids = np.asarray(ids)
    t, h, k = len(ids), cfg.text.hidden_size, cfg.num_deepstack_layers
    junk = np.random.default_rng(pad_seed).integers(0, 151000, T_PAD - t)
    overlay = np.zeros((T_PAD, h), np.float32)
    mask = np.zeros(T_PAD, bool)
    ds_mask = np.zeros(T_PAD, bool)
    ds_feats = np.zeros((k, T_PAD, h), np.float32)
    positions = np.zeros((3, T_PAD), np.int32)
    positions[:, :t] = np.arange(t)
    positions[:, t:] = np.arange(T_PAD - t)
    if mm is not None:
        inp, _ = media.prepare(ids, mm)
        rows = np.maximum(inp.overlay_index, 0)
        mask[:t] = inp.overlay_index >= 0
        overlay[:t] = inp.overlay_rows[rows]
        positions[:, :t] = inp.mrope_positions
        if inp.deepstack_rows is not None and deepstack:
            ds_mask[:t] = mask[:t]
            ds_feats[:, :t] = inp.deepstack_rows[:, rows]
    segments = np.where(np.arange(T_PAD) < t, 0, -1).astype(np.int32)
    logits, captured = _forward(model, jnp.asarray(np.concatenate([ids, junk]), jnp.int32), overlay, mask,
                                positions, segments, ds_mask, ds_feats, capture=(0, cfg.text.num_layers))
    return np.asarray(logits)[:t], {i: np.asarray(v)[:t] for i, v in captured.items()}


def test_text_logits_match_transformers(thinker, qwen3_omni_hf_model):
    ids = np.array(tiny.text_prompt_ids() + np.random.default_rng(2).integers(0, 151000, 9).tolist())
    with torch.no_grad():
        ref = qwen3_omni_hf_model.thinker(input_ids=torch.tensor(ids)[None], output_hidden_states=True)
    logits, hidden = _logits(thinker, ids)
    _close(logits, ref.logits[0].numpy())
    _close(hidden[0], ref.hidden_states[0][0].numpy())
    _close(hidden[3], ref.hidden_states[-1][0].numpy())


@pytest.mark.parametrize("case", ["audio", "image", "image_video"])
def test_media_logits_match_transformers(case, thinker, qwen3_omni_hf_model):
    p = Prompt(seed=3).text(4)
    if case == "audio":
        p.audio(250).text(2).audio(60)       # two audios: 2.5 chunks and a short one
    elif case == "image":
        p.image((1, 8, 12)).text(3)
    else:                                    # joint DeepStack rows over images and videos
        p.video((2, 4, 8)).text(2).image((1, 8, 8))
    p.done()
    ids = np.array(p.ids)
    with torch.no_grad():
        ref = qwen3_omni_hf_model.thinker(input_ids=torch.tensor(ids)[None], output_hidden_states=True,
                                          attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                          **p.hf_kwargs())
    logits, hidden = _logits(thinker, ids, p.mm)
    _close(logits, ref.logits[0].numpy())
    _close(hidden[0], ref.hidden_states[0][0].numpy())
    if case != "audio":
        # DeepStack matters: leaving it out moves the logits far beyond the tolerance.
        plain, _ = _logits(thinker, ids, p.mm, deepstack=False)
        assert np.abs(plain - ref.logits[0].numpy()).max() > 100 * TOL


def test_padding_tokens_do_not_change_real_rows(thinker):
    """Padding tokens (segment -1) go through the MoE too: other junk, bit-identical real rows."""
    ids = np.array(tiny.text_prompt_ids())
    a, _ = _logits(thinker, ids, pad_seed=1)
    b, _ = _logits(thinker, ids, pad_seed=2)
    np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------- engine
@pytest.fixture(scope="module")
def engine(converted):
    from omni_jax.models.qwen3_omni.stages import build_thinker_engine

    # Small KV pool and token budget: chunked prefill splits the media prompts.
    runner = RunnerConfig(num_blocks=48, block_size=16, max_num_seqs=8, max_num_batched_tokens=32,
                          max_model_len=160, token_buckets=(32,), decode_buckets=(8,))
    return build_thinker_engine(converted, runner, media_buckets=BUCKETS, progress=False)


def _hf_greedy(hf, ids, **kw):
    with torch.no_grad():
        out = hf.thinker.generate(input_ids=torch.tensor(ids)[None],
                                  attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  max_new_tokens=MAX_TOKENS, do_sample=False, **kw)
    return out[0, len(ids):].tolist()


def test_engine_greedy_matches_transformers(engine, qwen3_omni_hf_model):
    rng = np.random.default_rng(5)
    texts = [rng.integers(0, 151000, n) for n in (5, 23, 40, 9)]
    image = Prompt(seed=6).text(21).image((1, 8, 12)).text(2).done()
    audio = Prompt(seed=7).text(2).audio(130).done()
    c0 = engine.num_compilations
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    for i, p in enumerate(texts):
        engine.add_request(f"t{i}", p, greedy)
    engine.add_request("image", np.array(image.ids), greedy, multi_modal_data=image.mm)
    engine.add_request("audio", np.array(audio.ids), greedy, multi_modal_data=audio.mm)
    got = {}
    for _ in range(300):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert not engine.has_unfinished()
    assert engine.num_compilations == c0, "a step compiled after warm-up"
    hf = qwen3_omni_hf_model
    for i, p in enumerate(texts):
        assert got[f"t{i}"] == _hf_greedy(hf, p), f"request t{i}"
    assert got["image"] == _hf_greedy(hf, image.ids, **image.hf_kwargs())
    assert got["audio"] == _hf_greedy(hf, audio.ids, **audio.hf_kwargs())
    kv = engine.scheduler.kv_cache_manager
    assert kv.is_idle_and_leak_free()


def test_a_conversation_keeps_its_earlier_media_cached(engine, qwen3_omni_hf_model):
    """Turn 2 extends turn 1 with more audio and an image: its prefix-cache hit reaches past turn
    1's audio (each media item is a range of its own, keyed by its inputs), that audio's encoder
    rows are read back from the encoder cache, and its greedy tokens equal transformers' on the
    whole prompt."""
    full = Prompt(seed=12).text(2).audio(130).text(20).audio(60).text(3).image((1, 8, 8)).done()
    ids = np.array(full.ids)
    first_audio_end = int(np.flatnonzero(ids == tiny.AUDIO_END)[0])
    turn1 = ids[:first_audio_end + 21]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)

    def run(rid, prompt, mm):
        engine.add_request(rid, prompt, greedy, multi_modal_data=mm)
        tokens, cached = [], 0
        for _ in range(300):
            if not engine.has_unfinished():
                break
            for o in engine.step():
                tokens += o.new_token_ids
                cached = max(cached, o.num_cached_tokens)
        return tokens, cached

    encoded = engine.media_encoder.encoded
    seen = encoded.hits, encoded.misses
    assert run("turn 1", turn1, MultiModalPayload(audio_features=full.mm.audio_features[:1]))[1] == 0
    tokens, cached = run("turn 2", ids, full.mm)
    assert (encoded.hits - seen[0], encoded.misses - seen[1]) == (1, 3)  # turn 2 encoded its audio and image
    assert cached == len(turn1) // 16 * 16 and cached > first_audio_end, (cached, first_audio_end)  # 16: block size
    assert tokens == _hf_greedy(qwen3_omni_hf_model, full.ids, **full.hf_kwargs())
    assert engine.scheduler.kv_cache_manager.is_idle_and_leak_free()


def test_encoder_rows_read_back_equal_encoded_ones(engine):
    """A prompt whose media the encoder cache holds (some of them) gets the rows of one encoded
    afresh; the cache keeps the newest items within its bytes."""
    enc = engine.media_encoder
    first = Prompt(seed=15).text(2).audio(130).text(1).image((1, 8, 8)).done()
    p = Prompt(seed=15).text(2).audio(130).text(1).image((1, 8, 8)).text(1).audio(60).image((1, 8, 12)).done()
    ids = np.array(p.ids)
    enc.prepare(np.array(first.ids), first.mm)  # the same first audio and image
    hits = enc.encoded.hits
    held, fresh = enc.encoded, EncoderCache()
    cached = enc.prepare(ids, p.mm)[0]
    assert enc.encoded.hits == hits + 2
    enc.encoded = fresh
    try:
        computed = enc.prepare(ids, p.mm)[0]
    finally:
        enc.encoded = held
    np.testing.assert_allclose(cached.overlay_rows, computed.overlay_rows, atol=1e-5, rtol=0)
    np.testing.assert_allclose(cached.deepstack_rows, computed.deepstack_rows, atol=1e-5, rtol=0)
    small = EncoderCache(max_bytes=3000)
    for key in "abc":
        small.put(key, (np.zeros(250, np.float32), None))  # 1000 bytes each
    small.put("d", (np.zeros(250, np.float32), None))
    small.put("huge", (np.zeros(1000, np.float32), None))
    assert list(small.items) == ["b", "c", "d"] and small.bytes == 3000


def test_media_prefix_cache_ranges_and_keys(engine):
    """One range per media item; a video with its audio track interleaved is one range. An audio's
    key carries the request's chunk padding (transformers pads every chunk to the request's
    longest): beside a longer audio, the same short clip gets another key."""
    enc = engine.media_encoder

    def ranges(p):
        return enc.prepare(np.array(p.ids), p.mm)[1]

    alone = ranges(Prompt(seed=13).text(2).audio(40).done())
    beside = ranges(Prompt(seed=13).text(2).audio(40).text(2).audio(130).done())  # the same first clip
    assert len(alone) == 1 and len(beside) == 2 and alone[0][:2] == beside[0][:2] and alone[0][2] != beside[0][2]
    mixed = Prompt(seed=14).text(2).image((1, 8, 8)).text(1).video((2, 8, 8), with_audio_frames=60).done()
    ids = np.array(mixed.ids)
    got = ranges(mixed)
    media = np.flatnonzero(np.isin(ids, [tiny.IMAGE_TOKEN, tiny.VIDEO_TOKEN, tiny.AUDIO_TOKEN]))
    image = np.flatnonzero(ids == tiny.IMAGE_TOKEN)
    assert [(o, n) for o, n, _ in got] == [(image[0], len(image)), (media[len(image)], media[-1] - media[len(image)] + 1)]
    assert got[1][2].count("+") == 1  # the video's key and its audio's
    bad = Prompt(seed=13).text(2).audio(40).done()
    bad.mm.audio_features[0] = bad.mm.audio_features[0][0]  # one mel bin's row, not [bins, frames]
    with pytest.raises(ValueError, match=r"audio 0: expected log-mel features \[128, frames\], got shape \(40,\)"):
        enc.prepare(np.array(bad.ids), bad.mm)


def test_one_token_chunk_at_a_visual_token_gets_deepstack(engine, qwen3_omni_hf_model):
    """Chunked prefill text | 1 image token | rest: the lone visual token takes the prefill path."""
    import dataclasses

    from flax import nnx

    from omni_jax.engine.protocol import Request
    from omni_jax.engine.runner import ModelRunner, ScheduledChunk

    p = Prompt(seed=9).text(3).image((1, 8, 8)).text(2).done()
    ids = np.array(p.ids)
    inputs, _ = engine.media_encoder.prepare(ids, p.mm)
    text = engine.media_encoder.cfg.text
    model = nnx.merge(engine.runner.graphdef, engine.runner.state)
    runner = ModelRunner(model, dataclasses.replace(engine.runner.cfg, num_blocks=8), num_layers=text.num_layers,
                         num_kv_heads=text.num_kv_heads, head_dim=text.head_dim, hidden_size=text.hidden_size)
    req = Request("r", ids, SamplingParams(temperature=0.0), data=inputs)
    tables = np.arange(1, 8, dtype=np.int32)[None]
    v = int(np.flatnonzero(ids == tiny.IMAGE_TOKEN)[0])
    kinds = []
    for start, n in ((0, v), (v, 1), (v + 1, len(ids) - v - 1)):
        part = runner.execute([ScheduledChunk(req, start, n, needs_logits=start + n == len(ids))], tables)
        kinds.append(part.kind)
    assert kinds == ["prefill"] * 3
    with torch.no_grad():
        ref = qwen3_omni_hf_model.thinker(input_ids=torch.tensor(ids)[None],
                                          attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                          **p.hf_kwargs()).logits[0, -1].numpy()
    _close(np.asarray(part.logits)[0], ref)


# ---------------------------------------------------------------- multi-process
@pytest.mark.pipeline
def test_omnijax_text_generation_matches_transformers(converted, qwen3_omni_hf_model):
    from omni_jax import OmniJax
    from omni_jax.config import load_pipeline_config

    rng = np.random.default_rng(8)
    batch = [rng.integers(0, 151000, n).tolist() for n in (7, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    # The preset with one bucket per shape axis: a quick warm-up in the stage process.
    pipeline = load_pipeline_config("qwen3_omni_tiny").with_overrides(thinker=dict(
        token_buckets=[64], decode_buckets=[8], audio_chunk_buckets=[1], vision_patch_buckets=[64]))
    with OmniJax(model=converted, pipeline=pipeline) as omni:
        outs = omni.generate([{"prompt_token_ids": p} for p in batch], sampling_params=params)
    for p, out in zip(batch, outs):
        assert out.error is None and out.finish_reason == "length"
        assert out.token_ids == _hf_greedy(qwen3_omni_hf_model, p)
