"""Peak host memory of writing a converted stage and of loading one, each against the way that
held the stage twice (the peer, measured in the same run).

    python benchmarks/checkpoint_memory.py [--tensors 16] [--mib 128] [--layers 8]

write: `--tensors` tensors of `--mib` MiB (bfloat16) written by `omni_jax.checkpoint.save_stage` as conversion
hands them over (JAX arrays on the host CPU) and as numpy arrays (orbax copies those first).
load: a random Qwen2.5-Omni thinker of about 1.7 GB (float32: the real vocabulary, hidden size
1024, `--layers` layers) loaded by `load_checkpoint` in runs of RESTORE_GROUP_BYTES (`--group-mib`
sets another size) and in one run (the whole stage restored to host memory, then moved). Each way
runs in its own process and reports its peak RSS (VmHWM: ru_maxrss would count the parent's,
which a child inherits). On CPU the loaded parameters live in host memory too, so a load peaks at
the stage plus what the load holds beside it; on a GPU host, at the latter.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.machine import cpu_model  # noqa: E402

WRITE = """
import os, sys, tempfile
import jax, ml_dtypes, numpy as np
from omni_jax.checkpoint import save_stage
way, n, mib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
host = jax.devices("cpu")[0]
arrays = {}
for i in range(n):
    a = np.full((mib << 19,), i, ml_dtypes.bfloat16)  # mib MiB of bfloat16
    arrays[(f"layer{i}", "kernel")] = a if way == "numpy" else jax.device_put(a, host)
    del a
save_stage(os.path.join(tempfile.mkdtemp(), "stage"), arrays)
print(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])
"""

LOAD = """
import sys
import omni_jax.checkpoint as ck
ck.RESTORE_GROUP_BYTES, path = int(sys.argv[1]), sys.argv[2]
ck.load_checkpoint(path, "thinker")
print(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])
"""


def peak_mib(child: str, *args) -> float:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", child, *map(str, args)], capture_output=True, text=True, env=env,
                         check=True)
    return float(out.stdout.strip().splitlines()[-1]) / 1024  # VmHWM, kB: the child's own peak


def random_thinker(out: str, layers: int) -> float:
    """A random checkpoint whose thinker is about 2 GB; returns the thinker's size in MiB."""
    from omni_jax.checkpoint import read_config
    from omni_jax.models.qwen2_5_omni.tiny import build_random_checkpoint, tiny_config

    hf = tiny_config()
    hf["thinker_config"]["text_config"].update(hidden_size=1024, intermediate_size=4096, num_hidden_layers=layers,
                                               num_attention_heads=8, num_key_value_heads=4)
    build_random_checkpoint(out, hf, tokenizer=False)
    return read_config(out)["parameters"]["thinker"] * 4 / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--mib", type=int, default=128, help="size of each tensor written")
    p.add_argument("--layers", type=int, default=8, help="decoder layers of the thinker loaded")
    p.add_argument("--group-mib", type=int, default=None, help="the runs a stage loads in (default: "
                   "RESTORE_GROUP_BYTES)")
    args = p.parse_args()
    print(f"CPU {cpu_model()} ({os.cpu_count()} cores); load average {os.getloadavg()[0]:.2f}")
    size = args.tensors * args.mib
    jax_peak = peak_mib(WRITE, "jax", args.tensors, args.mib)
    np_peak = peak_mib(WRITE, "numpy", args.tensors, args.mib)
    print(f"write a stage of {size} MiB: peak RSS as JAX host arrays {jax_peak:.0f} MiB, as numpy arrays "
          f"{np_peak:.0f} MiB; numpy / JAX = {np_peak / jax_peak:.2f}")
    from omni_jax.checkpoint import RESTORE_GROUP_BYTES

    group = args.group_mib << 20 if args.group_mib else RESTORE_GROUP_BYTES
    with tempfile.TemporaryDirectory() as tmp:
        stage = random_thinker(os.path.join(tmp, "ckpt"), args.layers)
        grouped = peak_mib(LOAD, group, os.path.join(tmp, "ckpt"))
        whole = peak_mib(LOAD, 1 << 62, os.path.join(tmp, "ckpt"))
    print(f"load a thinker of {stage:.0f} MiB: peak RSS in runs of {group >> 20} MiB {grouped:.0f} MiB, "
          f"in one run {whole:.0f} MiB; one run / runs = {whole / grouped:.2f}")


if __name__ == "__main__":
    main()
