"""Structured outputs and logit bias, what shapes the logits before sampling: the sampler's mask
and bias against numpy (llguidance's own mask), the spec's checks, and the built-in tiny model's
thinker engine constrained to JSON schemas, regexes, choices and grammars (the replies checked by
Python's own json and re) or biased."""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import numpy as np
import pytest

from omni_jax.engine.runner import RunnerConfig
from omni_jax.engine.sampling import apply_token_bitmask
from omni_jax.engine.sampling_params import MAX_GRAMMAR_CHARS, SamplingParams, StructuredOutputs
from omni_jax.engine.structured_output import MAX_JSON_WHITESPACE, grammar_of
from omni_jax.errors import RequestError
from omni_jax.models.thinker_media import MediaBuckets
from omni_jax.models.qwen2_5_omni.stages import build_thinker_engine

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n", "color"],
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9},
                         "color": {"enum": ["red", "green"]}}}
PROMPT = [100, 200, 300, 400]


def _checks_schema(text: str) -> None:
    """`text` is a JSON object SCHEMA accepts (checked by hand, not by the grammar's library)."""
    value = json.loads(text)
    assert set(value) == {"ok", "n", "color"}, text
    assert isinstance(value["ok"], bool) and value["color"] in ("red", "green"), text
    assert type(value["n"]) is int and 0 <= value["n"] <= 9, text


@pytest.mark.parametrize("vocab", [64, 100, 151665])
def test_token_bitmask_equals_llguidance_numpy(vocab):
    from llguidance.numpy import apply_token_bitmask_inplace

    rng = np.random.default_rng(vocab)
    logits = rng.normal(size=(3, vocab)).astype(np.float32)
    bits = rng.integers(-2**31, 2**31, size=(3, (vocab + 31) // 32), dtype=np.int64).astype(np.int32)
    bits[2] = -1  # a row without a grammar: every token allowed
    want = logits.copy()
    apply_token_bitmask_inplace(want, bits)
    got = np.asarray(jax.jit(apply_token_bitmask)(logits, bits))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got[2], logits[2])
    # a mask narrower than the logits (a model's vocabulary past the tokenizer's) allows none past it
    short = np.asarray(jax.jit(apply_token_bitmask)(logits, bits[:, :1]))
    assert np.isneginf(short[:, 32:]).all() and np.array_equal(short[2, :32], logits[2, :32])


@pytest.mark.parametrize("given, says", [
    (dict(json="{}", regex="a"), "exactly one of"),
    (dict(), "exactly one of"),
    (dict(json_object=False), "exactly one of"),
    (dict(choice=[]), "choice must be a non-empty list"),
    (dict(choice=["a", ""]), "choice must be a non-empty list"),
    (dict(regex=""), "regex must be a non-empty string"),
    (dict(json_object=1), "json_object must be a bool"),
    (dict(regex="a" * (MAX_GRAMMAR_CHARS + 1)), f"at most {MAX_GRAMMAR_CHARS} characters"),
])
def test_a_bad_spec_says_what_is_wrong(given, says):
    with pytest.raises(ValueError, match=says):
        StructuredOutputs(**given)


@pytest.mark.parametrize("spec, says", [
    (StructuredOutputs(regex="(("), "regex is not valid: .*unclosed group"),
    (StructuredOutputs(json={"type": "nonsense"}), "JSON schema is not valid: .*nonsense"),
    (StructuredOutputs(json='{"type": '), "JSON schema is not valid"),
    (StructuredOutputs(grammar="start: undefined_rule"), "grammar is not valid"),
])
def test_a_grammar_that_does_not_compile_says_why(spec, says):
    with pytest.raises(ValueError, match=says):
        grammar_of(spec)


def test_sampling_params_take_the_spec_as_a_dict_and_refuse_min_tokens():
    p = SamplingParams(structured_outputs={"json": SCHEMA})
    assert p.structured_outputs == StructuredOutputs(json=json.dumps(SCHEMA, separators=(",", ":")))
    with pytest.raises(ValueError, match="SamplingParams.structured_outputs: Unexpected keyword argument .jsn."):
        SamplingParams(structured_outputs={"jsn": "{}"})
    with pytest.raises(ValueError, match="SamplingParams.min_tokens must be 0 with structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a+"}, min_tokens=2)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from omni_jax.models.qwen2_5_omni.tiny import tiny_checkpoint

    ckpt = tiny_checkpoint(str(tmp_path_factory.mktemp("tiny") / "model"))
    return build_thinker_engine(ckpt, RunnerConfig(num_blocks=96, block_size=16, max_num_seqs=8,
                                                   max_num_batched_tokens=64, max_model_len=512),
                                media_buckets=MediaBuckets((1,), (64,)), progress=False)


