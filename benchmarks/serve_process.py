"""`omni-jax serve` in a child process for a benchmark: started on a free loopback port, waited
for until /health answers, stopped with SIGTERM when the block ends."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served(args: list[str], env: dict, log_path: str, start_timeout_s: float = 1800):
    """Yield (process, base URL) of `omni-jax serve ARGS` once it is healthy; its output goes to
    `log_path`. Exits the benchmark with the log's end if the server dies or is not ready in time."""
    port = free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "omni_jax.cli", "serve", "--port", str(port), *args],
                                env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                sys.exit("the server did not start:\n" + open(log_path).read()[-3000:])
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
