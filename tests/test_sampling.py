"""Tests for the engine's sampling: params validation (`sampling_params`), metadata building
(`sampling_metadata`), the sampler (`sampling`)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import msgspec
import numpy as np
import pytest

from omni_jax.engine.sampling import (
    TOP_K_CANDIDATES,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    request_keys,
    sample,
)
from omni_jax.engine.sampling_metadata import (
    LOGPROBS_BUCKETS,
    PAD_TOKEN_ID,
    SamplingFlags,
    SamplingMetadata,
    SamplingMetadataBuilder,
)
from omni_jax.engine.sampling_params import SamplingParams, assign_seed

from omni_jax.config import default_pipeline_for

pytestmark = pytest.mark.engine

_sample = jax.jit(sample, static_argnames=("flags",))
_top_k_top_p = jax.jit(apply_top_k_top_p)
_min_p = jax.jit(apply_min_p)
_penalties = jax.jit(apply_penalties)


def _build(params, outputs=None, prompts=None, bucket=None, vocab=64, **kw):
    outputs = outputs if outputs is not None else [[] for _ in params]
    bucket = bucket or len(params)
    return SamplingMetadataBuilder().build(params, outputs, prompts, bucket, vocab, **kw)


def _run(logits, params, outputs=None, prompts=None, bucket=None, **kw):
    """Build + sample; logits [n, V] (padded to the bucket with zeros)."""
    logits = np.asarray(logits, np.float32)
    n, V = logits.shape
    bucket = bucket or n
    md, flags = _build(params, outputs, prompts, bucket, V, **kw)
    padded = np.zeros((bucket, V), np.float32)
    padded[:n] = logits
    out = _sample(jnp.asarray(padded), md, flags=flags)
    return out, flags


def _draws(logits_row, make_params, num_seeds, steps):
    """Many draws from one logits row: one seeded request per row, several steps each."""
    V = logits_row.shape[0]
    params = [make_params(seed) for seed in range(num_seeds)]
    logits = np.broadcast_to(logits_row, (num_seeds, V))
    builder = SamplingMetadataBuilder()
    tokens = []
    for step in range(steps):
        md, flags = builder.build(params, [[0] * step] * num_seeds, None, num_seeds, V)
        tokens.append(np.asarray(_sample(jnp.asarray(logits), md, flags=flags).token_ids))
    return np.concatenate(tokens)


# --- numpy references ------------------------------------------------------------------


def _np_softmax(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _np_top_k_top_p_keep(x, k, p):
    """Allowed-token mask after top-k then top-p (transformers' definitions)."""
    V = x.shape[-1]
    keep = np.ones(V, bool)
    if 0 < k < V:
        keep &= x >= np.sort(x)[::-1][k - 1]
    if p < 1.0:
        y = np.where(keep, x, -np.inf)
        order = np.argsort(y, kind="stable")  # ascending
        cum = np.cumsum(_np_softmax(y[order]))
        remove = cum <= 1.0 - p
        remove[-1] = False
        keep_p = np.ones(V, bool)
        keep_p[order[remove]] = False
        keep &= keep_p
    return keep


def _np_min_p_keep(x, min_p):
    probs = _np_softmax(x)
    return probs >= min_p * probs.max()


def _np_penalties(logits, prompt, output, rep, pres, freq):
    out = np.array(logits, np.float64)
    seen = np.zeros(out.shape[0], bool)
    seen[list(prompt) + list(output)] = True
    counts = np.bincount(np.asarray(output, np.int64), minlength=out.shape[0])
    pen = np.where(seen, rep, 1.0)
    out = np.where(out > 0, out / pen, out * pen)
    return out - freq * counts - pres * (counts > 0)


# --- SamplingParams --------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_k", -2),
        ("top_k", 2.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.1),
        ("seed", "abc"),
        ("stop", [1]),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", ["a"]),
        ("suppress_token_ids", [3, -5]),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("min_tokens", 17),  # > max_tokens (16)
        ("logprobs", -1),
        ("logprobs", 21),
        ("ignore_eos", "yes"),
        # Values that would wrap in the int32 device arrays or not encode for the wire.
        ("max_tokens", 10**30),
        ("max_tokens", 2**31),
        ("top_k", 2**31),
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
        ("stop_token_ids", [2**31]),
        ("suppress_token_ids", [10**30]),
    ],
)
def test_validation_names_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field} must be"):
        SamplingParams(**{field: value})


