"""The multi-process runtime: OmniJax / AsyncOmniJax over a thinker stage process."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from omni_jax import AsyncOmniJax, OmniJax, SamplingParams
from omni_jax.config import load_pipeline_config
from omni_jax.errors import EngineDeadError

pytestmark = pytest.mark.pipeline

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


def tiny_pipeline(**thinker):
    """The tiny preset with fewer buckets (quicker warm-up) and optional thinker overrides."""
    base = dict(token_buckets=[16, 64], decode_buckets=[1, 8])
    return load_pipeline_config("qwen2_5_omni_tiny").with_overrides(thinker={**base, **thinker})


@pytest.fixture(scope="module")
def omni(converted_thinker_fp32):
    engine = OmniJax(model=converted_thinker_fp32, pipeline=tiny_pipeline())
    yield engine
    engine.shutdown()


def prompts(n, seed=0, lo=3, hi=40):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 151000, int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def test_generate_matches_transformers_and_engine(omni, qwen2_5_omni_hf_model, converted_thinker_fp32):
    import torch

    from omni_jax.engine.runner import RunnerConfig
    from omni_jax.models.qwen2_5_omni.stages import build_thinker_engine

    batch = prompts(5)
    outs = omni.generate([{"prompt_token_ids": p} for p in batch], sampling_params=GREEDY)
    engine = build_thinker_engine(converted_thinker_fp32, RunnerConfig(num_blocks=64, max_num_seqs=8,
                                  max_num_batched_tokens=64, max_model_len=256), progress=False, warmup=False)
    for i, p in enumerate(batch):
        engine.add_request(f"e{i}", p, GREEDY)
    local = {}
    while engine.has_unfinished():
        for o in engine.step():
            local.setdefault(o.request_id, []).extend(o.new_token_ids)
    for i, (p, out) in enumerate(zip(batch, outs)):
        assert out.error is None and out.finished and out.finish_reason == "length"
        with torch.no_grad():
            ref = qwen2_5_omni_hf_model.thinker.generate(
                input_ids=torch.tensor(p)[None], attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=6, do_sample=False)[0, len(p):].tolist()
        assert out.token_ids == ref == local[f"e{i}"]
        assert out.metrics.ttft is not None and out.metrics.ttft >= 0


def test_logprobs_reach_the_caller_equal_to_transformers(omni, qwen2_5_omni_hf_model):
    """logprobs=3: per output token the sampled token's log-softmax and rank, and the top 3,
    equal to transformers' log-softmax of the logits (greedy and seeded sampling)."""
    import torch

    p = prompts(1, seed=5)[0]
    for params in (SamplingParams(temperature=0.0, max_tokens=5, logprobs=3),
                   SamplingParams(temperature=0.8, seed=11, max_tokens=5, logprobs=3)):
        out = omni.generate([{"prompt_token_ids": p}], sampling_params=params)[0]
        assert out.error is None and len(out.logprobs) == len(out.token_ids) == 5
        with torch.no_grad():
            logits = qwen2_5_omni_hf_model.thinker(input_ids=torch.tensor(p + out.token_ids)[None]).logits[0]
        ref = torch.log_softmax(logits.double(), -1)[len(p) - 1:-1].numpy()
        for pos, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
            assert abs(lp[token].logprob - ref[pos, token]) <= 1e-4
            assert lp[token].rank == 1 + int((ref[pos] > ref[pos, token]).sum())
            top = np.argsort(-ref[pos])[:3]
            for rank, t in enumerate(top, start=1):
                assert t in lp and lp[t].rank == rank and abs(lp[t].logprob - ref[pos, t]) <= 1e-4
        if params.temperature == 0.0:
            assert all(lp[t].rank == 1 for t, lp in zip(out.token_ids, out.logprobs))


def test_generate_shows_progress_unless_asked_not_to(omni, capsys):
    batch = [{"prompt_token_ids": p} for p in prompts(3, seed=6)]
    omni.generate(batch, sampling_params=GREEDY)
    assert "3/3" in capsys.readouterr().err
    omni.generate(batch, sampling_params=GREEDY, use_tqdm=False)
    assert "3/3" not in capsys.readouterr().err
    omni.generate(batch[:1], sampling_params=GREEDY)  # vLLM shows it for any batch
    assert "1/1" in capsys.readouterr().err


