"""Structured outputs' host cost per step on Qwen's vocabulary: OmniJax's backend (llguidance) against
vLLM's default one (xgrammar), same tokenizer, same grammars, same tokens, one after the other.

    python benchmarks/structured_output.py [--rows 1 8 32] [--repeat 5]

Each case is a grammar and a reply it accepts (tokenized by the tiny model's tokenizer, which is
Qwen2.5-Omni's real 151,665-token vocabulary over 152,064 logits). For each backend: the time to
wrap the tokenizer (once per engine), to build the grammar, and the time to fill the allowed-token
bitmask at every position of the reply (the work on a step's path), for one request and for
`--rows` requests at once (llguidance fills a batch on its own threads, `Grammars.bitmask`;
xgrammar fills each row in turn, as a caller without its batch matcher does). Prints ms and the
ratio xgrammar / llguidance. xgrammar is installed without its dependencies into
~/.cache/omni-jax/xgrammar (it needs torch, which the test venv has: run it from `.venv`).
Then the engine itself: the tiny model's greedy decode tokens/s with every request under a JSON
schema, or a thinking budget, against the same requests unconstrained (`--no-engine` skips it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from machine import cpu_model

os.environ.setdefault("JAX_PLATFORMS", "cpu")

XGRAMMAR = ("xgrammar==0.2.9", "apache-tvm-ffi==0.1.11")
VOCAB = 152064
FIELDS = {f"field_{i}": {"type": "string", "pattern": "^[a-z]{2,8}(-[0-9]{1,4})?$"} for i in range(40)}
CASES = {
    "small object": ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                        "tags": {"type": "array", "items": {"type": "string"}}},
                      "required": ["name", "age", "tags"]},
                     '{"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"]}'),
    "40 patterned fields": ({"type": "object", "properties": FIELDS, "required": list(FIELDS)},
                            json.dumps({k: f"ab{i % 7}"[:2] + "cd-12" for i, k in enumerate(FIELDS)})),
    "regex": (r"[A-Z][a-z]+ [0-9]{3}-[0-9]{4}( ext\. [0-9]{1,5})?", "Alice 555-1234 ext. 42"),
    "choice": (["positive", "negative", "neutral", "mixed feelings"], "mixed feelings"),
}


def _xgrammar_path() -> str:
    target = os.path.expanduser("~/.cache/omni-jax/xgrammar")
    if not os.path.isdir(os.path.join(target, "xgrammar")):
        print(f"installing {' '.join(XGRAMMAR)} into {target} (no dependencies)", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", target, *XGRAMMAR],
                       check=True)
    return target


def _params(grammar):
    from omni_jax import SamplingParams, StructuredOutputs

    if isinstance(grammar, dict):
        spec = StructuredOutputs(json=grammar)
    elif isinstance(grammar, list):
        spec = StructuredOutputs(choice=grammar)
    else:
        spec = StructuredOutputs(regex=grammar)
    return SamplingParams(structured_outputs=spec)


class Llguidance:
    name = "llguidance (OmniJax)"

    def __init__(self, tokenizer, eos):
        from omni_jax.engine.structured_output import Grammars

        self.grammars = Grammars(tokenizer, VOCAB, eos)
        self.grammars.build(_params("a")).result()  # wraps the tokenizer

    def matcher(self, grammar):
        return self.grammars.build(_params(grammar)).result()

    def fill(self, matchers):
        return self.grammars.bitmask(matchers, len(matchers))

    @staticmethod
    def accept(m, token):
        assert m.accept([token]) is None


class Xgrammar:
    name = "xgrammar (vLLM)"

    def __init__(self, tokenizer_file, eos):
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_file=tokenizer_file),
                                                  vocab_size=VOCAB, stop_token_ids=eos)
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)

    def matcher(self, grammar):
        if isinstance(grammar, dict):
            compiled = self.compiler.compile_json_schema(json.dumps(grammar))
        elif isinstance(grammar, list):
            compiled = self.compiler.compile_regex("(" + "|".join(map(_escape, grammar)) + ")")
        else:
            compiled = self.compiler.compile_regex(grammar)
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers):
        bits = self.xgr.allocate_token_bitmask(len(matchers), VOCAB)
        for j, m in enumerate(matchers):
            m.fill_next_token_bitmask(bits, j)
        return bits

    @staticmethod
    def accept(m, token):
        assert m.accept_token(token)


def _escape(text: str) -> str:
    import re

    return re.escape(text)


def _measure(backend, grammar, ids, rows: int, repeat: int):
    """(ms to build one grammar, ms per step to fill `rows` masks), the median over `repeat` passes."""
    builds, steps = [], []
    for _ in range(repeat):
        t = time.perf_counter()
        matchers = [backend.matcher(grammar) for _ in range(rows)]
        builds.append((time.perf_counter() - t) / rows)
        t = time.perf_counter()
        for token in ids:
            backend.fill(matchers)
            for m in matchers:
                backend.accept(m, token)
        steps.append((time.perf_counter() - t) / len(ids))
    return 1000 * float(np.median(builds)), 1000 * float(np.median(steps))


def engine_ratio(ckpt: str) -> None:
    from omni_jax import SamplingParams, StructuredOutputs
    from omni_jax.engine.runner import RunnerConfig
    from omni_jax.models.qwen2_5_omni.stages import build_thinker_engine
    from omni_jax.models.thinker_media import MediaBuckets

    engine = build_thinker_engine(ckpt, RunnerConfig(num_blocks=512, block_size=16, max_num_seqs=16,
                                                     max_num_batched_tokens=256, max_model_len=512),
                                  media_buckets=MediaBuckets((1,), (64,)), progress=False)
    schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    tags = (151646, 151647)  # stand-ins for <think> </think>, which Qwen2.5's vocabulary lacks
    cases = {"plain": ({}, []), "JSON schema": ({"structured_outputs": StructuredOutputs(json=schema)}, []),
             # the prompt opens the thinking: 32 tokens masked on the host, then the device's
             "thinking budget 32": ({"reasoning_tokens": tags, "thinking_token_budget": 32}, [tags[0]])}
    for label, (fields, opened) in cases.items():
        runs = []
        for rep in range(3):
            for i in range(16):
                engine.add_request(f"{label}{rep}-{i}", [100 + i, 200, 300, *opened], SamplingParams(
                    temperature=0.0, max_tokens=96, ignore_eos=True, **fields))
            n, t = 0, time.perf_counter()
            while engine.has_unfinished():
                n += sum(len(o.new_token_ids) for o in engine.step())
            runs.append(n / (time.perf_counter() - t))
        print(f"  engine, 16 requests x 96 tokens, {label}: {np.median(runs):,.0f} tokens/s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--no-engine", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, _xgrammar_path())
    from omni_jax.inputs.detokenizer import load_tokenizer
    from omni_jax.models.qwen2_5_omni.tiny import tiny_checkpoint

    ckpt = tiny_checkpoint(os.path.join(tempfile.gettempdir(), "omni_jax_bench_tiny"))
    tokenizer = load_tokenizer(ckpt)
    eos = [151645, 151643]
    print(f"load average {os.getloadavg()[0]:.2f}; {os.cpu_count()} CPUs; {cpu_model()}")
    backends = []
    for make in (lambda: Llguidance(tokenizer, eos), lambda: Xgrammar(os.path.join(ckpt, "tokenizer.json"), eos)):
        t = time.perf_counter()
        backends.append(make())
        print(f"{backends[-1].name}: tokenizer wrapped in {time.perf_counter() - t:.2f} s")
    for case, (grammar, reply) in CASES.items():
        ids = tokenizer.encode(reply, add_special_tokens=False).ids
        for rows in args.rows:
            got = [_measure(b, grammar, ids, rows, args.repeat) for b in backends]
            (lb, ls), (xb, xs) = got
            print(f"{case:20s} {len(ids):3d} tokens, {rows:2d} rows: build {lb:6.2f} / {xb:6.2f} ms, "
                  f"mask step {ls:6.3f} / {xs:6.3f} ms (llguidance / xgrammar), ratio xgrammar/llguidance "
                  f"{xs / ls:5.2f}", flush=True)
    if not args.no_engine:
        engine_ratio(ckpt)


if __name__ == "__main__":
    main()
