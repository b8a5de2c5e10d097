"""Wire codec and ZMQ channels: round trips, zero-copy receive, malformed input, no pickle."""

from __future__ import annotations

import ast
import logging
import os
import shutil
import stat
import threading

import ml_dtypes
import msgspec
import numpy as np
import pytest
import zmq

from omni_jax.engine import protocol
from omni_jax.runtime import transport
from omni_jax.engine.protocol import (
    AbortRequests,
    AddRequest,
    HealthCheck,
    HealthReply,
    MultiModalPayload,
    Ready,
    SamplingParams,
    Shutdown,
    StageFailure,
    StageInputs,
    StageOutput,
    StageOutputs,
    StageReply,
    StageRequest,
)
from omni_jax.runtime.transport import (
    Channel,
    Codec,
    ProtocolError,
    decode,
    encode,
    ipc_address,
    private_ipc_dir,
    stage_addresses,
    tcp_address,
)

pytestmark = pytest.mark.pipeline

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16, np.int32, np.int64, np.bool_, np.uint8]


def _array(dtype, shape, seed=0):
    rng = np.random.default_rng(seed)
    if np.dtype(dtype) == np.bool_:
        return np.asarray(rng.random(shape) > 0.5)
    if np.issubdtype(np.dtype(dtype), np.integer):
        return np.asarray(rng.integers(0, 100, shape), dtype)
    return np.asarray(rng.standard_normal(shape), dtype)


def assert_same(a, b, path="$"):
    """Deep equality for messages holding numpy arrays (dtype, shape and bytes equal)."""
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray), f"{path}: {type(b).__name__} is not an array"
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {a.shape} != {b.shape}"
        assert np.ascontiguousarray(a).tobytes() == b.tobytes(), f"{path}: values differ"
    elif isinstance(a, msgspec.Struct):
        assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
        for name in a.__struct_fields__:
            assert_same(getattr(a, name), getattr(b, name), f"{path}.{name}")
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{path}: keys differ"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{path}: {a!r} != {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert type(a) is type(b) and a == b, f"{path}: {a!r} != {b!r}"


def _requests():
    """One of every orchestrator -> stage message, arrays of every dtype and odd layouts."""
    sp = SamplingParams(temperature=0.7, top_k=40, top_p=0.8, seed=1234, stop=("</s>",),
                        stop_token_ids=(7, 8), max_tokens=99, logprobs=5, reasoning_tokens=(3, 4),
                        thinking_token_budget=12)
    big = _array(np.float32, (64, 48))  # 12 KiB: its own frame under the default codec
    inputs = StageInputs(
        mrope_positions=_array(np.int64, (3, 40)),
        mrope_delta=-5,
        overlay_rows=_array(ml_dtypes.bfloat16, (6, 16)),
        overlay_index=_array(np.int32, (6,)),
        extra_embeds=big[:, ::2],  # non-contiguous input
        extra_embeds_pad=_array(np.float16, (24,)),
        capture_hidden=True,
    )
    mm = MultiModalPayload(
        audio_features=[_array(np.float32, (128, 30)), _array(np.float32, (128, 0))],
        pixel_values=np.asfortranarray(_array(np.float32, (16, 12))),  # F-ordered
        image_grid_thw=np.array([[1, 4, 4]], np.int64),
        pixel_values_videos=_array(np.uint8, (2, 3, 5)),
        video_grid_thw=np.array([[2, 2, 2]], np.int64),
        video_second_per_grid=np.array(0.5, np.float32),  # 0-d
        use_audio_in_video=True,
    )
    return [
        AddRequest(request_id="r-0", prompt_token_ids=np.arange(100, dtype=np.int32),
                   sampling_params=sp, inputs=inputs, multi_modal=mm, arrival_time=12.5),
        AddRequest(request_id="r-1", prompt_token_ids=np.zeros(0, np.int64),
                   sampling_params=SamplingParams()),
        AbortRequests(request_ids=["r-0", "r-1"]),
        HealthCheck(nonce=2**40),
        Shutdown(),
    ]


