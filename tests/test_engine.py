"""The in-process AR engine on the tiny thinker, against transformers `generate`.

One engine serves the whole module: a KV pool small enough to force preemption, a
token budget small enough to force chunked prefill, and prefix caching on.
"""

from __future__ import annotations

import numpy as np
import pytest

import hf_tiny
from omni_jax.errors import RequestError, TooLongError, error_code
from omni_jax.engine.runner import RunnerConfig
from omni_jax.engine.sampling_params import SamplingParams
from omni_jax.models.qwen2_5_omni.audio_encoder import audio_output_lengths
from omni_jax.engine.protocol import MultiModalPayload, StageInputs
from omni_jax.models.thinker_media import MediaBuckets
from omni_jax.models.qwen2_5_omni.stages import build_thinker_engine

pytestmark = pytest.mark.engine

MAX_TOKENS = 8


def _build_engine(ckpt):
    runner = RunnerConfig(num_blocks=16, block_size=16, max_num_seqs=8, max_num_batched_tokens=32,
                          max_model_len=192)
    return build_thinker_engine(ckpt, runner, media_buckets=MediaBuckets((1, 4), (64, 256)), progress=False)


@pytest.fixture(scope="module")
def engine(converted_thinker_fp32):
    return _build_engine(converted_thinker_fp32)


@pytest.fixture(scope="module")
def engine_with_program_cache(converted_thinker_fp32, tmp_path_factory):
    """The same engine with its step programs from a program cache (as in a stage process)."""
    from omni_jax.engine import program_cache

    program_cache.activate(str(tmp_path_factory.mktemp("programs")), {"test": "engine"})
    try:
        return _build_engine(converted_thinker_fp32)
    finally:
        program_cache.use(None)


