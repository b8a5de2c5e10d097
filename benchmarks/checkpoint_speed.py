"""Seconds to write and to load a stage: OmniJax's checkpoint (orbax; uncompressed as
`save_stage` writes it, and with zstd as it wrote before), against safetensors (the format of Hugging Face checkpoints, what transformers and vLLM load:
the peer, measured in the same run).

    python benchmarks/checkpoint_speed.py [--layers 8] [--dir /dev/shm] [--repeat 2]

The stage: a random Qwen2.5-Omni thinker in bfloat16 (the real vocabulary, hidden size 1024,
`--layers` layers; ~0.9 GB at 8), its weights drawn as `random_weights` draws them (normal, the
spread of a trained model's). Each way writes the same arrays (host JAX arrays, as conversion
hands them over) and then loads them in a fresh process: OmniJax's way is `load_checkpoint`
(checks, restores in runs, builds the module), the peer's `safetensors.flax.load_file` (the
arrays, no module). Writes and loads alternate between the ways `--repeat` times and the best
of each is printed; the files live in `--dir` (the page cache holds them either way: what is
timed is the format's own cost, not the disk's).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.machine import cpu_model  # noqa: E402

LOAD = """
import sys, time
import jax
from flax import nnx
from safetensors.flax import load_file
from omni_jax.checkpoint import load_checkpoint
import omni_jax.models.qwen2_5_omni.stages  # noqa: F401  (imports off the clock)
way, path = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
if way == "safetensors":
    jax.block_until_ready(load_file(path))
else:
    module, _ = load_checkpoint(path, "thinker")
    jax.block_until_ready(nnx.state(module, nnx.Param))
print(time.perf_counter() - t0)
"""


def thinker_arrays(layers: int) -> tuple[dict, dict]:
    """(hf config, {parameter path: host bf16 array}) of the random thinker."""
    import jax.numpy as jnp
    import numpy as np

    from omni_jax.models.qwen2_5_omni.tiny import tiny_config
    from omni_jax.models.random_weights import random_params
    from omni_jax.models.registry import get_family

    hf = tiny_config()
    hf["thinker_config"]["text_config"].update(hidden_size=1024, intermediate_size=4096, num_hidden_layers=layers,
                                               num_attention_heads=8, num_key_value_heads=4)
    spec = get_family("qwen2_5_omni").stages["thinker"]
    cfg = spec.parse_config(hf[spec.config_key])
    return hf, random_params(spec.build, cfg, np.random.default_rng(0), jnp.bfloat16)


def write(way: str, out: str, hf: dict, arrays: dict) -> float:
    """Write the stage `way`'s way into `out`; seconds."""
    import json

    from omni_jax import checkpoint as ck

    t0 = time.perf_counter()
    if way == "safetensors":
        from safetensors.flax import save_file

        save_file({ck.path_key(p): a for p, a in arrays.items()}, out)
    else:
        os.makedirs(out)
        ck.save_stage(os.path.join(out, "thinker"), arrays, compress=way == "orbax zstd")
        with open(os.path.join(out, ck.CONFIG_FILE), "w") as f:
            json.dump({"format_version": ck.FORMAT_VERSION, "family": "qwen2_5_omni", "dtype": "bfloat16",
                       "stages": ["thinker"], "hf_config": hf}, f)
    return time.perf_counter() - t0


def load(way: str, path: str) -> float:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", LOAD, way, path], capture_output=True, text=True, env=env, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def size_mib(path: str) -> float:
    if os.path.isfile(path):
        return os.path.getsize(path) / 2**20
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs) / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8, help="decoder layers of the thinker")
    p.add_argument("--dir", default=None, help="where the files go (default: the temporary folder)")
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args()
    import jax

    jax.config.update("jax_platforms", "cpu")
    print(f"CPU {cpu_model()} ({os.cpu_count()} cores); load average {os.getloadavg()[0]:.2f}")
    hf, arrays = thinker_arrays(args.layers)
    host = jax.devices("cpu")[0]
    arrays = {k: jax.device_put(v, host) for k, v in arrays.items()}
    mib = sum(a.nbytes for a in arrays.values()) / 2**20
    ways = ("orbax zstd", "orbax", "safetensors")
    best = {w: [float("inf")] * 3 for w in ways}  # write s, load s, MiB
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for _ in range(args.repeat):
            for w in ways:
                out = os.path.join(tmp, w.replace(" ", "_") + (".safetensors" if w == "safetensors" else ""))
                wt = write(w, out, hf, arrays)
                lt = load(w, out)
                best[w] = [min(best[w][0], wt), min(best[w][1], lt), size_mib(out)]
                shutil.rmtree(out) if os.path.isdir(out) else os.remove(out)
    print(f"a bfloat16 thinker of {mib:.0f} MiB ({len(arrays)} tensors), best of {args.repeat}:")
    print("| way | write s | load s | on disk MiB | write / safetensors | load / safetensors |")
    print("|---|---|---|---|---|---|")
    peer = best["safetensors"]
    for w in ways:
        wt, lt, size = best[w]
        print(f"| {w} | {wt:.2f} | {lt:.2f} | {size:.0f} | {wt / peer[0]:.2f} | {lt / peer[1]:.2f} |")


if __name__ == "__main__":
    main()
