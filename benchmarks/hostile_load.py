"""Normal traffic beside hostile traffic: what a mix of abusive clients costs the others.

    python benchmarks/hostile_load.py [--seconds 60] [--normal-clients 2] [--hostile-clients 4]
                                      [--model tiny] [--pipeline YAML]

One `omni-jax serve` on a loopback port, then two phases of `--seconds` each, one after the other:
"normal" (only normal chats: `--normal-clients` clients, each a short greedy chat after the other)
and "hostile" (the same normal clients, plus `--hostile-clients` clients cycling through: 6 MB
text prompts, a FLAC that declares no length and holds 1200 s, a PNG declaring 30000 x 30000
pixels, prompts that take ~10 s to process whose clients leave after 0.5 s, streams dropped after
their first chunk, and connections that trickle their headers). Everything is bounded: the
phases by time, the hostile clients by count, each request by a client timeout; nothing leaves
127.0.0.1. Prints, per phase, the normal requests' count, failures, p50 and p99 latency, the
hostile requests by outcome, and the server process's peak resident memory (sampled every
10 ms with psutil), with the load average and CPU model: figures from a shared machine are
labelled as such by whoever reports them.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import socket
import sys
import tempfile
import threading
import time
import wave
from collections import Counter
from importlib import resources

import httpx
import numpy as np
import psutil
import yaml
from machine import cpu_model
from serve_process import served

API_KEY = "hostile-load"


def _quick_pipeline(tmp: str) -> str:
    """The tiny preset with few buckets (a quick warm-up), patient with a loaded machine."""
    cfg = yaml.safe_load(resources.files("omni_jax").joinpath("configs/qwen2_5_omni_tiny.yaml").read_text())
    cfg["name"] = "qwen2_5_omni_tiny_hostile_load"
    for st in cfg["stages"]:
        st.update(decode_buckets=[1, 2, 4], max_num_seqs=4, ready_timeout_s=1800)
        if st["name"] == "token2wav":
            st.update(token_buckets=[64, 256])
        else:
            st.update(token_buckets=[64])
    path = os.path.join(tmp, "pipeline.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


# ---------------------------------------------------------------------------------------- payloads

def _chat(content, **extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}


def _wav_b64(samples: int = 1600) -> str:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
        w.writeframes((np.sin(np.arange(samples) * 0.05) * 8000).astype("<i2").tobytes())
    return base64.b64encode(buf.getvalue()).decode()


def _flac_without_length(seconds: int, rate: int = 48000, unit_s: int = 4) -> bytes:
    """`seconds` of silence in a FLAC whose header declares no length (repeated frames)."""
    import av

    buf, packets = io.BytesIO(), []
    with av.open(buf, "w", format="flac") as out:
        stream = out.add_stream("flac", rate=rate, layout="mono")
        frame = av.AudioFrame.from_ndarray(np.zeros((1, rate * unit_s), np.int16), format="s16", layout="mono")
        frame.sample_rate = rate
        for p in list(stream.encode(frame)) + list(stream.encode(None)):
            packets.append(bytes(p))
            out.mux(p)
    data = buf.getvalue()
    head = bytearray(data[:data.index(packets[0])])
    info = head.index(b"fLaC") + 8
    head[info + 13] &= 0xF0
    head[info + 14:info + 18] = bytes(4)
    return bytes(head) + b"".join(packets) * (seconds // unit_s)


def _png_header_bomb(width: int = 30000, height: int = 30000) -> bytes:
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(bytes(width + 1))) + \
        chunk(b"IEND", b"")


def hostile_bodies() -> dict[str, bytes]:
    """The hostile request bodies, encoded once."""
    flac = "data:audio/flac;base64," + base64.b64encode(_flac_without_length(1200)).decode()
    png = "data:image/png;base64," + base64.b64encode(_png_header_bomb()).decode()
    slow = [{"type": "input_audio", "input_audio": {"data": _wav_b64(), "format": "wav"}}] * 50
    return {"big_text": json.dumps(_chat("lorem ipsum " * (1 << 19))).encode(),
            "audio_bomb": json.dumps(_chat([{"type": "audio_url", "audio_url": {"url": flac}}])).encode(),
            "image_bomb": json.dumps(_chat([{"type": "image_url", "image_url": {"url": png}}])).encode(),
            "abandoned": json.dumps(_chat(slow)).encode()}


# ---------------------------------------------------------------------------------------- clients

class Phase:
    """One phase's outcomes, filled by the client threads."""

    def __init__(self):
        self.normal_s: list[float] = []
        self.normal_failed = 0
        self.hostile: Counter = Counter()
        self.lock = threading.Lock()


def _normal_client(url: str, headers: dict, stop: threading.Event, phase: Phase) -> None:
    body = _chat("Hello, who are you?", temperature=0, max_tokens=8)
    with httpx.Client(headers=headers, timeout=60) as c:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                ok = c.post(f"{url}/v1/chat/completions", json=body).status_code == 200
            except httpx.HTTPError:
                ok = False
            with phase.lock:
                if ok:
                    phase.normal_s.append(time.monotonic() - t0)
                else:
                    phase.normal_failed += 1