def run_all(engine, max_steps=500):
    """Step until idle; returns {request_id: (tokens, final output)}."""
    tokens, final = {}, {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                final[o.request_id] = o
    assert not engine.has_unfinished(), "engine did not finish"
    return tokens, final


def hf_greedy(model, ids, n=MAX_TOKENS, **mm):
    import torch

    with torch.no_grad():
        out = model.thinker.generate(input_ids=torch.tensor(ids)[None],
                                     attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     max_new_tokens=n, do_sample=False, **mm)
    return out[0, len(ids):].tolist()


def assert_pool_empty(engine):
    kv = engine.scheduler.kv_cache_manager
    assert kv.is_idle_and_leak_free()
    kv.check_invariants()


def audio_prompt(frames):
    n = int(audio_output_lengths(np.array([frames]))[1][0])
    t = hf_tiny
    return np.array([t.IM_START, 872, 198, t.AUDIO_START] + [t.AUDIO_TOKEN] * n + [t.AUDIO_END, 3555, t.IM_END, 198])


def image_prompt(grid):
    n = int(np.prod(grid)) // 4
    t = hf_tiny
    return np.array([t.IM_START, 872, 198, t.VISION_START] + [t.IMAGE_TOKEN] * n + [t.VISION_END, 1207, t.IM_END])


@pytest.mark.parametrize("which", ["engine", "engine_with_program_cache"])
def test_concurrent_greedy_matches_transformers(which, request, qwen2_5_omni_hf_model):
    """Also with the step programs read from a program cache: the same tokens, and no program
    compiled after warm-up (an exported program's outputs are committed: so are its inputs)."""
    import torch

    engine = request.getfixturevalue(which)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 151000, n) for n in (5, 17, 33, 40, 64, 9, 70, 3)]
    mel = hf_tiny.random_mel(75, seed=4)
    pix = rng.standard_normal((8 * 12, 1176)).astype(np.float32)
    a_ids, i_ids = audio_prompt(75), image_prompt((1, 8, 12))
    c0 = engine.num_compilations
    pre0 = engine.stats["preemptions"]
    for i, p in enumerate(prompts):
        engine.add_request(f"t{i}", p, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    engine.add_request("audio", a_ids, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                       multi_modal_data=MultiModalPayload(audio_features=[mel]))
    engine.add_request("image", i_ids, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                       multi_modal_data=MultiModalPayload(pixel_values=pix, image_grid_thw=np.array([[1, 8, 12]])))
    got, final = run_all(engine)

    assert engine.stats["preemptions"] > pre0, "the KV pool was meant to force preemption"
    assert engine.num_compilations == c0, "a step compiled after warm-up"
    hf = qwen2_5_omni_hf_model
    for i, p in enumerate(prompts):
        assert got[f"t{i}"] == hf_greedy(hf, p), f"request t{i}"
        assert final[f"t{i}"].finish_reason == "length"
    assert got["audio"] == hf_greedy(hf, a_ids, input_features=torch.tensor(mel)[None],
                                     feature_attention_mask=torch.ones(1, 75, dtype=torch.long))
    assert got["image"] == hf_greedy(hf, i_ids, pixel_values=torch.tensor(pix),
                                     image_grid_thw=torch.tensor([[1, 8, 12]]))
    assert_pool_empty(engine)


def test_decodes_and_a_prefill_chunk_run_as_one_device_call(engine, qwen2_5_omni_hf_model):
    """A step mixing decodes with a prompt chunk is one call of the step program (the decodes
    through the decode kernel inside it); every request still decodes as transformers does."""
    rng = np.random.default_rng(7)
    early = {f"early{i}": rng.integers(0, 151000, n) for i, n in enumerate((6, 11))}
    late = rng.integers(0, 151000, 50)  # longer than the 32-token budget: chunked next to decodes
    calls, run = [], engine.runner.jitted.step
    # Each call's layout and integer inputs (a copy: the buffer is written again by the next step).
    engine.runner.jitted.step = lambda *a, **k: calls.append(k["layout"].views(np.array(a[3]))) or run(*a, **k)
    try:
        for rid, ids in early.items():
            engine.add_request(rid, ids, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
        tokens, steps = {}, engine.stats["steps"]
        while engine.has_unfinished():
            for o in engine.step():
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if "late" not in tokens and engine.stats["steps"] == steps + 1:
                engine.add_request("late", late, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
                tokens["late"] = []
    finally:
        engine.runner.jitted.step = run
    # Async scheduling may launch a step ahead of the one it finishes: count the finished ones.
    assert len(calls) == engine.stats["steps"] - steps
    assert sum(len(v.kv_lens) == engine.runner.cfg.max_num_seqs and int(v.num_decodes) > 0
               for v in calls) >= 2  # mixed steps: prefill layouts with decodes
    for rid, ids in {**early, "late": late}.items():
        assert tokens[rid] == hf_greedy(qwen2_5_omni_hf_model, ids), rid
    assert engine.stats["decode_steps"] + engine.stats["prefill_steps"] == engine.stats["steps"]
    assert_pool_empty(engine)


def test_decode_packing_equals_the_general_packing(engine):
    """The decode step's own packing (whole-array, rows kept from the last decode step) gives
    every token the id, positions, KV slot, KV length and logits row the general packer gives."""
    from omni_jax.engine.protocol import Request, StageInputs
    from omni_jax.engine.runner import ScheduledChunk

    runner = engine.runner
    mrope = np.stack([np.arange(9), np.arange(9) // 2, np.arange(9) + 5])
    reqs = [Request("plain", np.arange(5) + 10),
            Request("delta", np.arange(7) + 20, data=StageInputs(mrope_delta=-3)),
            Request("prompt", np.arange(9) + 30, data=StageInputs(mrope_positions=mrope, mrope_delta=4))]
    for r, n in zip(reqs, (12, 3, 0)):
        r.append_output_token_ids(list(range(40, 40 + n)))
    tables = np.array([[3, 5, 0, 0], [7, 0, 0, 0], [2, 0, 0, 0]], np.int32)
    for step in range(3):  # again with the same requests: rows kept from the step before
        # The last request's chunk is one prompt token (8, then 9...: positions from the prompt's M-RoPE rows).
        chunks = [ScheduledChunk(r, r.num_tokens - 1 if i < 2 else 6 + step, 1, needs_logits=i != 1)
                  for i, r in enumerate(reqs)]
        decode_step = runner.prepare(chunks, tables, num_decodes=len(chunks))
        general_step = runner.prepare(chunks, tables, num_decodes=0)
        assert decode_step.kind == "decode" and general_step.kind == "prefill"
        decode, general = decode_step.views, general_step.views
        n = len(chunks)
        for key in ("token_ids", "slot_mapping", "kv_lens"):
            np.testing.assert_array_equal(getattr(decode, key)[:n], getattr(general, key)[:n], key)
        np.testing.assert_array_equal(decode.positions[:, :n], general.positions[:, :n])
        np.testing.assert_array_equal(decode.block_tables[:n], general.block_tables[:n])
        assert decode_step.sample_rows == general_step.sample_rows == [0, 2]
        np.testing.assert_array_equal(decode.logits_indices[:2], general.logits_indices[:2])
        assert int(general.num_decodes) == 0 and list(decode.cu_q_lens[:n + 1]) == list(range(n + 1))
        # Padding rows write to the dummy block and read nothing.
        assert (decode.slot_mapping[n:] // runner.cfg.block_size == 0).all()
        assert not decode.kv_lens[n:].any()
        for r in reqs[:2]:
            r.append_output_token_ids([50 + step])


def test_prefix_cache_hits_and_same_tokens(engine, qwen2_5_omni_hf_model):
    prompt = np.random.default_rng(5).integers(0, 151000, 60)
    engine.add_request("first", prompt, SamplingParams(temperature=0.0, max_tokens=4))
    first, _ = run_all(engine)
    hits0 = engine.scheduler.kv_cache_manager.prefix_cache_stats.hits
    engine.add_request("again", prompt, SamplingParams(temperature=0.0, max_tokens=4))
    again, final = run_all(engine)
    assert engine.scheduler.kv_cache_manager.prefix_cache_stats.hits - hits0 >= 48
    assert final["again"].num_cached_tokens >= 48
    assert again["again"] == first["first"] == hf_greedy(qwen2_5_omni_hf_model, prompt, 4)
    assert_pool_empty(engine)


def test_same_media_tokens_different_image_do_not_share_cache(engine):
    rng = np.random.default_rng(6)
    ids = image_prompt((1, 8, 8))
    grid = np.array([[1, 8, 8]])
    outs = {}
    for name in ("img_a", "img_b"):
        pix = rng.standard_normal((64, 1176)).astype(np.float32)
        hits0 = engine.scheduler.kv_cache_manager.prefix_cache_stats.hits
        engine.add_request(name, ids, SamplingParams(temperature=0.0, max_tokens=3),
                           multi_modal_data=MultiModalPayload(pixel_values=pix, image_grid_thw=grid))
        toks, _ = run_all(engine)
        outs[name] = toks[name]
        # Only the block before the first placeholder (if full) may be shared.
        assert engine.scheduler.kv_cache_manager.prefix_cache_stats.hits - hits0 <= 16
    assert_pool_empty(engine)


def test_seeded_sampling_alone_and_in_batch(engine):
    prompt = np.arange(100, 120)
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=1234, max_tokens=6)
    engine.add_request("alone", prompt, params)
    alone, _ = run_all(engine)
    rng = np.random.default_rng(7)
    for i in range(5):
        engine.add_request(f"noise{i}", rng.integers(0, 151000, 10 + 7 * i),
                           SamplingParams(temperature=1.0, seed=i, max_tokens=6))
    engine.add_request("batched", prompt, params)
    batched, _ = run_all(engine)
    assert alone["alone"] == batched["batched"]
    assert_pool_empty(engine)


def test_abort_frees_blocks(engine):
    rng = np.random.default_rng(8)
    for i in range(3):
        engine.add_request(f"ab{i}", rng.integers(0, 151000, 50), SamplingParams(temperature=0.0, max_tokens=50))
    engine.step()
    engine.abort("ab0")  # mid-prefill or decoding
    engine.step()
    engine.abort("ab1")
    engine.abort("ab2")
    _, final = run_all(engine)
    assert_pool_empty(engine)


@pytest.mark.parametrize("prompt, params, match, code", [
    ([], SamplingParams(), "empty prompt", "invalid_request"),
    (list(range(1, 200)), SamplingParams(), "max_model_len", "context_length_exceeded"),
    ([5, 152064], SamplingParams(), "out of range", "invalid_request"),
    ([5, -1], SamplingParams(), "out of range", "invalid_request"),
    ([5, 6], SamplingParams(stop_token_ids=[999999]), "stop_token_ids|vocab", "invalid_request"),
])
def test_bad_requests_fail_clearly_others_finish(engine, prompt, params, match, code):
    engine.add_request("good", [11, 12, 13], SamplingParams(temperature=0.0, max_tokens=3))
    with pytest.raises(RequestError, match=match) as refused:
        engine.add_request("bad", prompt, params)
    assert error_code(refused.value) == code  # what the stage sends with its refusal
    toks, final = run_all(engine)
    assert set(final) == {"good"} and len(toks["good"]) == 3
    assert_pool_empty(engine)


@pytest.mark.parametrize("make, match", [
    (lambda h: StageInputs(overlay_rows=np.zeros((3, h + 1), np.float32), overlay_index=np.arange(3, dtype=np.int32)),
     r"overlay rows must be \[N, {h}\], got \(3, {h1}\)"),
    (lambda h: StageInputs(overlay_rows=np.zeros((3, h), np.float32), overlay_index=np.array([0, 1, 3], np.int32)),
     "overlay_index must give each of the 3 prompt tokens a row below 3"),
    (lambda h: StageInputs(extra_embeds=np.zeros((2, h + 1), np.float32), extra_embeds_pad=np.zeros(h, np.float32)),
     r"extra_embeds must be \[N, {h}\], got \(2, {h1}\)"),
    (lambda h: StageInputs(extra_embeds=np.zeros((2, h), np.float32), extra_embeds_pad=np.zeros((1, h), np.float32)),
     r"extra_embeds_pad must be \[{h}\], got \(1, {h}\)"),
])
def test_embedding_rows_that_do_not_fit_fail_only_that_request(engine, make, match):
    """Rows of the wrong width would fail the whole step they land in (every request in it):
    the request is refused at once, naming them."""
    h = engine.runner.hidden_size
    engine.add_request("good", [11, 12, 13], SamplingParams(temperature=0.0, max_tokens=3))
    with pytest.raises(RequestError, match=match.format(h=h, h1=h + 1)):
        engine.add_request("bad", [21, 22, 23], SamplingParams(max_tokens=2), inputs=make(h))
    toks, final = run_all(engine)
    assert set(final) == {"good"} and len(toks["good"]) == 3
    assert_pool_empty(engine)


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(top_k=-5), "top_k"),
])
def test_invalid_sampling_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_media_fails_only_that_request(engine, monkeypatch):
    engine.add_request("ok", [11, 12, 13, 14], SamplingParams(temperature=0.0, max_tokens=2))
    with pytest.raises(RequestError, match="placeholder"):
        engine.add_request("mismatch", image_prompt((1, 8, 8)), SamplingParams(),
                           multi_modal_data=MultiModalPayload(pixel_values=np.zeros((16, 1176), np.float32),
                                                           image_grid_thw=np.array([[1, 4, 4]])))
    # Audio past the context is refused before it is encoded (longer audio than the largest
    # bucket would take several encoder calls: test_long_media.py).
    calls = []
    monkeypatch.setattr(engine.media_encoder, "_encode_audio_call", lambda *a: calls.append(a))
    with pytest.raises(TooLongError, match="prompt of 1008 tokens leaves no room to generate"):
        engine.add_request("long", audio_prompt(4000), SamplingParams(),
                           multi_modal_data=MultiModalPayload(audio_features=[np.zeros((128, 4000), np.float32)]))
    assert calls == []
    toks, final = run_all(engine)
    assert set(final) == {"ok"}
    assert_pool_empty(engine)


def test_async_scheduling_same_outputs_as_sync(engine):
    """The next decode step launched before this one's tokens reach the host (the default)
    gives exactly the synchronous engine's outputs: lengths, stop ids, min_tokens, seeded
    sampling, penalties and logprobs. An abort while such a step is in flight (the path a stop string
    takes too) changes nothing else and leaks nothing."""
    import dataclasses

    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 151000, n) for n in (4, 9, 15, 6, 11, 7)]

    def run(async_scheduling, params, abort=None):
        engine.cfg = dataclasses.replace(engine.cfg, async_scheduling=async_scheduling)
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                engine.add_request(f"as{i}", p, sp)
            before = engine.stats["ahead_steps"]
            tokens, final, texts = {}, {}, {}
            for step in range(500):
                if not engine.has_unfinished():
                    break
                if abort and engine.stats["ahead_steps"] > before + 2 and abort not in final:
                    assert engine.abort(abort)  # the step launched last was scheduled ahead
                    final[abort] = None
                for o in engine.step():
                    tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                    texts[o.request_id] = texts.get(o.request_id, "") + o.text_delta
                    if o.finished:
                        final[o.request_id] = o
            assert_pool_empty(engine)
            return tokens, final, texts, engine.stats["ahead_steps"] - before
        finally:
            engine.cfg = dataclasses.replace(engine.cfg, async_scheduling=True)

    plain = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (3, 6, 9, 12, 14, 16)]
    ref, _, _, _ = run(False, plain)
    params = [
        plain[0],
        SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[ref["as1"][3]]),
        SamplingParams(temperature=0.0, max_tokens=9, stop_token_ids=[ref["as2"][1]], min_tokens=5),
        SamplingParams(temperature=0.0, max_tokens=12, logprobs=3),
        SamplingParams(temperature=0.9, top_k=20, seed=5, max_tokens=14, logprobs=2),
        # penalties: the step goes ahead, its sampler waits for the tokens before it (_launch_deferred)
        SamplingParams(temperature=0.7, seed=9, max_tokens=16, ignore_eos=True, repetition_penalty=1.3,
                       frequency_penalty=0.5),
    ]
    sync = run(False, params)
    tokens, final, texts, ahead_steps = run(True, params)
    assert sync[3] == 0 and ahead_steps > 0
    assert tokens == sync[0] and texts == sync[2]
    for rid, o in final.items():
        s = sync[1][rid]
        assert (o.finish_reason, o.stop_reason) == (s.finish_reason, s.stop_reason), rid
        # Batches may pad to other buckets: the same tokens, logprobs equal to fp32 rounding.
        for a, b in zip(o.logprobs or [], s.logprobs or []):
            assert (a["token_id"], a["rank"], [t for t, _ in a["top"]]) == (b["token_id"], b["rank"], [t for t, _ in b["top"]])
            np.testing.assert_allclose([a["logprob"]] + [v for _, v in a["top"]],
                                       [b["logprob"]] + [v for _, v in b["top"]], atol=1e-4)
        assert (o.logprobs is None) == (s.logprobs is None)
    assert final["as1"].stop_reason == ref["as1"][3] and len(tokens["as1"]) == 4

    # An abort while a step scheduled ahead is in flight: the others are unchanged.
    tokens, final, _, ahead_steps = run(True, plain, abort="as5")
    assert final["as5"] is None and len(tokens["as5"]) < len(ref["as5"])
    assert {k: v for k, v in tokens.items() if k != "as5"} == {k: v for k, v in ref.items() if k != "as5"}


