"""Prompt embeddings in, hidden states out (issue #19), on the tiny thinkers of both families.

Engine level: greedy tokens from `prompt_embeds` against transformers' `generate(inputs_embeds=...)`,
in one batch with token-id prompts; the model's own embedding rows give the tokens of the ids;
prefix caching keys embedding prompts by their content. Hidden states of the captured layers
against transformers' `output_hidden_states`. Front end (one Qwen2.5 speech pipeline): the
prompt checks, a mixed batch, hidden states to the caller (and none when not asked), speech
from embeddings.
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import hf_tiny_qwen3
from omni_jax import OmniJax, SamplingParams
from omni_jax.config import load_pipeline_config
from omni_jax.demo import _prompt
from omni_jax.engine.protocol import StageInputs
from omni_jax.engine.runner import RunnerConfig
from omni_jax.inputs.processor import PROMPT_EMBEDS_PLACEHOLDER_ID
from omni_jax.models.qwen2_5_omni import stages as qwen2_5_stages
from omni_jax.models.qwen3_omni import stages as qwen3_stages
from omni_jax.models.qwen3_omni.pipeline import load_handoff
from omni_jax.runtime.outputs import logprobs_of

pytestmark = pytest.mark.parity

MAX_TOKENS = 5
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
TOL = 1e-4


# ---------------------------------------------------------------- transformers references
def _embedding_rows(hf, ids) -> np.ndarray:
    return hf.thinker.get_input_embeddings().weight[torch.tensor(ids)].detach().numpy()


def _random_embeds(hf, n: int, seed: int) -> np.ndarray:
    """Rows at the scale of the model's own embeddings, but none of them."""
    scale = float(hf.thinker.get_input_embeddings().weight.detach().std())
    h = hf.thinker.get_input_embeddings().weight.shape[1]
    return (np.random.default_rng(seed).standard_normal((n, h)) * scale).astype(np.float32)


def _hf_greedy(hf, embeds: np.ndarray) -> list[int]:
    """transformers' greedy reply to a prompt of embeddings (placeholder ids beside them, which
    only serve its position computation; generate returns them in front of the reply)."""
    ids = torch.full((1, len(embeds)), PROMPT_EMBEDS_PLACEHOLDER_ID, dtype=torch.long)
    with torch.no_grad():
        out = hf.thinker.generate(input_ids=ids, inputs_embeds=torch.tensor(embeds)[None],
                                  attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, -MAX_TOKENS:].tolist()


def _hf_hidden(hf, embeds: np.ndarray, reply: list[int], layers) -> dict[int, np.ndarray]:
    """transformers' hidden states of the prompt rows and every fed-back reply token."""
    fed = np.concatenate([embeds, _embedding_rows(hf, reply[:-1])])
    ids = torch.full((1, len(fed)), PROMPT_EMBEDS_PLACEHOLDER_ID, dtype=torch.long)
    with torch.no_grad():
        hs = hf.thinker(input_ids=ids, inputs_embeds=torch.tensor(fed)[None], output_hidden_states=True).hidden_states
    return {k: hs[k][0].numpy() for k in layers}


def _assert_close(ours, ref):
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    err = np.abs(ours - ref).max()
    assert err <= TOL, f"max abs error {err:.3g}"


# ---------------------------------------------------------------- engine level, both families
def _engine(family: str, ckpt: str):
    stages = qwen2_5_stages if family == "qwen2_5_omni" else qwen3_stages
    layers = (0, 3) if family == "qwen2_5_omni" else (0, 2, 3)
    runner = RunnerConfig(num_blocks=64, block_size=16, max_num_seqs=8, max_num_batched_tokens=64,
                          max_model_len=128, token_buckets=(64,), decode_buckets=(8,), capture_layers=layers)
    return stages.build_thinker_engine(ckpt, runner, progress=False), layers


