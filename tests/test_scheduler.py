"""ARScheduler / OneShotScheduler driven by a fake model over a fake paged KV cache."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import pytest

from omni_jax.engine.protocol import Request, RequestStatus, StageOutput
from omni_jax.errors import TooLongError
from omni_jax.engine.runner import compute_slot_mapping
from omni_jax.engine.scheduler import (
    ARScheduler,
    OneShotScheduler,
    SchedulerConfig,
    SchedulerOutput,
)

pytestmark = pytest.mark.engine

EOS = 2


@dataclass
class SP:
    """Local stand-in for engine.sampling_params.SamplingParams (the scheduler duck-types it)."""

    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    stop: list = field(default_factory=list)
    stop_token_ids: list = field(default_factory=list)
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    suppress_token_ids: list = field(default_factory=list)


def next_token(seed: int, pos: int, eos_every: int = 0) -> int:
    """The fake model's greedy token at position `pos` of a request: depends on nothing else,
    so batching, chunking and preemption must not change any output."""
    if eos_every and (seed + pos) % eos_every == 0:
        return EOS
    return (seed * 1_000_003 + pos * 7919) % 997 + 3


class FakeRunner:
    """Writes per-position 'KV' (a code of token id and media) through the block tables and
    checks that every position a step attends to holds the right content."""

    def __init__(self, sched: ARScheduler, eos_every: int = 0):
        self.sched = sched
        self.bs = sched.block_size
        self.kv = np.full((sched.num_blocks, self.bs), -1, dtype=np.int64)
        self.eos_every = eos_every
        self.width = -(-sched.max_model_len // self.bs)
        self.last = None  # the previous step's (output, table): tables are built as the engine does

    @staticmethod
    def content(req: Request, upto: int) -> np.ndarray:
        code = req.all_token_ids[:upto].astype(np.int64)
        for off, n, h in req.mm_hashes:
            code[off : off + n] += 1_000_000 * (1 + int(str(h).split("-")[-1]))
        if req.cache_salt is not None:
            code += 10**9 * int(req.cache_salt)
        return code

    def step(self, out: SchedulerOutput) -> dict[str, list[int]]:
        if out.is_empty:
            return {}
        table = out.block_table_array(self.width, like=self.last)
        # Rows copied from the previous step's table are exactly the rebuilt ones.
        np.testing.assert_array_equal(table, out.block_table_array(self.width))
        self.last = (out, table)
        sampled = {}
        for row, s in enumerate(out.scheduled):
            req = s.request
            if req.is_finished:  # scheduled ahead, then finished by the step before: thrown away
                sampled[s.request_id] = [0]
                continue
            assert s.num_tokens > 0
            if s.fed_by_row < 0:  # else its token was not known when it was scheduled
                assert np.array_equal(s.token_ids, req.all_token_ids[s.start : s.start + s.num_tokens])
            assert len(s.block_ids) * self.bs >= s.kv_len
            if s.is_new or s.is_resumed:
                assert s.new_block_ids == s.block_ids
            pos = np.arange(s.kv_len)
            slots = compute_slot_mapping(table, np.full(len(pos), row), pos, self.bs)
            flat = self.kv.reshape(-1)
            new = slice(s.start, s.kv_len)
            flat[slots[new]] = self.content(req, s.kv_len)[new]
            # Attention reads every position up to the chunk's end: cached prefix included.
            np.testing.assert_array_equal(flat[slots], self.content(req, s.kv_len), err_msg=s.request_id)
            if s.needs_logits:
                sampled[s.request_id] = [next_token(req.data, s.kv_len, self.eos_every)]
        self.kv[0] = -7  # padding garbage lands in the dummy block; nobody may read it
        return sampled


def expected_output(req_seed, prompt_len, sp: SP, max_len, eos_every=0, eos=(EOS,)):
    """Reference generation loop with the finish rules, independent of the scheduler."""
    toks = []
    while True:
        t = next_token(req_seed, prompt_len + len(toks), eos_every)
        toks.append(t)
        n = len(toks)
        if n >= sp.min_tokens:
            if not sp.ignore_eos and t in eos:
                return toks, "stop", None
            if t in sp.stop_token_ids:
                return toks, "stop", t
        if (sp.max_tokens is not None and n >= sp.max_tokens) or prompt_len + n >= max_len:
            return toks, "length", None


def make_sched(**kw) -> ARScheduler:
    defaults = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, block_size=4,
                    num_blocks=64, eos_token_ids=(EOS,))
    defaults.update(kw)
    return ARScheduler(SchedulerConfig(**defaults))


def new_req(rid, n_prompt, sp=None, seed=None, base=0, **kw) -> Request:
    seed = hash_seed(rid) if seed is None else seed
    prompt = (np.arange(n_prompt) * 13 + base) % 500 + 3
    return Request(rid, prompt, sp or SP(), data=seed, **kw)


def hash_seed(rid: str) -> int:
    return sum(ord(c) * 31**i for i, c in enumerate(rid)) % 10_000


def run_to_end(sched, runner, max_steps=1000, on_step=None):
    """Drive schedule -> fake model -> update until idle. Returns {rid: final output} and step outputs."""
    finals: dict[str, StageOutput] = {}
    tokens: dict[str, list[int]] = {}
    steps = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        check_step(sched, out)
        steps.append(out)
        results = sched.update_from_output(out, runner.step(out))
        sched.kv_cache_manager.check_invariants()
        for r in results:
            tokens.setdefault(r.request_id, []).extend(r.new_token_ids)
            if r.finished:
                finals[r.request_id] = r
        if on_step:
            on_step(out)
    else:
        raise AssertionError("scheduler did not drain")
    return finals, tokens, steps


def check_step(sched: ARScheduler, out: SchedulerOutput):
    assert out.total_num_scheduled_tokens == sum(s.num_tokens for s in out.scheduled)
    assert out.total_num_scheduled_tokens <= sched.max_num_batched_tokens
    assert len(out.scheduled) <= sched.max_num_seqs
    assert len(sched.running) <= sched.max_num_seqs
    assert len(set(out.request_ids)) == len(out.scheduled)
    assert all(r.status == RequestStatus.RUNNING for r in sched.running)
    assert all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in sched.waiting)
    prios = [r.priority for r in sched.running]
    assert prios == sorted(prios)
    sched.kv_cache_manager.check_invariants()
    # Ownership: a block is in two tables only if it is a cached (hashed) prefix block.
    owners = {}
    for s in out.scheduled:
        for b in s.block_ids:
            if b in owners:
                assert sched.kv_cache_manager.block_pool.blocks[b].block_hash is not None
            owners[b] = s.request_id


def assert_no_leak(sched: ARScheduler):
    kv = sched.kv_cache_manager
    kv.check_invariants()
    assert not sched.has_unfinished_requests() and sched.get_num_unfinished_requests() == 0
    assert kv.num_free_blocks == kv.num_usable_blocks == sched.num_blocks - 1
    assert kv.is_idle_and_leak_free()


# -- budget, chunked prefill, priorities -----------------------------------------------------------
def test_chunked_prefill_under_token_budget():
    sched = make_sched(max_num_batched_tokens=16)
    runner = FakeRunner(sched)
    sp = SP(max_tokens=3)
    sched.add_request(new_req("long", 50, sp))
    finals, tokens, steps = run_to_end(sched, runner)
    chunks = [(s.scheduled[0].start, s.scheduled[0].num_tokens) for s in steps]
    assert chunks == [(0, 16), (16, 16), (32, 16), (48, 2), (50, 1), (51, 1)]
    assert [s.logits_request_ids for s in steps] == [[], [], [], ["long"], ["long"], ["long"]]
    assert steps[0].scheduled[0].is_new and not steps[1].scheduled[0].is_new
    assert steps[0].scheduled[0].is_prefill and not steps[-1].scheduled[0].is_prefill
    exp, _, _ = expected_output(hash_seed("long"), 50, sp, sched.max_len)
    assert tokens["long"] == exp and finals["long"].finish_reason == "length"
    assert_no_leak(sched)


def test_long_prefill_threshold_and_no_chunking():
    sched = make_sched(max_num_batched_tokens=64, long_prefill_token_threshold=10)
    sched.add_request(new_req("a", 25, SP(max_tokens=1)))
    out = sched.schedule()
    assert out.scheduled[0].num_tokens == 10
    sched.update_from_output(out, {})
    sched.abort_request("a")
    assert_no_leak(sched)

    with pytest.raises(ValueError, match="chunked prefill"):
        make_sched(enable_chunked_prefill=False, max_num_batched_tokens=32, max_model_len=128)
    sched = make_sched(enable_chunked_prefill=False, max_num_batched_tokens=40, max_model_len=40)
    runner = FakeRunner(sched)
    sched.add_request(new_req("a", 30, SP(max_tokens=2)))
    sched.add_request(new_req("b", 20, SP(max_tokens=2), base=7))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 30}  # b does not fit whole, and is not chunked
    sched.update_from_output(out, runner.step(out))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 20}
    res = sched.update_from_output(out, runner.step(out))
    assert [(r.request_id, r.finished) for r in res] == [("a", True), ("b", False)]
    finals, _, _ = run_to_end(sched, runner)
    assert set(finals) == {"b"}
    assert_no_leak(sched)


def test_max_num_seqs():
    sched = make_sched(max_num_seqs=2, max_num_batched_tokens=100)
    runner = FakeRunner(sched)
    for i in range(5):
        sched.add_request(new_req(f"r{i}", 5, SP(max_tokens=3)))
    out = sched.schedule()
    assert out.request_ids == ["r0", "r1"]
    assert sched.get_num_unfinished_requests() == 5 and len(sched.waiting) == 3
    sched.update_from_output(out, runner.step(out))
    finals, tokens, steps = run_to_end(sched, runner)
    assert all(len(s.scheduled) <= 2 for s in steps)
    assert sorted(finals) == [f"r{i}" for i in range(5)]
    assert {k: len(t) for k, t in tokens.items()} == {"r0": 2, "r1": 2, "r2": 3, "r3": 3, "r4": 3}
    assert_no_leak(sched)


def test_decodes_before_new_prefills():
    sched = make_sched(max_num_batched_tokens=8)
    runner = FakeRunner(sched)
    sched.add_request(new_req("a", 4, SP(max_tokens=10)))
    sched.add_request(new_req("b", 4, SP(max_tokens=10)))
    out = sched.schedule()
    sched.update_from_output(out, runner.step(out))
    sched.add_request(new_req("c", 30, SP(max_tokens=2)))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 6}
    assert [s.is_new for s in out.scheduled] == [False, False, True]
    assert out.logits_request_ids == ["a", "b"]
    sched.update_from_output(out, runner.step(out))
    run_to_end(sched, runner)
    assert_no_leak(sched)


def test_prefix_cache_through_scheduler():
    sched = make_sched(max_num_batched_tokens=64)
    runner = FakeRunner(sched)
    sched.add_request(new_req("a", 22, SP(max_tokens=2)))
    finals, _, _ = run_to_end(sched, runner)
    assert finals["a"].num_cached_tokens == 0
    sched.add_request(new_req("b", 22, SP(max_tokens=2)))  # same prompt
    out = sched.schedule()
    assert out.scheduled[0].start == 20 and out.scheduled[0].num_tokens == 2
    sched.update_from_output(out, runner.step(out))
    finals, _, _ = run_to_end(sched, runner)
    assert finals["b"].num_cached_tokens == 20
    assert sched.make_stats()["prefix_cache_hits"] == 20
    assert sched.reset_prefix_cache()
    assert_no_leak(sched)


# -- preemption -----------------------------------------------------------------------------------
def test_preemption_by_recompute_and_resume():
    # 6 usable blocks of 4 tokens; each request grows to 6 + 12 = 18 tokens (5 blocks).
    sched = make_sched(num_blocks=7, max_num_batched_tokens=32)
    runner = FakeRunner(sched)
    sp = SP(max_tokens=12)
    sched.add_request(new_req("a", 6, sp, arrival_time=1.0))
    sched.add_request(new_req("b", 6, sp, arrival_time=2.0))
    finals, tokens, steps = run_to_end(sched, runner)
    preempted = [rid for s in steps for rid in s.preempted_request_ids]
    assert preempted and set(preempted) == {"b"}  # the latest arrival goes
    resumed = [s for st in steps for s in st.scheduled if s.is_resumed]
    assert resumed and all(s.request_id == "b" and s.start >= 0 for s in resumed)
    # The resumed prefill recomputes prompt + the outputs so far.
    first_resume = resumed[0]
    assert first_resume.kv_len > 6
    for rid in "ab":
        exp, reason, _ = expected_output(hash_seed(rid), 6, sp, sched.max_len)
        assert tokens[rid] == exp and len(exp) == 12 and finals[rid].finish_reason == reason == "length"
    assert_no_leak(sched)


def test_request_longer_than_pool_finishes_with_length():
    sched = make_sched(num_blocks=4, max_model_len=128)  # 3 blocks = 12 tokens of KV
    runner = FakeRunner(sched)
    sched.add_request(new_req("a", 10, SP(max_tokens=100)))
    finals, tokens, _ = run_to_end(sched, runner)
    assert finals["a"].finish_reason == "length" and 10 + len(tokens["a"]) == 13
    assert_no_leak(sched)


# -- finish reasons ---------------------------------------------------------------------------------
def test_finish_reasons():
    sched = make_sched(max_model_len=20)
    runner = FakeRunner(sched, eos_every=0)
    seed = 5
    toks = [next_token(seed, 8 + i) for i in range(12)]
    sched.add_request(new_req("stop_tok", 8, SP(stop_token_ids=[toks[3]], max_tokens=50), seed=seed))
    sched.add_request(new_req("eos", 8, SP(max_tokens=50), seed=seed, eos_token_ids=[toks[2]]))
    sched.add_request(new_req("ign", 8, SP(max_tokens=5, ignore_eos=True), seed=seed, eos_token_ids=[toks[2]]))
    sched.add_request(new_req("min", 8, SP(max_tokens=50, min_tokens=4, stop_token_ids=[toks[1], toks[5]]), seed=seed))
    sched.add_request(new_req("max", 8, SP(max_tokens=4), seed=seed))
    sched.add_request(new_req("len", 8, SP(max_tokens=None), seed=seed))
    finals, tokens, _ = run_to_end(sched, runner)
    f = {k: (v.finish_reason, v.stop_reason, len(tokens[k])) for k, v in finals.items()}
    assert f["stop_tok"] == ("stop", toks[3], 4)
    assert f["eos"] == ("stop", None, 3)
    assert f["ign"] == ("length", None, 5)
    assert f["min"] == ("stop", toks[5], 6)
    assert f["max"] == ("length", None, 4)
    assert f["len"] == ("length", None, 12)  # 8 + 12 = max_model_len
    assert tokens["stop_tok"] == toks[:4]
    assert_no_leak(sched)


def test_scheduler_level_eos_and_stop_string_finish():
    sched = make_sched(eos_token_ids=(EOS,))
    runner = FakeRunner(sched, eos_every=7)
    seed = 3
    first_eos = next(k for k in range(1, 20) if (seed + 6 + k - 1) % 7 == 0)  # k-th output at position 5 + k
    e = new_req("e", 6, SP(max_tokens=30), seed=seed)
    sched.add_request(e)
    sched.add_request(new_req("s", 6, SP(max_tokens=30), seed=seed + 100))
    out = sched.schedule()
    sched.update_from_output(out, runner.step(out))
    # The detokenizer found a stop string in "s".
    assert sched.finish_request("s", reason="stop", stop_reason="\n\n")
    assert not sched.finish_request("s")  # already gone
    finals, tokens, _ = run_to_end(sched, runner)
    assert finals["e"].finish_reason == "stop" and tokens["e"][-1] == EOS
    assert e.num_output_tokens == first_eos and e.output_token_ids[-1] == EOS
    out = sched.schedule()
    assert out.is_empty and out.finished_request_ids == ["e"]  # reported once, at the next step
    assert sched.schedule().finished_request_ids == []
    with pytest.raises(ValueError, match="finish reason"):
        sched.finish_request("x", reason="bogus")
    assert_no_leak(sched)


# -- aborts and failures --------------------------------------------------------------------------
def test_abort_waiting_running_and_mid_prefill():
    sched = make_sched(max_num_batched_tokens=10, max_num_seqs=2)
    runner = FakeRunner(sched)
    sched.add_request(new_req("run", 4, SP(max_tokens=50)))
    sched.add_request(new_req("pre", 40, SP(max_tokens=50)))
    sched.add_request(new_req("wait", 4, SP(max_tokens=50)))
    out = sched.schedule()
    sched.update_from_output(out, runner.step(out))
    assert sched.get_request("pre").num_computed_tokens == 6  # partially prefilled
    assert sched.get_request("wait").status == RequestStatus.WAITING
    held = sched.kv_cache_manager.num_usable_blocks - sched.kv_cache_manager.num_free_blocks
    assert held > 0

    assert sched.abort_request("wait")
    assert sched.abort_request("pre")
    out = sched.schedule()
    assert sorted(out.finished_request_ids) == ["pre", "wait"]
    assert out.request_ids == ["run"]
    # Aborted between schedule() and the update: the update skips it.
    assert sched.abort_request("run")
    assert sched.update_from_output(out, runner.step(out)) == []
    assert not sched.abort_request("run")
    assert sched.schedule().finished_request_ids == ["run"]
    assert_no_leak(sched)


def test_failed_step_frees_blocks_and_others_continue():
    sched = make_sched()
    runner = FakeRunner(sched)
    sched.add_request(new_req("a", 9, SP(max_tokens=3)))
    out = sched.schedule()
    failed = sched.fail_scheduled(out, "RuntimeError: boom")
    assert [(r.request_id, r.finish_reason, r.error, r.error_code) for r in failed] == [
        ("a", "error", "RuntimeError: boom", "internal")]
    assert_no_leak(sched)
    sched.add_request(new_req("b", 9, SP(max_tokens=3)))
    finals, tokens, _ = run_to_end(sched, runner)
    assert len(tokens["b"]) == 3
    assert_no_leak(sched)


def test_bad_requests_rejected_others_continue():
    sched = make_sched(num_blocks=5, max_model_len=32)  # 4 usable blocks of 4 tokens
    runner = FakeRunner(sched)
    sched.add_request(new_req("ok", 5, SP(max_tokens=3)))
    with pytest.raises(ValueError, match=r"empty prompt \(0 tokens\)"):
        sched.add_request(Request("empty", [], SP()))
    with pytest.raises(TooLongError, match=r"prompt of 32 tokens.*max_model_len \(32\)"):
        sched.add_request(new_req("toolong", 32))
    with pytest.raises(TooLongError, match=r"prompt of 20 tokens needs 5 KV blocks.*4 usable blocks"):
        sched.add_request(new_req("toobig", 20))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(new_req("ok", 3))
    with pytest.raises(ValueError, match="max_tokens"):
        sched.add_request(new_req("zero", 3, SP(max_tokens=0)))
    with pytest.raises(ValueError, match="1-D"):
        Request("2d", np.zeros((2, 2), dtype=np.int32))
    assert sched.get_num_unfinished_requests() == 1
    finals, tokens, _ = run_to_end(sched, runner)
    assert list(finals) == ["ok"] and len(tokens["ok"]) == 3
    assert_no_leak(sched)


def test_update_from_output_forms_and_protocol_errors():
    sched = make_sched(max_num_batched_tokens=10)
    a = new_req("a", 3, SP(max_tokens=5))
    sched.add_request(a)
    sched.add_request(new_req("b", 12, SP(max_tokens=5)))
    out = sched.schedule()
    assert out.request_ids == ["a", "b"] and out.logits_request_ids == ["a"]
    with pytest.raises(RuntimeError, match="update_from_output"):
        sched.schedule()
    # Aligned with the logits requests.
    res = sched.update_from_output(out, np.array([[7]], dtype=np.int32))
    assert [(r.request_id, r.new_token_ids, r.finished) for r in res] == [("a", [7], False)]
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 5}
    # Aligned with the scheduled order (b's chunk ends its prompt, so it samples too).
    res = sched.update_from_output(out, np.array([8, 9]))
    assert [(r.request_id, r.new_token_ids) for r in res] == [("a", [8]), ("b", [9])]
    out = sched.schedule()
    with pytest.raises(ValueError, match="sampled entries"):
        sched.update_from_output(out, [1, 2, 3])
    with pytest.raises(ValueError, match="no sampled token for request 'b'"):
        sched.update_from_output(out, {"a": 1})
    assert a.output_token_ids == [7, 8]  # a bad call changes nothing
    res = sched.update_from_output(out, {"a": [4, 5, 6, 7], "b": 5})  # several tokens at once
    # a reaches max_tokens=5 at its third token: the fourth is dropped.
    assert [(r.request_id, r.new_token_ids, r.finish_reason) for r in res] == [
        ("a", [4, 5, 6], "length"), ("b", [5], None)]
    assert a.output_token_ids == [7, 8, 4, 5, 6] and a.is_finished
    with pytest.raises(RuntimeError, match="not the oldest pending step"):
        sched.update_from_output(out, {"a": 1, "b": 1})  # applied twice
    assert sched.abort_request("b")
    assert_no_leak(sched)


# -- one-shot stages --------------------------------------------------------------------------------
def test_one_shot_scheduler():
    sched = OneShotScheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100))
    for i, n in enumerate([30, 30, 30, 80, 10]):
        sched.add_request(Request(f"v{i}", np.arange(n)))
    with pytest.raises(ValueError, match="exceed"):
        sched.add_request(Request("huge", np.arange(101)))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(Request("e", []))
    batches = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        assert out.logits_request_ids == [] and all(s.is_new for s in out.scheduled)
        batches.append(out.request_ids)
        if "v3" in out.request_ids:
            sched.abort_request("v3")
        res = sched.update_from_output(out)
        assert all(r.finished and r.finish_reason == "stop" for r in res)
        assert "v3" not in [r.request_id for r in res]
    assert batches == [["v0", "v1"], ["v2"], ["v3", "v4"]]
    sched.add_request(Request("w", [1, 2]))
    assert sched.abort_request("w") and not sched.has_unfinished_requests()
    assert sched.schedule().finished_request_ids == ["v3", "v4", "w"]


# -- randomized workloads ------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(60))
def test_random_workloads(seed):
    rng = random.Random(seed)
    block_size = rng.choice([2, 4, 8])
    chunked = rng.random() < 0.8
    max_model_len = rng.choice([48, 64])
    cfg = SchedulerConfig(
        max_num_seqs=rng.randint(1, 6),
        max_num_batched_tokens=rng.choice([3, 8, 16, 64]) if chunked else max_model_len,
        max_model_len=max_model_len,
        block_size=block_size,
        num_blocks=rng.randint(48 // block_size + 2, 112 // block_size),
        enable_prefix_caching=rng.random() < 0.8,
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=rng.choice([0, 0, 5]),
        eos_token_ids=(EOS,),
    )
    sched = ARScheduler(cfg)
    eos_every = rng.choice([0, 13])
    runner = FakeRunner(sched, eos_every=eos_every)
    bases = [rng.randrange(1000) for _ in range(3)]

    specs: dict[str, tuple] = {}
    aborted, stopped_outside = set(), set()
    tokens: dict[str, list[int]] = {}
    finals: dict[str, StageOutput] = {}
    arrivals = sorted(rng.randrange(40) for _ in range(rng.randint(5, 25)))
    step = 0
    num_invalid = 0

    def add(i):
        nonlocal num_invalid
        rid = f"s{seed}-r{i}"
        kind = rng.random()
        if kind < 0.05:
            with pytest.raises(ValueError):
                sched.add_request(Request(rid, [], SP()))
            num_invalid += 1
            return
        if kind < 0.1:
            with pytest.raises(ValueError):
                sched.add_request(new_req(rid, max_model_len + rng.randint(0, 5)))
            num_invalid += 1
            return
        shared = rng.choice([0, 0, block_size * rng.randint(1, 3)])
        n = rng.randint(1, 30)
        prompt = np.concatenate([
            (np.arange(shared) * 13 + rng.choice(bases)) % 500 + 3,
            np.array([rng.randrange(3, 500) for _ in range(n)], dtype=np.int64),
        ])
        mm = []
        if rng.random() < 0.3 and len(prompt) > 4:
            off = rng.randrange(len(prompt) - 2)
            mm = [(off, rng.randint(1, len(prompt) - off), f"img-{rng.randrange(2)}")]
        salt = str(rng.randrange(2)) if rng.random() < 0.2 else None
        sp = SP(
            max_tokens=rng.choice([1, 2, 5, 20, None]),
            min_tokens=rng.choice([0, 0, 2]),
            ignore_eos=rng.random() < 0.2,
            stop_token_ids=[next_token(i, len(prompt) + 3)] if rng.random() < 0.2 else [],
        )
        req = Request(rid, prompt, sp, data=i, mm_hashes=mm, cache_salt=salt,
                      has_prompt_embeds=salt is not None or rng.random() < 0.1)
        if len(prompt) + 1 > max_model_len or -(-len(prompt) // block_size) > cfg.num_blocks - 1:
            with pytest.raises(ValueError, match="prompt of"):
                sched.add_request(req)
            num_invalid += 1
            return
        sched.add_request(req)
        specs[rid] = (i, len(prompt), sp)

    pending = list(enumerate(arrivals))
    while pending or sched.has_unfinished_requests():
        while pending and pending[0][1] <= step:
            add(pending.pop(0)[0])
        out = sched.schedule()
        check_step(sched, out)
        if out.scheduled and rng.random() < 0.05:
            victim = rng.choice(out.request_ids)  # aborted while its step is in flight
            sched.abort_request(victim)
            aborted.add(victim)
        sampled = runner.step(out)
        if out.scheduled and rng.random() < 0.02:
            for r in sched.fail_scheduled(out, "boom"):
                finals[r.request_id] = r
            results = []
        else:
            results = sched.update_from_output(out, sampled)
        for r in results:
            tokens.setdefault(r.request_id, []).extend(r.new_token_ids)
            if r.finished:
                finals[r.request_id] = r
        live = list(sched.requests)
        if live and rng.random() < 0.05:
            victim = rng.choice(live)
            sched.abort_request(victim)
            aborted.add(victim)
        if live and rng.random() < 0.03:
            victim = rng.choice(live)
            if sched.finish_request(victim, "stop", stop_reason="STOP"):
                stopped_outside.add(victim)
        sched.kv_cache_manager.check_invariants()
        step += 1
        assert step < 3000, "no progress"

    assert_no_leak(sched)
    assert len(specs) + num_invalid == len(arrivals)
    for rid, (i, n_prompt, sp) in specs.items():
        got = tokens.get(rid, [])
        exp, reason, stop_reason = expected_output(i, n_prompt, sp, sched.max_len, eos_every)
        if rid in aborted or rid in stopped_outside or (rid in finals and finals[rid].finish_reason == "error"):
            assert got == exp[: len(got)]
            continue
        assert got == exp, rid
        assert finals[rid].finish_reason == reason and finals[rid].stop_reason == stop_reason


def run_pipelined(sched, runner, arrivals=(), max_steps=2000):
    """Drive the scheduler as the engine does with async scheduling: the next decode step is
    scheduled ahead, before the current one's output is applied. `arrivals`: (step, request)
    pairs added at that step. Returns ({rid: tokens}, {rid: final output}, steps scheduled ahead)."""
    tokens, finals, ahead_steps = {}, {}, 0
    arrivals = list(arrivals)
    in_flight = None
    for step in range(max_steps):
        for when, req in [a for a in arrivals if a[0] == step]:
            sched.add_request(req)
        if in_flight is None:
            if not sched.has_unfinished_requests() and step > max((a[0] for a in arrivals), default=-1):
                break
            in_flight = sched.schedule()
            if in_flight.is_empty:
                sched.update_from_output(in_flight, {})
                in_flight = None
                continue
        current = in_flight
        in_flight = sched.schedule_ahead(current)
        ahead_steps += in_flight is not None
        for o in sched.update_from_output(current, runner.step(current)):
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                finals[o.request_id] = o
    assert in_flight is None and not sched.has_unfinished_requests()
    return tokens, finals, ahead_steps


@pytest.mark.parametrize("num_blocks", [64, 14])
def test_schedule_ahead_gives_the_same_outputs(num_blocks):
    """Steps scheduled ahead (eos, stop ids, lengths, new blocks, arrivals, a short pool that
    also preempts) produce exactly the reference outputs and leak nothing."""
    sched = make_sched(num_blocks=num_blocks, max_num_batched_tokens=16)
    runner = FakeRunner(sched, eos_every=29)
    reqs = []
    for i, (n, max_tokens) in enumerate([(5, 3), (9, 7), (3, 12), (14, 20), (6, 25), (11, 18)]):
        rid = f"r{i}"
        # r4 stops on its 5th token's id; r5 also waits for min_tokens first.
        stop = [next_token(hash_seed(rid), n + 4)] if i >= 4 else []
        reqs.append(new_req(rid, n, SP(max_tokens=max_tokens, stop_token_ids=stop, min_tokens=6 if i == 5 else 0)))
    late = [(9, new_req("late0", 7, SP(max_tokens=9))), (20, new_req("late1", 4, SP(max_tokens=5)))]
    tokens, finals, ahead_steps = run_pipelined(sched, runner, [(0, r) for r in reqs] + late)
    assert ahead_steps > 5
    for req in reqs + [r for _, r in late]:
        exp, reason, stop_reason = expected_output(hash_seed(req.request_id), req.num_prompt_tokens,
                                                   req.sampling_params, sched.max_len, eos_every=29)
        assert tokens[req.request_id] == exp, req.request_id
        assert (finals[req.request_id].finish_reason, finals[req.request_id].stop_reason) == (reason, stop_reason)
    assert_no_leak(sched)


def test_schedule_ahead_conditions_and_order():
    sched = make_sched(num_blocks=64)
    runner = FakeRunner(sched)
    sched.add_request(new_req("a", 6, SP(max_tokens=10)))
    prefill = sched.schedule()
    ahead = sched.schedule_ahead(prefill)  # a whole prompt with logits: its next step is one decode
    assert [(s.request_id, s.start, s.fed_by_row) for s in ahead.scheduled] == [("a", 6, 0)]
    assert sched.schedule_ahead(ahead) is None  # only right behind the one pending step
    with pytest.raises(RuntimeError, match="before update_from_output"):
        sched.schedule()
    with pytest.raises(RuntimeError, match="oldest pending"):
        sched.update_from_output(ahead, {"a": [5]})
    sched.update_from_output(prefill, runner.step(prefill))
    sched.add_request(new_req("b", 3))
    assert sched.schedule_ahead(ahead) is None  # b waits: the next step must admit it
    sched.update_from_output(ahead, runner.step(ahead))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 3}
    sched.update_from_output(out, runner.step(out))
    sched.abort_request("a")
    sched.abort_request("b")
    assert_no_leak(sched)


def test_a_step_ahead_is_fed_in_place_only_with_every_request_in_its_row():
    """`fed_in_place` (the engine then skips its per-request checks) holds only
    while the step ahead keeps every request of the step before it, each in its own row."""
    sched = make_sched(num_blocks=64)
    runner = FakeRunner(sched)
    sched.add_request(new_req("a", 5, SP(max_tokens=2)))
    sched.add_request(new_req("b", 5, SP(max_tokens=10)))
    prev = sched.schedule()  # both prompts, each sampling its first token
    ahead = sched.schedule_ahead(prev)
    assert ahead.fed_in_place and [(s.request_id, s.fed_by_row) for s in ahead.scheduled] == [("a", 0), ("b", 1)]
    sched.update_from_output(prev, runner.step(prev))
    after = sched.schedule_ahead(ahead)  # a's token from `ahead` is its last by length: a is left out
    assert [(s.request_id, s.fed_by_row) for s in after.scheduled] == [("b", 1)]
    assert not after.fed_in_place
    for out in (ahead, after):
        sched.update_from_output(out, runner.step(out))
    assert sched.requests["b"].num_output_tokens == 3 and "a" not in sched.requests
    sched.abort_request("b")
    assert_no_leak(sched)


def test_failed_step_scheduled_ahead():
    """A step scheduled ahead that fails (its launch raised) fails its requests; the step
    before it is still applied, skipping them, and nothing leaks."""
    sched = make_sched(num_blocks=64)
    runner = FakeRunner(sched)
    for rid in ("a", "b"):
        sched.add_request(new_req(rid, 5, SP(max_tokens=10)))
    prev = sched.schedule()
    sched.update_from_output(prev, runner.step(prev))
    prev = sched.schedule()  # two decodes
    ahead = sched.schedule_ahead(prev)
    failed = sched.fail_scheduled(ahead, "boom")
    assert sorted(o.request_id for o in failed) == ["a", "b"]
    assert all(o.finish_reason == "error" and o.error == "boom" for o in failed)
    assert sched.update_from_output(prev, runner.step(prev)) == []
    assert not sched.has_unfinished_requests()
    assert_no_leak(sched)