def _replies():
    """One of every stage -> orchestrator message."""
    hidden = {0: _array(np.float32, (3, 32)), 28: _array(ml_dtypes.bfloat16, (3, 32)).T}
    return [
        StageOutputs(stage="thinker", step_time=0.003, outputs=[
            StageOutput(request_id="r-0", new_token_ids=[5, 6, 7], hidden_states=hidden,
                        num_cached_tokens=16, text_delta="héllo",
                        logprobs=[{"5": -0.1}, {"6": -0.2}, {"7": -0.3}]),
            StageOutput(request_id="r-1", new_token_ids=[2], finished=True,
                        finish_reason="stop", stop_reason=2),
            StageOutput(request_id="r-2", finished=True, finish_reason="stop", stop_reason="</s>"),
            StageOutput(request_id="r-3", finished=True, finish_reason="error", error="boom"),
            StageOutput(request_id="r-4", audio=_array(np.float32, (24000,))),
            StageOutput(request_id="r-5", audio=np.zeros((0,), np.float32),
                        hidden_states={}),
        ]),
        StageOutputs(stage="talker", outputs=[]),
        Ready(stage="thinker", pid=123, warmup_seconds=4.5, num_compilations=12,
              info={"buckets": [16, 32], "mask": np.array([True, False])}),
        StageFailure(stage="talker", message="prompt too long", request_id="r-9"),
        StageFailure(stage="talker", message="CUDA OOM"),
        HealthReply(stage="vocoder", nonce=7, stats={"running": 3, "waiting": 0}),
    ]


@pytest.fixture
def ipc_dir():
    path = private_ipc_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def pipe(ipc_dir):
    """A real ipc PUSH -> PULL pair, wired as the orchestrator -> stage request path."""
    addr = stage_addresses(ipc_dir, "thinker").requests
    ctx = zmq.Context()
    pull = Channel(zmq.PULL, addr, bind=True, decode_type=StageRequest, context=ctx)
    push = Channel(zmq.PUSH, addr, bind=False, context=ctx)
    yield push, pull
    push.close()
    pull.close()
    ctx.term()


# ---------------------------------------------------------------------------------------
# Codec
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", [Codec(), Codec(inline_threshold=0)],
                         ids=["default", "all-frames"])
def test_round_trip_every_message(codec):
    for msg, union in [(m, StageRequest) for m in _requests()] + [
            (m, StageReply) for m in _replies()]:
        frames = codec.encode(msg)
        out = codec.decode(frames, union)
        assert_same(msg, out)
        # In-process decode shares memory with the frames (no copy on the decode side).
        for arr in _arrays(out):
            if arr.nbytes >= max(codec.inline_threshold, 1):
                assert any(np.shares_memory(arr, np.frombuffer(f, np.uint8)) for f in frames[1:])


def _arrays(obj):
    if isinstance(obj, np.ndarray):
        yield obj
    elif isinstance(obj, msgspec.Struct):
        for name in obj.__struct_fields__:
            yield from _arrays(getattr(obj, name))
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _arrays(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _arrays(v)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(), (0,), (5,), (3, 0, 2), (4, 7)])
def test_every_dtype_and_shape(dtype, shape):
    for codec in (Codec(), Codec(inline_threshold=0)):
        arr = _array(dtype, shape)
        msg = StageOutputs(stage="s", outputs=[StageOutput(request_id="x", audio=arr)])
        out = codec.decode(codec.encode(msg), StageReply).outputs[0].audio
        assert_same(arr, out)
    # Non-contiguous and non-native byte order inputs are made contiguous / native.
    if len(shape) == 2 and shape[0] > 1:
        arr = _array(dtype, shape)[::2, ::-1]
        assert_same(arr, decode(encode(StageOutput(request_id="x", audio=arr)), StageOutput).audio)
    if np.dtype(dtype).itemsize > 1 and np.dtype(dtype) != ml_dtypes.bfloat16:
        swapped = _array(dtype, (6,)).astype(np.dtype(dtype).newbyteorder(">"))
        out = decode(encode(StageOutput(request_id="x", audio=swapped)), StageOutput).audio
        assert out.dtype == np.dtype(dtype) and np.array_equal(out, swapped)