def test_per_prompt_sampling_params_equal_each_prompt_alone(omni):
    """A list of SamplingParams gives one per prompt (vLLM's meaning): different temperatures,
    seeds and max_tokens in one batch, each prompt's tokens and logprobs as when run alone."""
    batch = [{"prompt_token_ids": p} for p in prompts(3, seed=21)]
    params = [SamplingParams(temperature=0.0, max_tokens=3, logprobs=1),
              SamplingParams(temperature=0.7, seed=5, max_tokens=7, logprobs=1),
              SamplingParams(temperature=1.3, seed=6, max_tokens=5, logprobs=1)]
    together = omni.generate(batch, sampling_params=params)
    for prompt, p, out in zip(batch, params, together):
        alone = omni.generate([prompt], sampling_params=p)[0]
        assert out.error is None and len(out.token_ids) == p.max_tokens
        assert out.token_ids == alone.token_ids
        np.testing.assert_allclose([lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)],
                                   [lp[t].logprob for t, lp in zip(alone.token_ids, alone.logprobs)], atol=1e-4)
    # The same seeded params with another seed give another reply: the seeds were each prompt's own.
    other = omni.generate([batch[2]], sampling_params=params[2].updated(seed=7))[0]
    assert other.token_ids != together[2].token_ids


def test_per_prompt_and_per_stage_lists_are_unambiguous(omni):
    batch = [{"prompt_token_ids": p} for p in prompts(3, seed=22)]
    with pytest.raises(ValueError, match="2 entries for 3 prompt.*sampling_params_list"):
        omni.generate(batch, sampling_params=[GREEDY, GREEDY])
    with pytest.raises(ValueError, match="voice has 1 entries for 3 prompt"):
        omni.generate(batch, sampling_params=GREEDY, voice=["Ethan"])
    with pytest.raises(ValueError, match="sampling_params_list has 2 entries for a chain of 1"):
        omni.generate(batch, sampling_params_list=[GREEDY, GREEDY])
    with pytest.raises(ValueError, match="given twice"):
        omni.generate(batch, sampling_params=GREEDY, sampling_params_list=[GREEDY])
    # The per-stage list alone sets the thinker's params for every prompt.
    outs = omni.generate(batch, sampling_params_list=[GREEDY], use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in omni.generate(batch, sampling_params=GREEDY)]


def test_a_prompt_processed_once_serves_many_requests(omni):
    """`process` then `generate` with it: the same replies as the prompt itself, any number of times."""
    prompt = {"prompt_token_ids": prompts(1, seed=23)[0]}
    prepared = omni.process(prompt)
    seeded = [SamplingParams(temperature=1.0, seed=s, max_tokens=5) for s in (1, 2, 3)]
    assert [o.token_ids for o in omni.generate([prepared] * 3, sampling_params=seeded, use_tqdm=False)] == \
        [o.token_ids for o in omni.generate([prompt] * 3, sampling_params=seeded, use_tqdm=False)]
    assert omni.generate(prepared, GREEDY)[0].token_ids == omni.generate(prompt, GREEDY)[0].token_ids
    with pytest.raises(ValueError, match="empty prompt"):
        omni.process({"prompt_token_ids": []})


def test_bad_prompt_fails_alone(omni):
    outs = omni.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": []},
                          {"prompt_token_ids": list(range(600))}, "text without a tokenizer",
                          {"prompt_token_ids": [1, 2]}], sampling_params=GREEDY)
    assert outs[0].error is None and len(outs[0].token_ids) == 6
    assert "empty prompt" in outs[1].error
    assert "max_model_len" in outs[2].error or "too long" in outs[2].error
    assert "tokenizer" in outs[3].error
    assert outs[4].error is None and len(outs[4].token_ids) == 6
    assert [o.error_code for o in outs] == [None, "invalid_request", "context_length_exceeded", "invalid_request", None]