def test_validation_on_decode_and_update():
    bad = msgspec.msgpack.encode({"top_p": 2.0})
    with pytest.raises(ValueError, match="top_p"):
        msgspec.msgpack.decode(bad, type=SamplingParams)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams().updated(max_tokens=0)


def test_valid_params_and_normalisation():
    p = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), stop="END",
                       stop_token_ids=[1, np.int32(2)], suppress_token_ids=np.array([4]))
    assert p.stop == ("END",) and p.stop_token_ids == (1, 2) and p.suppress_token_ids == (4,)
    assert type(p.temperature) is float and type(p.top_k) is int
    SamplingParams(top_k=-1, top_p=1.0, min_p=1.0, presence_penalty=-2, frequency_penalty=2,
                   min_tokens=16, logprobs=20, seed=-(2**63))
    with pytest.raises(AttributeError):
        p.temperature = 1.0  # frozen: derive with updated()


def test_is_greedy_and_updated():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=1.0, top_k=1).is_greedy
    assert not SamplingParams(temperature=0.5).is_greedy
    p = SamplingParams(temperature=0.5, max_tokens=8)
    q = p.updated(temperature=0.0)
    assert q.is_greedy and q.max_tokens == 8 and not p.is_greedy


def test_validate_for_vocab():
    SamplingParams(stop_token_ids=[63], suppress_token_ids=[0]).validate_for_vocab(64)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[64]).validate_for_vocab(64)
    with pytest.raises(ValueError, match="suppress_token_ids"):
        SamplingParams(suppress_token_ids=[1, 100]).validate_for_vocab(64)


def test_msgpack_round_trip():
    p = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                       presence_penalty=0.5, frequency_penalty=-0.5, seed=2**40 + 3,
                       stop=["</s>", "\n\n"], stop_token_ids=[2, 3], max_tokens=100,
                       min_tokens=5, ignore_eos=True, logprobs=5, suppress_token_ids=[7],
                       include_stop_str_in_output=True)
    for q in (p, SamplingParams()):
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(q), type=SamplingParams) == q
    assert len(msgspec.msgpack.encode(SamplingParams())) < 4  # defaults are omitted


def test_seed_helpers_and_stage_defaults():
    p = SamplingParams()
    seeded = assign_seed(p)
    assert p.seed is None and isinstance(seeded.seed, int) and 0 <= seeded.seed < 2**32
    assert assign_seed(seeded) is seeded
    # A stage's default sampling has one source: its family's pipeline preset.
    talker = default_pipeline_for("qwen2_5_omni").stage("talker").sampling_params()
    assert (talker.top_k, talker.top_p, talker.temperature, talker.repetition_penalty) == (40, 0.8, 0.9, 1.05)
    assert default_pipeline_for("qwen3_omni").stage("thinker").sampling_params().is_greedy
    custom = default_pipeline_for("qwen3_omni").stage("talker").sampling_params(suppress_token_ids=[3000])
    assert custom.top_k == 50 and custom.suppress_token_ids == (3000,)
    with pytest.raises(ValueError, match="unknown model family"):
        default_pipeline_for("llama")


# --- metadata and flags ----------------------------------------------------------------


