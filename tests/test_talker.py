"""Qwen2.5-Omni talker: logits against transformers, and the thinker -> talker handoff."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from omni_jax import load_checkpoint
from omni_jax.engine.protocol import AddRequest
from omni_jax.engine.runner import RunnerConfig
from omni_jax.engine.sampling_params import SamplingParams
from omni_jax.runtime.stage_loop import to_engine_request
from omni_jax.inputs.rope_index import RopeIndexConfig
from omni_jax.models.layers.attention import AttentionMetadata
from omni_jax.models.qwen2_5_omni.pipeline import Qwen2_5OmniHandoff
from omni_jax.checkpoint import eos_token_ids
from omni_jax.models.qwen2_5_omni.stages import build_talker_engine, build_thinker_engine
from omni_jax.models.qwen2_5_omni.voices import Voices

pytestmark = pytest.mark.parity


def test_talker_logits(converted_thinker_fp32, qwen2_5_omni_hf_model):
    import jax.numpy as jnp

    model, cfg = load_checkpoint(converted_thinker_fp32, stage="talker")
    rng = np.random.default_rng(0)
    embeds = rng.standard_normal((11, cfg.embedding_size)).astype(np.float32) * 0.1
    pos = np.arange(11)
    with torch.no_grad():
        t = qwen2_5_omni_hf_model.talker
        h = t.model(inputs_embeds=t.thinker_to_talker_proj(torch.tensor(embeds)[None]),
                    position_ids=torch.tensor(pos)[None].expand(3, 1, -1)).last_hidden_state
        ref = t.codec_head(h)[0].numpy()
    hid, _, _ = model(jnp.asarray(embeds), jnp.asarray(pos), AttentionMetadata.dense(11))
    got = np.asarray(model.compute_logits(hid))
    assert np.abs(got - ref).max() <= 1e-4


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


def test_thinker_talker_handoff_matches_transformers(converted_thinker_fp32, qwen2_5_omni_hf_model):
    runner = RunnerConfig(num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256,
                          capture_layers=(0, 3))
    thinker = build_thinker_engine(converted_thinker_fp32, runner, warmup=False)
    talker = build_talker_engine(converted_thinker_fp32, runner, warmup=False)
    cfg = json.load(open(os.path.join(converted_thinker_fp32, "omni_jax_config.json")))["hf_config"]
    from omni_jax.models.qwen2_5_omni.talker import TalkerConfig

    handoff = Qwen2_5OmniHandoff(Voices.load(converted_thinker_fp32), TalkerConfig.from_hf(cfg["talker_config"]),
                                 RopeIndexConfig.from_hf(cfg), (151646, 151655, 151656),
                                 eos_token_ids(converted_thinker_fp32), (0, 3))
    ids = np.random.default_rng(3).integers(0, 151000, 21)
    first = AddRequest(request_id="r", prompt_token_ids=ids.astype(np.int32),
                       sampling_params=SamplingParams(temperature=0.0, max_tokens=7))
    from omni_jax.engine.protocol import StageInputs

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
