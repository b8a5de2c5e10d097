"""Async chunk, thinker -> talker, in one process: the talker starts while the thinker writes,
takes the thinker's later rows as they come, and produces exactly the codes it produces from
the whole thinker output; a talker request waiting for its next row never holds up others.

The driver below does what a talker stage process does (runtime/stage_loop.py) with the
thinker's per-step outputs: collect them, build the request once `stage_input` can, then
pass `more_input` to `extend_request`.
"""

from __future__ import annotations

import dataclasses

import msgspec.structs
import numpy as np
import pytest

import hf_tiny_qwen3 as tiny
from omni_jax.engine.protocol import AddRequest, StageData, StageInputs
from omni_jax.engine.runner import RunnerConfig
from omni_jax.engine.sampling_params import SamplingParams
from omni_jax.models.handoff import UpstreamOutputs, reply_rows
from omni_jax.runtime.stage_loop import _input_units, to_engine_request

pytestmark = pytest.mark.engine

THINKER = SamplingParams(temperature=0.0, max_tokens=9)
TALKER = SamplingParams(temperature=0.0, repetition_penalty=1.05, max_tokens=24)


def _stage_data(o) -> StageData:
    return StageData(request_id=o.request_id, token_ids=o.new_token_ids, hidden_states=o.hidden_states,
                     hidden_offset=o.hidden_offset, finished=o.finished, finish_reason=o.finish_reason)


def run_thinker(thinker, prompts: dict[str, np.ndarray], params=THINKER) -> list[list[StageData]]:
    """The thinker's outputs, step by step, as the talker stage would receive them."""
    for rid, ids in prompts.items():
        thinker.add_request(rid, ids, params, inputs=StageInputs(capture_hidden=True))
    steps = []
    while thinker.has_unfinished():
        steps.append([_stage_data(o) for o in thinker.step()])
    return steps


def stream_into_talker(talker, handoff, controls: dict[str, AddRequest], thinker_steps, others=(), rng=None):
    """Replay the thinker's steps into the talker, two talker steps per thinker step (then to the
    end); with `rng`, 0 to 3 (a talker behind or ahead of the thinker, as stage processes run).

    Returns (talker tokens per request, thinker step at which each request started, talker
    steps in which a request of `others` (added whole at the start) made progress while a
    streamed one waited for its next row).
    """
    for msg in others:
        talker.add_request(**to_engine_request(msg))
    up = {rid: UpstreamOutputs() for rid in controls}
    have, started, tokens, overlap = {}, {}, {}, 0
    for i, step in enumerate([*thinker_steps, *([[]] * 400)]):
        for data in step:
            rid = data.request_id
            up[rid].add(data)
            if rid not in started:
                built = handoff.stage_input("talker", controls[rid], up[rid])
                if built is None:
                    continue
                talker.add_request(**to_engine_request(built, stream=True))
                started[rid], have[rid] = i, _input_units(built)
            if have.get(rid) is not None:
                more, complete = handoff.more_input("talker", controls[rid], up[rid], have[rid])
                if len(more) or complete:
                    assert talker.extend_request(rid, more, complete) or complete
                have[rid] = None if complete else have[rid] + len(more)
        if not talker.has_unfinished() and i >= len(thinker_steps):
            break
        for _ in range(2 if rng is None else rng.integers(0, 4)):  # a faster talker catches up and waits
            waiting = talker.scheduler.make_stats()["num_waiting_for_chunk"] > 0
            for o in talker.step() if talker.has_unfinished() else ():
                assert o.error is None, o.error
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                overlap += waiting and o.request_id in {m.request_id for m in others} and bool(o.new_token_ids)
    assert not talker.scheduler.has_unfinished_requests()
    assert talker.scheduler.kv_cache_manager.is_idle_and_leak_free()
    return tokens, started, overlap


def whole_outputs(steps, rid) -> UpstreamOutputs:
    up = UpstreamOutputs()
    for step in steps:
        for d in step:
            if d.request_id == rid:
                up.add(d)
    return up


def run_whole(talker, msgs: list[AddRequest]) -> dict[str, list[int]]:
    for m in msgs:
        talker.add_request(**to_engine_request(m))
    out = {}
    while talker.has_unfinished():
        for o in talker.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def _check_streaming(thinker, talker, handoff, prompts, controls, start_token: int = 2):
    """`start_token`: the thinker output (1st, 2nd) with which the talker request starts."""
    steps = run_thinker(thinker, prompts)
    whole = {rid: handoff.stage_input("talker", controls[rid], whole_outputs(steps, rid)) for rid in prompts}
    ref = run_whole(talker, list(whole.values()))
    # Another talker request (the first prompt's, under a new id) runs whole beside the streamed ones.
    other = AddRequest(request_id="other", prompt_token_ids=whole["a"].prompt_token_ids,
                       sampling_params=whole["a"].sampling_params, inputs=whole["a"].inputs)
    got, started, overlap = stream_into_talker(talker, handoff, controls, steps, others=[other])
    finish_step = {d.request_id: i for i, s in enumerate(steps) for d in s if d.finished}
    for rid in prompts:
        assert got[rid] == ref[rid], rid
        assert started[rid] < finish_step[rid], f"{rid}: the talker started only after the thinker finished"
        with_tokens = [i for i, step in enumerate(steps) for d in step if d.request_id == rid and d.token_ids]
        assert started[rid] == with_tokens[start_token - 1], (rid, started[rid], with_tokens[:3])
    assert got["other"] == ref["a"]
    assert overlap > 0, "the whole talker request should progress while a streamed one waits"
    # Whatever the timing, the same codes: e.g. the thinker's finish coming after all the rows
    # were sent (it once ended the stage process in the tensor-parallel pipeline test).
    for seed in range(4):
        got, _, _ = stream_into_talker(talker, handoff, controls, steps, rng=np.random.default_rng(seed))
        assert {rid: got[rid] for rid in prompts} == {rid: ref[rid] for rid in prompts}, seed