def _run(engine, requests: dict, async_scheduling: bool = True) -> dict:
    """{request id: (text, tokens, final output)} of `requests` ({id: SamplingParams}) run together."""
    engine.cfg = dataclasses.replace(engine.cfg, async_scheduling=async_scheduling)
    for rid, params in requests.items():
        engine.add_request(rid, PROMPT, params)
    texts, tokens, final = {}, {}, {}
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            texts[o.request_id] = texts.get(o.request_id, "") + (o.text_delta or "")
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                final[o.request_id] = o
    assert not engine.has_unfinished()
    kv = engine.scheduler.kv_cache_manager
    assert kv.is_idle_and_leak_free()
    kv.check_invariants()
    return {rid: (texts[rid], tokens[rid], final[rid]) for rid in requests}


def test_replies_match_their_schema_regex_choice_or_grammar(engine):
    """Greedy and sampled, each constrained reply ends by itself (finish_reason stop) and is what
    it was asked to be; an unconstrained request beside them gets the tokens it gets alone, and
    async scheduling changes nothing; warm-up compiled every program they run."""
    eos = set(engine.cfg.eos_token_ids)
    compiled = engine.num_compilations
    asked = {}
    for temp in (0.0, 1.0):
        def sp(**spec):
            return SamplingParams(temperature=temp, seed=7, max_tokens=300,
                                  structured_outputs=StructuredOutputs(**spec))
        asked |= {f"schema{temp}": sp(json=SCHEMA), f"compact{temp}": sp(json=SCHEMA, disable_any_whitespace=True),
                  f"regex{temp}": sp(regex=r"[a-z]{3}-[0-9]{2}"), f"choice{temp}": sp(choice=["yes", "no", "maybe"]),
                  f"grammar{temp}": sp(grammar='start: "A" ("B" | "C")+ "D"'),
                  f"plain{temp}": SamplingParams(temperature=temp, seed=7, max_tokens=12)}
    asked["object0.0"] = SamplingParams(temperature=0.0, max_tokens=300,
                                        structured_outputs=StructuredOutputs(json_object=True))
    together = _run(engine, asked)
    for rid, (text, tokens, final) in together.items():
        if rid.startswith("plain"):
            assert final.finish_reason == "length" and len(tokens) == 12
            continue
        assert final.finish_reason == "stop" and final.error is None, (rid, text, final)
        assert tokens[-1] in eos, rid  # only an end token was allowed once the match was complete
        if rid.startswith(("schema", "compact")):
            _checks_schema(text)
        if rid.startswith("object"):
            assert isinstance(json.loads(text), dict), text
        if rid.startswith("compact"):
            assert text == json.dumps(json.loads(text)), text  # no whitespace but ", " and ": "
        if rid.startswith("schema"):
            assert max(map(len, re.findall(r"\s+", text)), default=0) <= MAX_JSON_WHITESPACE, text
        if rid.startswith("regex"):
            assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", text), text
        if rid.startswith("choice"):
            assert text in ("yes", "no", "maybe"), text
        if rid.startswith("grammar"):
            assert re.fullmatch(r"A[BC]+D", text), text
    alone = _run(engine, {"plain0.0": asked["plain0.0"]})
    assert alone["plain0.0"][1] == together["plain0.0"][1]
    sync = _run(engine, asked, async_scheduling=False)
    assert {k: v[1] for k, v in sync.items()} == {k: v[1] for k, v in together.items()}
    assert engine.num_compilations == compiled