def test_flags_and_padding_rows():
    V = 64
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=V + 5),
              SamplingParams(temperature=0.8, min_p=0.1, logprobs=3)]
    md, flags = _build(params, bucket=8, vocab=V)
    assert flags == SamplingFlags(all_greedy=False, any_penalties=False, any_top_k_top_p=False,
                                  any_min_p=True, top_logprobs=5)
    assert md.floats.shape == (8, 6) and md.ints.shape == (8, 6) and md.history_ids is None
    assert md.is_greedy.tolist() == [True, False, False] + [True] * 5
    assert md.top_k[1] == 0  # top_k >= vocab is off
    np.testing.assert_allclose(md.temperature, [1, 1, 0.8, 1, 1, 1, 1, 1])
    assert (md.banned_ids == PAD_TOKEN_ID).all()
    _, flags = _build([SamplingParams(temperature=0.0, top_p=0.5, repetition_penalty=1.2)], vocab=V)
    assert flags == SamplingFlags(all_greedy=True, any_penalties=True)
    _, flags = _build([SamplingParams(top_p=0.5, logprobs=0)], vocab=V)
    assert flags.any_top_k_top_p and flags.top_logprobs == 0 and flags.need_logprobs
    assert LOGPROBS_BUCKETS[-1] == 20


def test_padded_rows_harmless():
    rng = np.random.default_rng(0)
    V = 50
    logits = rng.normal(size=(3, V)).astype(np.float32)
    params = [SamplingParams(temperature=0.0), SamplingParams(seed=1, top_k=5),
              SamplingParams(seed=2, top_p=0.7, repetition_penalty=1.3, suppress_token_ids=[1])]
    outs = [[1, 2], [3], [4, 5, 6]]
    prompts = [[7], [8], [9, 10]]
    a, _ = _run(logits, params, outs, prompts, bucket=3)
    b, _ = _run(logits, params, outs, prompts, bucket=8)
    # Garbage (NaN) logits in padding rows must not leak into real rows either.
    md, flags = _build(params, outs, prompts, 8, V)
    padded = np.full((8, V), np.nan, np.float32)
    padded[:3] = logits
    c = _sample(jnp.asarray(padded), md, flags=flags)
    np.testing.assert_array_equal(a.token_ids, b.token_ids[:3])
    np.testing.assert_array_equal(a.token_ids, c.token_ids[:3])
    assert ((np.asarray(b.token_ids) >= 0) & (np.asarray(b.token_ids) < V)).all()


def test_prng_keys_match_jax_prngkey_and_take_64_bit_seeds():
    params = [SamplingParams(seed=7), SamplingParams(seed=2**40 + 7), SamplingParams(seed=-1)]
    md, _ = _build(params, [[0, 0, 0], [], []])
    keys = jax.random.key_data(request_keys(md))
    expected = jax.random.key_data(jax.random.fold_in(jax.random.PRNGKey(7), 3))
    np.testing.assert_array_equal(keys[0], expected)
    def key(hi, lo, step):
        raw = jax.random.wrap_key_data(np.array([hi, lo], np.uint32), impl="threefry2x32")
        return jax.random.key_data(jax.random.fold_in(raw, step))

    np.testing.assert_array_equal(keys[1], key(2**8, 7, 0))  # (high, low) 32-bit halves
    np.testing.assert_array_equal(keys[2], key(2**32 - 1, 2**32 - 1, 0))  # -1 mod 2**64


# --- greedy ----------------------------------------------------------------------------


def test_greedy_is_argmax_lowest_index_on_ties():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(6, 100)).astype(np.float32)
    logits[0, [10, 20, 30]] = 9.0  # a tie: the lowest index wins, as torch.argmax
    out, flags = _run(logits, [SamplingParams(temperature=0.0)] * 6)
    assert flags.all_greedy
    np.testing.assert_array_equal(out.token_ids, np.argmax(logits, -1))
    assert int(out.token_ids[0]) == 10


def test_top_k_1_equals_greedy_in_mixed_batch():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(8, 200)).astype(np.float32) * 3
    params = [SamplingParams(temperature=1.5, top_k=1, seed=i) if i % 2 else
              SamplingParams(temperature=1.0, top_p=0.9, seed=i) for i in range(8)]
    out, flags = _run(logits, params)
    assert not flags.all_greedy
    np.testing.assert_array_equal(np.asarray(out.token_ids)[1::2], np.argmax(logits, -1)[1::2])


# --- truncation masks ------------------------------------------------------------------


