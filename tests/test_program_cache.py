"""Traced programs kept between processes (omni_jax/engine/program_cache.py): a program is read
back only where everything that decides its trace is the same, computes what the traced one
does, keeps its donation, and a bad entry or an uncacheable program costs a trace, not a failure."""

from __future__ import annotations

import collections
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omni_jax.engine import program_cache
from omni_jax.engine.program_cache import ProgramCache, decode_tree, encode_tree


def _fn(params, state, x, *, scale):
    """A program with a dict of int keys in and out (as the step's captured layers), a donated
    state and a static value."""
    y = x @ params["w"] * scale
    return {0: y, 2: (y.sum(), None)}, [s + 1 for s in state]


def _args():
    params = {"w": jnp.arange(12, dtype=jnp.float32).reshape(4, 3)}
    return params, [jnp.zeros(3), jnp.ones(2)], jnp.ones((2, 4))


def _programs(cache):
    return cache.jit("f", _fn, static_argnames=("scale",), donate_argnums=(1,))


@pytest.mark.parametrize("tree", [({1: 0, 3: [0, None]}, (0,), []), {"a": {"b": (0, 0)}}, 0, None])
def test_trees_of_builtin_nodes_round_trip(tree):
    td = jax.tree.structure(tree)
    assert decode_tree(encode_tree(td)) == td


def test_a_tree_with_another_node_is_refused():
    with pytest.raises(program_cache.Unsupported):
        encode_tree(jax.tree.structure(collections.namedtuple("Pair", "a b")(0, 0)))


def test_a_second_process_reads_the_program_back_and_gets_the_same_outputs(tmp_path):
    want = _fn(*_args(), scale=2.0)
    first = ProgramCache(str(tmp_path), {"stage": "a"})
    got = _programs(first)(*_args(), scale=2.0)
    assert first.stats == {"loaded": 0, "exported": 1}
    again = ProgramCache(str(tmp_path), {"stage": "a"})  # a restart: a new cache on the same directory
    params, state, x = _args()
    out = _programs(again)(params, state, x, scale=2.0)
    assert again.stats == {"loaded": 1, "exported": 0}
    for a, b, c in zip(jax.tree.leaves(want), jax.tree.leaves(got), jax.tree.leaves(out)):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    assert jax.tree.structure(out) == jax.tree.structure(want)
    assert all(s.is_deleted() for s in state) and not x.is_deleted()  # donation kept


def test_another_static_value_shape_scope_or_code_is_another_program(tmp_path, monkeypatch):
    cache = ProgramCache(str(tmp_path), {"stage": "a"})
    f = _programs(cache)
    f(*_args(), scale=2.0)
    out = f(*_args(), scale=3.0)  # another static value: traced, not the first program
    np.testing.assert_array_equal(out[0][0], _fn(*_args(), scale=3.0)[0][0])
    params, state, _ = _args()
    f(params, state, jnp.ones((5, 4)), scale=2.0)  # another shape
    assert cache.stats["exported"] == 3
    assert ProgramCache(str(tmp_path), {"stage": "b"}).dir != cache.dir
    assert ProgramCache(str(tmp_path), {"stage": "a"}).dir == cache.dir
    digest = program_cache.code_digest
    monkeypatch.setattr(program_cache, "code_digest", lambda: "another version of the code")
    assert ProgramCache(str(tmp_path), {"stage": "a"}).dir != cache.dir
    monkeypatch.setattr(program_cache, "code_digest", digest)
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_dump_to=/nowhere")
    assert ProgramCache(str(tmp_path), {"stage": "a"}).dir != cache.dir