def test_a_bad_grammar_or_a_cut_reply_loses_nothing_else(engine):
    """A grammar that does not compile is refused at add_request by name, or, when only the
    tokenizer shows why (a special token it lacks), fails its request alone once built; a
    constrained reply cut by max_tokens ends as 'length'; an abort mid-reply frees its blocks."""
    with pytest.raises(RequestError, match="structured_outputs: regex is not valid"):
        engine.add_request("bad", PROMPT, SamplingParams(structured_outputs=StructuredOutputs(regex="((")))
    late = StructuredOutputs(grammar="start: <|no_such_token|>")
    ran = _run(engine, {"late": SamplingParams(structured_outputs=late),
                        "ok": SamplingParams(temperature=0.0, max_tokens=5)})
    final = ran["late"][2]
    assert (final.finish_reason, final.error_code) == ("error", "invalid_request") and not ran["late"][1]
    assert "unknown special token" in final.error and len(final.error) < 400
    assert len(ran["ok"][1]) == 5
    # A regex spelling an added token's text: llguidance lets the token through, then refuses it.
    # The request fails alone, saying so and how to name the token instead.
    ran = _run(engine, {"spelled": SamplingParams(temperature=0.0, max_tokens=20,
                                                  structured_outputs=StructuredOutputs(regex="<tool_call>x")),
                        "ok": SamplingParams(temperature=0.0, max_tokens=5)})
    final = ran["spelled"][2]
    assert (final.finish_reason, final.error_code) == ("error", "invalid_request"), final.error
    assert "'<tool_call>'" in final.error and "unquoted (<tool_call>)" in final.error and len(final.error) < 300
    assert len(ran["ok"][1]) == 5
    spec = StructuredOutputs(json=SCHEMA)
    cut = _run(engine, {"cut": SamplingParams(temperature=0.0, max_tokens=3, structured_outputs=spec)})
    text, tokens, final = cut["cut"]
    assert final.finish_reason == "length" and len(tokens) == 3 and text.startswith("{")
    engine.add_request("left", PROMPT, SamplingParams(temperature=0.0, max_tokens=300, structured_outputs=spec))
    engine.step()
    engine.step()
    assert engine.abort("left")
    done = _run(engine, {"after": SamplingParams(temperature=0.0, max_tokens=300, structured_outputs=spec)})
    _checks_schema(done["after"][0])


def test_shape_logits_adds_the_bias_then_masks():
    """sampling.shape_logits against numpy: each row's bias added at its ids (padding dropped), then
    the bitmask."""
    from llguidance.numpy import apply_token_bitmask_inplace

    from omni_jax.engine.sampling import shape_logits
    from omni_jax.engine.sampling_metadata import logit_bias_arrays

    rng = np.random.default_rng(0)
    vocab = 100
    logits = rng.normal(size=(3, vocab)).astype(np.float32)
    params = [SamplingParams(logit_bias={5: -100, 17: 2.5}), SamplingParams(), SamplingParams(logit_bias={99: 100})]
    ids, bias = logit_bias_arrays(params, 3)
    bits = rng.integers(-2**31, 2**31, size=(3, 4), dtype=np.int64).astype(np.int32)
    want = logits.copy()
    want[0, 5] -= 100
    want[0, 17] += 2.5
    want[2, 99] += 100
    apply_token_bitmask_inplace(want, bits)
    np.testing.assert_allclose(np.asarray(jax.jit(shape_logits)(logits, ids, bias, bits)), want, rtol=0, atol=1e-6)


def test_logit_bias_in_the_engine(engine):
    """-100 on the greedy first token makes the runner-up (by the engine's own logprobs) first; +100
    forces a token under sampling too; a biased request leaves its batch-mate's tokens alone; an id
    past the vocabulary is refused by name."""
    lp = _run(engine, {"lp": SamplingParams(temperature=0.0, max_tokens=1, logprobs=2)})["lp"][2].logprobs[0]
    top, second = [token for token, _ in lp["top"]]
    banned = _run(engine, {"b": SamplingParams(temperature=0.0, max_tokens=1, logit_bias={top: -100})})
    assert banned["b"][1] == [second]
    plain = SamplingParams(temperature=0.0, max_tokens=6)
    both = _run(engine, {"f": SamplingParams(temperature=1.0, seed=3, max_tokens=6, logit_bias={1234: 100}),
                         "p": plain})
    assert both["f"][1] == [1234] * 6
    assert both["p"][1] == _run(engine, {"p": plain})["p"][1]
    with pytest.raises(RequestError, match="logit_bias must be token ids < vocab_size"):
        engine.add_request("far", PROMPT, SamplingParams(logit_bias={engine.vocab_size: 1}))
