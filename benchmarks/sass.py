"""What a Pallas kernel's main loop issues on an NVIDIA GPU, read from its SASS without the GPU.

    .venv-gpu13/bin/python -m pip install "nvidia-cuda-nvdisasm>=13,<14"   # once: nvdisasm beside ptxas
    JAX_PLATFORMS=cpu .venv-gpu13/bin/python benchmarks/sass.py [--target h200] [--kernel decode moe]
        [--warps 4 2 1]

Compiles the kernels as a decode step runs them, deviceless for the target (omni_jax.gpu.aot):
the paged decode kernel at batch 64 x 4096 with the 7B's heads (the kernel target's point; each
of `--warps`), and one token's MoE experts of the 30B-A3B thinker (gate/up, then down). XLA's PTX
goes through ptxas and nvdisasm; for each kernel it prints registers and spills, then its longest
loop (from a backward branch to its label): the instructions a warp issues an iteration, those
that matter in a bandwidth-bound kernel (HMMA, LDGSTS, MUFU, BAR.SYNC, SHFL), and the wait at the
loop's top (`DEPBAR.LE SB0, n`: copy groups left in flight). The README's SASS figures
("Measured on a GPU") come from this. No timing: a GPU measures that.
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# An instruction line of `nvdisasm -c`: /*0a00*/ [@P0 | @!P1 ...] OPCODE.MODIFIERS operands ;
_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Z0-9_]+)*)")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")
WATCHED = ("HMMA", "LDGSTS", "MUFU", "BAR", "SHFL", "LDSM", "LDS", "STS")


def loop_profile(sass: str) -> dict | None:
    """The longest loop of one kernel's SASS: instructions an iteration, counts by opcode, and
    the wait at its top; None where the kernel has no loop."""
    lines = sass.splitlines()
    labels, loops = {}, []
    for i, line in enumerate(lines):
        m = _LABEL.match(line)
        if m:
            labels[m.group(1)] = i
        elif "BRA" in line:
            t = _TARGET.search(line)
            if t and t.group(1) in labels:  # a label already seen: a backward branch
                loops.append((labels[t.group(1)], i))
    if not loops:
        return None
    first, last = max(loops, key=lambda span: span[1] - span[0])
    ops = collections.Counter()
    wait = None
    for line in lines[first:last + 1]:
        m = _INSTRUCTION.match(line)
        if m:
            ops[m.group(1)] += 1
            w = re.search(r"DEPBAR\.LE SB0, (0x[0-9a-f]+)", line)
            if w and wait is None:
                wait = int(w.group(1), 16)
    return dict(instructions=sum(ops.values()), ops=dict(ops), depbar_wait=wait)


def _tools() -> tuple[str, str]:
    from omni_jax.gpu.client import cuda_data_dir

    bin_dir = os.path.join(cuda_data_dir(), "bin")
    ptxas, nvdisasm = os.path.join(bin_dir, "ptxas"), os.path.join(bin_dir, "nvdisasm")
    if not os.path.exists(nvdisasm):
        raise SystemExit(f"no nvdisasm beside {ptxas}: pip install the nvidia-cuda-nvdisasm wheel of that CUDA "
                         f"into the GPU compile environment")
    return ptxas, nvdisasm


def kernels_of(fn, args, target) -> dict[str, tuple[str, str]]:
    """{Pallas kernel name: (ptxas' usage line, SASS)} of `fn(*args)` compiled for `target`."""
    import jax

    from omni_jax.gpu.aot import PALLAS_PREFIXES, Compiler, ptxas_usage

    ptxas, nvdisasm = _tools()
    compiler = Compiler(target)
    dump = tempfile.mkdtemp(prefix="omni_jax_sass_")
    try:
        with jax.sharding.use_abstract_mesh(compiler.mesh):
            lowered = jax.jit(fn).lower(*compiler.place(args))
        lowered.compile(compiler_options={"xla_dump_to": dump, "xla_dump_emitter_re": "ptx"})
        out = {}
        for ptx in sorted(glob.glob(os.path.join(dump, "*.ptx"))):
            entries = re.findall(r"\.entry (\w+)\(", open(ptx).read())
            if not any(e.startswith(PALLAS_PREFIXES) for e in entries):
                continue
            cubin = ptx[:-4] + ".cubin"
            subprocess.run([ptxas, f"-arch={target.arch}", ptx, "-o", cubin], check=True)
            sass = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, check=True).stdout
            used = ptxas_usage(ptx, target.arch, ptxas)[entries[0]]
            out[entries[0]] = (f"{used['registers']} registers, {used['spill_stores']} bytes of spill stores", sass)
        return out
    finally:
        shutil.rmtree(dump, ignore_errors=True)


def _thinker(family: str):
    from omni_jax.gpu.programs import real_hf_config, text_config

    return text_config(family, "thinker", real_hf_config(family))


def decode_point(warps: int):
    """The paged decode kernel at batch 64 x 4096, the 7B thinker's heads, `warps` a program."""
    import functools

    import jax
    import jax.numpy as jnp

    from kernels_pallas.paged_attention import paged_attention

    text = _thinker("qwen2_5_omni")
    b, ctx, hq, hkv, d, bs = 64, 4096, text.num_heads, text.num_kv_heads, text.head_dim, 16
    pages = b * ctx // bs + 1
    s = jax.ShapeDtypeStruct
    args = (s((b, hq, d), jnp.bfloat16), s((pages, bs, hkv, d), jnp.bfloat16), s((pages, bs, hkv, d), jnp.bfloat16),
            s((b, ctx // bs), jnp.int32), s((b,), jnp.int32))
    return functools.partial(paged_attention, num_warps=warps), args


def moe_point():
    """One token's 8 of 128 experts of the 30B-A3B thinker, as a decode step runs them."""
    import jax
    import jax.numpy as jnp

    from omni_jax.models.layers.moe import fused_expert_outputs

    text = _thinker("qwen3_omni")
    e, k, h, w = text.num_experts, text.num_experts_per_tok, text.hidden_size, text.moe_intermediate_size
    s = jax.ShapeDtypeStruct
    return fused_expert_outputs, (s((1, h), jnp.bfloat16), s((k,), jnp.int32), s((e,), jnp.int32),
                                  s((e, 2 * w, h), jnp.bfloat16), s((e, h, w), jnp.bfloat16))


def report(name: str, used: str, sass: str) -> str:
    loop = loop_profile(sass)
    if loop is None:
        return f"{name}: {used}; no loop"
    ops = loop["ops"]
    counts = " ".join(f"{op} {ops.get(op, 0)}" for op in WATCHED)
    wait = loop["depbar_wait"]
    return (f"{name}: {used}; loop: {loop['instructions']} instructions a warp an iteration ({counts}); "
            + ("no copy wait" if wait is None else f"waits for all but {wait} copy groups"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="h200", help="h100, h200 or a100 (default h200)")
    ap.add_argument("--kernel", nargs="+", choices=("decode", "moe"), default=("decode", "moe"))
    ap.add_argument("--warps", nargs="+", type=int, default=(4,), help="the decode kernel's warps a program")
    args = ap.parse_args(argv)
    from omni_jax.gpu.targets import load_target

    target = load_target(args.target)
    points = []
    if "decode" in args.kernel:
        points += [(f"decode b64 x 4096, {w} warps", decode_point(w)) for w in args.warps]
    if "moe" in args.kernel:
        points.append(("moe experts, 1 token", moe_point()))
    for label, (fn, fn_args) in points:
        for name, (used, sass) in kernels_of(fn, fn_args, target).items():
            print(f"[{label}] {report(name, used, sass)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
