"""Qwen3-Omni speech output: thinker -> talker (+ code predictor) -> code2wav against transformers."""

from __future__ import annotations

import numpy as np
import pytest

import hf_tiny_qwen3 as tiny
from omni_jax.engine.protocol import AddRequest
from omni_jax.engine.protocol import StageInputs
from omni_jax.engine.runner import RunnerConfig
from omni_jax.engine.sampling_params import SamplingParams
from omni_jax.runtime.stage_loop import to_engine_request
from qwen3_prompt import Prompt

pytestmark = pytest.mark.e2e

THINKER_TOKENS = 8
TALKER_TOKENS = 16
MEDIA_BUCKETS = dict(audio_chunks=(4,), vision_patches=(64,))


@pytest.fixture(scope="module")
def converted(converted_qwen3_fp32) -> str:
    return converted_qwen3_fp32


def hf_generate(model, prompt: Prompt, voice: str = "ethan"):
    """transformers generate(return_audio=True), greedy thinker and talker.

    Returns (text ids, codes [G, frames], waveform); code2wav's input is captured on the way.
    """
    import torch

    captured = {}
    orig = model.code2wav.chunked_decode

    def capture(codes, **kw):
        captured["codes"] = codes[0].numpy().copy()
        return orig(codes, **kw)

    model.code2wav.chunked_decode = capture
    try:
        with torch.no_grad():
            seq, wav = model.generate(
                input_ids=torch.tensor(prompt.ids)[None], attention_mask=torch.ones(1, len(prompt.ids), dtype=torch.long),
                speaker=voice, thinker_max_new_tokens=THINKER_TOKENS, thinker_do_sample=False,
                talker_do_sample=False, talker_max_new_tokens=TALKER_TOKENS, **prompt.hf_kwargs())
    finally:
        model.code2wav.chunked_decode = orig
    return seq[0, len(prompt.ids):].tolist(), captured["codes"], wav.reshape(-1).numpy()


def _text_prompt(seed: int) -> Prompt:
    p = Prompt(seed=seed)
    p.ids = tiny.text_prompt_ids(tuple(np.random.default_rng(seed).integers(0, 151000, 6).tolist()))
    return p


# ---------------------------------------------------------------- in-process engines
def _run(engine, requests):
    """Drive an engine until idle; (tokens, codes, hidden chunks) per request."""
    for kw in requests:
        engine.add_request(**kw)
    toks, codes, hidden = {}, {}, {}
    for _ in range(500):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            assert o.error is None, o.error
            toks.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.codes is not None:
                codes.setdefault(o.request_id, []).append(o.codes)
            for layer, rows in (o.hidden_states or {}).items():
                hidden.setdefault(o.request_id, {}).setdefault(layer, []).append((o.hidden_offset, np.array(rows)))
    assert not engine.has_unfinished()
    return toks, codes, hidden


def test_talker_engine_codes_match_transformers(converted, qwen3_omni_hf_model):
    """Text, audio and image prompts together; a KV pool small enough that the talker preempts."""
    from omni_jax.models.qwen3_omni.media_encoder import MediaBuckets
    from omni_jax.models.qwen3_omni.pipeline import load_handoff
    from omni_jax.models.qwen3_omni.stages import build_talker_engine, build_thinker_engine

    prompts = {"text": _text_prompt(3),
               "audio": Prompt(seed=4).text(3).audio(130).text(2).done(),
               "image": Prompt(seed=5).text(4).image((1, 8, 8)).done()}
    thinker = build_thinker_engine(
        converted, RunnerConfig(num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=64,
                                max_model_len=256, token_buckets=(64,), decode_buckets=(4,), capture_layers=(0, 2)),
        media_buckets=MediaBuckets(**MEDIA_BUCKETS), progress=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=THINKER_TOKENS)
    text, _, hidden = _run(thinker, [
        dict(request_id=k, prompt_token_ids=np.array(p.ids), sampling_params=greedy,
             inputs=StageInputs(capture_hidden=True), multi_modal_data=p.mm if k != "text" else None)
        for k, p in prompts.items()])

    handoff = load_handoff(converted)
    talker = build_talker_engine(
        converted, RunnerConfig(num_blocks=9, block_size=16, max_num_seqs=4, max_num_batched_tokens=64,
                                max_model_len=128, token_buckets=(64,), decode_buckets=(4,)), progress=False)
    c0 = talker.num_compilations
    talker_params = SamplingParams(temperature=0.0, repetition_penalty=1.05, max_tokens=TALKER_TOKENS)
    reqs = []
    for k, p in prompts.items():
        first = AddRequest(request_id=k, prompt_token_ids=np.array(p.ids, np.int32), sampling_params=greedy,
                           multi_modal=None if k == "text" else _payload(p))
        reqs.append(to_engine_request(handoff.thinker2talker(first, text[k], hidden[k], talker_params, "Ethan", k)))
    toks, codes, _ = _run(talker, reqs)
    assert talker.stats["preemptions"] > 0, "the small KV pool should force a recompute"
    assert talker.num_compilations == c0, "the talker compiled after warm-up"
    assert talker.scheduler.kv_cache_manager.is_idle_and_leak_free()

    for k, p in prompts.items():
        ref_text, ref_codes, _ = hf_generate(qwen3_omni_hf_model, p)
        assert text[k] == ref_text, k
        frames = len(toks[k]) - 1
        ours = np.concatenate([np.array(toks[k])[:frames, None], np.concatenate(codes[k])[:frames]], axis=1).T
        np.testing.assert_array_equal(ours, ref_codes, err_msg=k)


