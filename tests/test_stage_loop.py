"""A stage process's loop (runtime/stage_loop.py), run in this process on real engines: what one
request's failure leaves to the others. Its sockets are left out (no inbox: replies go to a list).
"""

from __future__ import annotations

import dataclasses

import msgspec.structs
import numpy as np
import pytest

import hf_tiny_qwen3 as tiny
from omni_jax.config.stage import StageConfig
from omni_jax.engine.protocol import AddRequest, StageFailure, StageOutputs
from omni_jax.engine.runner import RunnerConfig
from omni_jax.runtime.stage_loop import StageServer
from test_async_chunk import TALKER, THINKER, run_thinker, run_whole, whole_outputs

pytestmark = pytest.mark.engine


class _Outbox:
    def __init__(self):
        self.sent = []

    def send(self, msg):
        self.sent.append(msg)


class _FailingHandoff:
    """The family's handoff, failing one request's later input: raising, or giving rows the
    talker cannot take."""

    def __init__(self, handoff, bad: str, how: str):
        self.handoff, self.bad, self.how = handoff, bad, how

    def stage_input(self, *args):
        return self.handoff.stage_input(*args)

    def more_input(self, kind, control, upstream, have):
        if control.request_id == self.bad:
            if self.how == "raises":
                raise ValueError("made to fail")
            return np.ones((1, 7), np.float32), False
        return self.handoff.more_input(kind, control, upstream, have)


@pytest.mark.parametrize("how", ["raises", "bad rows"])
def test_stage_loop_fails_only_the_request_whose_input_fails(converted_qwen3_fp32, how):
    """A streamed talker request whose later input cannot be built, or cannot be taken, fails
    alone, named, with its blocks back; the other streamed request speaks as the whole path does
    (a stage process's loop, in this process: runtime/stage_loop.py). Rows the engine could not
    take used to end the stage process."""
    from omni_jax.models.qwen3_omni.pipeline import load_handoff
    from omni_jax.models.qwen3_omni.stages import build_talker_engine, build_thinker_engine

    runner = RunnerConfig(num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
                          token_buckets=(64,), decode_buckets=(4,), capture_layers=(0, 2))
    thinker = build_thinker_engine(converted_qwen3_fp32, runner, progress=False)
    talker = build_talker_engine(converted_qwen3_fp32, dataclasses.replace(runner, capture_layers=()), progress=False)
    handoff = load_handoff(converted_qwen3_fp32)
    ids = np.array(tiny.text_prompt_ids((9707, 11, 1879, 0)), np.int32)
    steps = run_thinker(thinker, {"good": ids, "bad": ids})
    control = AddRequest(request_id="good", prompt_token_ids=ids, sampling_params=TALKER, voice="ethan",
                         inputs_from="thinker", async_chunk=True)
    ref = run_whole(talker, [handoff.stage_input("talker", control, whole_outputs(steps, "good"))])["good"]

    outbox = _Outbox()
    server = StageServer(StageConfig(name="talker"), talker, "qwen3_omni", converted_qwen3_fp32, ipc_dir="",
                         ctx=None, inbox=None, outbox=outbox)
    server._handoff = _FailingHandoff(handoff, "bad", how)
    for rid in ("good", "bad"):
        server._on_request(msgspec.structs.replace(control, request_id=rid))
    for step in steps:
        for data in step:
            server._on_data(data)
        server._step()
    while talker.has_unfinished():
        server._step()
    failures = [m for m in outbox.sent if isinstance(m, StageFailure)]
    assert [f.request_id for f in failures] == ["bad"]
    assert failures[0].message.startswith("building the 'talker' input failed: ")
    assert failures[0].message.endswith("ValueError: made to fail" if how == "raises" else
                                        "extra_embeds to project (extra_proj) must be rows of the thinker's "
                                        "width 64, got [(1, 7)]")
    got = [t for m in outbox.sent if isinstance(m, StageOutputs) for o in m.outputs if o.request_id == "good"
           for t in o.new_token_ids]
    assert got == ref
    assert not server.streamed and not server.upstream
    assert talker.scheduler.kv_cache_manager.is_idle_and_leak_free()


def test_stage_loop_fails_only_the_request_it_cannot_add(converted_qwen3_fp32, caplog):
    """An unexpected error while adding one request (a bug its input meets) fails that request,
    named, and logged with its traceback; the stage goes on with the next (it used to end the
    stage process, losing every request in it)."""
    from omni_jax.models.qwen3_omni.stages import build_thinker_engine

    runner = RunnerConfig(num_blocks=16, block_size=16, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64,
                          token_buckets=(32,), decode_buckets=(2,))
    thinker = build_thinker_engine(converted_qwen3_fp32, runner, progress=False)
    add = thinker.add_request

    def add_request(request_id, *args, **kw):
        if request_id == "bad":
            raise TypeError("made to fail")
        return add(request_id, *args, **kw)

    thinker.add_request = add_request
    outbox = _Outbox()
    server = StageServer(StageConfig(name="thinker"), thinker, "qwen3_omni", converted_qwen3_fp32, ipc_dir="",
                         ctx=None, inbox=None, outbox=outbox)
    ids = np.array(tiny.text_prompt_ids((9707, 11)), np.int32)
    for rid in ("bad", "good"):
        server._on_request(AddRequest(request_id=rid, prompt_token_ids=ids, sampling_params=THINKER))
    while thinker.has_unfinished():
        server._step()
    failures = [(m.request_id, m.message) for m in outbox.sent if isinstance(m, StageFailure)]
    assert failures == [("bad", "adding the request to stage 'thinker' failed: TypeError: made to fail")]
    assert "made to fail" in caplog.text and "Traceback" in caplog.text
    done = [o for m in outbox.sent if isinstance(m, StageOutputs) for o in m.outputs if o.finished]
    assert [(o.request_id, o.finish_reason) for o in done] == [("good", "length")]
    assert thinker.scheduler.kv_cache_manager.is_idle_and_leak_free()
