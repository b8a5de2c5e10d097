"""Speech output end to end: thinker -> talker -> token2wav against transformers."""

from __future__ import annotations

import wave

import numpy as np
import pytest

from omni_jax import OmniJax, SamplingParams
from omni_jax.config import load_pipeline_config
from omni_jax.models.qwen2_5_omni.stages import build_token2wav_engine
from omni_jax.models.qwen2_5_omni.voices import Voices

pytestmark = pytest.mark.e2e

T2W_SEED = 1234


def tiny_speech_pipeline():
    """The tiny preset with few buckets, so three stages warm up quickly."""
    return load_pipeline_config("qwen2_5_omni_tiny").with_overrides(
        thinker=dict(token_buckets=[16, 64], decode_buckets=[1, 4], max_num_seqs=4),
        talker=dict(token_buckets=[16, 64], decode_buckets=[1, 4], max_num_seqs=4,
                    default_sampling=dict(temperature=0.0, repetition_penalty=1.05, max_tokens=40)),
        token2wav=dict(token_buckets=[48], decode_buckets=[1, 4], max_num_seqs=4, max_num_batched_tokens=48))


def hf_token2wav(model, codes, voice, noise):
    """transformers' token2wav on `codes` with its torch.randn replaced by `noise`."""
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


def hf_generate(model, ids, voice, thinker_tokens, talker_tokens):
    """transformers generate(return_audio): greedy thinker and talker; (text ids, codes)."""
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


# One padded batch of two, or two one-request calls side by side in the same step.
@pytest.mark.parametrize("batch_buckets,max_num_seqs", [((1, 2), None), ((1,), 2)])
def test_token2wav_waveform_matches_transformers(converted_thinker_fp32, qwen2_5_omni_hf_model, batch_buckets,
                                                 max_num_seqs):
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


@pytest.fixture(scope="module")
def speech_omni(converted_thinker_fp32):
    # The whole-output path: its waveform equals transformers' (test_async_chunk_pipeline.py
    # compares the streamed one with it).
    omni = OmniJax(model=converted_thinker_fp32, pipeline=tiny_speech_pipeline(),
                   output_modalities=["text", "audio"], async_chunk=False)
    yield omni
    omni.shutdown()


def test_generate_speech_matches_transformers(speech_omni, qwen2_5_omni_hf_model, converted_thinker_fp32,
                                              tmp_path):
    ids = np.random.default_rng(11).integers(0, 151000, 17).tolist()
    params = [SamplingParams(temperature=0.0, max_tokens=6),
              SamplingParams(temperature=0.0, repetition_penalty=1.05, max_tokens=40),
              SamplingParams(seed=T2W_SEED)]
    out = speech_omni.generate([{"prompt_token_ids": ids}], sampling_params_list=params,
                               output_modalities=["text", "audio"], voice="Ethan")[0]
    assert out.error is None, out.error
    ref_text, ref_codes = hf_generate(qwen2_5_omni_hf_model, ids, "Ethan", 6, 40)
    assert out.token_ids == ref_text
    codes = out.stage_token_ids["talker"]
    if codes and codes[-1] in (8292, 8294):
        codes = codes[:-1]
    assert codes == ref_codes and len(codes) > 0
    # Same initial noise as the stage drew from its seed -> the same waveform.
    from omni_jax.models.qwen2_5_omni.token2wav import initial_noise

    noise = initial_noise(len(codes), T2W_SEED)
    ref_wav = hf_token2wav(qwen2_5_omni_hf_model, codes, "Ethan", noise)
    assert out.sample_rate == 24000 and out.audio.shape == ref_wav.shape
    assert np.abs(out.audio - ref_wav).max() <= 1e-4 * max(1.0, np.abs(ref_wav).max())
    assert out.metrics.time_to_first_audio is not None and out.metrics.rtf is not None

    path = tmp_path / "reply.wav"
    out.save_audio(str(path))
    with wave.open(str(path)) as f:
        assert f.getframerate() == 24000 and f.getnchannels() == 1 and f.getnframes() == len(out.audio)


def test_mixed_text_and_speech_batch(speech_omni):
    rng = np.random.default_rng(12)
    prompts = [{"prompt_token_ids": rng.integers(0, 151000, int(n)).tolist()} for n in (5, 9, 14, 7)]
    text_only = speech_omni.generate(prompts[:2], sampling_params=SamplingParams(temperature=0.0, max_tokens=4),
                                     output_modalities=["text"])
    speech = speech_omni.generate(prompts[2:], sampling_params=SamplingParams(temperature=0.0, max_tokens=4),
                                  output_modalities=["text", "audio"])
    assert all(o.error is None and o.audio is None and len(o.token_ids) == 4 for o in text_only)
    assert all(o.error is None and o.audio is not None and len(o.audio) > 0 for o in speech)


def test_per_prompt_voices_and_params_equal_each_prompt_alone(speech_omni):
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


def test_unknown_voice_lists_voices(speech_omni):
    out = speech_omni.generate([{"prompt_token_ids": [1, 2, 3]}], output_modalities=["text", "audio"],
                               voice="Nobody")[0]
    assert out.finish_reason == "error" and "Chelsie, Ethan" in out.error


def test_hidden_states_go_stage_to_stage(speech_omni):
    """The thinker's hidden states reach the talker directly: none pass through the caller's process."""
    ids = np.random.default_rng(13).integers(0, 151000, 11).tolist()
    out = speech_omni.generate([{"prompt_token_ids": ids}], sampling_params=SamplingParams(temperature=0.0,
                               max_tokens=5), output_modalities=["text", "audio"])[0]
    assert out.error is None and len(out.audio) > 0 and out.stage_token_ids["talker"]
    assert speech_omni._orch.hidden_state_bytes == 0
    # What this process sent: the prompt ids, once to each of the three stages.
    assert out.metrics.bytes_moved <= 3 * 8 * len(ids)


def test_failed_thinker_frees_the_waiting_stages(speech_omni):
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