def test_frame_layout():
    """Frame 0 is msgpack; each large array is one C-contiguous frame of its bytes."""
    h0 = _array(np.float32, (64, 32))
    h28 = _array(np.float32, (64, 32))
    small = np.arange(10, dtype=np.int32)
    frames = encode(StageOutput(request_id="x", hidden_states={0: h0, 28: h28}, audio=small))
    assert len(frames) == 3  # the 40-byte array rides in frame 0
    assert bytes(frames[1]) == h0.tobytes() and bytes(frames[2]) == h28.tobytes()
    # The sender's buffer is sent as is (no copy on the encode side either).
    assert np.shares_memory(np.frombuffer(frames[1], np.uint8), h0)
    assert isinstance(msgspec.msgpack.decode(frames[0]), dict)


def test_hidden_states_int_keys():
    hs = {0: _array(np.float32, (2, 8)), 28: _array(np.float32, (2, 8)), -1: np.zeros((2, 8))}
    out = decode(encode(StageOutput(request_id="x", hidden_states=hs)), StageOutput)
    assert list(out.hidden_states) == [0, 28, -1]
    assert all(type(k) is int for k in out.hidden_states)
    assert_same(hs, out.hidden_states)


def test_sampling_params_round_trip_and_validation():
    sp = SamplingParams(temperature=0.9, top_k=50, repetition_penalty=1.05, seed=3,
                        stop=["a", "bb"], suppress_token_ids=[1, 2], min_tokens=2,
                        ignore_eos=True, include_stop_str_in_output=True, logprobs=0)
    msg = AddRequest(request_id="r", prompt_token_ids=np.arange(4), sampling_params=sp)
    out = decode(encode(msg), StageRequest)
    assert out.sampling_params == sp and out.sampling_params.stop == ("a", "bb")
    bad = {"type": "AddRequest", "request_id": "r", "prompt_token_ids": np.arange(3),
           "sampling_params": {"top_p": 2.0}}
    with pytest.raises(ProtocolError, match="top_p"):
        decode(encode(bad), StageRequest)
    bad["sampling_params"] = {"max_tokens": "many"}
    with pytest.raises(ProtocolError, match="max_tokens"):
        decode(encode(bad), StageRequest)


def test_encode_refuses_unsupported():
    for arr in (np.array([object()]), np.array([1 + 2j]), np.array(["a"])):
        with pytest.raises(ProtocolError, match="dtype"):
            encode(StageOutput(request_id="x", audio=arr))
    with pytest.raises(ProtocolError):
        encode(Ready(stage="s", pid=1, warmup_seconds=0.0, num_compilations=0,
                     info={"x": object()}))


def test_concurrent_encode_decode():
    """Several threads encode and decode different messages through one codec at once."""
    codec = Codec(inline_threshold=0)
    errors = []

    def work(seed):
        try:
            for i in range(100):
                arr = _array(np.float32, (seed + 1, 3), seed=seed * 1000 + i)
                msg = StageOutput(request_id=f"{seed}-{i}", hidden_states={seed: arr}, audio=arr)
                out = codec.decode(codec.encode(msg), StageOutput)
                assert_same(msg, out)
        except Exception as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


# ---------------------------------------------------------------------------------------
# Malformed input
# ---------------------------------------------------------------------------------------


def _hdr(code, shape):
    return transport._pack_header(code, tuple(shape))


