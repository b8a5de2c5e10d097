"""The loop of a stage process: build the stage's engine (the family object maps each model
stage to a builder that loads its checkpoint part and warms it up), say Ready, then
receive -> step -> send.

Three sockets: requests from the orchestrator (add, abort, health, shutdown), replies to
it (outputs, failures), and this stage's data inbox, where the stage before it sends the
`StageData` of the requests this stage takes as input. Such a request waits here (not in
the engine) until its input is complete, or with async chunk until enough of it has come;
then the family's stage-input function builds its engine request in this process, and with
async chunk the rest follows into the engine (`extend_request`) as it arrives. Outputs of a
request with `forward_to` go to that stage's inbox as `StageData`; the orchestrator gets
them without codes, and with hidden states only of the layers and rows the caller asked for
(`AddRequest.output_hidden_states`).

A stage over several JAX processes runs this loop in process 0, which sends each turn to
the others (`follow`, runtime/spmd.py).

A request the engine rejects, whose input cannot be built or taken, or whose adding meets an
unexpected error, comes back as a `StageFailure` naming it; a malformed message is logged and
dropped; an exception in a step fails that step's requests (inside the engine) and the loop
goes on.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import sys
import time
import traceback

import jax
import msgspec.structs
import numpy as np
import zmq

from ..checkpoint import read_config
from ..config import StageConfig
from ..engine.protocol import (AbortRequests, AddRequest, HealthCheck, HealthReply, Ready, Shutdown, StageData,
                               StageFailure, StageOutputs, StageRequest)
from ..engine import program_cache
from ..engine.sharding import stage_devices
from ..engine.stage_engine import StageEngine
from ..models.handoff import UpstreamOutputs
from ..models.registry import get_family
from ..paths import cache_root
from . import spmd
from .transport import Channel, stage_addresses
from ..errors import ErrorCode, OutOfStep, ProtocolError, error_code

log = logging.getLogger("omni_jax.stage")

# How long the loop sleeps in poll when the engine has nothing to do (ms).
IDLE_POLL_MS = 20
# Ids of requests whose input is no longer wanted (aborted, or complete while the stage
# before goes on, e.g. past an end token) remembered, so that their late data is dropped.
CLOSED_MEMORY = 4096


def build_stage_engine(family: str, stage: StageConfig, ckpt_dir: str, async_chunk: bool = False) -> StageEngine:
    """The warmed-up engine of one stage, or a clear error if OmniJax cannot serve it.
    `async_chunk`: the pipeline streams between stages (what the engine compiles for)."""
    engines = get_family(family).engines
    if stage.model_stage not in engines:
        known = ", ".join(f"{family}/{s}" for s in engines)
        raise ValueError(f"no engine for stage {stage.model_stage!r} of {family!r} yet (available: {known})")
    return engines[stage.model_stage](stage, ckpt_dir, async_chunk)


def to_engine_request(msg, stream: bool = False) -> dict:
    """AddRequest -> keyword arguments of the engine's `add_request` (the same inputs and media
    types); `stream`: more input follows through `extend_request`."""
    kw = dict(request_id=msg.request_id, prompt_token_ids=np.asarray(msg.prompt_token_ids),
              sampling_params=msg.sampling_params, arrival_time=msg.arrival_time or None)
    if stream:
        kw["stream"] = True
    if msg.voice is not None:  # vocoder stages
        kw["voice"] = msg.voice
    else:
        kw.update(inputs=msg.inputs, multi_modal_data=msg.multi_modal)
    return kw


class StageServer:
    """One stage's engine behind its sockets (see module docstring)."""

    def __init__(self, stage: StageConfig, engine: StageEngine, family: str, ckpt_dir: str, ipc_dir: str, ctx: zmq.Context,
                 inbox: Channel | None, outbox: Channel | None, leader: spmd.Leader | None = None):
        """`leader`: this is process 0 of a multi-process stage; inbox and outbox None: one of
        its other processes (see `follow`), whose replies go nowhere."""
        self.name, self.stage, self.engine = stage.name, stage, engine
        self.family, self.ckpt_dir, self.ipc_dir, self.ctx = family, ckpt_dir, ipc_dir, ctx
        self.inbox, self.outbox, self.leader = inbox, outbox or _DISCARD, leader
        self.data_inbox = None if inbox is None else Channel(
            zmq.PULL, stage_addresses(ipc_dir, self.name).data, bind=True, decode_type=StageData, context=ctx)
        self._handoff = None                       # the family's stage-input functions, on first use
        self._peers: dict[str, Channel] = {}       # stage -> its data inbox
        self.forward: dict[str, str] = {}          # request id -> stage its outputs go to
        self.waiting: dict[str, AddRequest] = {}   # request id -> add message waiting for its input
        self.upstream: dict[str, UpstreamOutputs] = {}
        self.streamed: dict[str, list] = {}        # started, input still coming: id -> [add message, units given]
        self.caller_hidden: dict[str, tuple[list[int], int]] = {}  # id -> (layers, first position) the caller wants
        self.closed: collections.OrderedDict[str, None] = collections.OrderedDict()
        # A stage over several processes: the digest of the last step's outputs (spmd.py).
        self.last_step = spmd.outputs_digest(()) if leader is not None or inbox is None else None

    def serve(self) -> None:
        """Receive, step and send until Shutdown."""
        poller = zmq.Poller()
        poller.register(self.inbox.socket, zmq.POLLIN)
        poller.register(self.data_inbox.socket, zmq.POLLIN)
        running = True
        while running:
            poller.poll(0 if self.engine.has_unfinished() else IDLE_POLL_MS)
            running = self._drain(self.inbox, self._on_request)
            self._drain(self.data_inbox, self._on_data)
            step = running and self.engine.has_unfinished()
            if self.leader is not None:
                self.leader.publish(step, self.last_step)
            if step:
                self._step()

    def follow(self, ticks: Channel) -> None:
        """Another process of a multi-process stage: do what process 0 did, turn by turn, until
        Shutdown (runtime/spmd.py)."""
        steps = 0
        while True:
            tick = ticks.recv()
            if tick.last_step != self.last_step:
                raise OutOfStep(f"stage {self.name!r}: this process's outputs at step {steps} differ from "
                                     f"process 0's")
            for msg in tick.messages:
                if (self._on_data(msg) if isinstance(msg, StageData) else self._on_request(msg)) is False:
                    return
            if tick.step:
                self._step()
                steps += 1

    def _drain(self, channel: Channel, handle) -> bool:
        """Handle every queued message; False once Shutdown arrived."""
        while True:
            try:
                msg = channel.recv(timeout_ms=0)
            except ProtocolError as e:
                log.warning("dropped a malformed message: %s", e)
                if e.request_id is not None and channel is self.inbox:
                    self._fail(e.request_id, f"stage {self.name!r} could not read the request: {e}", "invalid_request")
                continue
            if msg is None:
                return True
            if self.leader is not None:
                msg = self.leader.pin(msg)
                self.leader.record(msg)
            if handle(msg) is False:
                return False

    # ------------------------------------------------------------------ control
    def _on_request(self, msg) -> bool:
        if isinstance(msg, AddRequest):
            self.closed.pop(msg.request_id, None)  # an id may be used again once its request ended
            if msg.inputs_from is not None:
                self.waiting[msg.request_id] = msg
                self._start_if_ready(msg.request_id)
            else:
                self._add(msg)
        elif isinstance(msg, AbortRequests):
            for rid in msg.request_ids:
                self._abort(rid)
        elif isinstance(msg, HealthCheck):
            stats = engine_stats(self.engine) | {"num_waiting_for_input": float(len(self.waiting)),
                                                 "num_streamed_inputs": float(len(self.streamed))}
            self.outbox.send(HealthReply(stage=self.name, nonce=msg.nonce, stats=stats))
        elif isinstance(msg, Shutdown):
            return False
        return True

    def _add(self, msg: AddRequest, stream: bool = False) -> bool:
        try:
            self.engine.add_request(**to_engine_request(msg, stream))
        except ValueError as e:
            self._fail(msg.request_id, str(e), error_code(e))
            return False
        except Exception as e:  # a bug met by this request's input: it fails, the stage and the others go on
            log.exception("stage %r: adding request %r failed", self.name, msg.request_id)
            self._fail(msg.request_id, f"adding the request to stage {self.name!r} failed: {type(e).__name__}: {e}")
            return False
        if msg.forward_to is not None:
            self.forward[msg.request_id] = msg.forward_to
        if msg.output_hidden_states:
            first = 0 if msg.hidden_states_include_prompt else len(msg.prompt_token_ids)
            self.caller_hidden[msg.request_id] = (list(msg.output_hidden_states), first)
        return True

    def _forget(self, rid: str) -> None:
        """Drop what this stage holds of a request's input."""
        self.waiting.pop(rid, None)
        self.upstream.pop(rid, None)
        self.streamed.pop(rid, None)

    def _abort(self, rid: str) -> None:
        self.engine.abort(rid)
        self.caller_hidden.pop(rid, None)
        self._close(rid)

    def _close(self, rid: str) -> None:
        """Forget a request's input and drop whatever more of it arrives."""
        self._forget(rid)
        self.closed[rid] = None
        while len(self.closed) > CLOSED_MEMORY:
            self.closed.popitem(last=False)

    def _fail(self, rid: str, message: str, code: ErrorCode = "internal") -> None:
        self.outbox.send(StageFailure(stage=self.name, message=message, request_id=rid, error_code=code))

    # ------------------------------------------------------------------ input from the stage before
    def _on_data(self, data: StageData) -> None:
        rid = data.request_id
        if rid in self.closed:
            return
        if data.finish_reason in ("abort", "error"):
            # The orchestrator fails or aborts the request everywhere; nothing to build.
            self._close(rid)
            return
        self.upstream.setdefault(rid, UpstreamOutputs()).add(data)
        if rid in self.streamed:
            self._feed(rid)
        else:
            self._start_if_ready(rid)

    def _start_if_ready(self, rid: str) -> None:
        """Build and add the request once its add message and its input (with async chunk:
        enough of it) are here."""
        msg, upstream = self.waiting.get(rid), self.upstream.get(rid)
        if msg is None or upstream is None or not (upstream.finished or msg.async_chunk):
            return
        try:
            built = self.handoff.stage_input(self.stage.model_stage, msg, upstream)
        except Exception as e:  # a family's input function failing is this request's error
            self._close(rid)
            self._fail(rid, f"building the {self.name!r} input failed: {type(e).__name__}: {e}")
            return
        if built is None:
            return
        del self.waiting[rid]
        if not self._add(msgspec.structs.replace(built, forward_to=msg.forward_to), stream=msg.async_chunk):
            self._close(rid)
        elif msg.async_chunk:
            self.streamed[rid] = [msg, _input_units(built)]
            self._feed(rid)
        else:
            self._close(rid)

    def _feed(self, rid: str) -> None:
        """Pass a started request the input that became final since (async chunk)."""
        msg, have = self.streamed[rid]
        upstream = self.upstream[rid]
        try:
            more, complete = self.handoff.more_input(self.stage.model_stage, msg, upstream, have)
            taken = not (len(more) or complete) or self.engine.extend_request(rid, more, complete)
        except Exception as e:  # this request's input, not the stage: the others keep running
            self._abort(rid)
            self._fail(rid, f"building the {self.name!r} input failed: {type(e).__name__}: {e}")
            return
        if not taken:
            self._close(rid)  # it finished here already (e.g. the talker's end token)
            return
        self.streamed[rid][1] = have + len(more)
        if complete:
            self._close(rid)

    @property
    def handoff(self):
        if self._handoff is None:
            self._handoff = get_family(self.family).handoff(self.ckpt_dir)
        return self._handoff

    # ------------------------------------------------------------------ step
    def _step(self) -> None:
        t = time.perf_counter()
        failed = self.engine.stats["failed_steps"] if self.leader is not None else 0
        outputs = self.engine.step()
        if self.leader is not None and self.engine.stats["failed_steps"] > failed:
            self.leader.after_failed_step()
        if self.last_step is not None:
            self.last_step = spmd.outputs_digest(outputs)
        if not outputs:
            return
        replies = []
        for o in outputs:
            target = self.forward.get(o.request_id)
            if target is not None:
                self._peer(target).send(StageData(
                    request_id=o.request_id, token_ids=o.new_token_ids, hidden_states=o.hidden_states,
                    hidden_offset=o.hidden_offset, codes=o.codes, finished=o.finished,
                    finish_reason=o.finish_reason))
                o.codes = None  # the next stage has them; the orchestrator does not need them
                if o.finished:
                    del self.forward[o.request_id]
            o.hidden_states, o.hidden_offset = self._caller_rows(o)
            if o.new_token_ids or o.finished or o.text_delta or o.audio is not None or o.hidden_states:
                replies.append(o)
        if replies:
            self.outbox.send(StageOutputs(stage=self.name, outputs=replies, step_time=time.perf_counter() - t))

    def _caller_rows(self, o) -> tuple[dict | None, int]:
        """(the hidden rows of this output the caller asked for, their first position); (None, 0)
        when it asked for none: nothing else leaves for the orchestrator."""
        want = self.caller_hidden.pop(o.request_id, None) if o.finished else self.caller_hidden.get(o.request_id)
        if want is None or not o.hidden_states:
            return None, 0
        layers, first = want
        skip = max(0, first - o.hidden_offset)
        # Layers this stage does not capture are left out (the front end refuses them first).
        rows = {k: o.hidden_states[k][skip:] for k in layers if k in o.hidden_states}
        if not rows or not len(next(iter(rows.values()))):
            return None, 0
        return rows, o.hidden_offset + skip

    def _peer(self, stage: str) -> Channel:
        if self.inbox is None:
            return _DISCARD
        if stage not in self._peers:
            self._peers[stage] = Channel(zmq.PUSH, stage_addresses(self.ipc_dir, stage).data, bind=False,
                                         context=self.ctx)
        return self._peers[stage]

    def close(self) -> None:
        for c in (self.data_inbox, *self._peers.values()):
            if c is not None:
                c.close()
        if self.leader is not None:
            self.leader.close()


