"""Headless Chromium driven over the DevTools protocol (a WebSocket of JSON commands), for the
voice chat page's tests: no Selenium, no driver binary, only the `websockets` the server uses.

`Browser(...)` starts Debian's chromium with a fake microphone playing a WAV file, opens one
tab, and collects what the page logs: `console_errors` holds every console.error, uncaught
exception and failed resource load.
"""

from __future__ import annotations

import base64
import fnmatch
import itertools
import json
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx
import websockets.sync.client as ws_client


class BrowserError(AssertionError):
    pass


class Browser:
    def __init__(self, mic_wav: str | None = None, *, allow_mic: bool = True, width: int = 1000, height: int = 760):
        """`mic_wav` plays, looped, as the microphone; `allow_mic=False`: the user denies it."""
        exe = shutil.which("chromium") or shutil.which("chromium-browser")
        assert exe, "chromium is needed for the page's tests (bash .ci/setup installs it)"
        self.profile = tempfile.mkdtemp(prefix="omni-jax-chromium-")
        args = [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check",
                "--disable-extensions", "--disable-background-networking", "--disable-component-update",
                "--remote-debugging-port=0", f"--user-data-dir={self.profile}", f"--window-size={width},{height}",
                "--autoplay-policy=no-user-gesture-required", "--use-fake-device-for-media-stream",
                "--use-fake-ui-for-media-stream" if allow_mic else "--deny-permission-prompts"]
        if mic_wav is not None:
            args.append(f"--use-file-for-fake-audio-capture={mic_wav}")
        self.proc = subprocess.Popen(args + ["about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port = self._devtools_port()
        tabs = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
        page = next(t for t in tabs if t["type"] == "page")
        # entered as `with` would: websockets >= 17.1 warns about a connection used without
        self.ws = ws_client.connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=10).__enter__()
        self.ids = itertools.count(1)
        self.replies: dict[int, dict] = {}
        self.cond = threading.Condition()
        self.console_errors: list[str] = []
        self.fake: dict[str, str] = {}
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable")

    def _devtools_port(self, timeout_s: float = 30.0) -> int:
        marker = Path(self.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if marker.exists() and marker.read_text().strip():
                return int(marker.read_text().split()[0])
            assert self.proc.poll() is None, f"chromium exited with {self.proc.returncode}"
            time.sleep(0.05)
        raise BrowserError(f"chromium opened no DevTools port in {timeout_s} s")

    def _read(self) -> None:
        try:
            for raw in self.ws:
                msg = json.loads(raw)
                if "id" in msg:
                    with self.cond:
                        self.replies[msg["id"]] = msg
                        self.cond.notify_all()
                else:
                    self._event(msg["method"], msg.get("params", {}))
        except Exception:  # the browser went away; calls waiting on it time out
            pass

    def respond(self, url_pattern: str, body: dict) -> None:
        """Answer the page's requests matching `url_pattern` with this JSON (what another server would say)."""
        self.fake[url_pattern] = base64.b64encode(json.dumps(body).encode()).decode()
        self.call("Fetch.enable", patterns=[{"urlPattern": p} for p in self.fake])

    def _event(self, method: str, p: dict) -> None:
        if method == "Fetch.requestPaused":  # only the patterns given to respond() pause
            body = next(b for pattern, b in self.fake.items() if fnmatch.fnmatch(p["request"]["url"], pattern))
            self.ws.send(json.dumps({"id": next(self.ids), "method": "Fetch.fulfillRequest", "params": {
                "requestId": p["requestId"], "responseCode": 200, "body": body,
                "responseHeaders": [{"name": "content-type", "value": "application/json"}]}}))
        elif method == "Runtime.consoleAPICalled" and p["type"] in ("error", "assert"):
            self.console_errors.append(" ".join(str(a.get("value", a.get("description", ""))) for a in p["args"]))
        elif method == "Runtime.exceptionThrown":
            d = p["exceptionDetails"]
            self.console_errors.append(d.get("exception", {}).get("description") or d.get("text", "exception"))
        elif method == "Log.entryAdded" and p["entry"]["level"] == "error":
            self.console_errors.append(f"{p['entry'].get('url', '')}: {p['entry']['text']}")

    def call(self, method: str, timeout_s: float = 30.0, **params) -> dict:
        i = next(self.ids)
        self.ws.send(json.dumps({"id": i, "method": method, "params": params}))
        with self.cond:
            if not self.cond.wait_for(lambda: i in self.replies, timeout_s):
                raise BrowserError(f"{method}: no answer in {timeout_s} s")
            msg = self.replies.pop(i)
        if "error" in msg:
            raise BrowserError(f"{method}: {msg['error']}")
        return msg.get("result", {})

    def js(self, expression: str, timeout_s: float = 30.0):
        """The value of a JavaScript expression in the page (awaited if it is a promise)."""
        r = self.call("Runtime.evaluate", timeout_s, expression=expression, awaitPromise=True, returnByValue=True,
                      userGesture=True)
        if "exceptionDetails" in r:
            raise BrowserError(f"{expression}: {r['exceptionDetails'].get('exception', {}).get('description')}")
        return r["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 120.0, what: str | None = None):
        """Poll a JavaScript expression until it is truthy; its value."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.js(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                state = self.js("JSON.stringify(window.omniStats ?? null)")
                raise BrowserError(f"{what or expression} not seen in {timeout_s} s; the page's stats: {state}")
            time.sleep(0.1)

    def open(self, url: str) -> None:
        self.call("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete'", 30, "the page loaded")

    def key(self, kind: str, code: str = "Space", key: str = " ") -> None:
        """Press ('keyDown') or release ('keyUp') a key as the user would."""
        self.call("Input.dispatchKeyEvent", type=kind, code=code, key=key, windowsVirtualKeyCode=32 if key == " " else 0)

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))

    def phone(self, width: int = 390, height: int = 800) -> None:
        """Lay the page out as a phone's screen would (until `desktop()`)."""
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=True)

    def desktop(self) -> None:
        self.call("Emulation.clearDeviceMetricsOverride")

    def close(self) -> None:
        try:
            self.call("Browser.close", 5)
        except Exception:
            pass
        try:
            self.ws.close()
        finally:
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            shutil.rmtree(self.profile, ignore_errors=True)