@pytest.mark.torch
@pytest.mark.parametrize("k, p", [(5, 1.0), (0, 0.8), (30, 0.5), (-1, 0.95), (200, 0.3), (1, 1.0)])
def test_top_k_top_p_mask_matches_numpy_and_transformers(k, p):
    import torch
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    rng = np.random.default_rng(k + int(p * 100))
    x = (rng.normal(size=(4, 200)) * 2).astype(np.float32)
    got = np.isfinite(np.asarray(_top_k_top_p(jnp.asarray(x), jnp.full(4, k, jnp.int32),
                                              jnp.full(4, p, jnp.float32))))
    scores = torch.from_numpy(x.copy())
    if 0 < k < 200:
        scores = TopKLogitsWarper(k)(None, scores)
    if p < 1.0:
        scores = TopPLogitsWarper(p)(None, scores)
    hf = torch.isfinite(scores).numpy()
    for row in range(4):
        np.testing.assert_array_equal(got[row], _np_top_k_top_p_keep(x[row], k, p))
    np.testing.assert_array_equal(got, hf)


def test_top_k_top_p_mask_on_a_wide_vocabulary_with_ties_and_banned_tokens():
    """The value search finds the sort's thresholds: rows per setting, logits of both signs,
    exact ties at the boundaries, -inf (banned) tokens, a row with one finite logit."""
    rng = np.random.default_rng(11)
    V = 5000
    x = (rng.normal(size=(8, V)) * 4).astype(np.float32)
    x[:, ::7] = np.round(x[:, ::7])  # many exact ties
    x[:, 1::11] = -np.inf
    x[7] = -np.inf
    x[7, 123] = -3.0
    ks = np.array([0, 40, 300, 0, 1, V, 2500, 3], np.int32)
    ps = np.array([0.9, 1.0, 0.5, 0.999, 0.3, 0.05, 1e-6, 0.7], np.float32)
    got = np.isfinite(np.asarray(_top_k_top_p(jnp.asarray(x), jnp.asarray(ks), jnp.asarray(ps))))
    for row in range(8):
        split = _np_top_k_top_p_keep(x[row], int(ks[row]), float(ps[row])) & np.isfinite(x[row])
        want = x[row] >= x[row][split].min()  # tokens tying with the lowest kept one are kept too
        np.testing.assert_array_equal(got[row], want, err_msg=f"row {row}")
    assert got[7].sum() == 1 and got[7, 123]


@pytest.mark.torch
@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 1.0])
def test_min_p_mask_matches_numpy_and_transformers(min_p):
    import torch
    from transformers.generation.logits_process import MinPLogitsWarper

    rng = np.random.default_rng(3)
    x = (rng.normal(size=(4, 300)) * 2).astype(np.float32)
    got = np.isfinite(np.asarray(_min_p(jnp.asarray(x), jnp.full(4, min_p, jnp.float32))))
    hf = torch.isfinite(MinPLogitsWarper(max(min_p, 1e-9))(None, torch.from_numpy(x.copy()))).numpy()
    for row in range(4):
        np.testing.assert_array_equal(got[row], _np_min_p_keep(x[row], min_p))
    np.testing.assert_array_equal(got, hf)


@pytest.mark.parametrize("V", [64, 4 * TOP_K_CANDIDATES])  # top-k candidates: never / when top_k is small
@pytest.mark.parametrize(
    "kw",
    [dict(top_k=4), dict(top_p=0.6), dict(min_p=0.2), dict(top_k=10, top_p=0.5, min_p=0.1),
     dict(top_k=6, temperature=0.5), dict(top_k=TOP_K_CANDIDATES + 1, top_p=0.3)],
)
def test_sampling_stays_inside_allowed_set(kw, V):
    rng = np.random.default_rng(4)
    x = (rng.normal(size=V) * 1.5).astype(np.float32)
    kw = {"temperature": 1.0, **kw}
    t = kw["temperature"]
    allowed = _np_top_k_top_p_keep(x / t, kw.get("top_k", 0), kw.get("top_p", 1.0))
    allowed &= _np_min_p_keep(np.where(allowed, x / t, -np.inf), kw.get("min_p", 0.0))
    tokens = _draws(x, lambda s: SamplingParams(seed=s, **kw), num_seeds=256, steps=4)
    seen = np.zeros(V, bool)
    seen[tokens] = True
    assert not (seen & ~allowed).any(), np.flatnonzero(seen & ~allowed)
    # Small allowed sets get fully explored with 1024 draws (a mass check on the sampler).
    if allowed.sum() <= 6:
        assert (seen == allowed).all()