def test_qwen2_5_streamed_talker_equals_whole(converted_thinker_fp32):
    from omni_jax.models.qwen2_5_omni.pipeline import load_handoff
    from omni_jax.models.qwen2_5_omni.stages import build_talker_engine, build_thinker_engine

    runner = RunnerConfig(num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256,
                          token_buckets=(32,), decode_buckets=(4,), capture_layers=(0, 3))
    thinker = build_thinker_engine(converted_thinker_fp32, runner, warmup=False)
    talker = build_talker_engine(converted_thinker_fp32, runner, warmup=False)
    handoff = load_handoff(converted_thinker_fp32)
    rng = np.random.default_rng(5)
    prompts = {"a": rng.integers(0, 151000, 21), "b": rng.integers(0, 151000, 9)}
    controls = {rid: AddRequest(request_id=rid, prompt_token_ids=ids.astype(np.int32), sampling_params=TALKER,
                                voice="Ethan") for rid, ids in prompts.items()}
    _check_streaming(thinker, talker, handoff, prompts, controls)


def test_qwen3_streamed_talker_equals_whole(converted_qwen3_fp32):
    from omni_jax.models.qwen3_omni.pipeline import load_handoff
    from omni_jax.models.qwen3_omni.stages import build_talker_engine, build_thinker_engine

    runner = RunnerConfig(num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
                          token_buckets=(64,), decode_buckets=(4,), capture_layers=(0, 2))
    thinker = build_thinker_engine(converted_qwen3_fp32, runner, progress=False)
    talker = build_talker_engine(converted_qwen3_fp32, dataclasses.replace(runner, capture_layers=()), progress=False)
    handoff = load_handoff(converted_qwen3_fp32)
    prompts = {"a": np.array(tiny.text_prompt_ids((9707, 11, 1879, 0)), np.int32),
               "b": np.array(tiny.text_prompt_ids((40, 1079, 264)), np.int32)}
    controls = {rid: AddRequest(request_id=rid, prompt_token_ids=ids, sampling_params=TALKER, voice="ethan")
                for rid, ids in prompts.items()}
    # Its rows are the reply's input embeddings, sent with each sampled token: it starts with the first.
    _check_streaming(thinker, talker, handoff, prompts, controls, start_token=1)

    # A finish that brings no row (all were sent) completes the request as the whole path does;
    # its empty rows are in the thinker's width, not the talker's (it used to fail the stage).
    control = msgspec.structs.replace(controls["a"], request_id="c")
    up = whole_outputs(run_thinker(thinker, {"c": prompts["a"]}), "c")
    whole = handoff.stage_input("talker", control, up)
    ref = run_whole(talker, [whole])["c"]
    empty, complete = handoff.more_input("talker", control, up, _input_units(whole))
    assert empty.shape[0] == 0 and complete and empty.shape[1] != talker.runner.hidden_size
    talker.add_request(**to_engine_request(whole, stream=True))
    assert talker.extend_request("c", empty, complete=True)
    got = []
    while talker.has_unfinished():
        for o in talker.step():
            assert o.error is None, o.error
            got.extend(o.new_token_ids)
    assert got == ref
    assert talker.scheduler.kv_cache_manager.is_idle_and_leak_free()


def test_qwen3_codec_frames_follow_the_talker_without_lag(converted_qwen3_fp32):
    """While the talker runs, each token with its residual codes is a frame as it arrives; its
    finish (with the last token, which is no frame) completes the same codes as the whole path."""
    from omni_jax.models.qwen3_omni.pipeline import load_handoff

    handoff = load_handoff(converted_qwen3_fp32)
    q = handoff.talker.num_code_groups
    rng = np.random.default_rng(8)
    tokens, codes = rng.integers(0, 100, 6), rng.integers(0, 100, (6, q - 1))
    up, have, pieces = UpstreamOutputs(), 0, []
    for k in range(6):
        last = k == 5
        up.add(StageData(request_id="r", token_ids=[int(tokens[k])], codes=codes[k:k + 1], finished=last,
                         finish_reason="length" if last else None))
        piece, complete = handoff.codec_frames(up, have)
        assert len(piece) == (0 if last else q) and complete == last
        have += len(piece)
        pieces.append(piece)
    whole, _ = handoff.codec_frames(UpstreamOutputs.complete(tokens.tolist(), codes=[codes]), 0)
    assert len(whole) == 5 * q
    np.testing.assert_array_equal(np.concatenate(pieces), whole)


