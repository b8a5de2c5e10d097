"""vLLM CPU as a benchmark peer: greedy generation over a request file, timed.

    python vllm_peer.py REQUESTS.json RESULT.json

Runs in vLLM's own virtualenv (see vllm_cpu_env.py), never in OmniJax's: it imports
nothing from this repository. REQUESTS.json holds {"model": checkpoint dir,
"dtype": "float32"|"bfloat16", "prompts": [[token ids]], "max_tokens": [n per
request], "max_model_len": n}. RESULT.json gets {"token_ids": [[ids per request]],
"seconds": time of the timed `generate`, "startup_seconds": building the LLM,
"vllm_version"}. Greedy, eos ignored, no tokenizer (the checkpoint has none).
"""

import json
import sys
import time


def main(requests_path: str, result_path: str) -> None:
    from vllm import LLM, SamplingParams, __version__
    from vllm.inputs import TokensPrompt

    with open(requests_path) as f:
        req = json.load(f)
    t = time.perf_counter()
    llm = LLM(model=req["model"], dtype=req["dtype"], skip_tokenizer_init=True,
              max_model_len=req["max_model_len"], seed=0)
    startup = time.perf_counter() - t

    def params(n):
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)

    prompts = [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
    # One short call first: its first steps pay for one-time work the timed run must not.
    llm.generate(prompts[:2], [params(4)] * min(2, len(prompts)), use_tqdm=False)
    t = time.perf_counter()
    outs = llm.generate(prompts, [params(n) for n in req["max_tokens"]], use_tqdm=False)
    seconds = time.perf_counter() - t
    with open(result_path, "w") as f:
        json.dump({"token_ids": [list(o.outputs[0].token_ids) for o in outs], "seconds": seconds,
                   "startup_seconds": startup, "vllm_version": __version__}, f)


if __name__ == "__main__":  # vLLM starts its engine core in a spawned process: guard the entry
    main(sys.argv[1], sys.argv[2])