@pytest.mark.parametrize("V,top_k", [(16, 0), (4 * TOP_K_CANDIDATES, 12)])
def test_temperature_distribution_matches_softmax(V, top_k):
    rng = np.random.default_rng(5)
    t = 0.7
    x = rng.normal(size=V).astype(np.float32)
    tokens = _draws(x, lambda s: SamplingParams(temperature=t, top_k=top_k, seed=s), num_seeds=1024, steps=8)
    n = tokens.size
    kept = _np_top_k_top_p_keep(x, top_k, 1.0)
    expected = _np_softmax(np.where(kept, x / t, -np.inf)) * n
    observed = np.bincount(tokens, minlength=V)
    ok = expected >= 5
    chi2 = ((observed - expected)[ok] ** 2 / expected[ok]).sum()
    assert chi2 < 60, (chi2, observed, expected.round())  # dof ~15; p(chi2 > 60) ~ 1e-7


@pytest.mark.parametrize("peak", [6.0, 0.0])  # the nucleus among the candidates / far wider
def test_top_p_without_top_k_draws_from_its_nucleus(peak):
    """Top-p rows without top-k draw among the top candidates when the nucleus lies there (a
    trained model's usual case), else over the whole vocabulary: either way only nucleus
    tokens, with the softmax's proportions."""
    from omni_jax.engine.sampling import _nucleus

    rng = np.random.default_rng(8)
    V, p = 4 * TOP_K_CANDIDATES, 0.9
    x = rng.normal(size=V).astype(np.float32)
    x[rng.choice(V, 10, replace=False)] += peak
    cand = np.sort(x)[::-1][:TOP_K_CANDIDATES][None]
    log_z = np.log(np.exp(x.astype(np.float64)).sum())
    _, fits = _nucleus(jnp.asarray(cand), jnp.full((1, 1), log_z, jnp.float32), jnp.full(1, p))
    assert bool(fits[0]) == (peak > 0)
    tokens = _draws(x, lambda s: SamplingParams(temperature=1.0, top_p=p, seed=s), num_seeds=1024, steps=8)
    allowed = _np_top_k_top_p_keep(x, 0, p)
    assert not np.isin(tokens, np.flatnonzero(~allowed)).any()
    expected = _np_softmax(np.where(allowed, x, -np.inf)) * tokens.size
    observed = np.bincount(tokens, minlength=V)
    ok = expected >= 5
    chi2 = ((observed - expected)[ok] ** 2 / expected[ok]).sum()
    assert chi2 < 3 * ok.sum() + 30, (chi2, ok.sum())  # dof = ok.sum() - 1


# --- per-request PRNG ------------------------------------------------------------------


# The target draws from the whole vocabulary / among its top-k candidates; the batch mixes both.
@pytest.mark.parametrize("target", [SamplingParams(temperature=0.9, top_p=0.95, seed=1234),
                                    SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=1234)])
