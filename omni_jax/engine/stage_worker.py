"""The stage process: load one stage, warm it up, then receive -> schedule -> run -> send.

Started by `StageClient` as a fresh interpreter (`python -m omni_jax.engine.stage_worker
CONFIG_JSON`): spawn semantics, never a fork after JAX is imported, and unlike
multiprocessing's spawn it does not re-import the caller's main module.
It connects to the two ipc sockets the orchestrator bound, loads its stage of the
checkpoint, compiles every bucket, and only then says `Ready`. A request the engine
rejects comes back as a `StageFailure` naming it; a malformed message is logged and
dropped; an exception in a step fails that step's requests (inside the engine) and
the loop goes on. The process exits on `Shutdown`, and also when its parent dies
(a watchdog thread notices the parent pid change, also during warm-up).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback

log = logging.getLogger("omni_jax.stage")

# How long the loop sleeps in poll when the engine has nothing to do (ms).
IDLE_POLL_MS = 20


def _exit_with_parent(parent_pid: int, period_s: float = 0.5) -> None:
    """Exit at once when the parent process is gone (no orphan stages), even mid-compile."""
    import threading

    def watch():
        while True:
            time.sleep(period_s)
            if os.getppid() != parent_pid:
                os._exit(0)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def _configure_device(stage: dict) -> None:
    """Per-stage device choice and memory fraction, before JAX is imported."""
    if stage.get("device") is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(stage["device"])
    if stage.get("memory_fraction") is not None:
        os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(stage["memory_fraction"])
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"


def stage_main(stage_json: str, ckpt_dir: str, family: str, in_addr: str, out_addr: str,
               parent_pid: int) -> None:
    """Entry point of a stage process (arguments are plain strings: nothing is unpickled)."""
    _exit_with_parent(parent_pid)
    stage = json.loads(stage_json)
    name = stage["name"]
    logging.basicConfig(level=os.environ.get("OMNI_JAX_LOG_LEVEL", "WARNING"),
                        format=f"[omni-jax {name} %(levelname)s] %(message)s")
    _configure_device(stage)

    import zmq

    from .protocol import (AbortRequests, AddRequest, HealthCheck, HealthReply, Ready, Shutdown,
                           StageFailure, StageOutputs, StageRequest)
    from .transport import Channel, ProtocolError

    ctx = zmq.Context()
    inbox = Channel(zmq.PULL, in_addr, bind=False, decode_type=StageRequest, context=ctx)
    outbox = Channel(zmq.PUSH, out_addr, bind=False, context=ctx)
    try:
        t0 = time.perf_counter()
        from .stage_factory import build_stage_engine

        engine = build_stage_engine(family, stage, ckpt_dir)
        outbox.send(Ready(stage=name, pid=os.getpid(), warmup_seconds=time.perf_counter() - t0,
                          num_compilations=engine.num_compilations))
    except BaseException as e:  # report why the stage could not start, then exit
        outbox.send(StageFailure(stage=name, message=f"stage {name!r} failed to start: "
                                                     f"{type(e).__name__}: {e}"))
        log.error("startup failed:\n%s", traceback.format_exc())
        _flush_and_close(outbox, inbox, ctx)
        sys.exit(1)

    from .stage_factory import to_engine_request

    running = True
    while running:
        try:
            msg = inbox.recv(timeout_ms=0 if engine.has_unfinished() else IDLE_POLL_MS)
        except ProtocolError as e:
            log.warning("dropped a malformed message: %s", e)
            continue
        while msg is not None:
            if isinstance(msg, AddRequest):
                try:
                    engine.add_request(**to_engine_request(msg))
                except ValueError as e:
                    outbox.send(StageFailure(stage=name, message=str(e), request_id=msg.request_id))
            elif isinstance(msg, AbortRequests):
                for rid in msg.request_ids:
                    engine.abort(rid)
            elif isinstance(msg, HealthCheck):
                outbox.send(HealthReply(stage=name, nonce=msg.nonce, stats=engine_stats(engine)))
            elif isinstance(msg, Shutdown):
                running = False
                break
            try:
                msg = inbox.recv(timeout_ms=0)
            except ProtocolError as e:
                log.warning("dropped a malformed message: %s", e)
                msg = None
        if running and engine.has_unfinished():
            t = time.perf_counter()
            outputs = engine.step()
            if outputs:
                outbox.send(StageOutputs(stage=name, outputs=[to_stage_output(o) for o in outputs],
                                         step_time=time.perf_counter() - t))
    _flush_and_close(outbox, inbox, ctx)


def _flush_and_close(outbox, inbox, ctx) -> None:
    """Give queued replies a moment to leave (channels close with LINGER 0), then close."""
    import zmq

    outbox.socket.setsockopt(zmq.LINGER, 2000)
    outbox.socket.close()
    inbox.close()
    ctx.term()


def engine_stats(engine) -> dict:
    """Plain-number stats for health replies."""
    stats = dict(engine.stats) if hasattr(engine, "stats") else {}
    stats["num_compilations"] = engine.num_compilations
    sched = getattr(engine, "scheduler", None)
    if sched is not None and hasattr(sched, "make_stats"):
        stats.update(sched.make_stats())
    return {k: float(v) for k, v in stats.items() if isinstance(v, (int, float))}


def to_stage_output(o):
    """EngineOutput -> the wire's StageOutput."""
    from .protocol import StageOutput

    return StageOutput(request_id=o.request_id, new_token_ids=list(o.new_token_ids), finished=o.finished,
                       finish_reason=o.finish_reason, stop_reason=o.stop_reason, error=o.error,
                       text_delta=o.text_delta, hidden_states=o.hidden_states, hidden_offset=o.hidden_offset,
                       num_cached_tokens=o.num_cached_tokens, logprobs=o.logprobs,
                       audio=o.audio, codes=o.codes)


def main(argv=None) -> None:
    """`python -m omni_jax.engine.stage_worker JSON`: JSON holds stage_main's keyword arguments."""
    args = json.loads((argv or sys.argv[1:])[0])
    stage_main(**args)


if __name__ == "__main__":
    main()