@pytest.fixture(scope="module", params=["qwen2_5_omni", "qwen3_omni"])
def family_engine(request):
    if request.param == "qwen2_5_omni":
        ckpt, hf = request.getfixturevalue("converted_thinker_fp32"), request.getfixturevalue("qwen2_5_omni_hf_model")
    else:
        ckpt, hf = request.getfixturevalue("converted_qwen3_fp32"), request.getfixturevalue("qwen3_omni_hf_model")
    engine, layers = _engine(request.param, ckpt)
    return request.param, engine, layers, hf


def _embeds_inputs(rows: np.ndarray, capture: bool = False) -> StageInputs:
    return StageInputs(overlay_rows=rows, overlay_index=np.arange(len(rows), dtype=np.int32), capture_hidden=capture)


def _run(engine) -> tuple[dict, dict]:
    """Step until idle: (request id -> tokens, request id -> {layer: [(offset, rows)]})."""
    tokens, hidden = {}, {}
    for _ in range(500):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            for k, v in (o.hidden_states or {}).items():
                hidden.setdefault(o.request_id, {}).setdefault(k, []).append((o.hidden_offset, np.array(v)))
    assert not engine.has_unfinished()
    return tokens, hidden


def _rows(pieces) -> np.ndarray:
    out = {}
    for offset, rows in pieces:
        for i, r in enumerate(rows):
            out[offset + i] = r
    return np.stack([out[i] for i in range(len(out))])


def test_engine_batch_of_embeddings_and_token_ids_matches_transformers(family_engine):
    """One batch: random embeddings, the model's own rows of some ids, the same ids as tokens,
    and an embedding prompt with hidden states; greedy tokens and hidden rows as transformers'."""
    _, engine, layers, hf = family_engine
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 151000, 20)
    rand = _random_embeds(hf, 23, seed=4)
    own = _embedding_rows(hf, ids)
    engine.add_request("rand", np.zeros(len(rand), np.int32), GREEDY, inputs=_embeds_inputs(rand))
    engine.add_request("own", ids, GREEDY, inputs=_embeds_inputs(own))
    engine.add_request("ids", ids, GREEDY)
    engine.add_request("hidden", np.zeros(len(rand), np.int32), GREEDY, inputs=_embeds_inputs(rand, capture=True))
    c0 = engine.num_compilations
    tokens, hidden = _run(engine)
    assert engine.num_compilations == c0, "a step compiled after warm-up"
    assert tokens["rand"] == tokens["hidden"] == _hf_greedy(hf, rand)
    assert tokens["own"] == tokens["ids"] == _hf_greedy(hf, own)
    ref = _hf_hidden(hf, rand, tokens["hidden"], layers)
    for k in layers:
        _assert_close(_rows(hidden["hidden"][k]), ref[k])
    assert engine.scheduler.kv_cache_manager.is_idle_and_leak_free()


def test_prefix_cache_keys_embeddings_by_content(family_engine):
    """Equal embedding prompts share blocks; a token-id prompt of the same ids never hits them."""
    family, engine, _, hf = family_engine
    stats = engine.scheduler.kv_cache_manager.prefix_cache_stats
    ids = np.random.default_rng(6).integers(0, 151000, 40)
    rows = _embedding_rows(hf, ids)  # the very rows the token ids would get

    def hits_of(rid, *args, **kw) -> int:
        before = stats.hits
        engine.add_request(rid, *args, **kw)
        _run(engine)
        return stats.hits - before

    assert hits_of("e1", ids, GREEDY, inputs=_embeds_inputs(rows)) == 0
    assert hits_of("t1", ids, GREEDY) == 0, "a token-id prompt hit an embedding prompt's blocks"
    assert hits_of("e2", ids, GREEDY, inputs=_embeds_inputs(rows.copy())) >= 32
    assert hits_of("e3", ids, GREEDY, inputs=_embeds_inputs(rows + 1e-3)) == 0
    assert hits_of("t2", ids, GREEDY) >= 32


