"""The Qwen3-Omni code2wav stage (OneShotEngine) against transformers' chunked_decode.

One engine with small buckets serves every test: padded batches of requests of
different lengths, requests longer than a chunk (decoded window by window), bad
requests refused with a clear error, and no compilation after warm-up.

The session's tiny checkpoint has a code2wav whose waveform barely depends on the
codes (default layer scales and conv inits: changing a code moves it by ~1e-7), so
a parity check on it could not catch a misplaced frame. The fixture below redraws
the vocoder's weights so every part shows in the waveform, writes that checkpoint
beside the session's and converts it.
"""

from __future__ import annotations

import copy
import os
import re
import shutil

import numpy as np
import pytest
import safetensors.numpy as stnp
import torch

import hf_tiny_qwen3 as tiny
from omni_jax.engine.jitted import COMPILE_WORKERS_ENV
from omni_jax.errors import RequestError
from omni_jax.models.qwen3_omni.code2wav_stage import build_code2wav_engine, plan_windows

pytestmark = pytest.mark.e2e

Q = tiny.NUM_CODE_GROUPS
CHUNK, CONTEXT = 40, 8  # small chunks keep the CPU test fast; same arguments on the HF side
LENGTH_BUCKETS, BATCH_BUCKETS = (16, 48), (1, 2)
MAX_FRAMES, FRAMES_PER_STEP = 120, 200  # codec frames (the engine counts Q x frames)


def _redraw(code2wav: torch.nn.Module) -> None:
    """Weights that make the waveform depend on every code, mostly inside the final clamp."""
    g = torch.Generator().manual_seed(7)

    def normal(p, std, mean=0.0):
        p.copy_(mean + std * torch.randn(p.shape, generator=g))

    with torch.no_grad():
        for name, p in code2wav.named_parameters():
            if name.endswith(("alpha", "beta")):
                normal(p, 0.3)
            elif name.endswith(("layer_scale.scale", "gamma")):
                normal(p, 0.1, mean=0.5)
            elif "norm" in name and name.endswith("weight"):
                normal(p, 0.1, mean=1.0)
            elif name == "code_embedding.weight":
                normal(p, 1.0)
            elif p.ndim >= 2:
                # ConvTranspose1d weights are [in, out, k], the others [out, in, (k)].
                transposed = re.fullmatch(r"(upsample\.\d+\.0|decoder\.\d+\.block\.1)\.conv\.weight", name)
                fan_in = p.shape[0] if transposed else int(np.prod(p.shape[1:]))
                normal(p, 0.5 / np.sqrt(fan_in))
            else:
                normal(p, 0.05)
        code2wav.decoder[-1].conv.weight.mul_(0.2)


@pytest.fixture(scope="module")
def hf_code2wav(qwen3_omni_hf_model):
    """The session model's vocoder (a copy) with expressive weights."""
    model = copy.deepcopy(qwen3_omni_hf_model.code2wav).eval()
    _redraw(model)
    return model


