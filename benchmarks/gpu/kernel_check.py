"""Part `kernels`: the Pallas kernels at the thinkers' shapes (real on a GPU, tiny on a CPU),
bf16, against their XLA references on the same device: error, time, achieved HBM bandwidth
and its share of a device-to-device copy measured in the same run, kernel / XLA ratio.
The measurements are benchmarks/pallas_kernels.py's (`*_point`)."""

from __future__ import annotations

import os
import sys

from sizes import ROOT, hf_config

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

REL_TOL = 2e-2   # bf16 operands: 1e-3 .. 1e-2 expected (METHOD.md); NaN never passes


def _heads(text):
    return text.num_heads, text.num_kv_heads, text.head_dim


def copy_peak(size, rep) -> float | None:
    """The device's copy bandwidth (read + write), recorded as the ceiling a kernel part holds its
    kernels against; None, recorded as a failure, where a GPU run sees no GPU."""
    import jax

    import pallas_kernels as kb

    device = jax.devices()[0]
    if size.name == "gpu" and device.platform != "gpu":
        rep.add("device", device.device_kind, note="FAIL: no GPU visible to JAX")
        return None
    peak = kb.copy_bandwidth(size.copy_bytes, iters=size.kernel_iters, reps=1 if size.interpret else 5)
    name, datasheet = kb.device_peak(device)
    rep.add("device copy bandwidth (read + write)", peak / 1e9, "GB/s", f"{size.copy_bytes >> 20} MiB bf16, the "
            "ceiling below" + (f"; datasheet {name}: {datasheet / 1e9:.0f}" if datasheet else ""))
    return peak


def run(size, rep, results_dir) -> None:
    import jax

    import pallas_kernels as kb
    from kernels_pallas.moe_route import MAX_TOKENS as ROUTE_KERNEL_MAX_TOKENS
    from omni_jax.gpu.programs import text_config

    qwen2_5 = text_config("qwen2_5_omni", "thinker", hf_config("qwen2_5_omni", size))
    qwen3 = text_config("qwen3_omni", "thinker", hf_config("qwen3_omni", size))
    on_gpu = jax.devices()[0].platform == "gpu"
    peak = copy_peak(size, rep)
    if peak is None:
        return
    iters, interp = size.kernel_iters, size.interpret
    if not on_gpu:
        rep.add("timing", "not meaningful", note="Pallas interpret mode on a CPU: numerics only")
    if on_gpu:
        rep.add("tuning", f"decode {kb.decode_tuning()}, prefill {kb.prefill_tuning()}, "
                          f"experts {kb.grouped_tuning()}")

    def record(name, r):
        bw = r["bytes"] / r["kernel_s"]
        ok = r["rel_err"] <= REL_TOL  # False for NaN
        ratio = f", XLA / kernel {r['xla_s'] / r['kernel_s']:.2f}x" if "xla_s" in r else ""
        rep.add(f"{name} time", r["kernel_s"] * 1e3, "ms",
                f"{bw / 1e9:.3g} GB/s = {100 * bw / peak:.3g}% of copy{ratio}"
                + (f", {r['flops'] / r['kernel_s'] / 1e12:.3g} TFLOP/s" if "flops" in r else ""))
        rep.add(f"{name} error", r["rel_err"], "rel L2",
                f"max abs {r['max_err']:.3g}" + ("" if ok else f" FAIL: over {REL_TOL}"))
        return bw / peak

    for family, text in (("qwen2.5", qwen2_5), ("qwen3", qwen3)):
        for batch, ctx in size.decode_points:
            share = record(f"decode {family} b{batch} ctx{ctx}",
                           kb.decode_point(batch, ctx, _heads(text), interpret=interp, iters=iters))
            if on_gpu and family == "qwen2.5" and batch >= 64:
                rep.add(f"decode b{batch} share of copy bandwidth", round(100 * share, 1), "%",
                        "target >= 70%" + ("" if share >= 0.7 else " (NOT MET)"))
            if family == "qwen2.5" and batch == max(b for b, _ in size.decode_points):
                # The kernel as it was before 2026-12-05 (page ids read in the loop): the A/B.
                record(f"decode {family} b{batch} ctx{ctx}, table read in the loop",
                       kb.decode_point(batch, ctx, _heads(text), interpret=interp, iters=iters,
                                       tuning=dict(preload_table=False)))
            # As the engine's decode steps call it: the step's KV write and RoPE inside (and
            # Qwen3's q/k norm), against the XLA ops it replaces.
            record(f"decode+write {family} b{batch} ctx{ctx}",
                   kb.decode_write_point(batch, ctx, _heads(text), qk_norm=family == "qwen3", interpret=interp,
                                         iters=iters))
    for new, cached, seqs in size.prefill_points:
        record(f"prefill qwen2.5 {seqs}x{new} after {cached}",
               kb.prefill_point(new, cached, seqs, _heads(qwen2_5), interpret=interp, iters=max(1, iters // 4)))
    for tokens in size.kv_write_tokens:
        record(f"kv write qwen2.5 {tokens} tokens", kb.kv_write_point(
            tokens, _heads(qwen2_5), pool_tokens=64 * 1024 if on_gpu else 256, iters=iters, interpret=interp))
    experts = (qwen3.num_experts, qwen3.num_experts_per_tok, qwen3.hidden_size, qwen3.moe_intermediate_size)
    for tokens in size.expert_tokens:
        record(f"moe gate/up qwen3 {tokens} tokens",
               kb.experts_point(tokens, experts, interpret=interp, iters=iters))
    for tokens in size.expert_tokens:
        if tokens <= ROUTE_KERNEL_MAX_TOKENS:   # the kernel routes decode steps
            record(f"moe routing qwen3 {tokens} tokens", kb.route_point(tokens, experts, interpret=interp, iters=iters))
    for tokens in size.expert_tokens:   # a decode batch and a prefill chunk
        record(f"add + rms norm qwen2.5 {tokens} tokens",
               kb.norm_point(tokens, qwen2_5.hidden_size, interpret=interp, iters=iters))
