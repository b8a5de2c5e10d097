"""Speech output end to end against transformers: Qwen2.5-Omni and Qwen3-Omni.

Both families, through the public API (thinker -> talker -> vocoder in their own processes):
greedy text, talker codes and waveform equal transformers'; text-only and speech requests run
side by side; an unknown voice fails naming the voices; a thinker that does not return the
hidden layers the talker reads is refused. Qwen2.5-Omni alone: token2wav batched against
transformers, per-prompt voices and params, hidden states going stage to stage, a failed thinker
request freeing the stages waiting for it. Qwen3-Omni alone: the in-process thinker -> talker
(+ code predictor) engines on text, audio and image prompts, and the handoff refusing an
empty reply.
"""

from __future__ import annotations

import re
import wave

import numpy as np
import pytest

import hf_tiny_qwen3
from omni_jax import OmniJax, SamplingParams
from omni_jax.config import load_pipeline_config
from omni_jax.engine.protocol import AddRequest, StageInputs
from omni_jax.engine.runner import RunnerConfig
from omni_jax.models.registry import get_family
from omni_jax.runtime.stage_loop import to_engine_request
from qwen3_prompt import Prompt

pytestmark = pytest.mark.e2e

T2W_SEED = 1234


# ---------------------------------------------------------------- per family
class Qwen2_5:
    """Qwen2.5-Omni: talker codes -> token2wav (DiT from seeded noise, then BigVGAN)."""

    name = "qwen2_5_omni"
    converted, hf_model = "converted_thinker_fp32", "qwen2_5_omni_hf_model"  # fixtures
    voices = "Chelsie, Ethan"  # as an unknown voice's error lists them
    talker_layers = [0, 3]  # the thinker's embeddings and last layer
    voice, thinker_tokens, talker_tokens = "Ethan", 6, 40
    # Every stage's params: the vocoder's seed fixes its noise (`reference` draws the same).
    request = dict(voice=voice, sampling_params_list=[
        SamplingParams(temperature=0.0, max_tokens=thinker_tokens),
        SamplingParams(temperature=0.0, repetition_penalty=1.05, max_tokens=talker_tokens),
        SamplingParams(seed=T2W_SEED)])
    # The whole-output path: its waveform equals transformers' (test_async_chunk_pipeline.py
    # compares the streamed one with it).
    async_chunk = False

    @classmethod
    def pipeline(cls):
        """The tiny preset with few buckets, so three stages warm up quickly."""
        return load_pipeline_config("qwen2_5_omni_tiny").with_overrides(
            thinker=dict(token_buckets=[16, 64], decode_buckets=[1, 4], max_num_seqs=4),
            talker=dict(token_buckets=[16, 64], decode_buckets=[1, 4], max_num_seqs=4,
                        default_sampling=dict(temperature=0.0, repetition_penalty=1.05, max_tokens=cls.talker_tokens)),
            token2wav=dict(token_buckets=[48], decode_buckets=[1, 4], max_num_seqs=4))

    @staticmethod
    def prompt(rng, n: int) -> list[int]:
        """n random token ids: the talker speaks after any prompt."""
        return rng.integers(0, 151000, n).tolist()

    @classmethod
    def reference(cls, model, ids):
        """transformers' (text ids, talker codes, waveform) for `request`."""
        from omni_jax.models.qwen2_5_omni.token2wav import initial_noise

        text, codes = hf_generate_qwen2_5(model, ids, cls.voice, cls.thinker_tokens, cls.talker_tokens)
        # The same initial noise as the stage drew from its seed -> the same waveform.
        return text, codes, hf_token2wav(model, codes, cls.voice, initial_noise(len(codes), T2W_SEED))

    @staticmethod
    def frames(talker_ids: list[int]) -> list[int]:
        """The codes the vocoder decodes: transformers trims the talker's end token."""
        return talker_ids[:-1] if talker_ids and talker_ids[-1] in (8292, 8294) else talker_ids