class _Discard:
    """Where the replies of a follower process go (process 0 sends the stage's)."""

    def send(self, msg) -> None:
        pass


_DISCARD = _Discard()


def _input_units(built: AddRequest) -> int:
    """How much input a request built from partial input holds, in the units `more_input`
    counts: per-step rows for a stage fed embeddings (talker), codec tokens for a vocoder."""
    if built.inputs is not None and built.inputs.extra_embeds is not None:
        return len(built.inputs.extra_embeds)
    return len(built.prompt_token_ids)


def serve_stage(stage: dict, ckpt_dir: str, family: str, ipc_dir: str, async_chunk: bool = False) -> None:
    """Serve one stage until `Shutdown` (exits the process if the stage cannot start). A stage
    over several processes starts the others here first (runtime/spmd.py)."""
    name = stage["name"]
    addrs = stage_addresses(ipc_dir, name)
    ctx = zmq.Context()
    inbox = Channel(zmq.PULL, addrs.requests, bind=False, decode_type=StageRequest, context=ctx)
    outbox = Channel(zmq.PUSH, addrs.replies, bind=False, context=ctx)
    followers = None
    try:
        t0 = time.perf_counter()
        config = StageConfig.from_dict(stage)
        leader = None
        if config.num_processes > 1:
            coordinator = config.coordinator_address
            if coordinator is None:  # every process on this host: start the others
                coordinator = spmd.local_coordinator()
                followers = spmd.FollowerWatch(name, spmd.start_followers(
                    dict(stage_json=json.dumps(stage), ckpt_dir=ckpt_dir, family=family, ipc_dir=ipc_dir,
                         async_chunk=async_chunk), config.num_processes, coordinator))
            leader = spmd.Leader(config, ipc_dir, ctx, followers)
            spmd.initialize(config, 0, coordinator)
            spmd.check_same_stage(config, family, async_chunk)
        _use_stage_device(config)
        if config.num_processes == 1:
            activate_program_cache(stage, ckpt_dir, family, async_chunk)
        # Start-up is the longest silence a user meets (a real model's compiles take minutes):
        # say what is happening and when it is done.
        print(f"[omni-jax] stage {name!r}: loading and compiling its programs", file=sys.stderr, flush=True)
        engine = build_stage_engine(family, config, ckpt_dir, async_chunk)
        server = StageServer(config, engine, family, ckpt_dir, ipc_dir, ctx, inbox, outbox, leader)
        seconds = time.perf_counter() - t0
        print(f"[omni-jax] stage {name!r} ready in {seconds:.1f} s{_programs_read_back()}", file=sys.stderr, flush=True)
        outbox.send(Ready(stage=name, pid=os.getpid(), warmup_seconds=seconds, num_compilations=engine.num_compilations))
    except BaseException as e:  # report why the stage could not start, then exit
        outbox.send(StageFailure(stage=name, message=f"stage {name!r} failed to start: "
                                                     f"{type(e).__name__}: {e}"))
        log.error("startup failed:\n%s", traceback.format_exc())
        _flush_and_close(outbox, inbox, ctx)
        sys.exit(1)
    server.serve()
    if config.num_processes > 1:
        spmd.leave(followers)
    server.close()
    _flush_and_close(outbox, inbox, ctx)