def test_any_prompt_failure_fails_only_that_prompt(omni, monkeypatch):
    """A prompt whose processing raises anything (here whatever a broken processor raises) is its
    own error, as are a bad role, a lone surrogate and an id past int32."""
    process = omni.processor.process

    def process_or_crash(prompt, **kw):
        if prompt == "crash":
            raise ZeroDivisionError("division by zero")
        return process(prompt, **kw)

    monkeypatch.setattr(omni.processor, "process", process_or_crash)
    outs = omni.generate([{"messages": [{"role": 7, "content": "hi"}]}, {"prompt_token_ids": [4, 5, 6]},
                          {"prompt_token_ids": [2**31]}, "crash", {"messages": [{"role": "user", "content": "\ud83d"}]}],
                         sampling_params=GREEDY)
    assert outs[0].finish_reason == "error" and "bad prompt: messages[0].role must be" in outs[0].error
    assert outs[1].error is None and len(outs[1].token_ids) == 6
    assert outs[2].finish_reason == "error" and "out of range" in outs[2].error
    assert outs[3].finish_reason == "error" and outs[3].error == "bad prompt: ZeroDivisionError: division by zero"
    assert outs[4].finish_reason == "error" and "not valid Unicode" in outs[4].error


def test_undecodable_payload_fails_its_request(omni):
    """A raw payload with a list where an array belongs cannot be read by the stage: that request
    fails with an error saying so (it used to be dropped, and generate waited for ever)."""
    from omni_jax.engine.protocol import MultiModalPayload

    bad = {"prompt_token_ids": [1, 2, 3], "multi_modal_data": MultiModalPayload(pixel_values=[[0.5] * 4])}
    outs = omni.generate([bad, {"prompt_token_ids": [4, 5, 6]}], sampling_params=GREEDY)
    assert outs[0].finish_reason == "error" and "could not read the request" in outs[0].error
    assert outs[0].error_code == "invalid_request" and outs[1].error_code is None
    assert outs[1].error is None and len(outs[1].token_ids) == 6


def test_duplicate_request_id_is_refused_and_an_early_abort_is_kept(converted_thinker_fp32):
    async def run():
        async with AsyncOmniJax(model=converted_thinker_fp32, pipeline=tiny_pipeline()) as engine:
            params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

            async def collect(rid):
                outs = [o async for o in engine.generate({"prompt_token_ids": [3, 4, 5]}, params, request_id=rid)]
                return outs[-1]

            original = asyncio.create_task(collect("same"))
            while "same" not in engine._orch._requests:
                await asyncio.sleep(0.001)
            duplicate = await asyncio.wait_for(collect("same"), 30)
            # The abort of a duplicate whose caller leaves before reading its refusal names that
            # request: it must not reach the original (as a bare id would).
            engine._orch.abort("same", object())  # another request than the one in flight
            original = await asyncio.wait_for(original, 60)
            # An abort issued before the iterator first runs (the request is not submitted yet) is kept.
            early = engine.generate({"prompt_token_ids": [3, 4, 5]}, params.updated(max_tokens=400), request_id="early")
            engine.abort("early")
            early = [o async for o in early]
            stats = engine.stage_stats()["thinker"]
            return original, duplicate, early, stats

    original, duplicate, early, stats = asyncio.run(run())
    assert duplicate.finish_reason == "error" and "already in flight" in duplicate.error
    assert duplicate.error_code == "invalid_request"
    assert original.error is None and original.finish_reason == "length" and len(original.token_ids) == 40
    assert len(early) == 1 and early[0].finished and early[0].finish_reason == "abort" and early[0].token_ids == []
    assert stats["num_running"] == 0 and stats["kv_cache_usage"] == 0.0


def test_200_concurrent_async_requests(converted_thinker_fp32):
    async def run():
        async with AsyncOmniJax(model=converted_thinker_fp32, pipeline=tiny_pipeline()) as engine:
            async def one(i, p):
                last = None
                async for out in engine.generate({"prompt_token_ids": p},
                                                 SamplingParams(temperature=0.0, max_tokens=4), request_id=f"a{i}"):
                    last = out
                return last
            results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts(200, seed=1, hi=20))))
            stats = engine.stage_stats()
            return results, stats

    results, stats = asyncio.run(run())
    assert all(r.finished and r.error is None and len(r.token_ids) == 4 for r in results)
    assert stats["thinker"]["kv_cache_usage"] == 0.0