class Qwen3:
    """Qwen3-Omni: talker codes (+ the code predictor's residual groups) -> code2wav."""

    name = "qwen3_omni"
    converted, hf_model = "converted_qwen3_fp32", "qwen3_omni_hf_model"
    voices = "aiden, chelsie, ethan"
    talker_layers = [0, 2]  # the thinker's embeddings and accept_hidden_layer
    voice, thinker_tokens, talker_tokens = "Chelsie", 8, 16
    # The thinker's params only: the talker's are the pipeline's defaults; code2wav is deterministic.
    request = dict(voice=voice, sampling_params=SamplingParams(temperature=0.0, max_tokens=thinker_tokens))
    async_chunk = None  # as the preset says: streamed

    @classmethod
    def pipeline(cls):
        """The tiny preset with few buckets, so three stages warm up quickly."""
        return load_pipeline_config("qwen3_omni_tiny").with_overrides(
            thinker=dict(token_buckets=[64], decode_buckets=[1, 4], max_num_seqs=4, audio_chunk_buckets=[4],
                         vision_patch_buckets=[64]),
            talker=dict(token_buckets=[64], decode_buckets=[1, 4], max_num_seqs=4, max_model_len=256,
                        default_sampling=dict(temperature=0.0, repetition_penalty=1.05, max_tokens=cls.talker_tokens)),
            code2wav=dict(token_buckets=[16], decode_buckets=[1, 4], max_num_seqs=4, max_model_len=cls.talker_tokens,
                          max_num_batched_tokens=4 * cls.talker_tokens))

    @staticmethod
    def prompt(rng, n: int) -> list[int]:
        """A chat prompt around n random token ids: the talker reads the turns off the ids."""
        return hf_tiny_qwen3.text_prompt_ids(tuple(rng.integers(0, 151000, n).tolist()))

    @classmethod
    def reference(cls, model, ids):
        """transformers' (text ids, group-0 codes, waveform) for `request` (its voices are lower case)."""
        text, codes, wav = hf_generate_qwen3(model, qwen3_text_prompt(ids), cls.voice.lower())
        return text, codes[0].tolist(), wav

    @staticmethod
    def frames(talker_ids: list[int]) -> list[int]:
        """The group-0 codes the vocoder decodes: every talker token but the last (transformers
        never feeds the last one back, so it has no residual codes)."""
        return talker_ids[:-1]


FAMILIES = {f.name: f for f in (Qwen2_5, Qwen3)}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    return FAMILIES[request.param]


@pytest.fixture(scope="module")
def converted(family, request) -> str:
    return request.getfixturevalue(family.converted)


@pytest.fixture
def hf_model(family, request):
    """The family's transformers reference. conftest marks `torch` the tests naming a reference
    fixture; those reaching one through this fixture carry the mark themselves."""
    return request.getfixturevalue(family.hf_model)


@pytest.fixture(scope="module")
def speech_omni(family, converted):
    with OmniJax(model=converted, pipeline=family.pipeline(), output_modalities=["text", "audio"],
                 async_chunk=family.async_chunk) as omni:
        yield omni


# Qwen2.5-Omni's tests on the same `speech_omni` as the parametrized ones (pytest groups them).
qwen2_5_only = pytest.mark.parametrize("family", [Qwen2_5.name], indirect=True)


# ---------------------------------------------------------------- transformers references
def hf_token2wav(model, codes, voice, noise):
    """Qwen2.5-Omni transformers' token2wav on `codes` with its torch.randn replaced by `noise`."""
    import torch

    spk = model.speaker_map[voice]
    orig = torch.randn

    def fixed(*args, **kw):
        return torch.tensor(noise)[None]

    torch.randn = fixed
    try:
        with torch.no_grad():
            wav = model.token2wav(torch.tensor(codes)[None], conditioning=spk["cond"].float(),
                                  reference_mel=spk["ref_mel"].float())
    finally:
        torch.randn = orig
    return wav.reshape(-1).numpy()


def hf_generate_qwen2_5(model, ids, voice, thinker_tokens, talker_tokens):
    """Qwen2.5-Omni transformers generate(return_audio): greedy thinker and talker; (text ids, codes)."""
    import torch

    captured = {}
    orig = model.token2wav.forward

    def capture(code, **kw):
        captured["codes"] = code[0].tolist()
        return torch.zeros(240 * code.shape[1])

    model.token2wav.forward = capture
    try:
        with torch.no_grad():
            seq, _ = model.generate(input_ids=torch.tensor(ids)[None],
                                    attention_mask=torch.ones(1, len(ids), dtype=torch.long), speaker=voice,
                                    thinker_max_new_tokens=thinker_tokens, thinker_do_sample=False,
                                    talker_do_sample=False, talker_max_new_tokens=talker_tokens)
    finally:
        model.token2wav.forward = orig
    return seq[0, len(ids):].tolist(), captured["codes"]


