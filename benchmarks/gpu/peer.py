"""Part `peer`: the same random Qwen2.5-Omni thinker (real size on a GPU, tiny on a CPU) in
transformers + torch on the same device: bf16 on the GPU, SDPA attention, greedy `generate`
with its dynamic and its static KV cache, tokens/s at each batch, and OmniJax's decode tokens/s
from the `thinker_7b` part over each. Unavailable (reported, not a crash) where torch is not installed.

Both decode from a prompt of `peer_prompt` tokens; OmniJax's figure is its engine's decode
step alone (batch / step time), transformers' the whole `generate` after its prefill is taken
out (the time of a 1-token `generate` of the same batch subtracted).
"""

from __future__ import annotations

import time

from report import Unavailable, rows_of
from sizes import hf_config


def _generate(model, ids, new_tokens: int, cache: str | None) -> float:
    import torch

    kwargs = dict(cache_implementation=cache) if cache else {}
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, use_cache=True, **kwargs)
    sync()
    assert out.shape[1] == ids.shape[1] + new_tokens, out.shape
    return time.perf_counter() - t0


def run(size, rep, results_dir) -> None:
    try:
        import torch
        import transformers
        from transformers import Qwen2_5OmniThinkerConfig, Qwen2_5OmniThinkerForConditionalGeneration
    except ImportError as e:
        raise Unavailable(f"torch or transformers not installed ({e})") from e
    rep.add("versions", f"torch {torch.__version__}, transformers {transformers.__version__}")
    on_gpu = size.name == "gpu"
    if on_gpu and not torch.cuda.is_available():
        raise RuntimeError("torch sees no CUDA device")
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = torch.bfloat16 if size.dtype == "bfloat16" else torch.float32
    cfg = Qwen2_5OmniThinkerConfig(**hf_config("qwen2_5_omni", size)["thinker_config"])
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with device:  # weights initialised on the device, not copied there
        model = Qwen2_5OmniThinkerForConditionalGeneration._from_config(cfg, dtype=dtype,
                                                                         attn_implementation="sdpa").eval()
    model.generation_config.pad_token_id = 0
    rep.add("random model on device", time.perf_counter() - t0, "s",
            f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters, {dtype}, sdpa")
    omnijax = rows_of(results_dir, "thinker_7b")
    vocab = cfg.text_config.vocab_size
    measured = 0
    # The dynamic cache first, every batch: it compiles nothing, so its figures are in even when
    # the static cache's (transformers compiles its forward for it) run past the part's budget.
    for cache in (None, "static"):
        name = cache or "dynamic"
        for b in size.peer_batches:
            ids = torch.randint(0, min(vocab, 150000), (b, size.peer_prompt), device=device)
            try:
                _generate(model, ids, 2, cache)  # warm: kernels, cache allocation, compilation
                prefill = _generate(model, ids, 1, cache)
                total = _generate(model, ids, size.peer_new_tokens, cache)
            except Exception as e:  # noqa: BLE001 - a cache setting this version lacks
                rep.add(f"generate b{b} cache={name}", "failed", note=f"{type(e).__name__}: {e}"[:200])
                continue
            measured += 1
            tok_s = b * (size.peer_new_tokens - 1) / max(total - prefill, 1e-9)
            rep.add(f"transformers decode b{b} cache={name}", tok_s, "tok/s",
                    f"generate {size.peer_new_tokens} tokens {total * 1e3:.0f} ms, prefill {prefill * 1e3:.0f} ms")
            step_ms = omnijax.get(f"decode step b{b}")
            if step_ms:
                ours = b / (step_ms / 1e3)
                rep.add(f"omnijax / transformers decode b{b} cache={name}", ours / tok_s, "x",
                        f"omnijax {ours:.0f} tok/s (thinker_7b part), transformers {tok_s:.0f} tok/s")
            else:
                rep.add(f"omnijax / transformers decode b{b} cache={name}", "n/a",
                        note="thinker_7b measured no decode at this batch")
    if not measured:
        raise RuntimeError("transformers generate failed with every cache setting")