def test_abort_mid_generation_frees_everything(omni):
    import threading

    done = []
    req_params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    def run():
        done.append(omni.generate([{"prompt_token_ids": [11, 12, 13]}], sampling_params=req_params)[0])

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 30
    rid = None
    while rid is None and time.monotonic() < deadline:
        rid = next(iter(omni._orch._requests), None)
        time.sleep(0.001)
    assert rid is not None
    # Abort once tokens flow (a fixed sleep races the engine: 400 tokens can take < 0.3 s).
    req = omni._orch._requests.get(rid)
    while req is not None and not req.output.token_ids and time.monotonic() < deadline:
        time.sleep(0.001)
    omni.abort(rid)
    t.join(30)
    assert done and done[0].finish_reason == "abort" and len(done[0].token_ids) < 400
    time.sleep(0.2)
    stats = omni.stage_stats()["thinker"]
    assert stats["kv_cache_usage"] == 0.0 and stats["num_running"] == 0 and stats["num_waiting"] == 0


def test_ctrl_c_in_generate_aborts_what_it_submitted(omni, monkeypatch):
    """Ctrl-C (a real SIGINT) while generate waits: KeyboardInterrupt reaches the caller and every
    request of the batch still running is aborted (they used to keep running, holding KV)."""
    aborted, abort = [], omni._orch.abort
    monkeypatch.setattr(omni._orch, "abort", lambda rid: (aborted.append(rid), abort(rid)))
    long = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)  # > 0.5 s at ~1 ms a step
    # SIGINT raises KeyboardInterrupt, as in a plain Python process: a test runner's worker
    # (pytest-xdist) or an earlier test's library may have put another handler in place.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            omni.generate([{"prompt_token_ids": [21, 22, 23 + i]} for i in range(6)], sampling_params=long)
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - t0 < 10
    assert len(set(aborted)) == 6, aborted
    stats = _idle_thinker(omni)
    assert stats["kv_cache_usage"] == 0.0
    assert omni.generate([{"prompt_token_ids": [1, 2]}], sampling_params=GREEDY)[0].error is None


def test_request_past_its_deadline_times_out_and_frees_everything(omni):
    long = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)  # ~1 ms a step: > 0.1 s
    t0 = time.monotonic()
    outs = omni.generate([{"prompt_token_ids": [11, 12, 13 + i]} for i in range(4)], sampling_params=long,
                         timeout_s=0.1)
    assert time.monotonic() - t0 < 5
    assert all(o.finish_reason == "timeout" and o.error is None and len(o.token_ids) < 500 for o in outs), \
        [(o.finish_reason, len(o.token_ids)) for o in outs]
    stats = _idle_thinker(omni)
    assert stats["kv_cache_usage"] == 0.0
    assert omni.generate([{"prompt_token_ids": [1, 2]}], sampling_params=GREEDY, timeout_s=30)[0].finish_reason == "length"
    for bad in (0, -1, float("inf"), float("nan"), "5", True):
        with pytest.raises(ValueError, match="timeout_s"):
            omni.generate([{"prompt_token_ids": [1, 2]}], timeout_s=bad)