def test_a_request_returning_hidden_states_takes_prefix_cache_hits(family_engine):
    """A speech reply's thinker returns the hidden rows of every prompt position: its prefix-cache
    hit replays the rows kept when the prefix was computed, equal to transformers' for the whole
    prompt; a hit on blocks whose rows are not kept (a text request computed them) is not taken."""
    _, engine, layers, hf = family_engine
    rng = np.random.default_rng(8)
    turn1, turn2 = rng.integers(0, 151000, 37), rng.integers(0, 151000, 21)
    both = np.concatenate([turn1, turn2])

    def run(rid, ids, capture=True):
        engine.add_request(rid, ids, GREEDY, inputs=StageInputs(capture_hidden=capture))
        cached = []
        tokens, hidden = {}, {}
        for _ in range(500):
            if not engine.has_unfinished():
                break
            for o in engine.step():
                cached.append(o.num_cached_tokens)
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                for k, v in (o.hidden_states or {}).items():
                    hidden.setdefault(k, []).append((o.hidden_offset, np.array(v)))
        return max(cached), tokens[rid], hidden

    assert run("text only", turn1[:20], capture=False)[0] == 0
    # Its first block's KV is cached, its rows are not: computed again (and kept this time).
    assert run("turn 1", turn1)[0] == 0
    cached, reply, hidden = run("turn 2", both)
    assert cached == 32  # turn 1's two full blocks (block size 16)
    ref = _hf_hidden(hf, _embedding_rows(hf, both), reply, layers)
    for k in layers:
        _assert_close(_rows(hidden[k])[:len(ref[k])], ref[k])
    assert engine.hidden_cache.num_open_requests == 0 and len(engine.hidden_cache) >= 3
    assert engine.scheduler.kv_cache_manager.is_idle_and_leak_free()


# ---------------------------------------------------------------- front end (Qwen2.5, three stages)
def _speech_pipeline():
    """The tiny preset with few buckets, so three stages warm up quickly: the thinker's and
    talker's are test_e2e_speech's, the vocoder's test_server's (streamed), so their programs
    come from the suite's compile cache."""
    return load_pipeline_config("qwen2_5_omni_tiny").with_overrides(
        thinker=dict(token_buckets=[16, 64], decode_buckets=[1, 4], max_num_seqs=4),
        talker=dict(token_buckets=[16, 64], decode_buckets=[1, 4], max_num_seqs=4,
                    default_sampling=dict(temperature=0.0, repetition_penalty=1.05, max_tokens=20)),
        token2wav=dict(token_buckets=[48], decode_buckets=[1, 4], max_num_seqs=4))


@pytest.fixture(scope="module")
def omni(converted_thinker_fp32):
    with OmniJax(model=converted_thinker_fp32, pipeline=_speech_pipeline(),
                 output_modalities=["text", "audio"]) as engine:
        yield engine


def test_hidden_states_reach_the_caller_only_when_asked(omni, qwen2_5_omni_hf_model):
    hf = qwen2_5_omni_hf_model
    rows = _random_embeds(hf, 13, seed=8)
    ids = np.random.default_rng(9).integers(0, 151000, 11).tolist()
    text = omni.generate([{"prompt_embeds": rows}, {"prompt_token_ids": ids}], GREEDY, output_modalities=["text"])
    speech = omni.generate([{"prompt_embeds": rows}], GREEDY)[0]
    assert all(o.error is None and o.hidden_states is None for o in text + [speech])
    assert speech.audio is not None and len(speech.audio) > 0, "speech from prompt embeddings"
    assert omni._orch.hidden_state_bytes == 0, "hidden states reached the caller's process unasked"

    for include_prompt in (False, True):
        outs = omni.generate([{"prompt_embeds": rows}, {"prompt_token_ids": ids}], GREEDY, output_modalities=["text"],
                             output_hidden_states=[3, 0], hidden_states_include_prompt=include_prompt)
        for o, embeds in zip(outs, (rows, _embedding_rows(hf, ids))):
            assert o.error is None and o.token_ids == _hf_greedy(hf, embeds)
            ref = _hf_hidden(hf, embeds, o.token_ids, (0, 3))
            skip = 0 if include_prompt else len(embeds)
            assert sorted(o.hidden_states) == [0, 3]
            for k in (0, 3):
                _assert_close(o.hidden_states[k], ref[k][skip:])
    assert omni._orch.hidden_state_bytes > 0
    # A speech request that asks gets them too (the talker still gets its own).
    asked = omni.generate([{"prompt_embeds": rows}], GREEDY, output_hidden_states=[3])[0]
    assert asked.error is None and len(asked.audio) > 0
    _assert_close(asked.hidden_states[3], _hf_hidden(hf, rows, asked.token_ids, (3,))[3][len(rows):])