def follow_stage(stage: dict, ckpt_dir: str, family: str, ipc_dir: str | None, async_chunk: bool,
                 process_id: int, coordinator: str) -> None:
    """Process `process_id` > 0 of a multi-process stage: build the same engine, then follow
    process 0's ticks until Shutdown (runtime/spmd.py). `ipc_dir`: the orchestrator's, when
    process 0 started this one on its host."""
    config = StageConfig.from_dict(stage)
    ctx = zmq.Context()
    ticks = spmd.ticks(config, ipc_dir, process_id, ctx)
    spmd.initialize(config, process_id, coordinator)
    spmd.check_same_stage(config, family, async_chunk)
    engine = build_stage_engine(family, config, ckpt_dir, async_chunk)
    log.info("process %d of %d is ready", process_id, config.num_processes)
    server = StageServer(config, engine, family, ckpt_dir, ipc_dir, ctx, None, None)
    server.follow(ticks)
    jax.distributed.shutdown()  # with process 0, after the Shutdown tick
    server.close()
    ticks.close()
    ctx.term()


def activate_program_cache(stage: dict, ckpt_dir: str, family: str, async_chunk: bool) -> None:
    """Keep the stage's traced programs (steps, media encoders, vocoders) under the OmniJax cache
    (engine/program_cache.py), scoped by what the stage is built from: a restart reads them back
    instead of tracing.
    `OMNI_JAX_PROGRAM_CACHE_DIR` chooses another place ("" turns it off)."""
    directory = os.environ.get("OMNI_JAX_PROGRAM_CACHE_DIR", os.path.join(cache_root(), "program-cache"))
    if directory:
        program_cache.activate(directory, dict(family=family, stage=stage, checkpoint=read_config(ckpt_dir),
                                               async_chunk=async_chunk))


def _programs_read_back() -> str:
    """What the program cache saved this start, for the stage's ready line ("" without one)."""
    cache = program_cache.active()
    if cache is None or not sum(cache.stats.values()):
        return ""
    return f" ({cache.stats['loaded']} of {sum(cache.stats.values())} programs read back from the program cache)"


def _use_stage_device(config: StageConfig) -> None:
    """A one-device stage (no mesh) runs on the default device: make it the stage's own.
    On GPU that is the one device the process sees (CUDA_VISIBLE_DEVICES, stage_worker.py);
    on CPU every process sees all (fake) devices, and `devices: [N]` picks the Nth
    (engine/sharding.stage_devices; a missing one fails the stage's start, naming it)."""
    if config.devices is not None and len(config.devices) == 1:
        device = stage_devices(config.devices, 1)[0]
        jax.config.update("jax_default_device", device)
        log.info("runs on %s", device)


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
