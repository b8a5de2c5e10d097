"""The orchestrator: one background thread that owns every stage socket.

Callers (the sync and async front ends, any thread) hand it requests through a
queue and get updates through a sink callable. The thread routes control only: it
sends each request to every stage of its chain at once (the first stage gets the
prompt; each later stage is told which stage its input comes from), polls all stages,
streams text deltas and audio back, propagates aborts and failures to every stage, and
records metrics. What one stage feeds the next (hidden states, codes) goes stage to
stage over direct channels and never reaches this process. If a stage process dies, or
stays silent past its health_timeout_s, every request of a chain through it fails with an
error naming the stage within a second; the stage is started again on the same sockets
(auto_restart) while the other stages keep serving, and requests through it are refused
until it is ready. Without auto_restart, or if it cannot start again, the engine is dead
and later submissions raise.

What callers get back is in `outputs`; the handle on each stage process in `stage_client`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import shutil
import threading
import time
from typing import Callable

import msgspec.structs
import numpy as np
import zmq

from ..engine.protocol import AddRequest, HealthReply, Ready, StageFailure, StageOutput, StageOutputs
from ..errors import EngineDeadError, ErrorCode, ProtocolError
from ..models.handoff import PositionRows
from .outputs import OmniRequestOutput, logprobs_of
from .stage_client import StageClient, close_stages
from .transport import private_ipc_dir


log = logging.getLogger("omni_jax.orchestrator")

# How often stage processes are checked for liveness (s).
LIVENESS_PERIOD = 0.2
# How often each stage is sent a heartbeat (s); its answer, or any other message, shows it
# is responsive (see StageConfig.health_timeout_s).
HEARTBEAT_PERIOD = 1.0
# The nonce of heartbeats (stats requests count from 1).
HEARTBEAT_NONCE = 0
# How long shutdown waits for the stages asked to exit before it kills them (s).
STAGE_EXIT_TIMEOUT_S = 5.0


@dataclasses.dataclass
class OrchestratorRequest:
    """One request as the orchestrator tracks it across its stage chain."""

    first: AddRequest
    chain: list[str]                          # stage names, in order
    sink: Callable[[OmniRequestOutput], None]  # called from the orchestrator thread
    output: OmniRequestOutput = None
    stage_params: list = dataclasses.field(default_factory=list)  # SamplingParams per chain stage
    voice: str | None = None
    stage_tokens: dict = dataclasses.field(default_factory=dict)  # stage -> its output token ids so far
    finished_stages: set = dataclasses.field(default_factory=set)
    hidden: dict = dataclasses.field(default_factory=dict)  # layer -> PositionRows the caller asked for
    deadline: float | None = None  # time.monotonic() past which it finishes with finish_reason "timeout"

    @property
    def request_id(self) -> str:
        return self.first.request_id

    def keep_hidden(self, o: StageOutput) -> None:
        """Keep an output's hidden rows by position (a recompute after preemption resends some)."""
        for layer, rows in o.hidden_states.items():
            self.hidden.setdefault(layer, PositionRows()).put(o.hidden_offset, np.array(rows, np.float32))

    def hidden_arrays(self) -> dict[int, np.ndarray]:
        """The asked layers' rows [T, H], from the first position the caller wants (a layer of which
        no row came, e.g. one generated token and no prompt rows, is [0, 0])."""
        first = 0 if self.first.hidden_states_include_prompt else len(self.first.prompt_token_ids)
        empty = np.zeros((0, 0), np.float32)
        return {layer: self.hidden[layer].get(slice(first, None)) if layer in self.hidden else empty
                for layer in self.first.output_hidden_states}

    def stage_messages(self, async_chunk: bool = False) -> list[AddRequest]:
        """What each stage of the chain is sent: the prompt to the first, to each later one the
        user's prompt and media (for its positions; pixels stay out), where its input comes from
        and whether to take it as it is produced (`async_chunk`)."""
        first, n = self.first, len(self.chain)
        msgs = [msgspec.structs.replace(first, forward_to=self.chain[1] if n > 1 else None)]
        if n > 1:
            mm = first.multi_modal
            if mm is not None:
                mm = msgspec.structs.replace(mm, pixel_values=None, pixel_values_videos=None)
            for i in range(1, n):
                msgs.append(AddRequest(request_id=first.request_id, prompt_token_ids=first.prompt_token_ids,
                                       sampling_params=self.stage_params[i], multi_modal=mm,
                                       arrival_time=first.arrival_time, voice=self.voice,
                                       inputs_from=self.chain[i - 1], async_chunk=async_chunk,
                                       forward_to=self.chain[i + 1] if i + 1 < n else None))
        return msgs