def _garbage():
    """(name, frames) pairs that must all be refused with ProtocolError."""
    rng = np.random.default_rng(0)
    f32 = 12
    ref = lambda code, shape, index: msgspec.msgpack.Ext(  # noqa: E731
        transport.EXT_ARRAY_FRAME, _hdr(code, shape) + transport._INDEX.pack(index))
    add = lambda ids, *rest: [msgspec.msgpack.encode(  # noqa: E731
        {"type": "AddRequest", "request_id": "r", "prompt_token_ids": ids,
         "sampling_params": {}}), *rest]
    return [
        ("random bytes", [rng.bytes(64)]),
        ("empty frame", [b""]),
        ("no frames", []),
        ("msgpack list", [msgspec.msgpack.encode([1, 2, 3])]),
        ("unknown tag", [msgspec.msgpack.encode({"type": "Exec", "code": "import os"})]),
        ("reply sent to a stage", encode(HealthReply(stage="s", nonce=1))),
        ("missing field", [msgspec.msgpack.encode({"type": "HealthCheck"})]),
        ("wrong field type", [msgspec.msgpack.encode({"type": "HealthCheck", "nonce": "x"})]),
        ("int where an array goes", add(5)),
        ("ref past the frames", add(ref(f32, (4,), 1))),
        ("ref to frame 0", add(ref(f32, (0,), 0), b"")),
        ("size mismatch", add(ref(f32, (4,), 1), b"\0" * 15)),
        ("unknown dtype code", add(ref(99, (4,), 1), b"\0" * 16)),
        ("huge dims", add(ref(f32, (0, 2**64 - 1), 1), b"")),
        ("too many dims", add(msgspec.msgpack.Ext(1, bytes([f32, 200]) + b"\0" * 8), b"")),
        ("truncated ref", add(msgspec.msgpack.Ext(1, bytes([f32])), b"")),
        ("unknown ext", add(msgspec.msgpack.Ext(77, b"x"), b"")),
        ("inline size mismatch", add(msgspec.msgpack.Ext(
            transport.EXT_ARRAY_INLINE, _hdr(f32, (3,)) + b"\0" * 11))),
        ("bool bytes not 0/1", add(msgspec.msgpack.Ext(
            transport.EXT_ARRAY_INLINE, _hdr(1, (3,)) + b"\0\1\7"))),
        ("frame not a buffer", add(ref(f32, (1,), 1), 12345)),
    ]


@pytest.mark.parametrize("name,frames", _garbage(), ids=[g[0] for g in _garbage()])
def test_garbage_raises_protocol_error(name, frames):
    with pytest.raises(ProtocolError):
        decode(frames, StageRequest)


def test_garbage_over_ipc_then_next_message_arrives(pipe, caplog):
    push, pull = pipe
    good = HealthCheck(nonce=42)
    for name, frames in _garbage():
        if not frames or any(not isinstance(f, (bytes, memoryview)) for f in frames):
            continue  # not sendable as ZMQ frames
        push.send_frames(frames)
        push.send(good)
        with pytest.raises(ProtocolError):
            pull.recv(timeout_ms=5000)
        assert pull.recv(timeout_ms=5000) == good, name
    # recv_or_drop: logged and dropped, the loop carries on.
    push.send_frames([b"\xc1garbage"])
    push.send(good)
    seen = []
    assert pull.recv_or_drop(timeout_ms=5000, log=seen.append) is None
    assert "malformed" in seen[0]
    assert pull.recv_or_drop(timeout_ms=5000) == good
    push.send_frames([b"\xc1"])
    with caplog.at_level(logging.WARNING, logger=transport.__name__):
        assert pull.recv_or_drop(timeout_ms=5000) is None
    assert "dropped a malformed message" in caplog.text
    assert pull.recv(timeout_ms=0) is None


# ---------------------------------------------------------------------------------------
# Channels
# ---------------------------------------------------------------------------------------