def test_same_seed_same_tokens_alone_and_in_batch(target):
    rng = np.random.default_rng(6)
    V, steps = 100, 12
    row_logits = rng.normal(size=(steps, V)).astype(np.float32) * 2
    others = [SamplingParams(temperature=1.2, top_k=7), SamplingParams(temperature=0.0),
              SamplingParams(min_p=0.1, seed=5), SamplingParams(top_p=0.5),
              SamplingParams(temperature=0.7), SamplingParams(seed=99, logprobs=2),
              SamplingParams(top_k=3, top_p=0.8)]
    alone_builder, batch_builder = SamplingMetadataBuilder(), SamplingMetadataBuilder()
    alone, batched = [], []
    outputs = []
    for step in range(steps):
        md, flags = alone_builder.build([target], [outputs], None, 1, V)
        alone.append(int(_sample(jnp.asarray(row_logits[step:step + 1]), md, flags=flags).token_ids[0]))
        batch = others[:5] + [target] + others[5:]  # target at row 5 of 8
        logits = rng.normal(size=(8, V)).astype(np.float32)
        logits[5] = row_logits[step]
        md, flags = batch_builder.build(batch, [[0] * step] * 5 + [outputs] + [[0] * step] * 2,
                                        None, 8, V)
        batched.append(int(_sample(jnp.asarray(logits), md, flags=flags).token_ids[5]))
        outputs = outputs + [alone[-1]]
    assert alone == batched
    assert len(set(alone)) > 3  # it did sample, not collapse to one token


def test_unseeded_requests_vary():
    x = np.zeros(1000, np.float32)
    params = [SamplingParams()]
    draws = {int(_run(x[None], params)[0].token_ids[0]) for _ in range(5)}
    assert len(draws) > 1


# --- penalties, suppression, min_tokens ------------------------------------------------


def test_penalties_match_numpy_reference():
    rng = np.random.default_rng(7)
    V, n = 80, 5
    logits = (rng.normal(size=(n, V)) * 3).astype(np.float32)
    prompts = [rng.integers(0, V, size=rng.integers(0, 30)).tolist() for _ in range(n)]
    outputs = [rng.integers(0, V, size=rng.integers(0, 40)).tolist() for _ in range(n)]
    cfg = [(1.3, 0.0, 0.0), (0.8, 0.5, 0.2), (1.0, -1.0, 1.5), (1.0, 0.0, 0.0), (2.0, 2.0, -2.0)]
    params = [SamplingParams(temperature=0.0, repetition_penalty=r, presence_penalty=pr,
                             frequency_penalty=f) for r, pr, f in cfg]
    md, flags = _build(params, outputs, prompts, bucket=8, vocab=V)
    assert flags.any_penalties and md.history_ids.shape[1] == 64
    got = np.asarray(_penalties(jnp.asarray(np.pad(logits, ((0, 3), (0, 0)))), md))[:n]
    for i, (r, pr, f) in enumerate(cfg):
        ref = _np_penalties(logits[i], prompts[i], outputs[i], r, pr, f)
        np.testing.assert_allclose(got[i], ref, rtol=1e-6, atol=1e-5)
    # Sampling uses the penalised logits: greedy picks their argmax.
    out = _sample(jnp.asarray(np.pad(logits, ((0, 3), (0, 0)))), md, flags=flags)
    np.testing.assert_array_equal(
        np.asarray(out.token_ids)[:n],
        [np.argmax(_np_penalties(logits[i], prompts[i], outputs[i], *cfg[i])) for i in range(n)])


@pytest.mark.torch
@pytest.mark.parametrize("penalty", [1.2, 0.7])
def test_repetition_penalty_matches_transformers(penalty):
    import torch
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    rng = np.random.default_rng(8)
    V = 120
    logits = (rng.normal(size=(3, V)) * 4).astype(np.float32)
    prompts = [rng.integers(0, V, 20).tolist() for _ in range(3)]
    outputs = [rng.integers(0, V, 15).tolist() for _ in range(3)]
    md, _ = _build([SamplingParams(repetition_penalty=penalty)] * 3, outputs, prompts, vocab=V)
    got = np.asarray(_penalties(jnp.asarray(logits), md))
    proc = RepetitionPenaltyLogitsProcessor(penalty)
    for i in range(3):
        ids = torch.tensor([prompts[i] + outputs[i]])
        hf = proc(ids, torch.from_numpy(logits[i:i + 1].copy())).numpy()[0]
        np.testing.assert_allclose(got[i], hf, rtol=1e-6, atol=1e-6)