def hf_generate_qwen3(model, prompt: Prompt, voice: str = "ethan"):
    """Qwen3-Omni transformers generate(return_audio=True), greedy thinker and talker.

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
                speaker=voice, thinker_max_new_tokens=Qwen3.thinker_tokens, thinker_do_sample=False,
                talker_do_sample=False, talker_max_new_tokens=Qwen3.talker_tokens, **prompt.hf_kwargs())
    finally:
        model.code2wav.chunked_decode = orig
    return seq[0, len(prompt.ids):].tolist(), captured["codes"], wav.reshape(-1).numpy()


def qwen3_text_prompt(ids) -> Prompt:
    p = Prompt()
    p.ids = list(ids)
    return p


# ---------------------------------------------------------------- both families
@pytest.mark.torch
def test_generate_speech_matches_transformers(family, speech_omni, hf_model, tmp_path):
    ids = family.prompt(np.random.default_rng(11), 17)
    out = speech_omni.generate([{"prompt_token_ids": ids}], output_modalities=["text", "audio"], **family.request)[0]
    assert out.error is None, out.error
    ref_text, ref_codes, ref_wav = family.reference(hf_model, ids)
    assert out.token_ids == ref_text
    codes = family.frames(out.stage_token_ids["talker"])
    assert codes == ref_codes and len(codes) > 0
    assert out.sample_rate == 24000 and out.audio.shape == ref_wav.shape
    # Qwen3-Omni's code2wav clamps to [-1, 1]: its bound is 1e-4.
    assert np.abs(out.audio - ref_wav).max() <= 1e-4 * max(1.0, np.abs(ref_wav).max())
    assert out.metrics.time_to_first_audio is not None and out.metrics.rtf is not None

    path = tmp_path / "reply.wav"
    out.save_audio(str(path))
    with wave.open(str(path)) as f:
        assert f.getframerate() == 24000 and f.getnchannels() == 1 and f.getnframes() == len(out.audio)


def test_mixed_text_and_speech_batch(family, speech_omni):
    rng = np.random.default_rng(12)
    prompts = [{"prompt_token_ids": family.prompt(rng, int(n))} for n in (5, 9, 14, 7)]
    params = SamplingParams(temperature=0.0, max_tokens=4)
    text_only = speech_omni.generate(prompts[:2], sampling_params=params, output_modalities=["text"])
    speech = speech_omni.generate(prompts[2:], sampling_params=params, output_modalities=["text", "audio"])
    assert all(o.error is None and o.audio is None and len(o.token_ids) == 4 for o in text_only)
    assert all(o.error is None and o.audio is not None and len(o.audio) > 0 for o in speech)


def test_unknown_voice_lists_voices(family, speech_omni):
    out = speech_omni.generate([{"prompt_token_ids": family.prompt(np.random.default_rng(0), 3)}],
                               output_modalities=["text", "audio"], voice="Nobody")[0]
    assert out.finish_reason == "error" and family.voices in out.error


def test_handoff_needs_the_talker_hidden_layers(family, converted):
    from omni_jax.errors import ConfigError

    pipeline = family.pipeline().with_overrides(thinker=dict(hidden_layers=[0]))
    with pytest.raises(ConfigError, match=r"stage 'thinker': hidden_layers must include "
                                          + re.escape(str(family.talker_layers))):
        get_family(family.name).handoff(converted).check_pipeline(pipeline)


# ---------------------------------------------------------------- Qwen2.5-Omni
# One padded batch of two, or two one-request calls side by side in the same step.
@pytest.mark.parametrize("batch_buckets,max_num_seqs", [((1, 2), None), ((1,), 2)])
def test_qwen2_5_token2wav_waveform_matches_transformers(converted_thinker_fp32, qwen2_5_omni_hf_model,
                                                         batch_buckets, max_num_seqs):
    from omni_jax.models.qwen2_5_omni.stages import build_token2wav_engine

    engine = build_token2wav_engine(converted_thinker_fp32, length_buckets=(32,), batch_buckets=batch_buckets,
                                    max_num_seqs=max_num_seqs, warmup=False)
    assert engine.synthesizer.calls.workers == (max_num_seqs or 1)
    rng = np.random.default_rng(0)
    codes = [rng.integers(0, 8192, n).tolist() for n in (19, 27)]
    noises = [rng.standard_normal((2 * len(c), 80)).astype(np.float32) for c in codes]
    for i, (c, n) in enumerate(zip(codes, noises)):
        engine.add_request(f"w{i}", c, voice="Chelsie" if i == 0 else "Ethan", noise=n)
    outs = {o.request_id: o for o in engine.step()}  # both in one step
    for i, (c, n) in enumerate(zip(codes, noises)):
        ref = hf_token2wav(qwen2_5_omni_hf_model, c, "Chelsie" if i == 0 else "Ethan", n)
        got = outs[f"w{i}"].audio
        assert got.shape == ref.shape
        assert np.abs(got - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())


@qwen2_5_only
def test_qwen2_5_per_prompt_voices_and_params_equal_each_prompt_alone(speech_omni):
    """voice=[...] and sampling_params=[...] give one per prompt: each reply's text, talker codes
    and audio as when run alone. (The tiny checkpoint's voices give audio equal to 1e-8, so the
    routing of voices is shown by an unknown one failing only its own prompt.)"""
    ids = np.random.default_rng(15).integers(0, 151000, 13).tolist()
    batch = [{"prompt_token_ids": ids}] * 2
    params = [SamplingParams(temperature=0.0, max_tokens=4), SamplingParams(temperature=0.9, seed=3, max_tokens=5)]
    stages = [None, None, SamplingParams(seed=T2W_SEED)]
    voices = ["Chelsie", "Ethan"]
    together = speech_omni.generate(batch, sampling_params=params, voice=voices, sampling_params_list=stages,
                                    output_modalities=["text", "audio"])
    for prompt, p, v, out in zip(batch, params, voices, together):
        alone = speech_omni.generate([prompt], sampling_params=p, voice=v, sampling_params_list=stages,
                                     output_modalities=["text", "audio"])[0]
        assert out.error is None and len(out.token_ids) == p.max_tokens
        assert out.token_ids == alone.token_ids
        assert out.stage_token_ids["talker"] == alone.stage_token_ids["talker"]
        np.testing.assert_allclose(out.audio, alone.audio, atol=1e-4)
    # Each prompt gets its own voice: an unknown one fails that prompt alone.
    ok, bad = speech_omni.generate(batch, sampling_params=params, voice=["Ethan", "Nobody"],
                                   output_modalities=["text", "audio"])
    assert ok.error is None and len(ok.audio) > 0
    assert bad.finish_reason == "error" and "Nobody" in bad.error


@qwen2_5_only
def test_qwen2_5_hidden_states_go_stage_to_stage(speech_omni):
    """The thinker's hidden states reach the talker directly: none pass through the caller's process."""
    ids = np.random.default_rng(13).integers(0, 151000, 11).tolist()
    out = speech_omni.generate([{"prompt_token_ids": ids}], sampling_params=SamplingParams(temperature=0.0,
                               max_tokens=5), output_modalities=["text", "audio"])[0]
    assert out.error is None and len(out.audio) > 0 and out.stage_token_ids["talker"]
    assert speech_omni._orch.hidden_state_bytes == 0
    # What this process sent: the prompt ids, once to each of the three stages.
    assert out.metrics.bytes_moved <= 3 * 8 * len(ids)


@qwen2_5_only
def test_qwen2_5_failed_thinker_frees_the_waiting_stages(speech_omni):
    """A speech request the thinker rejects is dropped by the talker and vocoder waiting for it."""
    too_long = [1] * 600  # the tiny thinker's max_model_len is 512
    ok = np.random.default_rng(14).integers(0, 151000, 9).tolist()
    outs = speech_omni.generate([{"prompt_token_ids": too_long}, {"prompt_token_ids": ok}],
                                sampling_params=SamplingParams(temperature=0.0, max_tokens=4),
                                output_modalities=["text", "audio"])
    assert outs[0].finish_reason == "error" and "512" in outs[0].error
    assert outs[1].error is None and len(outs[1].audio) > 0
    stats = speech_omni.stage_stats()
    assert stats["talker"]["num_waiting_for_input"] == 0 and stats["token2wav"]["num_waiting_for_input"] == 0
    for name in ("thinker", "talker"):
        assert stats[name]["num_running"] == 0 and stats[name]["kv_cache_usage"] == 0.0


# ---------------------------------------------------------------- Qwen3-Omni: in-process engines
MEDIA_BUCKETS = dict(audio_chunks=(4,), vision_patches=(64,))


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


def _payload(p: Prompt):
    from omni_jax.engine.protocol import MultiModalPayload

    mm = p.mm
    return MultiModalPayload(audio_features=list(mm.audio_features), pixel_values=mm.pixel_values,
                             image_grid_thw=mm.image_grid_thw, pixel_values_videos=mm.pixel_values_videos,
                             video_grid_thw=mm.video_grid_thw, video_second_per_grid=mm.video_second_per_grid,
                             use_audio_in_video=mm.use_audio_in_video)


def test_qwen3_talker_engine_codes_match_transformers(converted_qwen3_fp32, qwen3_omni_hf_model):
    """Text, audio and image prompts together; a KV pool small enough that the talker preempts."""
    from omni_jax.models.qwen3_omni.media_encoder import MediaBuckets
    from omni_jax.models.qwen3_omni.pipeline import load_handoff
    from omni_jax.models.qwen3_omni.stages import build_talker_engine, build_thinker_engine

    converted = converted_qwen3_fp32
    prompts = {"text": qwen3_text_prompt(Qwen3.prompt(np.random.default_rng(3), 6)),
               "audio": Prompt(seed=4).text(3).audio(130).text(2).done(),
               "image": Prompt(seed=5).text(4).image((1, 8, 8)).done()}
    thinker = build_thinker_engine(
        converted, RunnerConfig(num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=64,
                                max_model_len=256, token_buckets=(64,), decode_buckets=(4,), capture_layers=(0, 2)),
        media_buckets=MediaBuckets(**MEDIA_BUCKETS), progress=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=Qwen3.thinker_tokens)
    text, _, hidden = _run(thinker, [
        dict(request_id=k, prompt_token_ids=np.array(p.ids), sampling_params=greedy,
             inputs=StageInputs(capture_hidden=True), multi_modal_data=p.mm if k != "text" else None)
        for k, p in prompts.items()])

    handoff = load_handoff(converted)
    talker = build_talker_engine(
        converted, RunnerConfig(num_blocks=9, block_size=16, max_num_seqs=4, max_num_batched_tokens=64,
                                max_model_len=128, token_buckets=(64,), decode_buckets=(4,)), progress=False)
    c0 = talker.num_compilations
    talker_params = SamplingParams(temperature=0.0, repetition_penalty=1.05, max_tokens=Qwen3.talker_tokens)
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
        ref_text, ref_codes, _ = hf_generate_qwen3(qwen3_omni_hf_model, p)
        assert text[k] == ref_text, k
        frames = len(toks[k]) - 1
        ours = np.concatenate([np.array(toks[k])[:frames, None], np.concatenate(codes[k])[:frames]], axis=1).T
        np.testing.assert_array_equal(ours, ref_codes, err_msg=k)


def test_qwen3_handoff_rejects_an_empty_reply(converted_qwen3_fp32):
    from omni_jax.models.qwen3_omni.pipeline import load_handoff

    handoff = load_handoff(converted_qwen3_fp32)
    ids = np.array(hf_tiny_qwen3.text_prompt_ids(), np.int32)
    first = AddRequest(request_id="r", prompt_token_ids=ids, sampling_params=SamplingParams())
    hidden = {layer: [(0, np.zeros((len(ids), 64), np.float32))] for layer in (0, 2)}
    with pytest.raises(ValueError, match="reply is empty"):
        handoff.thinker2talker(first, [hf_tiny_qwen3.IM_END], hidden, SamplingParams(), None, "r")
    with pytest.raises(ValueError, match="unknown voice 'Nobody'; available voices: aiden, chelsie, ethan"):
        handoff.thinker2talker(first, [5, 6, hf_tiny_qwen3.IM_END], hidden, SamplingParams(), "Nobody", "r")