def test_uncaptured_layer_is_refused_naming_the_captured_ones(omni):
    with pytest.raises(ValueError, match=r"\[2\].*captures layers \[0, 3\]"):
        omni.generate([{"prompt_token_ids": [1, 2, 3]}], GREEDY, output_modalities=["text"],
                      output_hidden_states=[0, 2])


def test_bad_embeddings_fail_alone(omni, qwen2_5_omni_hf_model):
    hf = qwen2_5_omni_hf_model
    good = _random_embeds(hf, 9, seed=10)
    ids = np.random.default_rng(11).integers(0, 151000, 9).tolist()
    nan, inf = good.copy(), good.copy()
    nan[4, 2], inf[7, 0] = np.nan, np.inf
    bad = {
        "rank": ({"prompt_embeds": good[0]}, "must be [num_tokens, hidden_size]"),
        "hidden size": ({"prompt_embeds": good[:, :32]}, "hidden size is 64"),
        "empty": ({"prompt_embeds": good[:0]}, "empty prompt"),
        "too long": ({"prompt_embeds": np.zeros((512, 64), np.float32)}, "max_model_len"),
        "nan": ({"prompt_embeds": nan}, "NaN or inf (first in row 4)"),
        "inf": ({"prompt_embeds": inf}, "NaN or inf (first in row 7)"),
        "ids length": ({"prompt_embeds": good, "prompt_token_ids": ids[:5]}, "has 5 ids but"),
        "strings": ({"prompt_embeds": np.full((3, 64), "x")}, "real numbers"),
        "media": ({"prompt_embeds": good, "multi_modal_data": {}}, "only 'prompt_token_ids'"),
    }
    fine = [{"prompt_embeds": jnp.asarray(good, jnp.bfloat16)},      # a JAX array, cast to float32
            {"prompt_embeds": good, "prompt_token_ids": ids}]
    outs = omni.generate([p for p, _ in bad.values()] + fine, GREEDY, output_modalities=["text"])
    for (name, (_, why)), o in zip(bad.items(), outs):
        assert o.finish_reason == "error" and why in o.error, (name, o.error)
    bf16 = np.asarray(jnp.asarray(good, jnp.bfloat16), np.float32)
    assert outs[-2].error is None and outs[-2].token_ids == _hf_greedy(hf, bf16)
    assert outs[-1].error is None and outs[-1].token_ids == _hf_greedy(hf, good)
    assert outs[-1].prompt_token_ids == ids and outs[-2].prompt_token_ids == [PROMPT_EMBEDS_PLACEHOLDER_ID] * 9


# ---------------------------------------------------------------- speech refusal, CLI
def test_qwen3_speech_needs_the_chat_token_ids(converted_qwen3_fp32):
    """The Qwen3 talker reads the chat turns off the token ids: placeholder ids are refused up front."""
    handoff = load_handoff(converted_qwen3_fp32)
    handoff.check_prompt(hf_tiny_qwen3.text_prompt_ids())
    with pytest.raises(ValueError, match="give its prompt_token_ids too"):
        handoff.check_prompt([PROMPT_EMBEDS_PLACEHOLDER_ID] * 12)


