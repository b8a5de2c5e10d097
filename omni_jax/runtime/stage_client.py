"""The orchestrator's handle on one stage process: `StageClient` spawns it, talks to it, stops it.

The client binds the stage's two ipc sockets (requests out, replies in) inside the
orchestrator's private 0700 directory, spawns the process, and waits for its `Ready` with a
timeout that names the stage. Only the orchestrator thread uses the sockets after start-up
(ZMQ sockets are not thread-safe).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import zmq

from ..engine.protocol import AbortRequests, AddRequest, HealthCheck, Ready, Shutdown, StageFailure, StageReply
from ..errors import StageStartupError
from . import spmd
from .transport import Channel, stage_addresses

# How long a send to a stage may wait. Sockets queue without limit (DEFAULT_HWM), so a send
# waits only when the stage's end is gone: a stage that exited leaves its PUSH socket with
# no peer, and an unbounded send would stop the orchestrator thread, and every request, for ever.
SEND_TIMEOUT_MS = 200


class StageClient:
    """Spawn, talk to, and stop one stage process."""

    def __init__(self, stage_cfg, family: str, ckpt_dir: str, ipc_dir: str, zmq_ctx: zmq.Context,
                 async_chunk: bool = False):
        self.cfg = stage_cfg
        self.name = stage_cfg.name
        addrs = stage_addresses(ipc_dir, self.name)
        self.requests = Channel(zmq.PUSH, addrs.requests, bind=True, context=zmq_ctx)
        self.replies = Channel(zmq.PULL, addrs.replies, bind=True, decode_type=StageReply, context=zmq_ctx)
        self._argv = [sys.executable, "-m", "omni_jax.runtime.stage_worker", json.dumps(dict(
            stage_json=json.dumps(stage_cfg.to_dict()), ckpt_dir=ckpt_dir, family=family, ipc_dir=ipc_dir,
            parent_pid=os.getpid(), async_chunk=async_chunk))]
        self.process: subprocess.Popen | None = None
        self.ready: Ready | None = None
        self.dead_reason: str | None = None       # the process exited
        self.unhealthy_reason: str | None = None  # alive but silent for longer than health_timeout_s
        self.last_heard = 0.0                     # time.monotonic() of its last message
        self.restarting: str | None = None        # why it is being started again, until its Ready
        self.restart_time = 0.0                   # time.monotonic() of the last restart
        self.num_restarts = 0
        self._asked_to_exit = False

    def start(self) -> None:
        env = None
        if self.cfg.num_processes > 1:  # the processes of one stage hash alike (spmd.py)
            env = dict(os.environ, PYTHONHASHSEED=spmd.HASH_SEED)
        self.process = subprocess.Popen(self._argv, stdin=subprocess.DEVNULL, env=env)

    def restart(self, reason: str) -> None:
        """Kill what is left of the process and start a new one on the same sockets; its `Ready`
        comes through the replies channel like any message (the caller does not wait for it)."""
        self.kill()
        self.start()
        self.restarting, self.restart_time = reason, time.monotonic()
        self.dead_reason = self.unhealthy_reason = None
        self.num_restarts += 1

    @property
    def exitcode(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def wait_ready(self, timeout_s: float) -> Ready:
        """Block until the stage says Ready; raise StageStartupError naming it otherwise."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            msg = self.replies.recv(timeout_ms=200)
            if isinstance(msg, Ready):
                self.ready = msg
                self.last_heard = time.monotonic()
                return msg
            if isinstance(msg, StageFailure):
                self.kill()
                raise StageStartupError(msg.message)
            if not self.is_alive():
                raise StageStartupError(f"stage {self.name!r} exited with code {self.exitcode} "
                                        f"before it was ready")
        self.kill()
        raise StageStartupError(f"stage {self.name!r} was not ready within {timeout_s:.0f}s "
                                f"(loading and compiling took too long; raise ready_timeout_s)")

    def add(self, msg: AddRequest) -> bool:
        """Send a request; False if the stage cannot take messages (it exited)."""
        return self._send(msg)

    def abort(self, request_ids: list[str]) -> bool:
        return not request_ids or self._send(AbortRequests(request_ids=list(request_ids)))

    def health_check(self, nonce: int) -> bool:
        return self._send(HealthCheck(nonce=nonce))

    def _send(self, msg) -> bool:
        try:
            self.requests.send(msg, timeout_ms=SEND_TIMEOUT_MS)
            return True
        except TimeoutError:
            return False

    def is_alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def ask_to_exit(self) -> None:
        """Send a ready stage its `Shutdown`. One still starting (or starting again) is not
        asked: it reads no message until it has loaded and compiled everything, and holds no
        request yet, so `close` kills it at once."""
        if self.is_alive() and self.ready is not None and self.restarting is None:
            try:
                self.requests.send(Shutdown(), timeout_ms=1000)
                self._asked_to_exit = True
            except (zmq.ZMQError, TimeoutError):
                pass

    def close(self, deadline: float) -> None:
        """Wait until `deadline` (time.monotonic()) for a stage asked to exit, kill whatever is
        left, close the sockets."""
        if self._asked_to_exit and self.is_alive():
            try:
                self.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        self.requests.close()
        self.replies.close()

    def kill(self) -> None:
        if self.is_alive():
            self.process.kill()
        if self.process is not None:
            self.process.wait(5.0)


def close_stages(clients, timeout_s: float) -> None:
    """Stop stage processes: every ready one asked to exit first, then each waited for until one
    deadline (asked and waited for one at a time, their exits added up: the tiny three-stage
    engine's took 3.0 s, 1.8 s side by side), the rest killed, every socket closed."""
    clients = list(clients)
    for c in clients:
        c.ask_to_exit()
    deadline = time.monotonic() + timeout_s
    for c in clients:
        try:
            c.close(deadline)
        except Exception:
            c.kill()