@pytest.fixture(scope="module")
def converted(qwen3_omni_hf_dir, hf_code2wav, tmp_path_factory) -> str:
    """The session checkpoint with `hf_code2wav`'s weights, converted to fp32."""
    from conversion.convert import convert

    root = tmp_path_factory.mktemp("omni_jax_q3_c2w")
    hf_dir = str(root / "hf")
    shutil.copytree(qwen3_omni_hf_dir, hf_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    new = {"code2wav." + k: v.numpy() for k, v in hf_code2wav.state_dict().items()}
    replaced = set()
    for f in os.listdir(qwen3_omni_hf_dir):
        if f.endswith(".safetensors"):
            tensors = stnp.load_file(os.path.join(qwen3_omni_hf_dir, f))
            for k in tensors:
                if k.startswith("code2wav."):
                    tensors[k] = new[k]  # a KeyError here: on-disk and in-memory names differ
                    replaced.add(k)
            stnp.save_file(tensors, os.path.join(hf_dir, f), metadata={"format": "pt"})
    assert replaced
    return convert(hf_dir, str(root / "tiny_fp32"), dtype="float32", progress=False)


@pytest.fixture(scope="module")
def engine(converted):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(COMPILE_WORKERS_ENV, "2")  # its warm-up compiles on threads, as served (conftest: one)
        return build_code2wav_engine(converted, length_buckets=LENGTH_BUCKETS, batch_buckets=BATCH_BUCKETS,
                                     chunk_size=CHUNK, left_context=CONTEXT, max_num_batched_tokens=FRAMES_PER_STEP,
                                     max_model_len=MAX_FRAMES)


def random_codes(seed: int, frames: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, tiny.CODEBOOK, (Q, frames))


def flat(codes: np.ndarray) -> list[int]:
    """[Q, frames] -> frame-major flat list (the stage's request format)."""
    return codes.T.reshape(-1).tolist()


def hf_chunked(model, codes: np.ndarray, chunk_size: int = 300, left_context: int = 25) -> np.ndarray:
    with torch.no_grad():
        wav = model.chunked_decode(torch.from_numpy(codes)[None], chunk_size=chunk_size,
                                   left_context_size=left_context)
    return wav[0, 0].numpy()


def run(engine, requests: dict[str, np.ndarray]) -> dict:
    for rid, c in requests.items():
        engine.add_request(rid, flat(c))
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    return outs


def assert_close(got: np.ndarray, ref: np.ndarray) -> None:
    assert got.dtype == np.float32 and got.shape == ref.shape
    # Not flat, barely clamped: one changed code moves this waveform by ~0.1, far above the tolerance.
    assert np.abs(ref).mean() > 0.02 and ref.std() > 0.02 and (np.abs(ref) >= 1).mean() < 0.05
    err = np.abs(got - ref).max()
    assert err <= 1e-4, err


def test_plan_windows_follow_transformers():
    assert plan_windows(100, 40, 8) == [(0, 0, 40), (32, 8, 80), (72, 8, 100)]
    assert plan_windows(30, 300, 25) == [(0, 0, 30)]
    assert plan_windows(12, 5, 7) == [(0, 0, 5), (0, 5, 10), (3, 7, 12)]  # context = whole prefix when shorter


def test_padded_batch_matches_transformers(engine, hf_code2wav):
    codes = {"a": random_codes(0, 13), "b": random_codes(1, 29)}
    steps = engine.stats["steps"]
    outs = run(engine, codes)
    assert engine.stats["steps"] == steps + 1  # both requests in one padded batch
    for rid, c in codes.items():
        assert outs[rid].finish_reason == "stop" and outs[rid].error is None
        # Shorter than a chunk: one window, the same with transformers' default chunking.
        assert_close(outs[rid].audio, hf_chunked(hf_code2wav, c))


def test_long_request_decoded_chunk_by_chunk(engine, hf_code2wav):
    codes = {"long": random_codes(2, 100), "short": random_codes(3, 7)}  # 3 windows + 1, pooled
    outs = run(engine, codes)
    for rid, c in codes.items():
        assert_close(outs[rid].audio, hf_chunked(hf_code2wav, c, CHUNK, CONTEXT))
    synth = engine.synthesizer
    short_by = synth.total_upsample - synth.num_samples(1)  # each of the 3 chunks falls this short
    assert len(outs["long"].audio) == synth.request_samples(100) == 100 * synth.total_upsample - 3 * short_by


def test_calls_side_by_side_match_transformers(converted, hf_code2wav):
    """More windows in a step than the largest batch: one-window calls run in parallel threads."""
    engine = build_code2wav_engine(converted, length_buckets=LENGTH_BUCKETS, batch_buckets=(1,), chunk_size=CHUNK,
                                   left_context=CONTEXT, max_num_batched_tokens=FRAMES_PER_STEP,
                                   max_model_len=MAX_FRAMES, max_num_seqs=2, warmup=False)
    assert engine.synthesizer.calls.workers == 2 and engine.scheduler.max_num_seqs == 2
    codes = {"long": random_codes(2, 100), "short": random_codes(3, 7)}  # 4 windows, 4 calls
    outs = run(engine, codes)
    assert engine.stats["steps"] == 1
    for rid, c in codes.items():
        assert_close(outs[rid].audio, hf_chunked(hf_code2wav, c, CHUNK, CONTEXT))


def test_bad_requests_refused_others_served(engine):
    with pytest.raises(RequestError, match=f"multiple of num_quantizers={Q}"):
        engine.add_request("odd", list(range(Q * 3 + 1)))
    bad = random_codes(4, 5)
    bad[2, 3] = tiny.CODEBOOK
    with pytest.raises(RequestError, match=rf"code {tiny.CODEBOOK} \(frame 3, group 2\) is outside the codebook"):
        engine.add_request("range", flat(bad))
    with pytest.raises(RequestError, match="outside the codebook"):
        engine.add_request("negative", [-1] * Q)
    with pytest.raises(RequestError, match=f"{MAX_FRAMES + 1} codec frames exceed .* \\({MAX_FRAMES} frames\\)"):
        engine.add_request("long", flat(random_codes(5, MAX_FRAMES + 1)))
    outs = run(engine, {"ok": random_codes(6, 9)})
    assert set(outs) == {"ok"} and outs["ok"].error is None
    assert len(outs["ok"].audio) == engine.synthesizer.request_samples(9) == engine.synthesizer.num_samples(9)


def test_engine_limits_in_tokens(engine):
    sched = engine.scheduler
    assert (sched.max_num_batched_tokens, sched.max_num_seqs) == (Q * FRAMES_PER_STEP, BATCH_BUCKETS[-1])


def test_no_compilation_after_warmup(engine):
    before = engine.num_compilations
    frames = (1, 16, 17, 40, 47, 48, 49, 95, 3, 30)
    outs = run(engine, {f"m{i}": random_codes(10 + i, n) for i, n in enumerate(frames)})
    assert all(outs[f"m{i}"].error is None and len(outs[f"m{i}"].audio) > 0 for i in range(len(frames)))
    assert engine.num_compilations == before


def test_length_buckets_fit_the_window(converted):
    with pytest.raises(ValueError, match="must hold the longest window"):
        build_code2wav_engine(converted, length_buckets=(16, 32), batch_buckets=(1,), chunk_size=CHUNK,
                              left_context=CONTEXT, max_num_batched_tokens=100, warmup=False)
    # A stage whose requests are shorter than one chunk needs no bucket as long as a chunk.
    short = build_code2wav_engine(converted, length_buckets=(16,), batch_buckets=(1,), chunk_size=CHUNK,
                                  left_context=CONTEXT, max_model_len=16, warmup=False)
    assert short.synthesizer.length_buckets == (16,)
    # Buckets past the first that holds chunk + context would never be used: not compiled.
    unused = build_code2wav_engine(converted, length_buckets=(16, 48, 64, 128), batch_buckets=(1,), chunk_size=CHUNK,
                                   left_context=CONTEXT, warmup=False)
    assert unused.synthesizer.length_buckets == (16, 48)