def _idle_thinker(omni) -> dict:
    """The thinker's stats once it holds nothing (the abort of a finished request is async)."""
    deadline = time.monotonic() + 10
    while True:
        stats = omni.stage_stats()["thinker"]
        if (stats["num_running"], stats["num_waiting"]) == (0, 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def test_garbage_frames_are_dropped(omni):
    # Through the orchestrator's own request channel, the only peer of the stage's PULL socket: a
    # second PUSH connecting to that bound PUSH endpoint is refused by ZMQ (nothing reaches the
    # stage) and its send may block for ever. Safe from this thread: the orchestrator sends on
    # the channel only for a queued command, and none is queued while the fixture is idle.
    channel = omni._orch.clients["thinker"].requests
    noise = np.random.default_rng(0).bytes(64)
    for frames in ([b"\x00garbage"], [b"\x93\x01\x02\x03", b"x" * 10], [noise] * 3, [b""]):
        channel.send_frames(frames, timeout_ms=5000)
    out = omni.generate([{"prompt_token_ids": [7, 8, 9]}], sampling_params=GREEDY)[0]
    assert out.error is None and len(out.token_ids) == 6


def _long_request_in_flight(engine):
    """A 500-token request generating in a thread: (thread, list its outputs land in)."""
    import threading

    results = []
    t = threading.Thread(target=lambda: results.extend(engine.generate(
        [{"prompt_token_ids": [3, 4, 5]}], sampling_params=SamplingParams(temperature=0.0, max_tokens=500,
                                                                          ignore_eos=True))))
    t.start()
    deadline = time.monotonic() + 30
    while not engine._orch._requests and time.monotonic() < deadline:
        time.sleep(0.01)
    return t, results


def test_sigkill_stage_fails_requests_fast_and_later_calls_raise(converted_thinker_fp32):
    """Without auto_restart a dead stage is a dead engine."""
    engine = OmniJax(model=converted_thinker_fp32, pipeline=tiny_pipeline(auto_restart=False))
    pid = engine.stage_pids()["thinker"]
    t, results = _long_request_in_flight(engine)
    # Kill while the request is surely in flight (500 decode steps take well over 0.2 s).
    time.sleep(0.2)
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    t.join(15)
    assert not t.is_alive(), "generate hung after the stage died"
    assert time.monotonic() - killed_at < 10
    assert results[0].finish_reason == "error" and "thinker" in results[0].error
    assert results[0].error_code == "unavailable"
    with pytest.raises(EngineDeadError, match="thinker"):
        engine.generate([{"prompt_token_ids": [1, 2]}])
    engine.shutdown()


def test_silent_stage_fails_its_requests_and_recovers(converted_thinker_fp32):
    """A stage that stops answering without dying (SIGSTOP) is declared unhealthy after its
    health_timeout_s: its requests fail naming it, stats say so at once, and once it answers
    again (SIGCONT) new requests succeed and nothing leaks."""
    limit = 2.0
    engine = OmniJax(model=converted_thinker_fp32, pipeline=tiny_pipeline(health_timeout_s=limit, auto_restart=False))
    try:
        pid = engine.stage_pids()["thinker"]
        t, results = _long_request_in_flight(engine)
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            t.join(limit + 5)
            assert not t.is_alive(), "generate hung on a silent stage"
            assert results[0].finish_reason == "error" and "'thinker' stopped answering" in results[0].error
            t0 = time.monotonic()
            assert engine.stage_stats()["thinker"] == {"healthy": 0.0, "num_restarts": 0.0}
            assert time.monotonic() - t0 < 1.0
            refused = engine.generate([{"prompt_token_ids": [1, 2]}], sampling_params=GREEDY)[0]
            assert refused.finish_reason == "error" and "stopped answering" in refused.error
            assert results[0].error_code == refused.error_code == "unavailable"
        finally:
            os.kill(pid, signal.SIGCONT)
        assert time.monotonic() - stopped_at < limit + 5 + 5
        deadline = time.monotonic() + 30
        while engine.stage_stats()["thinker"]["healthy"] != 1.0 and time.monotonic() < deadline:
            time.sleep(0.1)
        out = engine.generate([{"prompt_token_ids": [1, 2]}], sampling_params=GREEDY)[0]
        assert out.error is None and len(out.token_ids) == 6
        stats = engine.stage_stats()["thinker"]
        assert stats["kv_cache_usage"] == 0.0 and stats["num_running"] == 0
    finally:
        engine.shutdown()


def _wait_healthy(engine, stage: str, limit_s: float) -> float:
    """Seconds until `stage` reports healthy again (fails past limit_s)."""
    t0 = time.monotonic()
    while engine.stage_stats()[stage]["healthy"] != 1.0:
        assert time.monotonic() - t0 < limit_s, f"stage {stage!r} not back within {limit_s} s"
        time.sleep(0.1)
    return time.monotonic() - t0


def test_dead_or_silent_stage_is_restarted(converted_thinker_fp32):
    """auto_restart (the default): a killed stage, and one silent past its health_timeout_s, fail
    their requests naming the stage, are started again, refuse requests until they are back, then
    serve; nothing leaks."""
    limit = 2.0
    engine = OmniJax(model=converted_thinker_fp32, pipeline=tiny_pipeline(health_timeout_s=limit))
    try:
        for n, (sig, says) in enumerate([(signal.SIGKILL, "'thinker' died"),
                                         (signal.SIGSTOP, "'thinker' stopped answering")], start=1):
            pid = engine.stage_pids()["thinker"]
            t, results = _long_request_in_flight(engine)
            os.kill(pid, sig)
            t0 = time.monotonic()
            t.join(limit + 5)
            assert not t.is_alive(), "generate hung on a failed stage"
            assert results[0].finish_reason == "error" and says in results[0].error, results[0].error
            assert results[0].error_code == "unavailable"
            assert time.monotonic() - t0 < limit + 5
            refused = engine.generate([{"prompt_token_ids": [1, 2]}], sampling_params=GREEDY)[0]
            if refused.error is not None:  # unless it is already back
                assert "'thinker' is restarting" in refused.error and refused.error_code == "unavailable"
            back = _wait_healthy(engine, "thinker", 60)
            print(f"thinker back {back:.1f} s after {sig.name}")
            assert engine.stage_pids()["thinker"] != pid
            out = engine.generate([{"prompt_token_ids": [1, 2]}], sampling_params=GREEDY)[0]
            assert out.error is None and len(out.token_ids) == 6
            stats = engine.stage_stats()["thinker"]
            assert stats["num_restarts"] == n and stats["kv_cache_usage"] == 0.0 and stats["num_running"] == 0
    finally:
        engine.shutdown()


def test_no_orphan_stage_when_parent_is_killed(converted_thinker_fp32, tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        from omni_jax import OmniJax
        from omni_jax.config import load_pipeline_config
        p = load_pipeline_config("qwen2_5_omni_tiny").with_overrides(
            thinker=dict(token_buckets=[16], decode_buckets=[1], max_num_batched_tokens=16, max_num_seqs=1))
        omni = OmniJax(model={converted_thinker_fp32!r}, pipeline=p)
        print(omni.stage_pids()["thinker"], omni._orch.ipc_dir, flush=True)
        time.sleep(600)
    """))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    pid, ipc_dir = parent.stdout.readline().split()
    stage_pid = int(pid)
    assert os.path.isdir(ipc_dir)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(stage_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(stage_pid, signal.SIGKILL)
        pytest.fail("the stage process outlived its parent")
    # The stage took the private socket directory with it.
    assert not os.path.exists(ipc_dir)


def test_stage_processes_keep_compiled_programs_under_the_omni_jax_cache(tmp_path):
    """A stage's compiled programs, the ones that compile in a blink too, go to JAX's persistent
    cache under $OMNI_JAX_CACHE: the next process loads them. JAX_COMPILATION_CACHE_DIR, when
    given, is left to choose."""
    script = ("import jax, jax.numpy as jnp; from omni_jax.runtime.stage_worker import configure_compile_cache; "
              "configure_compile_cache(); hits = []; "
              "jax.monitoring.register_event_listener(lambda e, **kw: hits.append(e) if e.endswith('cache_hits') else 0); "
              "jax.jit(lambda x: jnp.sin(x) * 3)(jnp.ones(5)).block_until_ready(); "
              "print(jax.config.jax_compilation_cache_dir, len(hits))")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
    runs = [subprocess.run([sys.executable, "-c", script], env={**env, "OMNI_JAX_CACHE": str(tmp_path)},
                           capture_output=True, text=True, check=True).stdout.split() for _ in range(2)]
    assert runs[0] == [str(tmp_path / "jax-compile-cache"), "0"]
    assert runs[1][0] == runs[0][0] and int(runs[1][1]) > 0, runs  # loaded, not compiled again
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env={**env, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "mine")}, check=True).stdout.split()
    assert out[0] == str(tmp_path / "mine")


def test_a_stage_process_leaves_without_the_interpreters_teardown():
    """A stage process whose stage has stopped exits at once, with code 0 and its output
    flushed, skipping the interpreter's teardown (1.5 s of the tiny stages' exits, JAX clearing
    its backend): an engine's shutdown waits on it."""
    script = textwrap.dedent("""
        import atexit, sys
        from omni_jax.runtime import stage_worker
        atexit.register(lambda: print(" and the teardown", flush=True))
        stage_worker.stage_main = lambda **kw: sys.stdout.write("served " + kw["family"])
        stage_worker.main(['{"family": "qwen2_5_omni"}'])
        print(" and on")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout) == (0, "served qwen2_5_omni"), proc.stderr
