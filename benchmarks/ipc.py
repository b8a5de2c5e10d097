"""Inter-process transfer: OmniJax's codec + Channel vs bare pyzmq, same frames, same run.

    python benchmarks/ipc.py [--messages 12] [--rounds 3]

A sender process (multiprocessing spawn, as the stage workers) pushes StageOutputs carrying
hidden_states {0: [2048, 3584] f32, 28: [2048, 3584] f32} (~58.7 MB per message) over an
ipc:// PUSH/PULL pair in a private 0700 dir to this process, which
* bare:  `send_multipart(frames, copy=False)` of frames encoded once / `recv_multipart(copy=False)`;
* codec: `Channel.send(msg)` (encode every message) / `Channel.recv()` (typed decode,
  arrays rebuilt as views of the received frames).
After an untimed warm-up round of each, rounds alternate between the two; the best round
of each is reported as GB/s (10^9 bytes) with the ratio codec / bare (target >= 50%). Then the orchestrator's per-message cost:
encode and decode of a small AddRequest (100 prompt ids) and of StageOutputs with 64
one-token outputs, in microseconds, in this process.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import sys
import time
import timeit

import numpy as np
import zmq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HIDDEN_SHAPE = (2048, 3584)
LAYERS = (0, 28)
WARMUP = 2  # messages per round not timed (connection set-up, first page faults)


def hidden_message():
    """The benchmark's StageOutputs: two layers of hidden states for a 2048-token prefill."""
    from omni_jax.engine.protocol import StageOutput, StageOutputs

    rng = np.random.default_rng(0)
    hs = {layer: rng.standard_normal(HIDDEN_SHAPE, dtype=np.float32) for layer in LAYERS}
    return StageOutputs(stage="thinker", step_time=0.01, outputs=[
        StageOutput(request_id="req-0", new_token_ids=[42], hidden_states=hs)])


def sender(data_addr: str, control_addr: str) -> None:
    """Child: for each (mode, count) order on the control socket, push that many messages."""
    from omni_jax.runtime.transport import Channel, encode

    msg = hidden_message()
    frames = encode(msg)  # the bare rounds send exactly these frames
    ctx = zmq.Context()
    control = ctx.socket(zmq.PULL)
    control.connect(control_addr)
    data = Channel(zmq.PUSH, data_addr, bind=False, context=ctx)
    try:
        while True:
            mode, _, count = control.recv_string().partition(" ")
            if mode == "stop":
                break
            for _ in range(int(count)):
                if mode == "bare":
                    data.socket.send_multipart(frames, copy=False)
                else:
                    data.send(msg)
    finally:
        data.close()
        control.close(linger=0)
        ctx.term()