def test_cli_reads_prompt_embeds(tmp_path):
    rows = np.ones((4, 8), np.float32)
    np.save(tmp_path / "p.npy", rows)
    args = argparse.Namespace(prompt=None, prompt_embeds=str(tmp_path / "p.npy"), system=None)
    np.testing.assert_array_equal(_prompt(args)["prompt_embeds"], rows)
    with pytest.raises(ValueError, match="exactly one"):
        _prompt(argparse.Namespace(prompt="hi", prompt_embeds=str(tmp_path / "p.npy"), system=None))


# ---------------------------------------------------------------- logprobs, both families
def _hf_log_softmax(hf, ids: list[int]) -> np.ndarray:
    """transformers' log-softmax of the thinker's logits at every position of `ids`."""
    with torch.no_grad():
        logits = hf.thinker(input_ids=torch.tensor(ids)[None]).logits[0]
    return torch.log_softmax(logits.double(), -1).numpy()


def _assert_logprobs(entries, tokens, ref, n):
    """Each entry (vLLM's {token id: Logprob}) against the reference rows: the token's logprob
    and rank, and the top n with their ranks."""
    assert len(entries) == len(tokens) == len(ref)
    for lp, token, row in zip(entries, tokens, ref):
        assert abs(lp[token].logprob - row[token]) <= TOL
        # Rank as transformers', up to the tokens within TOL of it (a flat random model has many).
        assert 1 + (row > row[token] + TOL).sum() <= lp[token].rank <= 1 + (row > row[token] - TOL).sum()
        for rank, t in enumerate(np.argsort(-row)[:n], start=1):
            assert lp[t].rank == rank and abs(lp[t].logprob - row[t]) <= TOL


def test_logprobs_and_prompt_logprobs_match_transformers(family_engine):
    """Greedy and seeded requests with logprobs=3 and prompt_logprobs=2, in one batch, their
    80-token prompt prefilled in two chunks (64-token budget) and its blocks already in the
    prefix cache: every logprob is transformers' log-softmax of the logits, and the prompt's
    are all there despite the cache (such a request computes its prompt again)."""
    _, engine, _, hf = family_engine
    prompt = np.random.default_rng(8).integers(0, 151000, 80)
    engine.add_request("warm", prompt, GREEDY)  # fills the prefix cache with this prompt
    _run(engine)
    stats = engine.scheduler.kv_cache_manager.prefix_cache_stats
    hits = stats.hits
    params = {"greedy": GREEDY.updated(logprobs=3, prompt_logprobs=2),
              "seeded": SamplingParams(temperature=0.8, seed=11, max_tokens=MAX_TOKENS, logprobs=3, prompt_logprobs=2)}
    for rid, p in params.items():
        engine.add_request(rid, prompt, p)
    c0 = engine.num_compilations
    outs = {}
    for _ in range(100):
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        if not engine.has_unfinished():
            break
    assert engine.num_compilations == c0, "a step compiled after warm-up"
    assert stats.hits == hits, "a request asking for prompt logprobs read the prefix cache"
    for rid, p in params.items():
        tokens = [t for o in outs[rid] for t in o.new_token_ids]
        lps = [logprobs_of(e) for o in outs[rid] for e in (o.logprobs or [])]
        prompt_lps = [o.prompt_logprobs for o in outs[rid] if o.prompt_logprobs is not None]
        assert len(tokens) == MAX_TOKENS and len(prompt_lps) == 1, rid
        ref = _hf_log_softmax(hf, prompt.tolist() + tokens)
        _assert_logprobs([logprobs_of(e) for e in prompt_lps[0]], prompt[1:].tolist(), ref[:len(prompt) - 1], 2)
        _assert_logprobs(lps, tokens, ref[len(prompt) - 1:-1], 3)
        if p.is_greedy:
            assert all(lp[t].rank == 1 for t, lp in zip(tokens, lps))
    assert engine.scheduler.kv_cache_manager.is_idle_and_leak_free()
