"""The loop of a stage process: load the stage's engine, say Ready, then receive -> step -> send.

A request the engine rejects comes back as a `StageFailure` naming it; a malformed
message is logged and dropped; an exception in a step fails that step's requests
(inside the engine) and the loop goes on.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback

import zmq

from ..config import StageConfig
from ..engine.protocol import (AbortRequests, AddRequest, HealthCheck, HealthReply, Ready, Shutdown, StageFailure,
                               StageOutput, StageOutputs, StageRequest)
from .stage_factory import build_stage_engine, to_engine_request
from .transport import Channel, ProtocolError

log = logging.getLogger("omni_jax.stage")

# How long the loop sleeps in poll when the engine has nothing to do (ms).
IDLE_POLL_MS = 20


def serve_stage(stage: dict, ckpt_dir: str, family: str, in_addr: str, out_addr: str) -> None:
    """Serve one stage until `Shutdown` (exits the process if the stage cannot start)."""
    name = stage["name"]
    ctx = zmq.Context()
    inbox = Channel(zmq.PULL, in_addr, bind=False, decode_type=StageRequest, context=ctx)
    outbox = Channel(zmq.PUSH, out_addr, bind=False, context=ctx)
    try:
        t0 = time.perf_counter()
        engine = build_stage_engine(family, StageConfig.from_dict(stage), ckpt_dir)
        outbox.send(Ready(stage=name, pid=os.getpid(), warmup_seconds=time.perf_counter() - t0,
                          num_compilations=engine.num_compilations))
    except BaseException as e:  # report why the stage could not start, then exit
        outbox.send(StageFailure(stage=name, message=f"stage {name!r} failed to start: "
                                                     f"{type(e).__name__}: {e}"))
        log.error("startup failed:\n%s", traceback.format_exc())
        _flush_and_close(outbox, inbox, ctx)
        sys.exit(1)

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
    return StageOutput(request_id=o.request_id, new_token_ids=list(o.new_token_ids), finished=o.finished,
                       finish_reason=o.finish_reason, stop_reason=o.stop_reason, error=o.error,
                       text_delta=o.text_delta, hidden_states=o.hidden_states, hidden_offset=o.hidden_offset,
                       num_cached_tokens=o.num_cached_tokens, logprobs=o.logprobs,
                       audio=o.audio, codes=o.codes)


