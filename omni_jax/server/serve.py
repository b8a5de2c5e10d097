"""`omni-jax serve`: the OpenAI-compatible server as a command.

    omni-jax serve --model HUB_ID|DIR|tiny [--host 127.0.0.1] [--port 8000] [--api-key KEY]

A Hub model or a Hugging Face directory is fetched and converted first, once (model_source.py;
progress bars on the console). Then the port is bound, and the stages load and compile in the
background (GET /health answers 503 until they are ready, and the console shows their progress
and "ready").
SIGINT / SIGTERM stop the HTTP server and every stage process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import sys

import uvicorn
from uvicorn.config import WS_PROTOCOLS

from ..api import add_async_chunk_argument
from ..inputs.media import MediaLimits
from ..errors import CheckpointError
from ..model_source import add_model_arguments, checkpoint_dir
from ..models.registry import tiny_family
from ..prompt_workers import PromptWorkers
from .app import build_app
from .engine import REASONING_PARSERS, ServedEngine
from .realtime import RealtimeLimits
from .timeouts import with_header_timeout


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--served-model-name", default=None, help="the name clients use (default: --model)")
    p.add_argument("--pipeline", default=None, help="pipeline preset name or YAML path (default: the model's)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("OMNI_JAX_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                        "(default: $OMNI_JAX_API_KEY, else none)")
    p.add_argument("--modalities", default=None,
                   help="output modalities the engine is started for: 'text' or 'text,audio' (default: all the "
                        "model delivers: text alone for a checkpoint without speech stages)")
    p.add_argument("--allowed-local-media-path", default=None,
                   help="directory whose files requests may name as media (default: none; data: URLs only)")
    p.add_argument("--max-request-body-mb", type=float, default=64.0, help="larger bodies get 413 (default 64)")
    p.add_argument("--max-inflight-body-mb", type=float, default=None,
                   help="bytes all request bodies may hold at once, from upload to the reply's end; past it a "
                        "request gets 503 with Retry-After (default: 4 x --max-request-body-mb)")
    p.add_argument("--prompt-workers", type=int, default=4,
                   help="threads that process prompts (templates, tokenizer, media decoding; default 4)")
    p.add_argument("--max-queued-prompts", type=int, default=256,
                   help="prompts that may wait for a prompt worker; more get 503 with Retry-After (default 256)")
    p.add_argument("--header-timeout-s", type=float, default=10.0,
                   help="a request's headers must arrive within this many seconds, else the connection is "
                        "closed (default 10)")
    p.add_argument("--body-timeout-s", type=float, default=30.0,
                   help="a request body that stops arriving for this many seconds gets 408 (default 30)")
    p.add_argument("--prompt-timeout-s", type=float, default=30.0,
                   help="a prompt whose processing takes longer fails with a 400 (default 30)")
    p.add_argument("--media-limits", default=None, metavar="JSON",
                   help="media checked before decoding, e.g. '{\"max_image_pixels\": 16777216, \"max_video_frames\": "
                        "3600}' (keys: min_sample_rate, max_sample_rate, max_image_pixels, max_video_fps, "
                        "max_video_frames; default: MediaLimits())")
    p.add_argument("--max-realtime-sessions", type=int, default=16,
                   help="realtime sessions at most, WebSocket and WebRTC together; one more gets an error event and close "
                        "code 1008, or 429 for a call (default 16)")
    p.add_argument("--realtime-max-buffer-s", type=float, default=60.0,
                   help="seconds of input audio a realtime session holds before a commit (default 60)")
    p.add_argument("--realtime-max-session-s", type=float, default=1800.0,
                   help="a realtime session is closed after this many seconds (default 1800, OpenAI's 30 minutes)")
    p.add_argument("--allowed-origins", default="[]", metavar="JSON",
                   help="web origins whose pages may call the API from a browser besides the server's own, as "
                        "vLLM's, e.g. '[\"https://app.example.org\"]' ('[\"*\"]': any; default: none)")
    p.add_argument("--ice-server", action="append", default=[], metavar="URL",
                   help="a STUN or TURN server for WebRTC calls (/v1/realtime/calls), e.g. stun:stun.example.org:3478; "
                        "repeat for more (default: none, the host's own addresses only)")
    p.add_argument("--reply-audio-ttl-s", type=float, default=3600.0,
                   help="how long a chat reply's audio id can bring that reply into a later request (default 3600)")
    p.add_argument("--stored-responses-mb", type=float, default=256.0,
                   help="/v1/responses: what stored responses and their conversations may hold, the oldest dropped "
                        "first (each is kept an hour at most; 0 keeps none; default 256)")
    p.add_argument("--reasoning-parser", default="auto", choices=list(REASONING_PARSERS),
                   help="qwen3: replies' thinking (<think> ... </think>) comes apart from their answers, as "
                        "reasoning_content / reasoning items, and structured outputs and tool calls hold the answer; "
                        "none: replies as written; auto (default): qwen3 for a checkpoint without speech stages "
                        "whose vocabulary has the tags (Qwen3-Omni-30B-A3B-Thinking)")
    p.add_argument("--no-ui", action="store_true", help="do not serve the voice chat page at /")
    add_async_chunk_argument(p)
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


# uvicorn's WebSocket protocol on the websockets package (its older implementation warns that
# it is deprecated; uvicorn releases before the sans-I/O one have only that).
WS = "websockets-sansio" if "websockets-sansio" in WS_PROTOCOLS else "websockets"


class _Server(uvicorn.Server):
    """uvicorn's server, minus its re-raising of SIGINT / SIGTERM after the graceful shutdown
    (a KeyboardInterrupt traceback, or death by SIGTERM): the command exits 0 instead."""

    @contextlib.contextmanager
    def capture_signals(self):
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _check_flags(args: argparse.Namespace) -> None:
    """ValueError naming a flag whose value cannot serve."""
    if args.api_key is not None and not args.api_key.strip():
        # An empty key would let `Authorization: Bearer` (an empty token) in: never what was meant.
        raise ValueError("the API key is empty (--api-key or $OMNI_JAX_API_KEY); give a key, or unset it to "
                         "serve without one")
    try:
        origins = json.loads(args.allowed_origins)
    except ValueError:
        origins = None
    if not isinstance(origins, list) or not all(isinstance(o, str) for o in origins):
        raise ValueError(f"--allowed-origins must be a JSON list of origins, e.g. '[\"https://app.example.org\"]', "
                         f"got {args.allowed_origins[:100]!r}")
    args.allowed_origins = origins
    if args.max_realtime_sessions < 0:
        raise ValueError(f"--max-realtime-sessions must be 0 or more, got {args.max_realtime_sessions}")
    for flag in ("max_request_body_mb", "header_timeout_s", "body_timeout_s", "realtime_max_buffer_s",
                 "realtime_max_session_s", "reply_audio_ttl_s"):
        value = getattr(args, flag)
        if not 0 < value < float("inf"):
            raise ValueError(f"--{flag.replace('_', '-')} must be a positive number, got {value!r}")
    if not 0 <= args.stored_responses_mb < float("inf"):
        raise ValueError(f"--stored-responses-mb must be 0 or more, got {args.stored_responses_mb!r}")
    if args.max_inflight_body_mb is not None and not args.max_inflight_body_mb >= args.max_request_body_mb:
        raise ValueError(f"--max-inflight-body-mb ({args.max_inflight_body_mb:g}) must be at least "
                         f"--max-request-body-mb ({args.max_request_body_mb:g}), or no body could be taken")


def engine_model(model: str, revision: str | None = None) -> str:
    """What the served engine loads for `--model`: the converted directory (a Hub model or HF
    directory converted now, so that loading needs no network); a built-in tiny model by its
    name, which is what picks its tiny preset (its directory would pick the full-size one)."""
    ckpt = checkpoint_dir(model, revision)
    return model if tiny_family(model) is not None else ckpt


def run(args: argparse.Namespace) -> int:
    mods = None if args.modalities is None else [m.strip() for m in args.modalities.split(",") if m.strip()]
    if mods not in (None, ["text"], ["text", "audio"]):
        print("omni-jax serve: error: --modalities must be 'text' or 'text,audio'", file=sys.stderr)
        return 2
    try:
        limits = None if args.media_limits is None else MediaLimits.from_json(args.media_limits)
        PromptWorkers.check(args.prompt_workers, args.prompt_timeout_s, args.max_queued_prompts)
        _check_flags(args)
    except ValueError as e:
        print(f"omni-jax serve: error: {e}", file=sys.stderr)
        return 2
    try:  # a Hub model is fetched and converted first (minutes, with progress bars); then the port opens
        model = engine_model(args.model, args.revision)
    except CheckpointError as e:
        print(f"omni-jax serve: error: {e}", file=sys.stderr)
        return 1
    try:
        sock = _bind(args.host, args.port)
    except OSError as e:
        print(f"omni-jax serve: error: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    server: _Server | None = None

    def stop_server():
        if server is not None:
            server.should_exit = True

    engine = ServedEngine(model, args.served_model_name or args.model, args.pipeline, mods,
                          on_failed=stop_server, async_chunk=args.async_chunk,
                          engine_options=dict(prompt_workers=args.prompt_workers, prompt_timeout_s=args.prompt_timeout_s,
                                              media_limits=limits, max_queued_prompts=args.max_queued_prompts),
                          reasoning_parser=args.reasoning_parser)
    max_body = int(args.max_request_body_mb * (1 << 20))
    realtime = RealtimeLimits(max_sessions=args.max_realtime_sessions, max_buffer_s=args.realtime_max_buffer_s,
                              max_session_s=args.realtime_max_session_s)
    inflight = None if args.max_inflight_body_mb is None else int(args.max_inflight_body_mb * (1 << 20))
    app = build_app(engine, api_key=args.api_key, max_body_bytes=max_body,
                    allowed_media_dir=args.allowed_local_media_path, max_inflight_body_bytes=inflight,
                    body_timeout_s=args.body_timeout_s, realtime=realtime,
                    reply_audio_ttl_s=args.reply_audio_ttl_s,
                    stored_responses_bytes=int(args.stored_responses_mb * (1 << 20)), ui=not args.no_ui,
                    ice_servers=tuple(args.ice_server), allowed_origins=tuple(args.allowed_origins))
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"omni-jax serve: listening on http://{host}:{sock.getsockname()[1]} "
          f"(model {engine.served_name!r}; loading and compiling the stages, /health is 503 until ready"
          f"{'' if args.no_ui else '; the voice chat page is at /'})",
          flush=True)
    server = _Server(uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5,
                                    access_log=args.log_level == "debug", http=with_header_timeout(args.header_timeout_s),
                                    # one realtime message at most the body limit (larger: close code 1009)
                                    ws=WS, ws_max_size=max_body))
    engine.start()
    server.run(sockets=[sock])  # returns on SIGINT / SIGTERM, after the app's shutdown stopped the stages
    return 1 if engine.state == "failed" else 0
