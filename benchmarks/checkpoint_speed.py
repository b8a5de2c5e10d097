"""Seconds to write and to load a stage: OmniJax's checkpoint (orbax; uncompressed as
`save_stage` writes it, and with zstd as it wrote before), against safetensors (the format of
Hugging Face checkpoints, what transformers and vLLM load: the peer, measured in the same run).

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


def random_checkpoint(out: str, layers: int) -> dict:
    """A random bf16 checkpoint with the benchmark's thinker, written as the project writes one;
    returns the thinker's arrays (host JAX arrays, as conversion hands them over) by path."""
    import jax
    from flax import nnx

    from omni_jax.checkpoint import load_checkpoint
    from omni_jax.models.qwen2_5_omni.tiny import build_random_checkpoint, tiny_config

    hf = tiny_config()
    hf["thinker_config"]["text_config"].update(hidden_size=1024, intermediate_size=4096, num_hidden_layers=layers,
                                               num_attention_heads=8, num_key_value_heads=4)
    build_random_checkpoint(out, hf, dtype="bfloat16", tokenizer=False)
    module, _ = load_checkpoint(out, "thinker")
    host = jax.devices("cpu")[0]
    return {p: jax.device_put(v.get_value(), host) for p, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}


def write(way: str, out: str, base: str, arrays: dict) -> float:
    """Write the thinker `way`'s way into `out` (a checkpoint: `base`'s config and other stages
    beside it; a file for safetensors); seconds."""
    from omni_jax import checkpoint as ck

    if way == "safetensors":
        t0 = time.perf_counter()
        from safetensors.flax import save_file

        save_file({ck.path_key(p): a for p, a in arrays.items()}, out)
        return time.perf_counter() - t0
    shutil.copytree(base, out, ignore=lambda d, names: ["thinker"] if d == base else [])
    t0 = time.perf_counter()
    ck.save_stage(os.path.join(out, "thinker"), arrays, compress=way == "orbax zstd")
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
    ways = ("orbax zstd", "orbax", "safetensors")
    best = {w: [float("inf")] * 3 for w in ways}  # write s, load s, MiB
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        base = os.path.join(tmp, "base")
        arrays = random_checkpoint(base, args.layers)
        mib = sum(a.nbytes for a in arrays.values()) / 2**20
        for _ in range(args.repeat):
            for w in ways:
                out = os.path.join(tmp, w.replace(" ", "_") + (".safetensors" if w == "safetensors" else ""))
                wt = write(w, out, base, arrays)
                lt = load(w, out)
                best[w] = [min(best[w][0], wt), min(best[w][1], lt),
                           size_mib(os.path.join(out, "thinker") if os.path.isdir(out) else out)]
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