@pytest.mark.parametrize("which", ["engine", "engine_with_program_cache"])
def test_decode_steps_keep_their_buffers_in_place(which, request, qwen2_5_omni_hf_model):
    """Under async scheduling, a decode step reads its integer inputs from the buffer the step
    before of its bucket read, and writes its logits and hidden rows where that step wrote
    its own (stable_buffers.py: on a GPU, a CUDA graph whose buffers move is recorded again
    before every launch). The tokens are transformers' still. So with the step programs read
    from a program cache (their donation is the cache's jit's)."""
    import jax

    engine = request.getfixturevalue(which)
    runner = engine.runner
    seen, run = [], runner.jitted.step

    def step(*a, **k):
        released = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(a[2])]  # donated: read first
        out = run(*a, **k)
        if k["layout"].decode:
            written = [x.unsafe_buffer_pointer() for x in jax.tree.leaves((out[0], out[2], out[3]))]
            seen.append((k["layout"].tokens, a[3].unsafe_buffer_pointer(), released, written, k["layout"]))
        return out

    rng = np.random.default_rng(12)
    prompts = {f"sb{i}": rng.integers(0, 151000, n) for i, n in enumerate((5, 8, 12))}
    ahead0 = engine.stats["ahead_steps"]
    runner.jitted.step = step
    try:
        for rid, ids in prompts.items():
            engine.add_request(rid, ids, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
        tokens, _ = run_all(engine)
    finally:
        runner.jitted.step = run
    assert engine.stats["ahead_steps"] - ahead0 >= 4
    pairs = [(a, b) for a, b in zip(seen, seen[1:]) if a[0] == b[0]]  # consecutive steps, same bucket
    assert len(pairs) >= 4
    for before, after in pairs:
        assert after[1] == before[1], "the integer inputs moved"
        assert after[2] == before[3] == after[3], "the outputs moved"
        assert after[4] is before[4], "the layout (its offsets worked out once) was made again"
    for rid, ids in prompts.items():
        assert tokens[rid] == hf_greedy(qwen2_5_omni_hf_model, ids), rid
    assert_pool_empty(engine)


def test_the_step_keeps_its_temporaries_in_place_where_xla_can(engine, monkeypatch):
    """Under async scheduling other programs run between two steps and the step's temporaries
    moved, so on a GPU XLA re-recorded its CUDA graph each step: the step is compiled with
    XLA's SKIP_TEMP command-buffer mode where the jaxlib has it (not 0.10.2; 0.11.2, the GPU
    image's, and 0.12 have it), unless the user's XLA_FLAGS choose a mode."""
    import jax

    from omni_jax.engine.jitted import stable_temporaries

    version = tuple(int(p) for p in jax.__version__.split(".")[:3])
    options = stable_temporaries()
    if version < (0, 11):
        assert options == {}
    elif version >= (0, 11, 2):
        assert options == {"xla_gpu_command_buffer_update_mode": "SKIP_TEMP"}
    runner = engine.runner
    b = runner._dummy_batch("decode", runner.cfg.decode_buckets[0], False)
    lowered = runner.jitted.step.lower(runner._step_leaves, runner.kv_caches, runner._blank_decode_outputs(b.bucket),
                                       jax.numpy.asarray(b.ints), None, None, None, None,
                                       layout=b.layout, rich=False, deepstack=False)
    assert dict(lowered._lowering._compiler_options_kvs) == options
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_command_buffer_update_mode=ALWAYS_UPDATE")
    assert stable_temporaries.__wrapped__() == {}


def test_the_step_is_handed_only_the_parameters_it_reads(engine):
    """The thinker's module holds its media encoders too, which its own programs run: the step
    is handed the decoder's and the LM head's leaves only (each array handed to a jitted call
    costs host time, read or not)."""
    import jax

    from omni_jax.engine.sharding import state_path

    runner = engine.runner
    paths = [state_path(k) for k, _ in jax.tree_util.tree_flatten_with_path(runner.state)[0]]
    step = [paths[i] for i in runner._step_params]
    assert step == [p for p in paths if p.split("/")[0] in ("model", "lm_head")]
    assert any(p.startswith("audio_tower/") for p in paths) and any(p.startswith("visual/") for p in paths)
    assert all(a is runner._param_leaves[i] for a, i in zip(runner._step_leaves, runner._step_params))


def test_streamed_text_and_stop_strings(tmp_path_factory):
    """With a real tokenizer (the built-in tiny model): the text deltas add up to the decoded
    tokens, the last token's text included; a stop string cuts the text and finishes the
    request; async scheduling changes none of it."""
    import dataclasses

    from omni_jax.models.qwen2_5_omni.tiny import tiny_checkpoint

    ckpt = tiny_checkpoint(str(tmp_path_factory.mktemp("tiny") / "model"))
    eng = build_thinker_engine(ckpt, RunnerConfig(num_blocks=32, block_size=16, max_num_seqs=4,
                                                  max_num_batched_tokens=64, max_model_len=96),
                               media_buckets=MediaBuckets((1,), (64,)), progress=False)

    def run(async_scheduling, params):
        eng.cfg = dataclasses.replace(eng.cfg, async_scheduling=async_scheduling)
        for i, sp in enumerate(params):
            eng.add_request(f"t{i}", [100 + i, 200, 300, 400], sp)
        tokens, texts, final = run_all_text(eng)
        assert_pool_empty(eng)
        return tokens, texts, final

    plain = [SamplingParams(temperature=0.0, max_tokens=n) for n in (6, 9, 12)]
    tokens, texts, _ = run(False, plain)
    for rid, toks in tokens.items():
        assert texts[rid] == eng.tokenizer.decode(toks, skip_special_tokens=True), rid
    assert run(True, plain)[:2] == (tokens, texts)

    full = texts["t2"]
    stop = full[len(full) // 2:len(full) // 2 + 2]
    stopped = [plain[0], plain[1], SamplingParams(temperature=0.0, max_tokens=12, stop=[stop])]
    sync = run(False, stopped)
    tokens, texts, final = run(True, stopped)
    assert (tokens, texts) == sync[:2]
    assert final["t2"].finish_reason == "stop" and final["t2"].stop_reason == stop
    assert texts["t2"] == full[:full.find(stop)] and len(tokens["t2"]) < 12
    # Stop strings wait for min_tokens, as stop ids do.
    waited = [plain[0], plain[1], SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12, stop=[stop])]
    tokens, texts, final = run(True, waited)
    assert final["t2"].finish_reason == "length" and len(tokens["t2"]) == 12 and stop in texts["t2"]


def run_all_text(engine, max_steps=500):
    """Step until idle; returns ({rid: tokens}, {rid: text}, {rid: final output})."""
    tokens, texts, final = {}, {}, {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            texts[o.request_id] = texts.get(o.request_id, "") + o.text_delta
            if o.finished:
                final[o.request_id] = o
    assert not engine.has_unfinished(), "engine did not finish"
    return tokens, texts, final


@pytest.mark.parametrize("stops", [(), ("\n", "ab")])
def test_incremental_detokenizer_matches_whole_decode(stops):
    """The windowed detokenizer gives the text of decoding every output at once: random
    ids (split multi-byte characters, special tokens), fed one to three at a time."""
    from omni_jax.engine.incremental_detokenizer import IncrementalDetokenizer
    from omni_jax.inputs.qwen_tokenizer import build_qwen2_5_omni_tokenizer

    tok = build_qwen2_5_omni_tokenizer()
    rng = np.random.default_rng(3)
    for trial in range(40):
        ids = rng.integers(0, 151660 if trial % 4 else 152000, int(rng.integers(1, 40))).tolist()
        det = IncrementalDetokenizer(tok, stops, include_stop=True)
        out, stopped, i = "", None, 0
        while i < len(ids) and stopped is None:
            n = int(rng.integers(1, 4))
            stopped = det.update(ids[i:i + n])
            out += det.take()
            i += n
        whole = tok.decode(ids[:i], skip_special_tokens=True)
        if stopped is None:
            out += det.flush()
            assert out == whole.removesuffix("\ufffd"), (trial, ids)
        else:  # cut right after the first stop string
            assert out == whole[:whole.find(stopped) + len(stopped)], (trial, ids)


def test_a_program_from_the_persistent_cache_counts_as_a_compilation():
    """The suite shares a JAX compilation cache between processes (conftest.py): a program
    another engine compiled still shows up in `num_compilations` when a warm-up missed it."""
    import jax
    import jax.numpy as jnp

    from omni_jax.engine.runner import compilation_count

    hits = []
    jax.monitoring.register_event_listener(lambda event, **kw: hits.append(event == "/jax/compilation_cache/cache_hits"))
    f = jax.jit(lambda x: jnp.tanh(x) * 3.0 + 1.0)
    x = jnp.zeros((3, 7, 11), jnp.float32)
    f(x).block_until_ready()        # compiled, written to the persistent cache
    jax.clear_caches()
    hits.clear()
    n0 = compilation_count()
    f(x).block_until_ready()        # loaded from it
    assert any(hits), "the session's persistent compilation cache is not in use"
    assert compilation_count() > n0
    # The event of a load alone counts one.
    n1 = compilation_count()
    jax.monitoring.record_event_duration_secs("/jax/compilation_cache/cache_retrieval_time_sec", 0.01)
    assert compilation_count() == n1 + 1


def test_both_engines_provide_what_the_stage_loop_asks():
    """The stage loop drives either engine through `StageEngine` alone: each engine has every
    method of it, taking at least its positional arguments, and `num_compilations` as a property."""
    import inspect

    from omni_jax.engine.ar_engine import AREngine
    from omni_jax.engine.oneshot_engine import OneShotEngine
    from omni_jax.engine.stage_engine import StageEngine

    methods = {n: m for n, m in vars(StageEngine).items() if not n.startswith("_") and inspect.isfunction(m)}
    assert set(methods) == {"add_request", "extend_request", "abort", "has_unfinished", "step", "warmup"}
    for cls in (AREngine, OneShotEngine):
        assert isinstance(inspect.getattr_static(cls, "num_compilations"), property), cls
        for name, proto in methods.items():
            positional = [p for p in inspect.signature(proto).parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
            impl = list(inspect.signature(getattr(cls, name)).parameters.values())
            assert len(impl) >= len(positional) and all(p.kind is p.POSITIONAL_OR_KEYWORD
                                                        for p in impl[:len(positional)]), (cls.__name__, name)
