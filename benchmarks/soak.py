"""Soak: thousands of mixed text and speech requests through one AsyncOmniJax; every request ends, nothing leaks.

    python benchmarks/soak.py [--num-requests 10000] [--speech-fraction 0.2] [--concurrency 64]
                              [--abort-fraction 0.05] [--bad-fraction 0.01] [--max-tokens 8] [--talker-tokens 24]

One engine (`--model`, default the built-in tiny Qwen2.5-Omni with its preset: three stages,
async chunk on) serves N requests, at most `--concurrency` in flight. Each is planned from
`--seed`: text-only or text + speech (a chat prompt, `--speech-fraction`), greedy or seeded, a
reply of 1..`--max-tokens` thinker tokens and at most `--talker-tokens` codec tokens; some are
aborted after their first update (half by leaving the stream, half by `engine.abort` while
reading on) and a few are bad on purpose: a prompt with a negative token id and out-of-range
SamplingParams (both refused at the call), a stop id past the vocabulary and a prompt longer
than the thinker's max_model_len (both end with an error from the stage).

Before the measured run, `--warmup` requests of the same mix; the compilation counters and the
process RSS are read after them. Progress is printed every N/10 requests. At the end: requests/s,
finished / error / aborted / unexpected counts (an unexpected failure: a good request that
errors or raises, a bad one that is served, any request still open after `--request-timeout`),
every stage's KV usage and request counts once idle, the RSS (VmRSS) of the front end and of each
stage process after warm-up and after the first and last tenths, compilations since warm-up,
and the load average at start and end. The peer of this benchmark is the run itself: the ratio of
the last tenth to the first tenth (requests/s, RSS) shows whether the engine slows down or grows
as it serves (the last tenth includes draining the final requests). Exit status 1 on any
unexpected failure, a leak (a stage or the front end still holding a request or a KV block, a
process whose RSS grew past `--max-rss-growth` times its first-tenth size) or a compilation after
warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Stats that count what a stage holds: all 0 once every request has ended.
HELD = ("num_running", "num_waiting", "num_waiting_for_chunk", "num_waiting_for_input", "num_streamed_inputs",
        "num_streams", "num_streams_waiting_for_codes", "kv_cache_usage")
BAD_KINDS = ("bad_prompt", "bad_params", "bad_stop_id", "too_long")
WORDS = ("hello", "speech", "model", "the", "quick", "river", "seven", "blue", "engine", "why", "tell", "me")


@dataclasses.dataclass(frozen=True)
class Plan:
    """What request `index` is and how its caller behaves."""

    index: int
    speech: bool
    bad: str | None       # one of BAD_KINDS, or None
    abort: str | None     # "leave" (close the stream) or "abort" (engine.abort, read on), or None
    max_tokens: int
    seeded: bool
    words: tuple[str, ...]


def make_plans(n: int, seed: int, speech_fraction: float, abort_fraction: float, bad_fraction: float,
               max_tokens: int) -> list[Plan]:
    rng = np.random.default_rng(seed)
    plans = []
    for i in range(n):
        bad = BAD_KINDS[i % len(BAD_KINDS)] if rng.random() < bad_fraction else None
        abort = None if bad else (("leave", "abort")[i % 2] if rng.random() < abort_fraction else None)
        plans.append(Plan(index=i, speech=bool(rng.random() < speech_fraction), bad=bad, abort=abort,
                          max_tokens=int(rng.integers(1, max_tokens + 1)), seeded=bool(rng.random() < 0.5),
                          words=tuple(rng.choice(WORDS, int(rng.integers(1, 12))))))
    return plans


def rss_mb(pid: int) -> float:
    """VmRSS of a process in MB (nan if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def load_average() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "load average: " + " ".join(f"{x:.2f}" for x in os.getloadavg())


class Soak:
    """The engine, the request mix and the tallies of one run."""

    def __init__(self, engine, args):
        from omni_jax import SamplingParams

        self.engine, self.args = engine, args
        self.SamplingParams = SamplingParams
        talker = engine.pipeline.stage("talker").sampling_params() if "talker" in engine._orch.clients else None
        self.talker = None if talker is None else talker.updated(max_tokens=args.talker_tokens)
        self.vocab = engine.processor.vocab_size
        self.too_long = list(range(1, engine.pipeline.stage("thinker").max_model_len + 50))
        self.counts: collections.Counter = collections.Counter()
        self.unexpected: list[str] = []

    def request(self, plan: Plan):
        """(prompt, generate keyword arguments) of a plan; ValueError for bad params (as a caller gets)."""
        SP = self.SamplingParams
        # Seeded: temperature only (a top-p / top-k sort over the 152k vocabulary costs ~0.5 s a step on 2 CPU cores).
        sampling = dict(temperature=0.8, seed=plan.index) if plan.seeded else dict(temperature=0.0)
        text = " ".join(plan.words)
        if plan.speech:
            prompt = {"messages": [{"role": "user", "content": text}]}
        else:
            prompt = text if plan.index % 3 else {"messages": [{"role": "user", "content": [{"type": "text",
                                                                                            "text": text}]}]}
        params = dict(max_tokens=plan.max_tokens, **sampling)
        if plan.bad == "bad_prompt":
            prompt = {"prompt_token_ids": [5, -1, 7]}
        elif plan.bad == "bad_params":
            params["temperature"] = -1.0
        elif plan.bad == "bad_stop_id":
            params["stop_token_ids"] = [self.vocab]
        elif plan.bad == "too_long":
            prompt = {"prompt_token_ids": self.too_long}
        kw = dict(request_id=f"soak-{plan.index}")
        if plan.speech:
            seeded_talker = self.talker.updated(seed=plan.index) if plan.seeded else self.talker
            kw.update(output_modalities=["text", "audio"], sampling_params_list=[SP(**params), seeded_talker])
        else:  # the engine's own default is text and audio
            kw.update(output_modalities=["text"], sampling_params=SP(**params))
        return prompt, kw

    async def run_one(self, plan: Plan) -> str:
        """Serve one planned request; its outcome ("finished", "error", "refused", "aborted")."""
        try:
            prompt, kw = self.request(plan)
        except ValueError:
            return "refused"
        gen, last, updates = None, None, 0
        try:
            gen = self.engine.generate(prompt, **kw)  # refusals may come from the call or the first step
            async for out in gen:
                last, updates = out, updates + 1
                if out.finished:
                    break
                if plan.abort == "leave":
                    return "aborted"
                if plan.abort == "abort" and updates == 1:
                    self.engine.abort(out.request_id)
        except ValueError:  # PromptError is one
            return "refused"
        finally:
            if gen is not None:
                await gen.aclose()
        if last is None or not last.finished:
            raise AssertionError(f"request {plan.index}: the stream ended without a final update")
        if last.finish_reason == "abort" and plan.abort:
            return "aborted"
        if last.finish_reason == "error":
            if not last.error:
                raise AssertionError(f"request {plan.index}: finish_reason 'error' without the reason")
            return "error"
        if last.finish_reason not in ("stop", "length") or last.error is not None:
            raise AssertionError(f"request {plan.index}: finish_reason {last.finish_reason!r}, error {last.error!r}")
        if plan.speech:
            spoke = last.audio is not None and len(last.audio) > 0
            self.counts["speech with audio" if spoke else "speech without audio"] += 1
        return "finished"

    async def judged(self, plan: Plan) -> None:
        """run_one within the bound, tallied; what a plan did not expect goes to `unexpected`."""
        try:
            outcome = await asyncio.wait_for(self.run_one(plan), self.args.request_timeout)
        except TimeoutError:
            outcome, why = "unexpected", f"request {plan.index} did not end within {self.args.request_timeout:g} s"
        except Exception as e:
            outcome, why = "unexpected", f"request {plan.index}: {type(e).__name__}: {e}"
        else:
            expected = {"bad_prompt": "refused", "bad_params": "refused", "bad_stop_id": "error",
                        "too_long": "error"}.get(plan.bad)
            ok = outcome == expected if expected else outcome in ("finished", "aborted" if plan.abort else "finished")
            if not ok:
                why = f"request {plan.index} ({plan}) ended {outcome!r}, expected {expected or 'finished'!r}"
                outcome = "unexpected"
        if outcome == "unexpected":
            self.unexpected.append(why)
            if len(self.unexpected) <= 5:
                print(f"  UNEXPECTED: {why}", flush=True)
        self.counts[outcome] += 1

    async def serve(self, plans: list[Plan], on_done=None) -> None:
        """Every plan, at most `concurrency` in flight (workers pulling the next plan)."""
        todo = iter(plans)

        async def worker():
            for plan in todo:
                await self.judged(plan)
                if on_done is not None:
                    on_done()

        await asyncio.gather(*(worker() for _ in range(min(self.args.concurrency, len(plans)))))


def idle_stats(engine, limit_s: float = 10.0) -> dict:
    """Every stage's stats once none holds anything (or after limit_s: then they show the leak)."""
    deadline = time.monotonic() + limit_s
    while True:
        stats = engine.stage_stats()
        if not any(s.get(k, 0.0) for s in stats.values() for k in HELD) or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def snapshot_rss(engine) -> dict[str, float]:
    return {"front end": rss_mb(os.getpid())} | {name: rss_mb(pid) for name, pid in engine.stage_pids().items()}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--num-requests", type=int, default=10000)
    ap.add_argument("--speech-fraction", type=float, default=0.2, help="share of requests with speech out")
    ap.add_argument("--concurrency", type=int, default=64, help="requests in flight at most")
    ap.add_argument("--abort-fraction", type=float, default=0.05, help="share aborted after their first update")
    ap.add_argument("--bad-fraction", type=float, default=0.01, help="share bad on purpose (error paths)")
    ap.add_argument("--max-tokens", type=int, default=8, help="thinker tokens per reply: 1..this")
    ap.add_argument("--talker-tokens", type=int, default=24, help="codec tokens per speech reply at most")
    ap.add_argument("--warmup", type=int, default=64, help="requests of the same mix before measuring")
    ap.add_argument("--request-timeout", type=float, default=120.0, help="seconds a request may take to end")
    ap.add_argument("--max-rss-growth", type=float, default=1.25,
                    help="a process whose RSS at the end exceeds this times its first-tenth RSS counts as a leak")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.num_requests < 10 or args.concurrency < 1:
        ap.error("--num-requests must be >= 10 and --concurrency >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from omni_jax import AsyncOmniJax

    load_start = load_average()
    print(f"start: {load_start}", flush=True)
    t_start = time.perf_counter()
    engine = AsyncOmniJax(model=args.model, output_modalities=("text", "audio"))
    try:
        print(f"engine ready in {time.perf_counter() - t_start:.1f} s (async_chunk={engine.pipeline.async_chunk}, "
              f"stages {list(engine.stage_pids())})", flush=True)
        return run(engine, args, load_start)
    finally:
        engine.shutdown()


def run(engine, args, load_start: str) -> int:
    n = args.num_requests
    plans = make_plans(n + args.warmup, args.seed, args.speech_fraction, args.abort_fraction, args.bad_fraction,
                       args.max_tokens)
    warm, plans = plans[n:], plans[:n]
    soak = Soak(engine, args)
    t0 = time.perf_counter()
    asyncio.run(soak.serve(warm))
    print(f"warm-up: {len(warm)} requests in {time.perf_counter() - t0:.1f} s, {dict(soak.counts)}", flush=True)
    warm_unexpected = list(soak.unexpected)
    soak.counts.clear()
    soak.unexpected.clear()
    idle_stats(engine)
    compiled_before = {name: s["num_compilations"] for name, s in engine.stage_stats().items()}
    rss = {"after warm-up": snapshot_rss(engine)}
    bounds = [round(n * k / 10) for k in range(11)]  # requests done at the end of each tenth
    marks = [time.perf_counter()]  # the time each tenth ended
    done = 0

    def on_done():
        nonlocal done
        done += 1
        if done == bounds[len(marks)]:
            now = time.perf_counter()
            marks.append(now)
            snap = snapshot_rss(engine)
            rss["end of first tenth" if len(marks) == 2 else "end"] = snap
            c = soak.counts
            rate = (bounds[len(marks) - 1] - bounds[len(marks) - 2]) / (now - marks[-2])
            print(f"{done:6d}/{n}  {now - marks[0]:7.1f} s  {rate:6.2f} req/s this tenth  "
                  f"finished {c['finished']} error {c['error']} refused {c['refused']} aborted {c['aborted']} "
                  f"unexpected {c['unexpected']}  RSS MB " + " ".join(f"{k} {v:.0f}" for k, v in snap.items()),
                  flush=True)

    asyncio.run(soak.serve(plans, on_done))
    wall = marks[-1] - marks[0]
    stats = idle_stats(engine)
    compiled = {name: s["num_compilations"] - compiled_before.get(name, 0.0) for name, s in stats.items()}
    load_end = load_average()

    first_rate = bounds[1] / (marks[1] - marks[0])
    last_rate = (n - bounds[9]) / (marks[10] - marks[9])
    c = soak.counts
    print()
    print(f"soak: {n} requests ({sum(p.speech for p in plans)} with speech, {sum(bool(p.abort) for p in plans)} "
          f"aborted on purpose, {sum(bool(p.bad) for p in plans)} bad on purpose), concurrency {args.concurrency}, "
          f"model {args.model}, {os.cpu_count()} cores")
    print(f"  requests/s: {n / wall:.2f} overall ({wall:.1f} s); first tenth {first_rate:.2f}, last tenth "
          f"{last_rate:.2f}; last / first tenth {last_rate / first_rate:.2f}")
    print(f"  finished {c['finished']} (speech with audio {c['speech with audio']}, "
          f"without {c['speech without audio']})"
          f", error {c['error']} (bad on purpose), refused {c['refused']} (bad on purpose), aborted {c['aborted']}, "
          f"unexpected failures {c['unexpected']}")
    leaks = []
    for name, s in stats.items():
        held = {k: s[k] for k in HELD if k in s}
        print(f"  {name:10s} after the run: " + ", ".join(f"{k} {v:g}" for k, v in held.items())
              + f", healthy {s.get('healthy', 0):g}, restarts {s.get('num_restarts', 0):g}")
        if any(held.values()):
            leaks.append(f"stage {name!r} still holds {({k: v for k, v in held.items() if v})}")
        if s.get("num_restarts") or s.get("healthy") != 1.0:
            leaks.append(f"stage {name!r} restarted or is unhealthy")
    if engine._orch._requests:
        leaks.append(f"the front end still tracks {len(engine._orch._requests)} requests")
    print(f"  RSS MB       {'after warm-up':>14s} {'1st tenth':>10s} {'end':>10s} {'end / 1st tenth':>16s}")
    for proc in rss["end"]:
        first, end = rss["end of first tenth"][proc], rss["end"][proc]
        growth = end / first
        print(f"  {proc:10s} {rss['after warm-up'][proc]:14.1f} {first:10.1f} {end:10.1f} {growth:16.3f}")
        if growth > args.max_rss_growth:
            leaks.append(f"{proc} RSS grew {growth:.2f}x from the first tenth to the end")
    print("  compilations after warm-up: " + ", ".join(f"{k} {v:g}" for k, v in compiled.items()))
    print(f"  load at start: {load_start}\n  load at end:   {load_end}")
    failures = warm_unexpected + soak.unexpected + leaks
    failures += [f"stage {k!r} compiled {v:g} times after warm-up" for k, v in compiled.items() if v]
    if failures:
        print(f"FAIL: {len(failures)} problem(s):", *failures[:20], sep="\n  ")
        return 1
    print("PASS: every request ended as planned; nothing leaked or compiled after warm-up")
    return 0


if __name__ == "__main__":
    sys.exit(main())
