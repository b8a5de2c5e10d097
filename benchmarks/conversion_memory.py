"""Peak host memory of writing one converted stage: as conversion does (each tensor a JAX array
on the host CPU) against numpy arrays handed to orbax as they are (the peer: what conversion did).

    python benchmarks/conversion_memory.py [--tensors 16] [--mib 128]

Each way runs in its own process: it makes the tensors (bfloat16), writes them with
`omni_jax.checkpoint.save_stage` into a temporary directory, and reports its peak RSS
(ru_maxrss) beside the tensors' size. Prints both, and the ratio numpy / JAX. A stage converts
only if the machine holds its peak: the Qwen3-Omni-30B-A3B thinker is 61 GB in bfloat16.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.machine import cpu_model  # noqa: E402

CHILD = """
import os, resource, sys, tempfile
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
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""


def peak_mib(way: str, tensors: int, mib: int) -> float:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    out = subprocess.run([sys.executable, "-c", CHILD, way, str(tensors), str(mib)], capture_output=True, text=True,
                         env=env, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--mib", type=int, default=128, help="size of each tensor")
    args = p.parse_args()
    size = args.tensors * args.mib
    jax_peak = peak_mib("jax", args.tensors, args.mib)
    np_peak = peak_mib("numpy", args.tensors, args.mib)
    print(f"CPU {cpu_model()} ({os.cpu_count()} cores); load average {os.getloadavg()[0]:.2f}")
    print(f"stage of {size} MiB: peak RSS as JAX host arrays {jax_peak:.0f} MiB, as numpy arrays {np_peak:.0f} MiB; "
          f"numpy / JAX = {np_peak / jax_peak:.2f}")


if __name__ == "__main__":
    main()
