"""`omni-jax plan`: memory and roofline plan of a pipeline preset on one GPU model.

    omni-jax plan --model qwen2_5_omni|qwen3_omni|HUB_ID|DIR --gpu h100|a100|h200 [--context 2048] [--ends]

Compiles every decode and prefill step of the preset's AR stages for the target (in the
GPU compile environment, see `omni_jax.gpu`), the thinker's largest audio and vision
encoder calls and the vocoder's calls of the most padded codes, and prints, per stage:
parameter bytes, temporaries per bucket (from the compiled programs; the encoders' and the
vocoder's count too, the latter times the calls a step runs side by side), the KV blocks
that fit the configured memory fractions, whether the stage fits and what to change if not; per decode bucket the
HBM bytes a step must move (weights + KV read at `--context` tokens per sequence), the
roofline time at the target's bandwidth, the bytes the compiled step moves over that
minimum, its kernel launches (those outside command buffers apart, and per layer) and the
time they take at GRAPHED_LAUNCH_S / HOST_LAUNCH_S each, and which bound rules (launches
and temporaries where the bucket was compiled: every bucket, or the ends with ``--ends``;
launches and bytes at the smallest and largest bucket also from the 1- and 2-layer steps,
`launch_profile`). Per device: the stages placed on it and whether their shares fit.

Roofline: weights read per decode step = the decoder and LM head (embedding table: only
B rows; encoders run once per request); for MoE layers the experts the step's tokens are
routed to, expected under uniform routing: E * (1 - (1 - k/E)^B) of E.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections import defaultdict

from kernels_pallas.paged_attention import used_splits

from ..config import default_pipeline_for, list_presets
from ..errors import CheckpointError, ConfigError
from ..model_source import add_revision_argument, model_config
from . import client
from .hlo_bytes import SPLIT_DECODE
from .roofline import step_weight_bytes
from .targets import FILES, load_target

GB = 1e9
# What one kernel launch costs a decode step, in seconds: inside a CUDA graph (XLA's command
# buffers) and launched by the host alone. Not measured here (no GPU): issue 47's "a
# microsecond or two per launch even inside a graph", and a few for a host launch.
GRAPHED_LAUNCH_S = 1.5e-6
HOST_LAUNCH_S = 5e-6


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, help="a preset name (the real model of its family), or a model as "
                   "`serve` takes it: a Hugging Face Hub id (its config.json alone is fetched), a Hugging Face or "
                   "converted checkpoint directory")
    add_revision_argument(p)
    p.add_argument("--gpu", default="h100", choices=sorted(FILES))
    p.add_argument("--context", type=int, default=2048, help="KV tokens each sequence reads per decode step")
    p.add_argument("--ends", action="store_true", help="compile only the smallest and largest bucket")
    p.add_argument("--json", default=None, help="also write the plan as JSON to this file")


def _resolve(model: str, revision: str | None) -> tuple[str, dict | None]:
    """(preset name, the model's HF config) for `model`; a preset's config is None: the worker
    plans its family's real model."""
    if model in list_presets():
        if revision is not None:
            raise ConfigError(f"a revision ({revision!r}) is for a Hugging Face Hub id, and {model} is a preset")
        return model, None
    try:
        family, hf_config, stages = model_config(model, revision)
    except CheckpointError as e:
        raise ConfigError(f"--model {model!r} is not a preset {list_presets()}, and as a model: {e}") from None
    return default_pipeline_for(family, checkpoint_stages=stages).name, hf_config


def launch_profile(reports: list[dict]) -> dict:
    """{(preset, stage, batch): profile} of the decode steps compiled at 1 and 2 layers
    (`worker.select_layers`): launches per layer (2 layers less 1), per step besides the
    layers, the host's launches outside command buffers (kind and name) and the graphs; and
    the after-sample program's launches at that batch where the stage has one."""
    steps, after = defaultdict(dict), {}
    for r in reports:
        if not r["ok"]:
            continue
        key = (r["preset"], r["stage"], r["info"]["bucket"])
        if r["info"].get("kind") == "decode_layers":
            steps[key][r["info"]["layers"]] = r
        elif r["info"].get("kind") == "after_sample":
            after[key] = r
    out = {}
    for key, by_depth in steps.items():
        if set(by_depth) != {1, 2}:
            continue
        one, two = by_depth[1], by_depth[2]
        per_layer = two["launches"] - one["launches"]
        layer_bytes = two["bytes_accessed"] - one["bytes_accessed"]
        parts = [r.get("partial_bytes", {}) for r in (one, two)]
        layer_partials = {k: parts[1].get(k, 0) - parts[0].get(k, 0) for k in parts[1]}
        outside_per_layer = len(two["outside_launches"]) - len(one["outside_launches"])
        out[key] = dict(per_layer=per_layer, fixed=one["launches"] - per_layer,
                        graphed_per_layer=two["graphed_launches"] - one["graphed_launches"],
                        outside=list(two["outside_launches"]), outside_per_layer=outside_per_layer,
                        fixed_outside=len(one["outside_launches"]) - outside_per_layer, host_loops=two["host_loops"],
                        command_buffers=two["command_buffers"],
                        bytes_per_layer=layer_bytes, fixed_bytes=one["bytes_accessed"] - layer_bytes,
                        partials_per_layer=layer_partials,
                        fixed_partials={k: v - layer_partials.get(k, 0) for k, v in parts[0].items()})
        if key in after:
            a = after[key]
            out[key]["after_sample"] = dict(launches=a["launches"], graphed=a["graphed_launches"],
                                            outside=list(a["outside_launches"]),
                                            command_buffers=a["command_buffers"], host_loops=a["host_loops"])
    return out


def partial_bytes_at(partials: dict, context: int) -> float:
    """What split decode kernels move of their partials ({kernel: all splits' bytes},
    `hlo_bytes`) when every sequence holds `context` tokens: the share of splits in use."""
    total = 0.0
    for kernel, nbytes in partials.items():
        block_size, pages_per_block, splits = map(int, SPLIT_DECODE.match(kernel).groups())
        total += nbytes * int(used_splits(context, splits, pages_per_block, block_size)) / splits
    return total


def launch_bound_s(launches: int, outside: int) -> float:
    """Seconds a step's launches take at GRAPHED_LAUNCH_S / HOST_LAUNCH_S each."""
    return (launches - outside) * GRAPHED_LAUNCH_S + outside * HOST_LAUNCH_S


def build_plan(result: dict, context: int) -> dict:
    """The plan (plain data) from one worker's result (`--select plan`)."""
    target = load_target(result["target"])
    bw = target.memory_bandwidth
    steps = defaultdict(list)
    for r in result["reports"]:
        steps[r["preset"], r["stage"]].append(r)
    profiles = launch_profile(result["reports"])
    stages = []
    for s in result["stages"]:
        row = dict(s)
        reps = sorted((r for r in steps.get((s["preset"], s["stage"]), [])
                       if r["info"].get("kind") in ("decode", "prefill")),
                      key=lambda r: (r["info"]["kind"], r["info"]["bucket"]))
        row["failed"] = [f"{r['name']}: {r['error']}" for r in reps if not r["ok"]]
        row["prefill"] = [dict(bucket=r["info"]["bucket"], temp_bytes=r["temp_bytes"], launches=r["launches"])
                          for r in reps if r["ok"] and r["info"]["kind"] == "prefill"]
        compiled = {r["info"]["bucket"]: r for r in reps if r["ok"] and r["info"]["kind"] == "decode"}
        row["decode"] = []
        for b in s.get("decode_buckets", []):
            weights = step_weight_bytes(s, s.get("num_experts", 0), s.get("top_k", 0), b)
            ctx = min(context, s["max_model_len"])
            kv = b * ctx * s.get("kv_bytes_per_token", 0)
            r = compiled.get(b)
            prof = profiles.get((s["preset"], s["stage"], b))
            d = dict(bucket=b, weight_bytes=weights, kv_read_bytes=kv, roofline_ms=(weights + kv) / bw * 1e3,
                     launches=r["launches"] if r else None, temp_bytes=r["temp_bytes"] if r else None,
                     outside=len(r["outside_launches"]) if r else None,
                     command_buffers=r["command_buffers"] if r else None, profile=prof)
            moved = r["bytes_accessed"] + partial_bytes_at(r.get("partial_bytes", {}), ctx) if r else None
            if r is None and prof is not None:   # the real depth from the 1- and 2-layer steps
                n = s["num_layers"]
                d["launches"] = prof["fixed"] + prof["per_layer"] * n
                d["outside"] = prof["fixed_outside"] + prof["outside_per_layer"] * n
                partials = {k: prof["fixed_partials"].get(k, 0) + v * n for k, v in prof["partials_per_layer"].items()}
                moved = prof["fixed_bytes"] + prof["bytes_per_layer"] * n + partial_bytes_at(partials, ctx)
            if d["launches"] is not None:
                d["launch_ms"] = launch_bound_s(d["launches"], d["outside"]) * 1e3
            if moved is not None:
                # What the step moves: its XLA kernels and the Pallas kernels' reads but of their
                # tables (hlo_bytes), the split partials at `context`, plus what the attention
                # reads of the KV pool at `context` and the grouped matmul of the experts the
                # batch is routed to: the minimum's own terms, so the ratio is what the step
                # moves beyond them.
                d["bytes_accessed"] = moved + kv + weights - s.get("decode_dense_bytes", 0)
                d["bytes_ratio"] = d["bytes_accessed"] / (weights + kv)
            row["decode"].append(d)
        # A thinker's encoders run between its steps, in the same headroom.
        media = [r for r in steps.get((s["preset"], s["stage"]), []) if r["info"].get("kind") in ("audio", "vision")]
        row["failed"] += [f"{r['name']}: {r['error']}" for r in media if not r["ok"]]
        row["media"] = [dict(kind=r["info"]["kind"], bucket=r["info"]["bucket"], temp_bytes=r["temp_bytes"])
                        for r in media if r["ok"]]
        # A vocoder step may run `parallel` calls side by side, each with its temporaries.
        vocoder = [r for r in steps.get((s["preset"], s["stage"]), []) if r["info"].get("kind") == "vocoder"]
        row["failed"] += [f"{r['name']}: {r['error']}" for r in vocoder if not r["ok"]]
        row["vocoder"] = [dict(call=r["info"]["call"], batch=r["info"]["batch"], bucket=r["info"]["bucket"],
                               temp_bytes=r["temp_bytes"] * r["info"]["parallel"], parallel=r["info"]["parallel"])
                          for r in vocoder if r["ok"]]
        temps = [x["temp_bytes"] for x in row["prefill"] + row["decode"] + row["media"] + row["vocoder"]
                 if x["temp_bytes"] is not None]
        row["max_temp_bytes"] = max(temps, default=0)
        row["problems"] = _problems(row)
        stages.append(row)
    devices = defaultdict(list)
    for s in stages:
        devices[s["device"] or 0].append(s)
    device_rows = []
    for d, ss in sorted(devices.items()):
        frac = sum(s["memory_fraction"] or 1.0 for s in ss)
        device_rows.append(dict(device=d, stages=[s["stage"] for s in ss], memory_fraction=frac,
                                fits=frac <= 1.0 and not any(s["problems"] for s in ss)))
    whole = dict(params=sum(s["params"] for s in stages),
                 min_kv=sum(s["block_bytes"] * (s["blocks_per_seq"] + 1) for s in stages if s["block_bytes"]),
                 temps=sum(s["max_temp_bytes"] for s in stages))
    whole["fits_one_gpu"] = whole["params"] + whole["min_kv"] + whole["temps"] <= target.device_memory_size
    return dict(target=target.name, device_kind=target.device_kind, bandwidth=bw,
                device_memory=target.device_memory_size, context=context, stages=stages, devices=device_rows,
                single_gpu=whole)


def _problems(s: dict) -> list[str]:
    out = list(s["failed"])
    if s["params"] > s["share"]:
        out.append(f"weights ({s['params'] / GB:.1f} GB) exceed the stage's share ({s['share'] / GB:.1f} GB): "
                   f"raise memory_fraction or move the stage to its own device (device: N)")
    if s["block_bytes"] and s["num_blocks"] < s["blocks_per_seq"] + 1:
        out.append(f"{s['num_blocks']} KV blocks hold less than one max_model_len request "
                   f"({s['blocks_per_seq'] + 1} blocks): lower max_model_len or raise memory_fraction")
    if s["max_temp_bytes"] > s["headroom"]:
        out.append(f"step temporaries ({s['max_temp_bytes'] / GB:.2f} GB) exceed what KV leaves "
                   f"({s['headroom'] / GB:.2f} GB): " + (_vocoder_over(s) if s["vocoder"] else
                   "lower kv_memory_fraction or the largest token bucket" + _largest_prefill_that_fits(s)
                   + _media_over(s)))
    return out


def _vocoder_over(s: dict) -> str:
    """What to lower where a vocoder's largest calls do not fit beside its weights."""
    over = [f"{v['call']} {v['batch']} x {v['bucket']}" + (f" ({v['parallel']} side by side)" if v["parallel"] > 1 else "")
            for v in s["vocoder"] if v["temp_bytes"] > s["headroom"]]
    return (f"the calls {', '.join(over)} do: lower max_num_batched_tokens (padded codes per call), the "
            f"largest batch (decode_buckets) or length bucket (token_buckets), or raise memory_fraction")


def _media_over(s: dict) -> str:
    """The encoder calls (largest bucket) whose temporaries exceed the headroom, if any."""
    over = [f"{m['kind']} {m['bucket']}" for m in s["media"] if m["temp_bytes"] > s["headroom"]]
    return f"; the encoder calls {', '.join(over)} alone do: lower that bucket" if over else ""


def _largest_prefill_that_fits(s: dict) -> str:
    """Prefill temporaries grow about linearly in tokens: the largest power-of-two token
    bucket the headroom holds, from the compiled smallest and largest buckets."""
    pre = s["prefill"]
    if len(pre) < 2 or pre[-1]["temp_bytes"] <= pre[0]["temp_bytes"]:
        return ""
    per_token = (pre[-1]["temp_bytes"] - pre[0]["temp_bytes"]) / (pre[-1]["bucket"] - pre[0]["bucket"])
    fit = pre[0]["bucket"] + (s["headroom"] - pre[0]["temp_bytes"]) / per_token
    if fit < 1:
        return ""
    bucket = 1 << (int(fit).bit_length() - 1)
    return (f" (prefill needs ~{per_token / 2**20:.1f} MiB per token: max_num_batched_tokens {bucket} "
            f"fits the present headroom)")


def format_plan(plan: dict, preset: str) -> str:
    """The plan as text tables."""
    lines = [f"plan of preset {preset!r} on {plan['device_kind']} ({plan['device_memory'] / GB:.1f} GB, "
             f"{plan['bandwidth'] / 1e12:.2f} TB/s); bf16 weights and KV; decode KV read at "
             f"{plan['context']} tokens per sequence", ""]
    lines.append(f"{'stage':<10}{'dev':>4}{'share GB':>10}{'params GB':>11}{'KV blocks':>11}{'KV tokens':>11}"
                 f"{'KV GB':>8}{'max temp GB':>13}{'headroom GB':>13}  fits")
    for s in plan["stages"]:
        lines.append(f"{s['stage']:<10}{s['device'] or 0:>4}{s['share'] / GB:>10.1f}{s['params'] / GB:>11.2f}"
                     f"{s['num_blocks']:>11}{s['num_blocks'] * s['block_size']:>11}{s['num_blocks'] * s['block_bytes'] / GB:>8.1f}"
                     f"{s['max_temp_bytes'] / GB:>13.3f}{(s['headroom']) / GB:>13.2f}  "
                     f"{'yes' if not s['problems'] else 'NO'}")
        for p in s["problems"]:
            lines.append(f"    ! {p}")
    for s in plan["stages"]:
        if not s["decode"] and not s["prefill"]:
            continue
        lines += ["", f"{s['stage']}: decode step per bucket"]
        lines.append(f"{'batch':>6}{'weights GB':>12}{'KV read GB':>12}{'moved/min':>11}{'roofline ms':>13}"
                     f"{'launches':>10}{'outside':>9}{'per layer':>11}{'launch ms':>11}{'bound':>11}{'temp MiB':>10}")
        for d in s["decode"]:
            launches = "-" if d["launches"] is None else d["launches"]
            temp = "-" if d["temp_bytes"] is None else f"{d['temp_bytes'] / 2**20:.1f}"
            outside = "-" if d["outside"] is None else d["outside"]
            per_layer = "-" if d["profile"] is None else d["profile"]["per_layer"]
            launch_ms = d.get("launch_ms")
            bound = "-" if launch_ms is None else ("launches" if launch_ms > d["roofline_ms"] else "bandwidth")
            ratio = f"{d['bytes_ratio']:.2f}" if "bytes_ratio" in d else "-"
            lines.append(f"{d['bucket']:>6}{d['weight_bytes'] / GB:>12.2f}{d['kv_read_bytes'] / GB:>12.2f}{ratio:>11}"
                         f"{d['roofline_ms']:>13.2f}{launches:>10}{outside:>9}{per_layer:>11}"
                         f"{'-' if launch_ms is None else f'{launch_ms:.2f}':>11}{bound:>11}{temp:>10}")
        for d in s["decode"]:
            prof = d["profile"]
            if prof and (prof["outside"] or prof.get("after_sample")):
                extra = [f"outside command buffers: {', '.join(prof['outside']) or 'none'}"]
                if prof.get("after_sample"):
                    a = prof["after_sample"]
                    extra.append(f"after-sample program {a['launches']} launches ({len(a['outside'])} outside)")
                lines.append(f"  batch {d['bucket']}: " + "; ".join(extra))
        lines.append(f"  (moved/min: HBM bytes the step moves over weights + KV read; launch ms: "
                     f"{GRAPHED_LAUNCH_S * 1e6:.1f} us per launch in a command buffer, {HOST_LAUNCH_S * 1e6:.0f} us "
                     f"outside; both at the real depth from the 1- and 2-layer steps where the bucket "
                     f"was not compiled whole)")
        lines.append(f"{s['stage']}: prefill temporaries per token bucket: " + ", ".join(
            f"{p['bucket']}: {p['temp_bytes'] / 2**20:.0f} MiB" for p in s["prefill"]))
    for s in plan["stages"]:
        if s["vocoder"]:
            lines += ["", f"{s['stage']}: temporaries of its largest calls (batch x length)" + (
                f", {s['vocoder'][0]['parallel']} side by side" if s["vocoder"][0]["parallel"] > 1 else "") + ": "
                + ", ".join(f"{v['call']} {v['batch']} x {v['bucket']}: {v['temp_bytes'] / GB:.2f} GB"
                            for v in s["vocoder"])]
    lines.append("")
    for d in plan["devices"]:
        lines.append(f"device {d['device']}: {', '.join(d['stages'])}; memory fractions sum to "
                     f"{d['memory_fraction']:.2f}: {'fits' if d['fits'] else 'does NOT fit'}")
    w = plan["single_gpu"]
    lines.append(f"all stages on one {plan['target'].upper()}: weights {w['params'] / GB:.1f} GB + KV for one "
                 f"max-length request per stage {w['min_kv'] / GB:.1f} GB + temporaries {w['temps'] / GB:.2f} GB "
                 f"{'<=' if w['fits_one_gpu'] else '>'} {plan['device_memory'] / GB:.1f} GB: "
                 f"{'fits' if w['fits_one_gpu'] else 'does not fit'}")
    return "\n".join(lines)


def run(args) -> int:
    try:
        preset, hf_config = _resolve(args.model, args.revision)
    except ConfigError as e:
        print(f"omni-jax plan: error: {e}", file=sys.stderr)
        return 1
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="omni-jax-plan-") as f:
        json.dump(hf_config, f)
        f.flush()
        extra = ["--presets", preset, *(["--hf-config", f.name] if hf_config else []),
                 *(["--ends"] if args.ends else [])]
        result = client.run_workers([args.gpu], "plan", extra)[args.gpu]
    if args.json:  # the compile reports too, so the table can be rebuilt without compiling
        with open(args.json + ".reports", "w") as f:
            json.dump(result, f)
    plan = build_plan(result, args.context)
    print(format_plan(plan, preset))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(plan, f, indent=1)
    return 0 if all(not s["problems"] for s in plan["stages"]) else 1


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="plan")
    add_arguments(ap)
    sys.exit(run(ap.parse_args()))