def _trickle_headers(url: str, stop: threading.Event) -> str:
    host, port = url.removeprefix("http://").split(":")
    try:
        with socket.create_connection((host, int(port)), timeout=1) as s:
            for byte in b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" * 20:
                if stop.is_set():
                    return "trickle: stopped"
                s.sendall(bytes([byte]))
                time.sleep(0.5)
    except OSError:
        return "trickle: closed by the server"
    return "trickle: never closed"


def _hostile_client(i: int, url: str, headers: dict, bodies: dict, stop: threading.Event, phase: Phase) -> None:
    kinds = ["big_text", "audio_bomb", "image_bomb", "abandoned", "dropped_stream", "trickle"]
    k = i
    with httpx.Client(headers={**headers, "Content-Type": "application/json"}, timeout=30) as c:
        while not stop.is_set():
            kind = kinds[k % len(kinds)]
            k += 1
            try:
                if kind == "trickle":
                    outcome = _trickle_headers(url, stop)
                elif kind == "dropped_stream":
                    body = _chat("Tell me a story", stream=True, max_tokens=200, ignore_eos=True)
                    with c.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                        next(r.iter_lines())
                    outcome = f"{kind}: dropped"
                elif kind == "abandoned":
                    try:
                        c.post(f"{url}/v1/chat/completions", content=bodies[kind], timeout=0.5)
                        outcome = f"{kind}: answered"
                    except httpx.TimeoutException:
                        outcome = f"{kind}: left"
                else:
                    outcome = f"{kind}: {c.post(f'{url}/v1/chat/completions', content=bodies[kind]).status_code}"
            except httpx.HTTPError as e:
                outcome = f"{kind}: {type(e).__name__}"
            with phase.lock:
                phase.hostile[outcome] += 1


def _run_phase(url: str, ps: psutil.Process, args, bodies: dict | None) -> tuple[Phase, int, str]:
    phase, stop = Phase(), threading.Event()
    headers = {"Authorization": f"Bearer {API_KEY}"}
    threads = [threading.Thread(target=_normal_client, args=(url, headers, stop, phase))
               for _ in range(args.normal_clients)]
    if bodies is not None:
        threads += [threading.Thread(target=_hostile_client, args=(i, url, headers, bodies, stop, phase))
                    for i in range(args.hostile_clients)]
    load = os.getloadavg()
    peak = ps.memory_info().rss
    for t in threads:
        t.start()
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline:
        peak = max(peak, ps.memory_info().rss)
        time.sleep(0.01)
    stop.set()
    for t in threads:
        t.join(60)
    return phase, peak, f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"


def _report(name: str, phase: Phase, peak: int, load: str) -> None:
    lat = np.array(phase.normal_s) if phase.normal_s else np.array([np.nan])
    print(f"{name:8s} normal: {len(phase.normal_s)} ok, {phase.normal_failed} failed, "
          f"p50 {np.percentile(lat, 50) * 1000:.0f} ms, p99 {np.percentile(lat, 99) * 1000:.0f} ms; "
          f"server peak RSS {peak / 2**20:.0f} MiB; load average at start {load}")
    for outcome, n in sorted(phase.hostile.items()):
        print(f"{'':8s} hostile {outcome}: {n}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="length of each phase (default 60; at most 600)")
    p.add_argument("--normal-clients", type=int, default=2)
    p.add_argument("--hostile-clients", type=int, default=4, help="at most 16")
    p.add_argument("--model", default="tiny")
    p.add_argument("--pipeline", default=None, help="pipeline YAML (default: the tiny preset with few buckets)")
    args = p.parse_args()
    if not 0 < args.seconds <= 600 or not 1 <= args.normal_clients <= 16 or not 0 <= args.hostile_clients <= 16:
        p.error("--seconds must be in (0, 600], --normal-clients in [1, 16], --hostile-clients in [0, 16]")
    with tempfile.TemporaryDirectory(prefix="omni-jax-hostile-") as tmp:
        args_ = ["--model", args.model, "--host", "127.0.0.1", "--api-key", API_KEY,
                 "--pipeline", args.pipeline or _quick_pipeline(tmp)]
        log_path = os.path.join(tmp, "serve.log")
        with served(args_, {**os.environ, "JAX_PLATFORMS": "cpu"}, log_path) as (proc, url):
            bodies = hostile_bodies()
            ps = psutil.Process(proc.pid)
            print(f"hostile_load: {args.seconds:g} s per phase, {args.normal_clients} normal and "
                  f"{args.hostile_clients} hostile clients; CPU {cpu_model()} ({os.cpu_count()} cores)", flush=True)
            print(f"server RSS after start-up {ps.memory_info().rss / 2**20:.0f} MiB", flush=True)
            _report("normal", *_run_phase(url, ps, args, None))
            _report("hostile", *_run_phase(url, ps, args, bodies))
            if proc.poll() is not None:
                print("the server died during the run:\n" + open(log_path).read()[-3000:])
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