@pytest.mark.parametrize("tokens, finished, expect", [
    ([5, 6, 7, 8], False, (2, False)),   # row j is final once token j + 2 exists
    ([5], False, (0, False)),
    ([5, 6, 9], False, (1, True)),       # an eos ends the reply even before the finish arrives
    ([5, 6, 7], True, (1, True)),        # the last token is never fed back
    ([9], True, (0, True)),
    ([5, 9, 7, 8], True, (0, True)),     # nothing after the first eos is spoken
])
def test_reply_rows_rule(tokens, finished, expect):
    assert reply_rows(tokens, finished, [9]) == expect


@pytest.mark.parametrize("tokens, finished, expect", [
    ([5, 6, 7, 8], False, (3, False)),   # rows sent with their token: row j final with token j + 1
    ([5], False, (0, False)),
    ([5, 6], False, (1, False)),
    ([5, 6, 9], False, (1, True)),       # the same end rules as above
    ([5, 6, 7], True, (1, True)),        # the finish says token 2 was the last: its row is not spoken
    ([5, 9, 7, 8], True, (0, True)),
])
def test_reply_rows_rule_with_rows_sent_at_sampling(tokens, finished, expect):
    assert reply_rows(tokens, finished, [9], rows_at_sampling=True) == expect
    # What a running thinker declared final stays so: its finish comes with one more token at
    # least (an output finishing the request carries its last token), and the whole request
    # then has at least as many rows.
    n, _ = reply_rows(tokens, False, [9], rows_at_sampling=True)
    for more in ([4], [4, 3]):
        assert reply_rows(tokens + more, True, [9])[0] >= n


def test_qwen2_5_reply_begun_in_the_prompt_is_spoken(converted_thinker_fp32):
    """A prompt ending inside the assistant turn (the speech endpoint's text to say): the talker
    request equals the one for the same tokens generated by the thinker, rows by position being
    the same, whole and streamed; it used to speak only what the thinker added."""
    from omni_jax.models.qwen2_5_omni.pipeline import load_handoff

    turn = (151644, 77091, 198)
    handoff = dataclasses.replace(load_handoff(converted_thinker_fp32), assistant_turn=turn)
    rng = np.random.default_rng(3)
    head = [*rng.integers(0, 150000, 7).tolist(), *turn]
    said, more = rng.integers(0, 150000, 5).tolist(), [11, 12, 13]
    layers = handoff.hidden_layers
    total = len(head) + len(said) + len(more)
    width = handoff.voices.row("text_eos_embed").shape[-1]
    rows = {layer: [(0, rng.standard_normal((total, width)).astype(np.float32))] for layer in layers}
    control = AddRequest(request_id="r", prompt_token_ids=np.array(head, np.int32), sampling_params=TALKER,
                         voice="Ethan")
    begun = msgspec.structs.replace(control, prompt_token_ids=np.array(head + said, np.int32))

    def request(ctrl, generated, finished):
        up = UpstreamOutputs.complete(generated, rows)
        up.finished = finished
        req = handoff.stage_input("talker", ctrl, up)
        return req, up

    for n_more, finished in ((len(more), True), (1, False), (2, False)):
        want, up_want = request(control, said + more[:n_more], finished)
        got, up_got = request(begun, more[:n_more], finished)
        np.testing.assert_array_equal(got.prompt_token_ids, want.prompt_token_ids)
        np.testing.assert_array_equal(got.inputs.overlay_rows, want.inputs.overlay_rows)
        np.testing.assert_array_equal(got.inputs.overlay_index, want.inputs.overlay_index)
        np.testing.assert_array_equal(got.inputs.extra_embeds, want.inputs.extra_embeds)
        for have in range(len(want.inputs.extra_embeds) + 1):
            tail_want, done_want = handoff.more_input("talker", control, up_want, have)
            tail_got, done_got = handoff.more_input("talker", begun, up_got, have)
            np.testing.assert_array_equal(tail_got, tail_want)
            assert done_got == done_want == finished
    # The begun reply's rows are all spoken: 1 in the prompt, then said[1:] and more[:-1], then text end.
    assert len(request(begun, more, True)[0].inputs.extra_embeds) == len(said) + len(more) - 2 + 1
    # Without a begun reply (prompt ends at the turn start, or no turn, or media in it) nothing changes.
    for prompt in (head, head[:-3], head + [handoff.media_token_ids[0]] + said):
        ctrl = msgspec.structs.replace(control, prompt_token_ids=np.array(prompt, np.int32))
        req = handoff.stage_input("talker", ctrl, UpstreamOutputs.complete(more, rows))
        assert len(req.prompt_token_ids) == len(prompt) + 2