def _payload(p: Prompt):
    from omni_jax.engine.protocol import MultiModalPayload

    mm = p.mm
    return MultiModalPayload(audio_features=list(mm.audio_features), pixel_values=mm.pixel_values,
                             image_grid_thw=mm.image_grid_thw, pixel_values_videos=mm.pixel_values_videos,
                             video_grid_thw=mm.video_grid_thw, video_second_per_grid=mm.video_second_per_grid,
                             use_audio_in_video=mm.use_audio_in_video)


def test_handoff_rejects_an_empty_reply(converted):
    from omni_jax.models.qwen3_omni.pipeline import load_handoff

    handoff = load_handoff(converted)
    ids = np.array(tiny.text_prompt_ids(), np.int32)
    first = AddRequest(request_id="r", prompt_token_ids=ids, sampling_params=SamplingParams())
    hidden = {layer: [(0, np.zeros((len(ids), 64), np.float32))] for layer in (0, 2)}
    with pytest.raises(ValueError, match="reply is empty"):
        handoff.thinker2talker(first, [tiny.IM_END], hidden, SamplingParams(), None, "r")
    with pytest.raises(ValueError, match="unknown voice 'Nobody'; available voices: aiden, chelsie, ethan"):
        handoff.thinker2talker(first, [5, 6, tiny.IM_END], hidden, SamplingParams(), "Nobody", "r")


# ---------------------------------------------------------------- multi-process
def tiny_speech_pipeline():
    """The tiny preset with few buckets, so three stages warm up quickly."""
    from omni_jax.config import load_pipeline_config

    return load_pipeline_config("qwen3_omni_tiny").with_overrides(
        thinker=dict(token_buckets=[64], decode_buckets=[1, 4], max_num_seqs=4, audio_chunk_buckets=[4],
                     vision_patch_buckets=[64]),
        talker=dict(token_buckets=[64], decode_buckets=[1, 4], max_num_seqs=4, max_model_len=256,
                    default_sampling=dict(temperature=0.0, repetition_penalty=1.05, max_tokens=TALKER_TOKENS)),
        code2wav=dict(token_buckets=[16], decode_buckets=[1, 4], max_num_seqs=4, max_model_len=TALKER_TOKENS,
                      max_num_batched_tokens=4 * TALKER_TOKENS))


@pytest.fixture(scope="module")
def speech_omni(converted):
    from omni_jax import OmniJax

    with OmniJax(model=converted, pipeline=tiny_speech_pipeline(), output_modalities=["text", "audio"]) as omni:
        yield omni


def test_generate_speech_matches_transformers(speech_omni, qwen3_omni_hf_model):
    prompt = _text_prompt(7)
    out = speech_omni.generate([{"prompt_token_ids": prompt.ids}],
                               sampling_params=SamplingParams(temperature=0.0, max_tokens=THINKER_TOKENS),
                               output_modalities=["text", "audio"], voice="Chelsie")[0]
    assert out.error is None, out.error
    ref_text, ref_codes, ref_wav = hf_generate(qwen3_omni_hf_model, prompt, voice="chelsie")
    assert out.token_ids == ref_text
    assert out.stage_token_ids["talker"][:ref_codes.shape[1]] == ref_codes[0].tolist()
    # code2wav is deterministic: equal codes in all groups give the same waveform.
    assert out.sample_rate == 24000 and out.audio.shape == ref_wav.shape
    assert np.abs(out.audio - ref_wav).max() <= 1e-4
    assert out.metrics.time_to_first_audio is not None


def test_mixed_text_and_speech_batch(speech_omni):
    rng = np.random.default_rng(12)
    prompts = [{"prompt_token_ids": tiny.text_prompt_ids(tuple(rng.integers(0, 151000, int(n)).tolist()))}
               for n in (3, 9, 5, 7)]
    params = SamplingParams(temperature=0.0, max_tokens=4)
    text_only = speech_omni.generate(prompts[:2], sampling_params=params, output_modalities=["text"])
    speech = speech_omni.generate(prompts[2:], sampling_params=params, output_modalities=["text", "audio"])
    assert all(o.error is None and o.audio is None and len(o.token_ids) == 4 for o in text_only)
    assert all(o.error is None and o.audio is not None and len(o.audio) > 0 for o in speech)


def test_unknown_voice_lists_voices(speech_omni):
    out = speech_omni.generate([{"prompt_token_ids": tiny.text_prompt_ids()}], output_modalities=["text", "audio"],
                               voice="Nobody")[0]
    assert out.finish_reason == "error" and "aiden, chelsie, ethan" in out.error


def test_handoff_needs_the_talker_hidden_layers(converted):
    from omni_jax.errors import ConfigError
    from omni_jax.models.qwen3_omni.pipeline import load_handoff

    pipeline = tiny_speech_pipeline().with_overrides(thinker=dict(hidden_layers=[0]))
    with pytest.raises(ConfigError, match=r"stage 'thinker': hidden_layers must include \[0, 2\]"):
        load_handoff(converted).check_pipeline(pipeline)
