"""Compile a selection of real-size programs for one target; write the reports as JSON.

    python -m omni_jax.gpu.worker --target h100 --select tier --families qwen2_5_omni,qwen3_omni --out R.json

Runs in the GPU compile environment (see `omni_jax.gpu`); one process per target, so
the kernels' per-target tuning (read at trace time) never leaks between targets, and
many programs share one process's start-up. Selections:

* ``tier``: what the gpu_compile tests check (see `select_tier`);
* ``full``: every kind of program the issue lists, at its extreme buckets (`select_full`);
* ``plan``: the steps `omni-jax plan` reads (every decode and prefill bucket of each
  AR stage, or only the smallest and largest with ``--ends``; each vocoder's largest calls);
* ``layers``: only what every selection adds, each AR stage's launch profile
  (`select_layers`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import sys
import time

import jax
import jax.numpy as jnp

import kernels_pallas

from ..models.registry import family_names
from . import aot, programs as P
from .memory import stage_memory, tree_bytes
from .roofline import decode_weight_bytes
from .targets import load_target

# The negative control: 512 KV tokens per step with 3 stages needs 282752 B of shared
# memory on either GPU (H100 allows 232448, A100 166912), so it must fail to compile.
NEGATIVE_CONTROL = dict(pages_per_compute_block=32, num_warps=4, num_stages=3)


def stage_facts(family: str, stage, hf_config: dict, target) -> dict:
    """Parameter bytes and KV division of one stage on the target (no compilation)."""
    model, _ = P.stage_model(family, stage.model_stage, hf_config,
                             P.DTYPE if stage.runner == "ar" else jnp.float32)
    from flax import nnx

    state = nnx.state(model, nnx.Param)
    params = tree_bytes(state)
    facts = dict(family=family, stage=stage.name, model_stage=stage.model_stage, runner=stage.runner,
                 device=stage.devices[0] if stage.devices else None, memory_fraction=stage.memory_fraction, block_size=stage.block_size,
                 blocks_per_seq=stage.blocks_per_seq, max_model_len=stage.max_model_len,
                 decode_buckets=list(stage.resolved_decode_buckets) if stage.runner == "ar" else [])
    block = 0
    if stage.runner == "ar":
        text = P.text_config(family, stage.model_stage, hf_config)
        block = P.kv_block_bytes(stage, text)
        facts.update(decode_weight_bytes(state), num_experts=getattr(text, "num_experts", 0),
                     top_k=getattr(text, "num_experts_per_tok", 0), kv_bytes_per_token=block // stage.block_size,
                     num_layers=text.num_layers)
    return facts | stage_memory(stage, target, params, block).__dict__


def _ends(programs, kind, variant=None):
    sel = [p for p in programs if p.kind == kind and (variant is None or p.info.get("variant") == variant)]
    if not sel:
        return []
    lo, hi = min(p.bucket for p in sel), max(p.bucket for p in sel)
    return [p for p in sel if p.bucket in (lo, hi)]


def _step_variant(stage) -> str:
    # Thinkers mostly serve text (plain); a talker's inputs are always embeddings (rich).
    return "plain" if stage.model_stage == "thinker" else "rich"


def select_tier(family: str, stage, hf_config: dict, num_blocks: int, target_name: str, stage_mesh) -> list:
    """What the gpu_compile tier checks (a few minutes on 2 cores): on both targets the
    Pallas kernels at every bucket (MoE stages: also their largest prefill step with 2 and
    4 layers) and the dense stages' (Qwen2.5's) largest decode steps (KV donation), the
    thinker's also at tensor parallel 2 over two GPUs (`stage_mesh`: Compiler.stage_mesh); on
    A100 also the cheap sampler variants (greedy, random), the pre-sampler program of structured
    outputs and logit_bias, and the dense thinker's smallest vision encoder call; on both, each
    thinker's largest vision encoder call (the plan holds its temporaries against what the KV
    pages leave). The programs that take minutes to compile (the MoE stages' steps,
    prefill steps, the sorting sampler variants, encoders, whole-request vocoder calls) are
    in `select_full`. The vocoders' streamed calls,
    what both presets serve with (async chunk), take seconds: their smallest shapes are here, and
    off the A100 (whose worker compiles the sampler variants) every vocoder call of the most
    padded cells (the plan holds their temporaries against what the weights leave)."""
    if stage.runner != "ar":
        smallest = [p for p in select_full(family, stage, hf_config, num_blocks, target_name, stage_mesh)
                    if p.info["call"] != "whole"]
        if target_name == "a100":
            return smallest
        return smallest + largest_vocoder_calls(P.vocoder_programs(family, stage, hf_config))
    out = P.kernel_programs(family, stage, hf_config, num_blocks)
    vision = _ends(P.media_programs(family, stage, hf_config), "vision") if stage.model_stage == "thinker" else []
    out += vision[-1:]
    if _is_moe(family, stage, hf_config):
        return out + select_prefill_layers(family, stage, hf_config, num_blocks)
    progs = P.ar_engine_programs(family, stage, hf_config, num_blocks)
    out.append(max(_ends(progs, "decode", _step_variant(stage)), key=lambda p: p.bucket))
    if stage.model_stage == "thinker":
        out.append(P.sharded_step(out[-1], stage_mesh(2)))
    if target_name == "a100" and stage.model_stage == "thinker":
        top = max(p.bucket for p in progs if p.kind == "sample")
        out += [p for p in progs if p.bucket == top and (p.kind == "shape" or p.kind == "sample"
                                                         and p.info["variant"] in ("greedy", "random"))]
        # The vision encoder once failed only here (Triton GEMM tiling; models/thinker_media.py): keep it compiling.
        out += vision[:1]
    return out


# Decoder depths the per-layer launch count is taken from (launches(2) - launches(1)).
LAYER_DEPTHS = (1, 2)


def select_layers(family: str, stage, hf_config: dict, num_blocks: int) -> list:
    """An AR stage's decode step at its smallest and largest bucket with a 1- and a 2-layer
    decoder of the real widths (seconds to compile each, where the real depth takes minutes
    for a MoE stage): launches per layer and per step besides the layers (`plan.launch_profile`).
    A stage with an after-sample program (Qwen3's code predictor) adds it at the same batches."""
    if stage.runner != "ar":
        return []
    out = []
    for n in LAYER_DEPTHS:
        progs = P.ar_engine_programs(family, stage, P.with_layers(family, stage.model_stage, hf_config, n),
                                     num_blocks)
        picked = _ends(progs, "decode", _step_variant(stage))
        if n == LAYER_DEPTHS[0]:
            picked += _ends(progs, "after_sample")
        out += [dataclasses.replace(p, name=f"{p.name}/layers{n}", kind="decode_layers", info=dict(p.info, layers=n))
                if p.kind == "decode" else p for p in picked]
    return out


def _is_moe(family: str, stage, hf_config: dict) -> bool:
    return bool(getattr(P.text_config(family, stage.model_stage, hf_config), "num_experts", 0))


# 2 and 4, not 1 and 2: XLA packs a 1-layer step's temporaries tighter (Qwen3's talker: 122 MiB,
# then 161 MiB at every depth from 2 to 20).
PREFILL_LAYER_DEPTHS = (2, 4)


def select_prefill_layers(family: str, stage, hf_config: dict, num_blocks: int) -> list:
    """An AR stage's largest prefill step with a 2- and a 4-layer decoder of the real widths:
    its temporaries must not grow with the layers. XLA:GPU has twice kept one buffer per MoE
    layer alive at once: a kernel's aliased zero-filled output (9.5 GiB in Qwen3-Omni's
    4096-token prefill), then the zeros the rows were scattered into, which it fused into one
    kernel at the step's start (5.4 GB)."""
    out = []
    for n in PREFILL_LAYER_DEPTHS:
        progs = P.ar_engine_programs(family, stage, P.with_layers(family, stage.model_stage, hf_config, n),
                                     num_blocks)
        top = max(_ends(progs, "prefill", _step_variant(stage)), key=lambda p: p.bucket)
        out.append(dataclasses.replace(top, name=f"{top.name}/layers{n}", kind="prefill_layers",
                                       info=dict(top.info, layers=n)))
    return out


def select_full(family: str, stage, hf_config: dict, num_blocks: int, target_name: str, stage_mesh) -> list:
    """Everything the issue lists, per target: kernels at every bucket; the smallest and
    largest decode and prefill steps of every AR stage, and the largest decode step over two
    GPUs at tensor parallel 2 (MoE stages: also at expert parallel 2); the sampler variants and
    the pre-sampler program at the largest batch; the after-sample hook; the encoders and
    vocoders at their smallest bucket. Tens of minutes on 2 cores (the MoE steps and the
    token2wav DiT take minutes each); run by `python -m omni_jax.gpu.client --full`."""
    if stage.runner != "ar":
        voc = P.vocoder_programs(family, stage, hf_config)
        calls = {p.info["call"] for p in voc}  # the whole request, and the streamed calls
        return [min((p for p in voc if p.info["call"] == c), key=lambda p: (p.info["batch"], p.bucket))
                for c in sorted(calls)]
    out = P.kernel_programs(family, stage, hf_config, num_blocks)
    progs = P.ar_engine_programs(family, stage, hf_config, num_blocks)
    v = _step_variant(stage)
    out += _ends(progs, "decode", v) + _ends(progs, "prefill", v)
    decode = max(_ends(progs, "decode", v), key=lambda p: p.bucket)
    out.append(P.sharded_step(decode, stage_mesh(2)))
    if _is_moe(family, stage, hf_config):
        out.append(P.sharded_step(decode, stage_mesh(1, 2)))
    top = max(p.bucket for p in progs if p.kind == "sample")
    out += [p for p in progs if p.kind in ("sample", "shape", "after_sample") and p.bucket == top]
    if stage.model_stage == "thinker":
        media = P.media_programs(family, stage, hf_config)
        out += _ends(media, "audio")[:1] + _ends(media, "vision")[:1]
    return out


def select_plan(family: str, stage, hf_config: dict, num_blocks: int, ends: bool) -> list:
    """Every decode and prefill step of an AR stage (or only the smallest and largest), and a
    thinker's largest audio and vision encoder calls (their temporaries count as the steps');
    a vocoder's largest calls (`largest_vocoder_calls`)."""
    if stage.runner != "ar":
        return largest_vocoder_calls(P.vocoder_programs(family, stage, hf_config))
    progs = P.ar_engine_programs(family, stage, hf_config, num_blocks)
    v = _step_variant(stage)
    media = []
    if stage.model_stage == "thinker":
        encoders = P.media_programs(family, stage, hf_config)
        media = _ends(encoders, "audio")[-1:] + _ends(encoders, "vision")[-1:]
    if ends:
        return _ends(progs, "decode", v) + _ends(progs, "prefill", v) + media
    return [p for p in progs if p.kind in ("decode", "prefill") and p.info.get("variant") == v] + media


def largest_vocoder_calls(programs) -> list:
    """Per kind of vocoder call (whole request, streamed halves) those of the most padded cells
    (batch x length): a call's temporaries grow with them."""
    out = []
    for call in sorted({p.info["call"] for p in programs}):
        mine = [p for p in programs if p.info["call"] == call]
        top = max(p.info["batch"] * p.bucket for p in mine)
        out += [p for p in mine if p.info["batch"] * p.bucket == top]
    return out


def negative_control(compiler: aot.Compiler, family: str, stage, hf_config: dict, num_blocks: int):
    """The thinker's largest decode kernel with a tile that cannot fit in shared memory."""
    prog = [p for p in P.kernel_programs(family, stage, hf_config, num_blocks)
            if p.info["kernel"] == "paged_attention"][-1]
    fn = jax.jit(lambda *a: kernels_pallas.paged_attention(*a, **NEGATIVE_CONTROL))
    report = compiler.compile(prog.name.replace("kernel", "negative_control"), fn, *compiler.place(prog.args))
    report.info = dict(kind="negative_control", tuning=NEGATIVE_CONTROL)
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--select", choices=("tier", "full", "plan", "layers"), default="tier")
    ap.add_argument("--families", default=",".join(family_names()))
    ap.add_argument("--presets", default=None, help="comma-separated presets (default: the families' own)")
    ap.add_argument("--ends", action="store_true", help="plan: only the smallest and largest bucket")
    ap.add_argument("--hf-config", default=None, help="a JSON file of the model's HF config, not the real one")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    target = load_target(args.target)
    compiler = aot.Compiler(target)
    presets = (args.presets or args.families).split(",")
    stages, reports = [], []
    for name in presets:
        pipeline = P.preset(name)
        hf = P.file_hf_config(args.hf_config) if args.hf_config else P.real_hf_config(pipeline.family)
        for stage in pipeline.stages:
            facts = stage_facts(pipeline.family, stage, hf, target)
            facts["preset"] = pipeline.name
            stages.append(facts)
            blocks = max(facts["num_blocks"], 2)
            if args.select in ("tier", "full"):
                pick = select_tier if args.select == "tier" else select_full
                progs = pick(pipeline.family, stage, hf, blocks, target.name, compiler.stage_mesh)
                if stage.model_stage == "thinker":
                    reports.append(negative_control(compiler, pipeline.family, stage, hf, blocks).to_dict()
                                   | {"stage": stage.name, "preset": pipeline.name})
            elif args.select == "plan":
                progs = select_plan(pipeline.family, stage, hf, blocks, args.ends)
            else:
                progs = []
            # Every selection: the launch profile of each AR stage's decode step.
            progs += select_layers(pipeline.family, stage, hf, blocks)
            for p in progs:
                placed = p.args if p.mesh is not None else compiler.place(p.args)
                r = compiler.compile(p.name, p.fn, *placed, mesh=p.mesh, **p.kwargs)
                r.info = dict(p.info, kind=p.kind, bucket=p.bucket)
                reports.append(r.to_dict() | {"stage": stage.name, "preset": pipeline.name})
                print(f"{r.name}: {'ok' if r.ok else r.error} ({r.seconds:.1f}s)", file=sys.stderr, flush=True)
    result = dict(target=target.name, seconds=time.perf_counter() - t0, stages=stages, reports=reports,
                  peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