def test_private_ipc_dir_mode_and_addresses(ipc_dir):
    assert stat.S_IMODE(os.stat(ipc_dir).st_mode) == 0o700
    addrs = stage_addresses(ipc_dir, "talker")
    assert addrs.requests == f"ipc://{ipc_dir}/talker-requests"
    assert addrs.replies == f"ipc://{ipc_dir}/talker-replies"
    assert addrs.data == f"ipc://{ipc_dir}/talker-data"
    with pytest.raises(ValueError, match="name"):
        ipc_address(ipc_dir, "../evil")
    with pytest.raises(ValueError, match="bytes"):
        ipc_address(ipc_dir, "x" * 120)
    assert tcp_address(port=5555) == "tcp://127.0.0.1:5555"
    assert tcp_address("::1", 1) == "tcp://[::1]:1"


def test_ipc_round_trip_zero_copy(pipe, ipc_dir):
    push, pull = pipe
    # The bound socket's file lives in the private dir.
    assert os.path.exists(os.path.join(ipc_dir, "thinker-requests"))
    for msg in _requests():
        push.send(msg)
        assert_same(msg, pull.recv(timeout_ms=5000))

    # Zero-copy receive: the decoded array is a view of the received ZMQ frame.
    hs = {0: _array(np.float32, (256, 128)), 28: _array(ml_dtypes.bfloat16, (256, 128))}
    out_ch = Channel(zmq.PUSH, push.address, bind=False, context=push.socket.context)
    try:
        reply = StageOutputs(stage="thinker", outputs=[
            StageOutput(request_id="r", new_token_ids=[1], hidden_states=hs)])
        out_ch.send(reply)
        frames = pull.recv_raw(timeout_ms=5000)
    finally:
        out_ch.close()
    assert len(frames) == 3 and all(isinstance(f, zmq.Frame) for f in frames)
    got = decode(frames, StageReply)
    assert_same(reply, got)
    for layer, frame in zip((0, 28), frames[1:]):
        arr = got.outputs[0].hidden_states[layer]
        frame_bytes = np.frombuffer(frame.buffer, np.uint8)
        assert np.shares_memory(arr, frame_bytes)
        assert arr.ctypes.data == frame_bytes.ctypes.data


def test_reply_direction_and_tcp():
    """Stage PUSH connects to the orchestrator's bound PULL; TCP is opt-in on 127.0.0.1."""
    ctx = zmq.Context()
    with Channel(zmq.PULL, tcp_address(), bind=True, decode_type=StageReply,
                 context=ctx) as pull:
        assert pull.address.startswith("tcp://127.0.0.1:") and not pull.address.endswith("*")
        with Channel(zmq.PUSH, pull.address, bind=False, context=ctx) as push:
            for msg in _replies():
                push.send(msg, timeout_ms=5000)
                assert_same(msg, pull.recv(timeout_ms=5000))
            assert "PUSH" in repr(push)
    assert pull.closed
    ctx.term()


def test_send_times_out_without_peer(ipc_dir):
    ctx = zmq.Context()
    with Channel(zmq.PUSH, ipc_address(ipc_dir, "nobody"), bind=True, context=ctx) as push:
        with pytest.raises(TimeoutError):
            push.send(Shutdown(), timeout_ms=20)
    ctx.term()


def test_stage_client_never_waits_on_an_exited_stage(ipc_dir):
    """The orchestrator thread sends to stages; a stage that exited (its end of the socket
    gone) must not stop it: every send gives up at once and says so."""
    import subprocess
    import sys

    from omni_jax.config import load_pipeline_config
    from omni_jax.runtime.stage_client import StageClient

    ctx = zmq.Context()
    cfg = load_pipeline_config("qwen2_5_omni_tiny").stages[0]
    client = StageClient(cfg, "qwen2_5_omni", "/nonexistent", ipc_dir, ctx)
    stage_end = Channel(zmq.PULL, client.requests.address, bind=False, context=ctx)
    t = threading.Thread()
    try:
        assert client.add(AddRequest(request_id="r0", prompt_token_ids=[1], sampling_params=SamplingParams()))
        assert stage_end.recv_raw(timeout_ms=5000) is not None
        stage_end.close()  # the stage process exits
        client.process = subprocess.Popen([sys.executable, "-c", "pass"])
        client.process.wait()
        sent: list = []
        t = threading.Thread(target=lambda: sent.extend([
            client.add(AddRequest(request_id="r1", prompt_token_ids=[1], sampling_params=SamplingParams())),
            client.abort(["r1"]), client.health_check(0)]), daemon=True)
        t.start()
        t.join(5.0)
        assert not t.is_alive(), "a send to an exited stage blocked"
        assert sent == [False, False, False]
    finally:
        for ch in (stage_end, client.requests, client.replies):
            ch.close()
        if not t.is_alive():  # a thread stuck in a send would stop term() too
            ctx.term()