def transfer(messages: int, rounds: int) -> None:
    """Run the alternating bare / codec rounds and print GB/s of each and the ratio."""
    from omni_jax.engine.protocol import StageReply
    from omni_jax.runtime.transport import Channel, ipc_address, private_ipc_dir

    ipc_dir = private_ipc_dir()
    ctx = zmq.Context()
    data_addr, control_addr = ipc_address(ipc_dir, "data"), ipc_address(ipc_dir, "control")
    # As in the pipeline: this (orchestrator) side binds, the child connects.
    pull = Channel(zmq.PULL, data_addr, bind=True, decode_type=StageReply, context=ctx)
    control = ctx.socket(zmq.PUSH)
    control.setsockopt(zmq.LINGER, 0)
    control.bind(control_addr)
    proc = mp.get_context("spawn").Process(target=sender, args=(data_addr, control_addr),
                                           daemon=True)
    proc.start()
    payload = sum(int(np.prod(HIDDEN_SHAPE)) * 4 for _ in LAYERS)
    results: dict[str, list[float]] = {"bare": [], "codec": []}
    try:
        # One untimed round per mode first: the receiver's allocator settles (glibc starts
        # reusing freed 29 MB blocks instead of mmap + page faults for each new one).
        for r in range(rounds + 1):
            for mode in ("bare", "codec"):
                control.send_string(f"{mode} {WARMUP + messages}")
                for i in range(WARMUP + messages):
                    if i == WARMUP:
                        t0 = time.perf_counter()
                    if pull.socket.poll(60_000) == 0:
                        raise RuntimeError("sender stopped sending")
                    if mode == "bare":
                        got = pull.socket.recv_multipart(copy=False)
                        assert sum(f.buffer.nbytes for f in got[1:]) == payload
                    else:
                        got = pull.recv()
                        assert got.outputs[0].hidden_states[28].shape == HIDDEN_SHAPE
                    del got  # free the 58 MB before the next message arrives
                dt = time.perf_counter() - t0
                if r:
                    results[mode].append(messages * payload / dt / 1e9)
        control.send_string("stop")
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.terminate()
        pull.close()
        control.close(linger=0)
        ctx.term()
        shutil.rmtree(ipc_dir, ignore_errors=True)

    bare, codec = max(results["bare"]), max(results["codec"])
    print(f"hidden-state transfer, {payload / 1e6:.1f} MB per message, {messages} messages "
          f"x {rounds} rounds per mode, ipc PUSH/PULL between two processes")
    print(f"  bare pyzmq   : {bare:6.2f} GB/s  ({payload / bare / 1e6:.1f} ms/message)   "
          f"rounds: {', '.join(f'{x:.2f}' for x in results['bare'])}")
    print(f"  codec+Channel: {codec:6.2f} GB/s  ({payload / codec / 1e6:.1f} ms/message)   "
          f"rounds: {', '.join(f'{x:.2f}' for x in results['codec'])}")
    print(f"  ratio codec/bare: {codec / bare:.0%} (target >= 50%)")


def per_message_overhead() -> None:
    """Microseconds to encode / decode the orchestrator's small, frequent messages."""
    from omni_jax.engine.protocol import (AddRequest, SamplingParams, StageOutput,
                                          StageOutputs, StageReply, StageRequest)
    from omni_jax.runtime.transport import decode, encode

    def us(fn, number):
        return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6

    add = AddRequest(request_id="chatcmpl-0123456789abcdef",
                     prompt_token_ids=np.arange(100, dtype=np.int32),
                     sampling_params=SamplingParams(temperature=0.0, max_tokens=256),
                     arrival_time=time.time())
    outs = StageOutputs(stage="thinker", step_time=0.012, outputs=[
        StageOutput(request_id=f"chatcmpl-{i:016x}", new_token_ids=[1000 + i], text_delta=" a")
        for i in range(64)])
    sp_only = SamplingParams(temperature=0.0, max_tokens=256)
    print("per-message codec cost (this process, best of 5)")
    for name, msg, typ in (("AddRequest (100 prompt ids)", add, StageRequest),
                           ("StageOutputs (64 x 1 token)", outs, StageReply)):
        frames = encode(msg)
        size = sum(memoryview(f).nbytes for f in frames)
        print(f"  {name:28s}: encode {us(lambda: encode(msg), 2000):6.1f} us, "
              f"decode {us(lambda: decode(frames, typ), 2000):6.1f} us "
              f"({len(frames)} frame(s), {size} bytes)")
    # Part of AddRequest's decode is SamplingParams.__post_init__ validation (engine/sampling_params.py).
    print(f"  of which SamplingParams(...) construction + validation: "
          f"{us(lambda: SamplingParams(temperature=0.0, max_tokens=256), 2000):.1f} us "
          f"(equal params: {decode(encode(add), StageRequest).sampling_params == sp_only})")


def main() -> None:
    """Parse arguments and run both measurements."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--messages", type=int, default=12, help="timed messages per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per mode (best is kept)")
    args = ap.parse_args()
    transfer(args.messages, args.rounds)
    per_message_overhead()


if __name__ == "__main__":
    main()