def _array_bytes(obj) -> int:
    """Bytes of the numpy arrays inside a message (what crosses as zero-copy frames)."""
    total = 0
    for name in getattr(obj, "__struct_fields__", ()):
        v = getattr(obj, name)
        if isinstance(v, np.ndarray):
            total += v.nbytes
        elif isinstance(v, dict):
            total += sum(a.nbytes for a in v.values() if isinstance(a, np.ndarray))
        elif isinstance(v, list):
            total += sum(a.nbytes if isinstance(a, np.ndarray) else _array_bytes(a) for a in v)
        elif hasattr(v, "__struct_fields__"):
            total += _array_bytes(v)
    return total


class Orchestrator:
    """Starts the stage processes and routes requests between them (see module docstring)."""

    def __init__(self, pipeline, ckpt_dir: str, stage_names: list[str] | None = None):
        self.pipeline = pipeline
        self.ipc_dir = private_ipc_dir()
        self._zmq = zmq.Context()
        names = stage_names or [s.name for s in pipeline.stages]
        self.clients: dict[str, StageClient] = {}
        self.dead: str | None = None
        self._requests: dict[str, OrchestratorRequest] = {}
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_lock = threading.Lock()
        wake_addr = f"inproc://omni-jax-wake-{id(self)}"
        self._wake_pull = self._zmq.socket(zmq.PULL)
        self._wake_pull.bind(wake_addr)
        self._wake_push = self._zmq.socket(zmq.PUSH)
        self._wake_push.connect(wake_addr)
        self._stop = threading.Event()
        self._health: dict = {}
        self._health_nonce = 0
        # Bytes of hidden states that reached this process: stages exchange them directly, so 0.
        self.hidden_state_bytes = 0
        try:
            for name in names:
                self.clients[name] = StageClient(pipeline.stage(name), pipeline.family, ckpt_dir, self.ipc_dir,
                                                 self._zmq, async_chunk=pipeline.async_chunk)
            for c in self.clients.values():
                c.start()
            for c in self.clients.values():
                c.wait_ready(c.cfg.ready_timeout_s)
        except BaseException:
            self._close_all()
            raise
        # Silence counts from now: a stage that was ready long before the last one finished
        # compiling has had nobody to answer yet.
        for c in self.clients.values():
            c.last_heard = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="omni-jax-orchestrator", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ caller side (any thread)
    def submit(self, req: OrchestratorRequest) -> None:
        """Queue a request; its updates go to req.sink from the orchestrator thread."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if self._stop.is_set():
            raise RuntimeError("the engine is shut down")
        self._commands.put(("submit", req))
        self._wake()

    def abort(self, request_id: str, request: "OrchestratorRequest | None" = None) -> None:
        """Abort a request in every stage; its sink gets a final output with finish_reason 'abort'.
        With `request`, only if that is the one in flight under the id (a refused duplicate's
        caller leaving must not abort the original)."""
        self._commands.put(("abort", (request_id, request)))
        self._wake()

    def stage_stats(self, timeout_s: float = 10.0) -> dict[str, dict]:
        """Every stage's engine stats (KV usage, running requests, compilations...) and `healthy`
        (1.0, or 0.0 with nothing else for a stage that died or stopped answering)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("health", fut))
        self._wake()
        try:
            return fut.result(timeout_s)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"no stage stats within {timeout_s:g} s: a stage is busy, or silent for less "
                               f"than its health_timeout_s so far") from None

    def shutdown(self) -> None:
        """Stop the thread and every stage process; safe to call twice."""
        if not self._stop.is_set():
            self._stop.set()
            self._wake()
            self._thread.join(10.0)
        self._close_all()

    def _wake(self) -> None:
        with self._wake_lock:
            try:
                self._wake_push.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    # ------------------------------------------------------------------ the thread
    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_pull, zmq.POLLIN)
        by_socket = {}
        for c in self.clients.values():
            poller.register(c.replies.socket, zmq.POLLIN)
            by_socket[c.replies.socket] = c
        next_check = time.monotonic() + LIVENESS_PERIOD
        next_heartbeat = time.monotonic()
        while not self._stop.is_set():
            try:
                events = dict(poller.poll(timeout=int(LIVENESS_PERIOD * 1000)))
                if self._wake_pull in events:
                    while True:
                        try:
                            self._wake_pull.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                self._drain_commands()
                for sock, client in by_socket.items():
                    if sock in events:
                        self._drain_replies(client)
                if time.monotonic() >= next_heartbeat:
                    for c in self.clients.values():
                        if c.dead_reason is None and c.restarting is None:
                            c.health_check(HEARTBEAT_NONCE)  # an unreachable stage: the liveness check says why
                    next_heartbeat = time.monotonic() + HEARTBEAT_PERIOD
                if time.monotonic() >= next_check:
                    self._check_liveness()
                    self._expire()
                    next_check = time.monotonic() + LIVENESS_PERIOD
            except Exception:  # keep routing whatever one message did
                log.exception("orchestrator loop error")
        for req in list(self._requests.values()):
            self._finish(req, error="the engine was shut down", reason="abort", code="unavailable")

    def _drain_commands(self) -> None:
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                self._start(arg)
            elif kind == "health":
                self._health_nonce += 1
                self._health[self._health_nonce] = (arg, {})
                for c in self._responsive():
                    c.health_check(self._health_nonce)
                self._resolve_stats()
            elif kind == "abort":
                rid, only = arg
                req = self._requests.get(rid)
                if req is not None and (only is None or req is only):
                    self._finish(req, reason="abort")

    def _start(self, req: OrchestratorRequest) -> None:
        if self.dead is not None:
            self._finish(req, error=self.dead, code="unavailable")
            return
        silent = [self.clients[n].unhealthy_reason for n in req.chain if self.clients[n].unhealthy_reason]
        silent += [f"stage {n!r} is restarting ({self.clients[n].restarting}); try again when it is back"
                   for n in req.chain if self.clients[n].restarting]
        if silent:
            self._finish(req, error=silent[0], code="unavailable")
            return
        if req.request_id in self._requests:
            # Refused without touching the request already in flight under that id.
            out = req.output
            out.finished, out.finish_reason = True, "error"
            out.error, out.error_code = f"request id {req.request_id!r} is already in flight", "invalid_request"
            req.sink(out.snapshot())
            return
        self._requests[req.request_id] = req
        for name, msg in zip(req.chain, req.stage_messages(self.pipeline.async_chunk)):
            req.output.metrics.bytes_moved += _array_bytes(msg)
            try:
                sent = self.clients[name].add(msg)
            except ProtocolError as e:  # a value the wire cannot carry (text that is not UTF-8, an object...)
                self._finish(req, error=f"the request cannot be sent to stage {name!r}: {e}", code="invalid_request")
                return
            if not sent:
                self._finish(req, error=f"stage {name!r} takes no messages (exit code {self.clients[name].exitcode})",
                             code="unavailable")
                return

    def _drain_replies(self, client: StageClient) -> None:
        while True:
            try:
                msg = client.replies.recv(timeout_ms=0)
            except ProtocolError as e:
                log.warning("dropped a malformed reply from stage %r: %s", client.name, e)
                continue
            if msg is None:
                return
            client.last_heard = time.monotonic()
            if client.unhealthy_reason is not None:
                log.warning("stage %r answers again", client.name)
                client.unhealthy_reason = None
            if isinstance(msg, StageOutputs):
                self._on_outputs(client.name, msg)
            elif isinstance(msg, Ready) and client.restarting is not None:
                log.warning("stage %r is back, %.1f s after its restart", client.name,
                            time.monotonic() - client.restart_time)
                client.restarting = None
            elif isinstance(msg, StageFailure):
                req = self._requests.get(msg.request_id) if msg.request_id else None
                if req is not None:
                    self._finish(req, error=msg.message, code=msg.error_code)
                elif msg.request_id is None and client.restarting is not None:
                    self._give_up(client, msg.message)  # it could not start again
                elif msg.request_id is None:
                    log.error("stage %r reported: %s", client.name, msg.message)
            elif isinstance(msg, HealthReply) and msg.nonce in self._health:
                self._health[msg.nonce][1][msg.stage] = msg.stats | {"healthy": 1.0}
                self._resolve_stats()

    def _responsive(self) -> list[StageClient]:
        return [c for c in self.clients.values()
                if c.dead_reason is None and c.unhealthy_reason is None and c.restarting is None]

    def _resolve_stats(self) -> None:
        """Answer the stats requests every responsive stage has replied to (the others: healthy 0)."""
        names = {c.name for c in self._responsive()}
        for nonce, (fut, got) in list(self._health.items()):
            if names <= got.keys():
                del self._health[nonce]
                fut.set_result({n: (got[n] if n in names else {"healthy": 0.0})
                                | {"num_restarts": float(c.num_restarts)} for n, c in self.clients.items()})

    def _on_outputs(self, stage: str, msg: StageOutputs) -> None:
        now = time.monotonic()
        for o in msg.outputs:
            req = self._requests.get(o.request_id)
            if req is None or stage not in req.chain:
                continue  # aborted or already failed
            out = req.output
            m = out.metrics
            m.stage_time[stage] = m.stage_time.get(stage, 0.0) + msg.step_time
            if o.hidden_states:  # only the layers the caller asked for get here (stage_loop)
                self.hidden_state_bytes += sum(a.nbytes for a in o.hidden_states.values())
                m.bytes_moved += sum(a.nbytes for a in o.hidden_states.values())
                req.keep_hidden(o)
            req.stage_tokens.setdefault(stage, []).extend(o.new_token_ids)
            if o.error is not None:
                self._finish(req, error=o.error, code=o.error_code or "internal")
                continue
            if stage == req.chain[0] and o.num_cached_tokens:
                out.num_cached_tokens = o.num_cached_tokens
            if self._delivers_text(req, stage) and (o.new_token_ids or o.text_delta):
                if m.first_token_time is None:
                    m.first_token_time = now
                out.token_ids.extend(o.new_token_ids)
                if o.prompt_logprobs is not None:  # vLLM's shape: None for the first position
                    out.prompt_logprobs = [None] + [logprobs_of(e) for e in o.prompt_logprobs]
                if o.logprobs:
                    # Extended in place: rebuilding the list made each token's update O(length).
                    if out.logprobs is None:
                        out.logprobs = []
                    out.logprobs.extend(logprobs_of(e) for e in o.logprobs)
                out.text += o.text_delta
                m.num_output_tokens = len(out.token_ids)
                if o.finished:
                    out.finish_reason, out.stop_reason = o.finish_reason, o.stop_reason
                self._emit(req, new_token_ids=list(o.new_token_ids), text_delta=o.text_delta)
            if o.audio is not None and len(o.audio):
                if m.first_audio_time is None:
                    m.first_audio_time = now
                out.audio = o.audio if out.audio is None else np.concatenate([out.audio, o.audio])
                m.audio_seconds = len(out.audio) / out.sample_rate
                self._emit(req, audio_delta=o.audio)
            if o.finished:
                req.finished_stages.add(stage)
                out.stage_token_ids[stage] = list(req.stage_tokens.get(stage, ()))
                if o.finish_reason == "abort":
                    self._finish(req, reason="abort")
                elif req.finished_stages.issuperset(req.chain):
                    # With async chunk the vocoder may end first (the talker stopped at its
                    # max_tokens while the thinker still writes): the text goes on.
                    self._finish(req, reason=out.finish_reason or o.finish_reason)

    def _delivers_text(self, req: OrchestratorRequest, stage: str) -> bool:
        return self.pipeline.stage(stage).final_output == "text"

    def _emit(self, req: OrchestratorRequest, *, new_token_ids=(), text_delta="", audio_delta=None) -> None:
        out = req.output
        out.new_token_ids, out.text_delta, out.audio_delta = list(new_token_ids), text_delta, audio_delta
        req.sink(out.snapshot())
        out.new_token_ids, out.text_delta, out.audio_delta = [], "", None

    def _finish(self, req: OrchestratorRequest, *, reason: str | None = None, error: str | None = None,
                code: ErrorCode = "internal") -> None:
        """End a request (failed with `error` and its `code`, or for `reason`) and free it everywhere."""
        self._requests.pop(req.request_id, None)
        out = req.output
        out.finished = True
        out.finish_reason = "error" if error is not None else (reason or out.finish_reason)
        out.error, out.error_code = error, (code if error is not None else None)
        out.metrics.finish_time = time.monotonic()
        if req.first.output_hidden_states:
            out.hidden_states = req.hidden_arrays()
        # Every stage that has not finished the request may hold it (running, or waiting for
        # its input): free it there.
        for name in req.chain:
            c = self.clients.get(name)
            if name not in req.finished_stages and c is not None and c.restarting is None and c.is_alive():
                try:
                    c.abort([req.request_id])
                except ProtocolError:  # an id the wire cannot carry never reached the stage
                    pass
        req.sink(out.snapshot())

    def _check_liveness(self) -> None:
        now = time.monotonic()
        for name, c in self.clients.items():
            if c.dead_reason is not None:
                continue
            if c.restarting is not None:
                if not c.is_alive():
                    self._give_up(c, f"stage {name!r} exited (code {c.exitcode}) while starting again "
                                     f"after: {c.restarting}")
                elif now - c.restart_time > c.cfg.ready_timeout_s:
                    c.kill()
                    self._give_up(c, f"stage {name!r} was not ready within ready_timeout_s="
                                     f"{c.cfg.ready_timeout_s:g} of its restart after: {c.restarting}")
            elif not c.is_alive():
                reason = f"stage {name!r} died (exit code {c.exitcode})"
                if c.cfg.auto_restart:
                    self._restart(c, reason)
                else:
                    self._give_up(c, f"{reason}; restart the engine")
            elif c.unhealthy_reason is None and now - c.last_heard > c.cfg.health_timeout_s:
                c.unhealthy_reason = (f"stage {name!r} stopped answering (nothing for {now - c.last_heard:.0f} s, "
                                      f"health_timeout_s={c.cfg.health_timeout_s:g})")
                log.error(c.unhealthy_reason)
                if c.cfg.auto_restart:
                    self._restart(c, c.unhealthy_reason)
        if self.dead is not None:
            for req in list(self._requests.values()):
                self._finish(req, error=self.dead, code="unavailable")
        for c in self.clients.values():
            if c.unhealthy_reason is not None:
                for req in [r for r in self._requests.values() if c.name in r.chain]:
                    self._finish(req, error=c.unhealthy_reason, code="unavailable")
        self._resolve_stats()

    def _expire(self) -> None:
        """Finish the requests past their deadline (freed in every stage, as an abort)."""
        now = time.monotonic()
        for req in [r for r in self._requests.values() if r.deadline is not None and r.deadline < now]:
            self._finish(req, reason="timeout")

    def _restart(self, c: StageClient, reason: str) -> None:
        """Fail the requests of chains through the stage, then start it again (not waiting)."""
        log.error("%s; starting it again", reason)
        for req in [r for r in self._requests.values() if c.name in r.chain]:
            self._finish(req, error=f"{reason}; it is being restarted", code="unavailable")
        c.restart(reason)

    def _give_up(self, c: StageClient, reason: str) -> None:
        """The stage cannot serve again: the engine is dead (every request fails, later calls raise)."""
        log.error(reason)
        c.dead_reason = self.dead = reason
        c.restarting = None

    def _close_all(self) -> None:
        close_stages(self.clients.values(), STAGE_EXIT_TIMEOUT_S)
        self._wake_pull.close(0)
        self._wake_push.close(0)
        self._zmq.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