def test_a_torn_entry_is_traced_again(tmp_path, caplog):
    _programs(ProgramCache(str(tmp_path), {"stage": "a"}))(*_args(), scale=2.0)
    (entry,) = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs if f.endswith(".exported")]
    with open(entry, "r+b") as f:
        f.truncate(os.path.getsize(entry) // 2)
    again = ProgramCache(str(tmp_path), {"stage": "a"})
    with caplog.at_level(logging.WARNING, logger="omni_jax.program_cache"):
        out = _programs(again)(*_args(), scale=2.0)
    assert "unreadable" in caplog.text and again.stats == {"loaded": 0, "exported": 1}
    np.testing.assert_array_equal(out[0][0], _fn(*_args(), scale=2.0)[0][0])
    third = ProgramCache(str(tmp_path), {"stage": "a"})  # written anew
    _programs(third)(*_args(), scale=2.0)
    assert third.stats == {"loaded": 1, "exported": 0}


def test_a_program_the_cache_cannot_keep_is_traced_as_usual(tmp_path, caplog):
    cache = ProgramCache(str(tmp_path), {"stage": "a"})
    f = cache.jit("g", lambda x: {"k": jnp.sin(x)})
    unusual = cache.jit("h", lambda x, *, o: x + len(o.__class__.__name__), static_argnames=("o",))
    np.testing.assert_allclose(f(jnp.ones(3))["k"], np.sin(1.0))  # a str-keyed dict: kept
    with caplog.at_level(logging.WARNING, logger="omni_jax.program_cache"):
        assert float(unusual(jnp.zeros(()), o=object())) == 6.0  # no stable key for the static value
    assert "traced without the program cache" in caplog.text and cache.stats["exported"] == 1
    with pytest.raises(ValueError, match="already cached"):
        cache.jit("g", jnp.sin)


def test_a_stage_engine_restarted_reads_its_step_programs_and_decodes_the_same(tmp_path, converted_thinker_fp32):
    """The tiny thinker built three times: without the cache, with it empty, with it filled
    (a restart): the same greedy tokens and media features, and the restart traces none of its
    step or media encoder programs."""
    from omni_jax import SamplingParams
    from omni_jax.config import load_pipeline_config
    from omni_jax.runtime.stage_loop import build_stage_engine

    stage = load_pipeline_config("qwen2_5_omni_tiny").stages[0]

    def run(cache):
        program_cache.use(cache)
        try:
            engine = build_stage_engine("qwen2_5_omni", stage, converted_thinker_fp32)
        finally:
            program_cache.use(None)
        for i, n in enumerate((5, 40, 9)):
            engine.add_request(request_id=f"r{i}", prompt_token_ids=np.arange(100, 100 + n),
                               sampling_params=SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        tokens = {}
        while engine.has_unfinished():
            for o in engine.step():
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        # and its media encoders' programs (one audio, one image of 4 x 8 patches)
        media, rng = engine.media_encoder, np.random.default_rng(0)
        audio = media.encode_audio([rng.standard_normal((media.cfg.audio.num_mel_bins, 200)).astype(np.float32)])
        image = media.encode_vision(rng.standard_normal((32, media.cfg.vision.patch_dim)).astype(np.float32),
                                    np.array([[1, 4, 8]]), "image")
        return tokens, audio, image

    want = run(None)
    first = ProgramCache(str(tmp_path), {"stage": "thinker"})
    restart = ProgramCache(str(tmp_path), {"stage": "thinker"})
    for got in (run(first), run(restart)):
        assert got[0] == want[0]
        for a, b in zip(jax.tree.leaves(got[1:]), jax.tree.leaves(want[1:])):
            np.testing.assert_array_equal(a, b)
    assert first.stats["exported"] > 0 and first.stats["loaded"] == 0
    assert restart.stats == {"loaded": first.stats["exported"], "exported": 0}
    kept = {f.split("-")[0] for f in os.listdir(first.dir)}
    assert {"step", "media.audio", "media.vision"} <= kept, kept


def _restarts_agree(tmp_path, build, run) -> None:
    """`run(build())` without the cache, with it empty and with it filled (a restart) gives the
    same result, and the restart traces none of what the first start wrote."""
    def built(cache):
        program_cache.use(cache)
        try:
            return build()
        finally:
            program_cache.use(None)

    want = run(built(None))
    first = ProgramCache(str(tmp_path), {"test": "restart"})
    np.testing.assert_array_equal(run(built(first)), want)
    restart = ProgramCache(str(tmp_path), {"test": "restart"})
    np.testing.assert_array_equal(run(built(restart)), want)
    assert first.stats["exported"] > 0 and first.stats["loaded"] == 0
    assert restart.stats == {"loaded": first.stats["exported"], "exported": 0}


@pytest.mark.parametrize("family, stage", [("qwen2_5_omni", "token2wav"), ("qwen3_omni", "code2wav")])
def test_a_vocoder_restarted_reads_its_programs_and_speaks_the_same(tmp_path, request, family, stage):
    """A vocoder stage's programs come from the cache: the same waveform from each start (the
    streamed ones are the same kind of program, the async chunk pipelines' starts read them)."""
    from omni_jax import SamplingParams
    from omni_jax.config import load_pipeline_config
    from omni_jax.engine.oneshot_engine import OneShotRequestData
    from omni_jax.engine.protocol import Request
    from omni_jax.runtime.stage_loop import build_stage_engine

    ckpt = request.getfixturevalue("converted_thinker_fp32" if family == "qwen2_5_omni" else "converted_qwen3_fp32")
    # One bucket of each kind (whole requests only): three starts' compiles stay short.
    small = dict(max_num_seqs=1, decode_buckets=[1], token_buckets=[64], max_num_batched_tokens=64, max_model_len=64)
    pipeline = load_pipeline_config(f"{family}_tiny")
    name = next(s.name for s in pipeline.stages if s.model_stage == stage)
    config = next(s for s in pipeline.with_overrides(**{name: small}).stages if s.name == name)

    def speak(engine):
        synth = engine.synthesizer
        groups = getattr(synth, "num_quantizers", 1)  # Qwen3's code groups per frame, frame-major
        codes = np.random.default_rng(0).integers(0, 8, 30 * groups).tolist()
        return synth([Request("r", codes, SamplingParams(seed=0), data=OneShotRequestData())])[0]

    _restarts_agree(tmp_path, lambda: build_stage_engine(family, config, ckpt, async_chunk=False), speak)


def test_a_cache_that_cannot_be_written_costs_a_trace_not_the_program(tmp_path, caplog):
    blocked = tmp_path / "a-file-where-the-directory-would-go"
    blocked.write_text("")
    cache = ProgramCache(str(blocked), {"stage": "a"})
    with caplog.at_level(logging.WARNING, logger="omni_jax.program_cache"):
        out = _programs(cache)(*_args(), scale=2.0)
        assert cache.fact("probe", lambda: {"read": [1, 2]}, shapes=[1]) == {"read": [1, 2]}
    np.testing.assert_array_equal(out[0][0], _fn(*_args(), scale=2.0)[0][0])
    assert "traced without the program cache" in caplog.text and "not written" in caplog.text


def test_scopes_unused_for_weeks_are_removed_when_a_stage_starts(tmp_path):
    """Every code version leaves a scope directory: a start removes those no start has used in
    PRUNE_AFTER_DAYS, renews its own, and leaves what the cache did not name alone."""
    days = 86400.0

    def scope(name, age_days):
        path = tmp_path / name
        path.mkdir()
        (path / "step-0.exported").write_bytes(b"x")
        os.utime(path, (time.time() - age_days * days,) * 2)
        return path

    current = ProgramCache(str(tmp_path), {"stage": "a"})
    mine = scope(os.path.basename(current.dir), program_cache.PRUNE_AFTER_DAYS + 5)  # the scope this start uses
    stale = scope("0123456789abcdef0123456789abcdef", program_cache.PRUNE_AFTER_DAYS + 1)
    recent = scope("fedcba9876543210fedcba9876543210", program_cache.PRUNE_AFTER_DAYS - 1)
    foreign = scope("my-notes", 400)
    try:
        cache = program_cache.activate(str(tmp_path), {"stage": "a"})
        assert cache.dir == str(mine) and program_cache.active() is cache
    finally:
        program_cache.use(None)
    assert not stale.exists()
    assert mine.exists() and time.time() - mine.stat().st_mtime < days  # renewed: a start used it
    assert recent.exists() and foreign.exists()
    assert program_cache.prune(str(tmp_path / "absent")) == []
