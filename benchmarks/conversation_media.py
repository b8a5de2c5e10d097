"""What a spoken conversation with a camera costs the prompt processor at each turn: the chat APIs
send the whole conversation every turn, the voice page a camera still (448 x 336 JPEG data: URL)
and a spoken clip per turn. OmniJax's processor keeps each item's processed inputs by its
source's content; the peer is the same processor with that cache off (`media_cache_bytes=0`),
which does what transformers' Qwen-Omni processor does per request: every item decoded, resized,
normalised or log-mel'd again. Both run one after the other on the same conversation.

    python benchmarks/conversation_media.py [--turns 20] [--clip-seconds 3] [--rounds 3]

Prints, at every fifth turn, the milliseconds of `InputProcessor.process` (the peer's includes
hashing every item, which its stage did before the processor carried the digests), and of the
item keys a thinker stage computes on its loop for its prefix and encoder caches
(`MultiModalPayload.item_hashes`: the processor's digests carried, or every item hashed from its
arrays), the ratio, and the machine. Image sizes are the released 7B's (no cap from the tiny
model's vision buckets).
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import time

import numpy as np
from machine import cpu_model
from PIL import Image

from omni_jax.inputs.processor import MEDIA_CACHE_BYTES
from omni_jax.models.registry import checkpoint_family, get_family, resolve_model


def _still(rng: np.random.Generator) -> str:
    """A camera-like 448 x 336 JPEG (smooth shading, edges, sensor noise) as the page sends it."""
    y, x = np.mgrid[0:336, 0:448]
    base = np.stack([x / 448, y / 336, (x + y) / 784], -1) * 200 + rng.uniform(0, 40, 3)
    for _ in range(6):
        cx, cy, r = rng.integers(0, 448), rng.integers(0, 336), rng.integers(20, 90)
        base[(x - cx) ** 2 + (y - cy) ** 2 < r * r] = rng.uniform(0, 255, 3)
    img = np.clip(base + rng.normal(0, 6, base.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, "JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def _conversation(turns: int, clip_seconds: float, seed: int = 0) -> list[list[dict]]:
    """The messages sent at each turn: every user turn a still and a clip, every reply a sentence."""
    rng = np.random.default_rng(seed)
    messages, out = [], []
    for _ in range(turns):
        clip = (0.1 * rng.standard_normal(int(16000 * clip_seconds))).astype(np.float32)
        messages.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": _still(rng)}},
                                                     {"type": "audio", "audio": (clip, 16000)}]})
        out.append(list(messages))
        messages.append({"role": "assistant", "content": "That is a picture with a few round shapes."})
    return out


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def _session(proc, conversation, report: set[int], carried: bool) -> dict[int, tuple[float, float]]:
    """{turn: (process ms, item_hashes ms)}: every turn processed in order, as it arrives in a session;
    the stage's hashing with the processor's digests carried, or from the arrays."""
    proc.process({"messages": _conversation(1, 1.0, seed=1)[0]})  # builds the media processors
    out = {}
    for turn, messages in enumerate(conversation, 1):
        t = time.perf_counter()
        mm = proc.process({"messages": messages}).multi_modal
        if not carried:
            mm.digests = {}
        if turn in report:
            out[turn] = ((time.perf_counter() - t) * 1e3, _best(mm.item_hashes, 3))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--clip-seconds", type=float, default=3.0)
    p.add_argument("--rounds", type=int, default=3, help="sessions per side, alternating; the best of each turn")
    args = p.parse_args()
    ckpt = resolve_model("tiny")
    family = get_family(checkpoint_family(ckpt))
    conversation = _conversation(args.turns, args.clip_seconds)
    report = {t for t in range(1, args.turns + 1) if t == 1 or t % 5 == 0}
    load = os.getloadavg()[0]
    sides = {"cached": {}, "peer": {}}
    for _ in range(args.rounds):
        for side, cache_bytes in (("cached", MEDIA_CACHE_BYTES), ("peer", 0)):
            got = _session(family.prompt_processor(ckpt, media_cache_bytes=cache_bytes), conversation, report,
                           carried=side == "cached")
            for turn, ms in got.items():
                sides[side][turn] = tuple(map(min, zip(ms, sides[side].get(turn, ms))))
    print(f"# {cpu_model()}, {os.cpu_count()} cores; load average {load:.2f} before, {os.getloadavg()[0]:.2f} after")
    print(f"# each turn adds a 448x336 still and a {args.clip_seconds:g} s clip; ms per turn as it arrives, "
          f"best of {args.rounds} sessions")
    print("| turn | process, cached | process, uncached (peer) | peer / cached "
          "| stage's item_hashes, digests carried | stage's item_hashes, from the arrays (peer) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for turn in sorted(report):
        (c, ch), (f, fh) = sides["cached"][turn], sides["peer"][turn]
        print(f"| {turn} | {c:.1f} | {f:.1f} | {f / c:.1f}x | {ch:.2f} | {fh:.2f} |")


if __name__ == "__main__":
    main()