def test_history_inputs_lists_arrays_and_incremental_cache_agree():
    rng = np.random.default_rng(9)
    V = 50
    logits = jnp.asarray(rng.normal(size=(3, V)).astype(np.float32))
    params = [SamplingParams(repetition_penalty=1.5, frequency_penalty=0.3)] * 2 + [SamplingParams()]
    prompts = [rng.integers(0, V, 10).tolist() for _ in range(3)]
    outputs = [[], rng.integers(0, V, 3).tolist(), []]
    builder = SamplingMetadataBuilder(history_min_width=8)
    for step in range(70):  # grows past the row buffers and the history width buckets
        if step == 30:  # a new request takes row 0 (the steady-state path must notice)
            outputs[0] = rng.integers(0, V, 5).tolist()
        if step == 40:  # rows swap places
            outputs[:2], prompts[:2] = outputs[1::-1], prompts[1::-1]
        if step == 50:  # a request is skipped for a step (preempted), then comes back
            builder.build(params[1:], outputs[1:], prompts[1:], 2, V)
        md, _ = builder.build(params, outputs, prompts, 4, V)
        fresh, _ = SamplingMetadataBuilder().build(
            params, [np.array(o, np.int32) for o in outputs],
            [np.array(p, np.int32) for p in prompts], 4, V)
        np.testing.assert_allclose(_penalties(jnp.pad(logits, ((0, 1), (0, 0))), md),
                                   _penalties(jnp.pad(logits, ((0, 1), (0, 0))), fresh), rtol=1e-6)
        for o in outputs:
            o.append(int(rng.integers(0, V)))
    assert md.history_ids.shape[1] == 128


def test_banned_ids_follow_batch_changes():
    V, eos = 32, 1
    builder = SamplingMetadataBuilder()
    a = SamplingParams(suppress_token_ids=[5], min_tokens=2)
    b = SamplingParams(suppress_token_ids=[6, 7])

    def banned(params, outputs):
        md, _ = builder.build(params, outputs, None, 2, V, eos_token_ids=[eos])
        return [sorted(r[r != PAD_TOKEN_ID].tolist()) for r in md.banned_ids]

    assert banned([a, b], [[], []]) == [[1, 5], [6, 7]]  # row 0 gated by min_tokens
    assert banned([a, b], [[0, 0], [0]]) == [[5], [6, 7]]
    assert banned([a, b], [[0, 0, 0], [0, 0]]) == [[5], [6, 7]]  # reused array
    assert banned([b, a], [[0, 0], [0, 0, 0]]) == [[6, 7], [5]]
    assert banned([b], [[0, 0]]) == [[6, 7], []]


def test_steady_state_builds_equal_fresh_ones():
    """A build with the same params in the same rows as the last one reuses its arrays: every
    array must still be what a fresh builder packs (step column, min_tokens gating ending,
    penalty histories, a batch that changes)."""
    V, eos = 40, 1
    params = [SamplingParams(temperature=0.7, top_k=5, seed=3, min_tokens=3, suppress_token_ids=[4]),
              SamplingParams(temperature=0.0), SamplingParams(repetition_penalty=1.3, seed=1, top_p=0.9)]
    outputs, prompts = [[], [2], [5, 6]], [[7, 8], [9], [10, 11, 12]]
    builder = SamplingMetadataBuilder()
    for step in range(9):
        if step == 6:  # rows change places
            params, outputs, prompts = params[::-1], outputs[::-1], prompts[::-1]
        md, flags = builder.build(params, outputs, prompts, 4, V, eos_token_ids=[eos])
        fresh, fresh_flags = SamplingMetadataBuilder().build(
            params, [list(o) for o in outputs], [list(p) for p in prompts], 4, V, eos_token_ids=[eos])
        assert flags == fresh_flags
        for name in ("floats", "ints", "banned_ids", "history_ids"):
            np.testing.assert_array_equal(getattr(md, name), getattr(fresh, name), err_msg=f"{name}, step {step}")
        for o in outputs:
            o.append(step + 10)
    assert builder._last_build is not None and builder._last_build.banned is not None  # the steady path ran


