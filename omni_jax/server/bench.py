"""`omni-jax bench`: a closed-loop streaming load run against a running server (vLLM's
`bench serve --omni`), or the same requests through `AsyncOmniJax` in this process.

    omni-jax bench --base-url http://127.0.0.1:8000 --concurrency 16 --num-requests 64 --modalities text,audio
    omni-jax bench --library tiny --concurrency 16 --num-requests 64      # the library, no HTTP
    omni-jax bench --backend realtime --concurrency 1,4,16 --barge-in     # spoken turns (bench_realtime.py)

`--concurrency` clients each send their next request when the last one ends. Every
request is streamed; it reports req/s and, with p50/p90/p99, TTFT, TPOT (from the
server's usage counts), time to first audio and RTF (request time / seconds of speech).
Replies are forced to `--max-tokens` tokens (`ignore_eos`) and the talker is seeded per
request, so the server run and the library run do the same work.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import aiohttp

from ..api import AsyncOmniJax, add_async_chunk_argument
from .bench_load import SAMPLE_RATE, Result, closed_loop, http_one, summarize
from .bench_realtime import run_levels

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default %(default)s)")
    p.add_argument("--library", default=None, metavar="MODEL",
                   help="run the requests through AsyncOmniJax(model=MODEL) in this process instead of a server")
    p.add_argument("--pipeline", default=None, help="with --library: pipeline preset or YAML (default: the model's)")
    add_async_chunk_argument(p, "with --library: ")
    p.add_argument("--model", default=None, help="model name to request (default: the server's first)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--concurrency", default="1", help="clients in flight; a comma list runs each in turn (1,16,64)")
    p.add_argument("--num-requests", type=int, default=32, help="requests per run")
    p.add_argument("--modalities", default="text", help="'text' or 'text,audio'")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt", default="Tell me about the weather today.")
    p.add_argument("--warmup", type=int, default=1, help="requests sent before timing (default 1)")
    p.add_argument("--json", default=None, help="also write the summary to this JSON file")
    p.add_argument("--backend", default="chat", choices=["chat", "realtime"],
                   help="chat: streamed chat completions; realtime: spoken turns over /v1/realtime, then the same "
                        "turns through chat completions (bench_realtime.py)")
    p.add_argument("--utterance", default=None, metavar="WAV",
                   help="realtime: the spoken turn (default: espeak-ng saying --prompt)")
    p.add_argument("--barge-in", action="store_true", help="realtime: also speak over a second reply, timing the cut")


def _body(args, model: str, mods: list[str], i: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": args.prompt}], "modalities": mods,
            "max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if "audio" in mods:
        body["audio"] = {"format": "pcm16"}
        body["sampling_params_list"] = [None, {"seed": 1000 + i}]
    return body


async def _library_one(omni, args, mods: list[str], i: int) -> Result:
    names = [s.name for s in omni.pipeline.stages_for(tuple(mods))]
    params = [omni.pipeline.stage(n).sampling_params() for n in names]
    params[0] = params[0].updated(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    if len(params) > 1:
        params[1] = params[1].updated(seed=1000 + i)
    res, t0, out = Result(), time.perf_counter(), None
    async for out in omni.generate({"messages": [{"role": "user", "content": args.prompt}]}, sampling_params_list=params,
                                   output_modalities=mods):
        if out.text_delta and res.ttft is None:
            res.ttft = time.perf_counter() - t0
        if out.audio_delta is not None and len(out.audio_delta) and res.ttfa is None:
            res.ttfa = time.perf_counter() - t0
    if out.error:
        res.error = out.error
        return res
    res.tokens, res.audio_seconds = len(out.token_ids), 0.0 if out.audio is None else len(out.audio) / SAMPLE_RATE
    res.latency, res.ok = time.perf_counter() - t0, True
    return res


def _print(summary: dict, label: str) -> None:
    print(f"{label}: {summary['requests']} requests ({summary['failed']} failed) in {summary['wall_s']:.2f} s: "
          f"{summary['req_per_s']:.2f} req/s, {summary['output_tok_per_s']:.1f} output tok/s")
    for name, unit, scale in (("ttft", "ms", 1e3), ("tpot", "ms", 1e3), ("ttfa", "ms", 1e3), ("rtf", "", 1.0),
                              ("latency", "ms", 1e3), ("barge_in", "ms", 1e3)):
        if name in summary:
            s = summary[name]
            print(f"  {name:8s} mean {s['mean'] * scale:9.2f}  p50 {s['p50'] * scale:9.2f}  "
                  f"p90 {s['p90'] * scale:9.2f}  p99 {s['p99'] * scale:9.2f} {unit}")
    for e in summary["errors"]:
        print(f"  error: {e}")


async def _run(args, levels: list[int]) -> list[dict]:
    """One summary per concurrency level."""
    mods = [m.strip() for m in args.modalities.split(",") if m.strip()]
    summaries = []
    if args.library:
        omni = AsyncOmniJax(model=args.library, pipeline=args.pipeline, output_modalities=mods,
                            async_chunk=args.async_chunk)
        try:
            for i in range(args.warmup):
                await _library_one(omni, args, mods, -1 - i)
            for level in levels:
                results, wall = await closed_loop(lambda i: _library_one(omni, args, mods, i), args.num_requests,
                                                   level)
                summaries.append(summarize(results, wall))
        finally:
            omni.shutdown()
        return summaries
    base = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # aiohttp (vLLM's bench client too): its C parser leaves the cores to the server. With httpx
    # this load generator took about 2.5x the CPU, all of it taken from the engine on a small machine.
    connector = aiohttp.TCPConnector(limit=max(levels) + 4)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        model = args.model
        if model is None:
            async with session.get(f"{base}/v1/models", headers=headers) as r:
                r.raise_for_status()
                model = (await r.json())["data"][0]["id"]
        url = f"{base}/v1/chat/completions"
        for i in range(args.warmup):
            await http_one(session, url, _body(args, model, mods, -1 - i), headers)
        for level in levels:
            results, wall = await closed_loop(
                lambda i: http_one(session, url, _body(args, model, mods, i), headers), args.num_requests, level)
            summaries.append(summarize(results, wall))
    return summaries


def run(args: argparse.Namespace) -> int:
    try:
        levels = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
        assert levels and min(levels) >= 1
    except (ValueError, AssertionError):
        print("omni-jax bench: error: --concurrency must be a positive int or a comma list of them", file=sys.stderr)
        return 2
    try:
        if args.backend == "realtime":
            labelled = asyncio.run(run_levels(args, levels))
        else:
            target = f"library {args.library}" if args.library else args.base_url
            labelled = [(f"{target} [{args.modalities}] concurrency {level}", summary)
                        for level, summary in zip(levels, asyncio.run(_run(args, levels)))]
    except (aiohttp.ClientError, OSError) as e:
        print(f"omni-jax bench: error: cannot reach {args.base_url}: {e}", file=sys.stderr)
        return 1
    report = []
    for label, summary in labelled:
        _print(summary, label)
        report.append({"label": label, **summary})
    summaries = [summary for _, summary in labelled]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if all(s["failed"] == 0 for s in summaries) else 1