# A stage process stand-in: reads its requests (when ready) and exits 0 `linger` seconds after
# the first message, as a stage takes a moment to exit; a starting one reads nothing.
FAKE_STAGE = r'''
import sys, time, zmq
ready, linger = sys.argv[2] == "ready", float(sys.argv[3])
sock = zmq.Context().socket(zmq.PULL)
sock.connect(sys.argv[1])
if not ready:
    time.sleep(120)
sock.recv()
time.sleep(linger)
'''


def _close_fake_stages(ipc_dir, states, timeout_s, linger=0.0):
    """Stand-ins for stages in `states` ("ready", "starting", "restarting") closed by
    `close_stages`: (each one's exit code, seconds it took)."""
    import subprocess
    import sys
    import time

    from omni_jax.config import load_pipeline_config
    from omni_jax.engine.protocol import Ready
    from omni_jax.runtime.stage_client import StageClient, close_stages

    ctx, clients = zmq.Context(), []
    try:
        for i, state in enumerate(states):
            cfg = load_pipeline_config("qwen2_5_omni_tiny").stages[i]
            client = StageClient(cfg, "qwen2_5_omni", "/nonexistent", ipc_dir, ctx)
            client.process = subprocess.Popen([sys.executable, "-c", FAKE_STAGE, client.requests.address,
                                               "ready" if state != "starting" else "starting", str(linger)])
            clients.append(client)
            if state != "starting":
                client.ready = Ready(stage=cfg.name, pid=client.process.pid, warmup_seconds=0.0, num_compilations=0)
            if state == "restarting":
                client.restarting = "its process died"
        t0 = time.monotonic()
        close_stages(clients, timeout_s=timeout_s)
        return [c.process.poll() for c in clients], time.monotonic() - t0
    finally:
        for c in clients:
            if c.process.poll() is None:
                c.process.kill()
        ctx.term()


@pytest.mark.parametrize("state", ["ready", "starting", "restarting"])
def test_stage_client_shutdown_waits_only_for_a_ready_stage(ipc_dir, state):
    """A ready stage is asked to exit (and gets the time to); one still loading or compiling
    reads no message before it is done, so it is killed at once instead of waiting out the
    timeout: an `OmniJax` closed during a stage's (re)start returns in moments."""
    codes, took = _close_fake_stages(ipc_dir, [state], timeout_s=60.0)
    assert codes == [0 if state == "ready" else -9]
    assert took < 30.0, f"shutdown of a {state} stage took {took:.1f} s"


def test_stages_exit_side_by_side(ipc_dir):
    """Every stage is asked to exit before any is waited for: three stages that each take 4 s
    to exit are gone in about 4 s, not 12, each by its own exit (none killed)."""
    codes, took = _close_fake_stages(ipc_dir, ["ready"] * 3, timeout_s=30.0, linger=4.0)
    assert codes == [0, 0, 0]
    assert took < 10.0, f"three stages took {took:.1f} s to exit"


# ---------------------------------------------------------------------------------------
# No pickle
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("module", [protocol, transport])
def test_no_pickle(module):
    source = open(module.__file__, encoding="utf-8").read()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "marshal",
                           "shelve", "jsonpickle"}
    # pyzmq's *_pyobj helpers pickle; eval/exec would run wire data.
    for word in ("pyobj", "eval(", "exec(", "__reduce__", "import pickle"):
        assert word not in source, word