def test_suppressed_tokens_never_sampled():
    V = 64
    x = np.zeros(V, np.float32)
    x[[3, 9]] = 20.0  # the two most likely tokens, suppressed
    tokens = _draws(x, lambda s: SamplingParams(seed=s, suppress_token_ids=[3, 9]), 128, 2)
    assert not np.isin(tokens, [3, 9]).any()
    out, _ = _run(x[None], [SamplingParams(temperature=0.0, suppress_token_ids=[3, 9])])
    assert int(out.token_ids[0]) not in (3, 9)


def test_min_tokens_blocks_eos_and_stop_ids():
    V, eos, stop = 32, 2, 7
    x = np.zeros((2, V), np.float32)
    x[:, eos] = 30.0
    x[:, stop] = 29.0
    x[:, 11] = 1.0
    params = [SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop]),
              SamplingParams(seed=0, min_tokens=3, stop_token_ids=[stop])]
    for n_out in range(5):
        out, _ = _run(x, params, [[11] * n_out] * 2, eos_token_ids=[eos])
        tokens = np.asarray(out.token_ids)
        if n_out < 3:
            assert not np.isin(tokens, [eos, stop]).any(), (n_out, tokens)
        else:
            assert tokens[0] == eos
    md, _ = _build(params, [[1], [1]], vocab=V, eos_token_ids=[eos])
    assert sorted(md.banned_ids[0][md.banned_ids[0] != PAD_TOKEN_ID]) == [eos, stop]


# --- logprobs --------------------------------------------------------------------------


def test_logprobs_of_processed_pre_temperature_logits():
    rng = np.random.default_rng(10)
    V = 40
    logits = rng.normal(size=(3, V)).astype(np.float32)
    params = [SamplingParams(temperature=0.0, logprobs=3, suppress_token_ids=[0]),
              SamplingParams(temperature=2.0, seed=3, logprobs=0),
              SamplingParams(temperature=0.5, seed=4)]
    out, flags = _run(logits, params)
    assert flags.top_logprobs == 5
    lp = out.logprobs
    ref_logits = logits.copy()
    ref_logits[0, 0] = -np.inf
    with np.errstate(divide="ignore"):
        ref = np.log(_np_softmax(ref_logits))
    tok = np.asarray(out.token_ids)
    np.testing.assert_allclose(lp.sampled_logprob, ref[np.arange(3), tok], rtol=1e-5)
    np.testing.assert_array_equal(lp.top_token_ids, np.argsort(-ref, axis=-1)[:, :5])
    np.testing.assert_allclose(lp.top_logprobs, -np.sort(-ref, axis=-1)[:, :5], rtol=1e-5)
    ranks = (ref > ref[np.arange(3), tok][:, None]).sum(-1) + 1
    np.testing.assert_array_equal(lp.sampled_rank, ranks)
    assert int(lp.sampled_rank[0]) == 1
    out, flags = _run(logits, [SamplingParams(temperature=0.0)] * 3)
    assert out.logprobs is None and not flags.need_logprobs


def test_metadata_build_classmethod_is_a_pytree():
    md, flags = SamplingMetadata.build([SamplingParams(seed=1)], [[]], None, 4, 16)
    leaves = jax.tree_util.tree_leaves(md)
    assert len(leaves) == 3  # floats, ints, banned_ids: few host->device copies
    assert math.isclose(float(md.top_p[0]), 1.0)


def test_every_sampler_variant_lowers_for_cuda():
    """The engine's compiled sampler variants (with their lax.cond branches) lower for GPUs."""
    from omni_jax.engine.ar_engine import _VARIANTS

    B, V = 8, 152064
    md, _ = _build([SamplingParams(seed=0, top_k=40, repetition_penalty=1.1)] * B, vocab=V)
    md = md.replace(history_ids=np.zeros((B, 64), np.int32))
    spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), md)
    for flags in _VARIANTS:
        text = (_sample.trace(jax.ShapeDtypeStruct((B, V), jnp.float32), spec, flags=flags)
                .lower(lowering_platforms=("cuda",)).as_text())
        assert "func.func public @main" in text
