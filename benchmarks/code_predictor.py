"""Qwen3-Omni code predictor: one talker step's residual codes, OmniJax vs transformers.

    python benchmarks/code_predictor.py [--batch 1 8 32] [--reps 5]

Every talker step runs the code predictor (5 dense layers at the real size: hidden 1024,
16 q / 8 kv heads of 128, 16 code groups) to fill code groups 1..15 autoregressively.
* transformers: `code_predictor.generate(inputs_embeds=[h, embed(c0)], max_new_tokens=15)`
  exactly as the talker's `prepare_inputs_for_generation` calls it: KV-cached, one
  forward per group, Python between them;
* OmniJax: `Qwen3OmniTalker.after_sample` (the engine's after-sample hook), one jitted
  function per talker step, in its two variants: "cached" (the default: a paged KV cache
  local to the call, 16 token rows per request) and "rerun" (the whole <= 16-token
  sequence again at each group, no cache: 2 + 3 + ... + 16 = 135 rows, 8.4x the FLOPs).
  While B x 16 rows are few the predictor is bound by reading its weights, which every
  variant does 15 times; the FLOPs decide at larger batches.
Greedy on all sides, same random weights; prints ms per talker step, the ratio of
transformers to each variant, and checks they produce the same codes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

GROUPS = 16


def build(seed: int = 0):
    """An HF talker with a one-layer MoE decoder and a real-size code predictor, and ours."""
    import torch
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeTalkerConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeTalkerForConditionalGeneration)

    from conversion.mapping import load_hf_into
    from omni_jax.models.qwen3_omni.talker import Qwen3OmniTalker, TalkerConfig
    from omni_jax.models.registry import abstract_module

    torch.manual_seed(seed)
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [24, 20, 20], "mrope_interleaved": True}
    text = dict(vocab_size=3072, hidden_size=1024, intermediate_size=2048, num_hidden_layers=1,
                num_attention_heads=16, num_key_value_heads=2, head_dim=128, moe_intermediate_size=256,
                num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=256, rope_parameters=rope)
    predictor = dict(vocab_size=2048, hidden_size=1024, intermediate_size=3072, num_hidden_layers=5,
                     num_attention_heads=16, num_key_value_heads=8, head_dim=128, num_code_groups=GROUPS,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    cfg = Qwen3OmniMoeTalkerConfig(text_config=text, code_predictor_config=predictor, num_code_groups=GROUPS,
                                   thinker_hidden_size=64, spatial_merge_size=2)
    hf = Qwen3OmniMoeTalkerForConditionalGeneration(cfg).eval().float()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if ".experts." in name or name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.02)  # transformers leaves these uninitialised
    ours = abstract_module(lambda rngs: Qwen3OmniTalker(TalkerConfig.from_hf(hf.config.to_dict()), rngs=rngs))
    load_hf_into(ours, {k: v.detach().numpy() for k, v in hf.state_dict().items()}, prefix="")
    return hf, ours


def hf_step(hf, hidden, group0):
    """transformers' residual codes [B, 15] for one talker step (as prepare_inputs_for_generation)."""
    import torch

    with torch.no_grad():
        embeds = torch.cat([hidden[:, None], hf.get_input_embeddings()(group0)[:, None]], dim=1)
        out = hf.code_predictor.generate(inputs_embeds=embeds, max_new_tokens=GROUPS - 1, do_sample=False,
                                         return_dict_in_generate=True)
    return out.sequences


def best_of(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    import torch
    from flax import nnx

    torch.set_num_threads(os.cpu_count() or 1)
    hf, ours = build()
    graphdef, state = nnx.split(ours)

    @jax.jit
    def cached(state, hidden, group0):
        return nnx.merge(graphdef, state).after_sample(hidden, group0, *greedy_args(hidden.shape[0]))[0]

    @jax.jit
    def rerun(state, hidden, group0):
        return nnx.merge(graphdef, state).predict_residual_codes(hidden, group0, cache=False)

    def greedy_args(b):
        z = jax.numpy.zeros(b, jax.numpy.int32)
        return jax.numpy.ones(b, bool), z, z

    print(f"code predictor: 5 layers, hidden 1024, {GROUPS} groups; ms per talker step (best of {args.reps})")
    print(f"{'batch':>5} {'transformers':>13} {'cached':>9} {'ratio':>6} {'rerun':>9} {'ratio':>6}  codes equal")
    rng = np.random.default_rng(0)
    for b in args.batch:
        hidden = rng.standard_normal((b, 1024)).astype(np.float32)
        group0 = rng.integers(0, 2048, b).astype(np.int32)
        h_t, g_t = torch.tensor(hidden), torch.tensor(group0, dtype=torch.long)
        t_hf = best_of(lambda: hf_step(hf, h_t, g_t), args.reps)
        times, same = [], True
        ref = hf_step(hf, h_t, g_t).numpy()
        for fn in (cached, rerun):
            run = lambda: jax.block_until_ready(fn(state, hidden, group0))  # noqa: E731
            times.append(best_of(run, args.reps))
            same &= np.array_equal(np.asarray(run()), ref)
        print(f"{b:>5} {t_hf * 1e3:>13.1f} {times[0] * 1e3:>9.1f} {t_hf / times[0]:>5.2f}x "
              f"{times[1] * 1e3:>9.1f} {t_hf / times[1]:>5.2f}x  {same}")


if __name__ == "__main__":
    main()
