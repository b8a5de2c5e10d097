"""A stage over several JAX processes (jax.distributed): process 0 serves, the others follow.

A stage with `num_processes` > 1 spans the devices of that many JAX processes, and its jitted
programs are SPMD: every process must launch the same programs in the same order with the
same replicated inputs, or the collectives inside them wait for ever. The engine is
deterministic given its inputs, so the stage keeps its processes' inputs equal instead of
shipping device calls (vLLM's multi-node workers likewise each run the step on the
scheduler's broadcast output):

* process 0 is the stage process the orchestrator started. It runs the stage loop as a
  one-process stage does, and after each turn sends every follower a `StageTick`: the
  messages it handled (requests, stage-to-stage data), in order, and whether it then stepped;
* a follower runs the same `StageServer` on each tick with its replies discarded, so its
  scheduler makes the same decisions and its runner launches the same programs. Only
  process 0 talks to the orchestrator and to the other stages.

What a process would otherwise choose for itself is pinned by process 0 before it handles a
message: an unseeded random request's seed (the engine draws one at random) and a missing
arrival time (the scheduler's order). The processes share one PYTHONHASHSEED, `HASH_SEED`
(set by the stage client and `omni-jax stage-process`), and the KV block count is the smallest any process can hold (runner.py).
Each tick carries a digest of process 0's outputs at its last step; a follower whose own
differ is out of step (something above was missed) and stops the stage, rather than letting
the processes launch different programs and wait on each other for ever.

Start: all processes call `jax.distributed.initialize` (XLA:CPU needs gloo collectives
across processes) and check that their stage configs are the same. On one host (no
`coordinator_address`), process 0 picks a free 127.0.0.1 port for the coordinator, starts
processes 1.. itself, and ticks travel over ipc sockets in the orchestrator's private
directory. Over several hosts, the user starts processes 1.. there (`omni-jax stage-process`);
process 0 serves the coordinator on `coordinator_address` ("host:port") and process N's
ticks on port + N, on that address only: like jax.distributed's own, these are for a private
network (no authentication).

Failure: a follower exits when process 0 does (the parent watchdog of the stage worker on
one host, jax.distributed's heartbeat across hosts), and process 0 exits as soon as a local
follower does, since it could only wait in a collective for ever (a remote one: when the
heartbeat times out); the orchestrator then fails the stage's requests and starts the stage
again, as for any stage that died.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time

import jax
import msgspec.structs
import numpy as np
import zmq
from jax.experimental import multihost_utils

from ..config import StageConfig
from ..engine.protocol import AddRequest, StageTick
from .transport import Channel, encode, ipc_address

log = logging.getLogger("omni_jax.stage")

# How often process 0 looks at its local followers, and how long jax.distributed may take to
# notice a process gone (its heartbeat; the watchdog here is quicker) or to shut down.
WATCH_PERIOD_S = 0.2
HASH_SEED = "0"  # PYTHONHASHSEED of every process of a multi-process stage
HEARTBEAT_TIMEOUT_S = 10
SHUTDOWN_TIMEOUT_S = 10


def tick_address(stage: StageConfig, ipc_dir: str | None, process_id: int) -> str:
    """Where process `process_id` receives its ticks (see the module docstring)."""
    if stage.coordinator_address is None:
        return ipc_address(ipc_dir, f"{stage.name}-tick{process_id}")
    host, port = stage.coordinator_address.rsplit(":", 1)
    return f"tcp://{host}:{int(port) + process_id}"


def local_coordinator() -> str:
    """A coordinator address free on 127.0.0.1 now (jax.distributed binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def initialize(stage: StageConfig, process_id: int, coordinator: str) -> None:
    """Join the stage's jax.distributed job, before JAX creates its backend."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, stage.num_processes, process_id, coordinator_bind_address=coordinator,
                               initialization_timeout=int(stage.ready_timeout_s),
                               heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
                               shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S)


def check_same_stage(stage: StageConfig, family: str, async_chunk: bool) -> None:
    """Every process builds the engine process 0 builds, or the stage does not start."""
    mine = json.dumps([stage.to_dict(), family, async_chunk], sort_keys=True).encode()
    digest = np.frombuffer(hashlib.blake2b(mine, digest_size=8).digest(), np.uint32)
    if not np.array_equal(multihost_utils.broadcast_one_to_all(digest), digest):
        raise ValueError(f"stage {stage.name!r}: process {jax.process_index()} was started with another stage "
                         f"config, family or async_chunk than process 0 (start it with the same pipeline)")


def start_followers(worker_args: dict, num_processes: int, coordinator: str) -> list[subprocess.Popen]:
    """Processes 1.. of the stage, on this host: the stage worker again, with their process id,
    the coordinator, and this process as the parent they live and die with."""
    procs = []
    for process_id in range(1, num_processes):
        args = dict(worker_args, parent_pid=os.getpid(), process_id=process_id, coordinator=coordinator)
        procs.append(subprocess.Popen([sys.executable, "-m", "omni_jax.runtime.stage_worker", json.dumps(args)],
                                      stdin=subprocess.DEVNULL))
    return procs


class FollowerWatch:
    """Exit process 0 at once when one of its followers exits before the stage shuts down."""

    def __init__(self, stage: str, procs: list[subprocess.Popen]):
        self.stage, self.procs, self.stopping = stage, procs, False
        threading.Thread(target=self._watch, name="follower-watchdog", daemon=True).start()

    def _watch(self) -> None:
        while not self.stopping:
            time.sleep(WATCH_PERIOD_S)
            self._exit_if_one_is_gone()

    def _exit_if_one_is_gone(self) -> None:
        for process_id, p in enumerate(self.procs, start=1):
            if p.poll() is not None and not self.stopping:
                log.error("stage %r: its process %d (pid %d) exited with code %s; the stage stops",
                          self.stage, process_id, p.pid, p.returncode)
                os._exit(1)

    def after_failed_step(self, grace_s: float = 1.0) -> None:
        """A step failed: if a follower is gone (the collective found its sockets closed, and its
        exit shows a moment later), stop now rather than fail the step's requests with the
        collective's error and go on alone."""
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            self._exit_if_one_is_gone()
            time.sleep(0.05)

    def wait(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Let the followers exit (killed if they do not in time)."""
        for p in self.procs:
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()


def leave(watch: FollowerWatch | None) -> None:
    """Process 0, after its Shutdown tick: leave the distributed job with the others (their
    exits are no longer failures), then let those it started exit."""
    if watch is not None:
        watch.stopping = True
    jax.distributed.shutdown()
    if watch is not None:
        watch.wait()


def outputs_digest(outputs) -> str:
    """What a step produced, as far as the next steps depend on it: each output's request,
    new tokens and end."""
    h = hashlib.blake2b(digest_size=8)
    for o in outputs:
        h.update(repr((o.request_id, list(o.new_token_ids), o.finished, o.finish_reason)).encode())
    return h.hexdigest()


class Leader:
    """Process 0's side: pins and records the messages of one loop turn, then sends them."""

    def __init__(self, stage: StageConfig, ipc_dir: str, ctx: zmq.Context, watch: FollowerWatch | None):
        """`watch`: the followers process 0 started (None: on other hosts)."""
        self.channels = [Channel(zmq.PUSH, tick_address(stage, ipc_dir, p), bind=True, context=ctx)
                         for p in range(1, stage.num_processes)]
        self.watch = watch
        self.messages: list = []

    @staticmethod
    def pin(msg):
        """`msg` with what each process would draw for itself fixed (see the module docstring)."""
        if not isinstance(msg, AddRequest):
            return msg
        changes = {}
        if not msg.arrival_time:
            changes["arrival_time"] = time.monotonic()
        params = msg.sampling_params
        if params is not None and params.seed is None and not params.is_greedy:
            changes["sampling_params"] = params.with_seed()
        return msgspec.structs.replace(msg, **changes) if changes else msg

    def record(self, msg) -> None:
        self.messages.append(msg)

    def publish(self, step: bool, last_step: str) -> None:
        """Send this turn to every follower (nothing when nothing happened), with the digest
        of the outputs of the last step."""
        if not self.messages and not step:
            return
        frames = encode(StageTick(messages=self.messages, step=step, last_step=last_step))
        for channel in self.channels:
            channel.send_frames(frames)
        self.messages = []

    def after_failed_step(self) -> None:
        if self.watch is not None:
            self.watch.after_failed_step()

    def close(self) -> None:
        for channel in self.channels:
            channel.socket.close(linger=2000)  # the last tick (Shutdown) must leave


def ticks(stage: StageConfig, ipc_dir: str | None, process_id: int, ctx: zmq.Context) -> Channel:
    """A follower's end of its tick channel."""
    return Channel(zmq.PULL, tick_address(stage, ipc_dir, process_id), bind=False, decode_type=StageTick,
                   context=ctx)
