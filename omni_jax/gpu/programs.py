"""Every jitted program a real-size stage can run, as (jitted function, abstract arguments).

The stages are built from the real models' HF configs (`real_configs/`) with
`nnx.eval_shape`, so no weight exists in memory. The programs are not re-implemented
here: each stage's own engine, built by its family around the abstract module
(`ModelFamily.module_engines`, with a 2-block KV cache), runs its own warm-up while its
programs (each object's `Jitted`: the runner's steps, the sampler, the media encoders, the
vocoder's synthesizer) are recorded, each call's arguments kept. Compiling the original
jitted function with those arguments (the KV cache replaced by the real-size pages) is then
exactly what the engine would compile on the GPU.

Kernel programs call `kernels_pallas` directly at each bucket's shapes, with the same
table width, page pool and GQA group as the stage's steps.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import kernels_pallas

from ..config import PipelineConfig, StageConfig, load_pipeline_config
from ..engine import sharding
from ..models.layers.moe import sorted_experts
from ..models.layers.parallel import EP, TP
from ..models.registry import abstract_stage, get_family, stages_of

REAL_CONFIGS = Path(__file__).resolve().parent / "real_configs"
DTYPE = jnp.bfloat16


@dataclasses.dataclass
class Program:
    """One jitted function and the (concrete or abstract) arguments of one call."""

    name: str          # e.g. "qwen2_5_omni/thinker/decode/b64"
    kind: str          # prefill | decode | feed | sample | after_sample | project | audio | vision | vocoder | kernel
    fn: Callable       # the jitted function the engine calls
    args: tuple
    kwargs: dict
    bucket: int = 0
    info: dict = dataclasses.field(default_factory=dict)
    mesh: Any = None   # a stage mesh of the target's GPUs: the args carry their shardings on it


def real_hf_config(family: str) -> dict:
    """The real model's HF config (Qwen2.5-Omni-7B, Qwen3-Omni-30B-A3B; QWEN_NOTES "Real sizes")."""
    return json.loads((REAL_CONFIGS / f"{family}.json").read_text())


def file_hf_config(path: str) -> dict:
    """The HF config in a JSON file (plan writes the one of the model it was given)."""
    return json.loads(Path(path).read_text())


def with_layers(family: str, model_stage: str, hf_config: dict, layers: int) -> dict:
    """A copy of the HF config whose `model_stage` decoder has `layers` layers (real widths):
    the launches of one layer are those of two layers less those of one, at a few seconds
    of compiling where the real depth takes minutes."""
    hf = copy.deepcopy(hf_config)
    cfg = hf[stages_of(family)[model_stage].config_key]
    text = cfg.get("text_config", cfg)
    text["num_hidden_layers"] = layers
    for key in ("layer_types",):   # per-layer lists follow the depth
        if key in text:
            text[key] = text[key][:layers]
    return hf


def stage_model(family: str, model_stage: str, hf_config: dict, dtype=DTYPE):
    """(abstract module, stage config) of one stage; built once per process, as tracing
    a real-size model's initialisers takes seconds (the module is only read here)."""
    key = (family, model_stage, jnp.dtype(dtype).name, json.dumps(hf_config, sort_keys=True))
    if key not in _MODELS:
        spec = stages_of(family)[model_stage]
        cfg = spec.parse_config(hf_config[spec.config_key])
        _MODELS[key] = (abstract_stage(spec, cfg, dtype), cfg)
    return _MODELS[key]


_MODELS: dict = {}


# ------------------------------------------------------------------ recording
def _recorder(calls: list, stand_ins: dict):
    """`Jitted.record`'s wrap: each call is kept as (name, fn, args, kwargs) and answered by
    `stand_ins[name](*args, **kwargs)` (arrays of the shapes the caller reads), or None where
    the caller reads nothing of it (warm-ups that only compile)."""
    def wrap(name, fn):
        def call(*args, **kwargs):
            calls.append((name, fn, args, kwargs))
            return stand_ins[name](*args, **kwargs) if name in stand_ins else None
        return call
    return wrap


def kv_block_bytes(stage: StageConfig, text_cfg, dtype=DTYPE) -> int:
    """Bytes of one KV block over all layers (K and V)."""
    return (2 * text_cfg.num_layers * stage.block_size * text_cfg.num_kv_heads * text_cfg.head_dim
            * jnp.dtype(dtype).itemsize)


def stage_engine(family: str, stage: StageConfig, hf_config: dict):
    """The engine `stage` runs, around the abstract real-size module (its family's
    `module_engines`); an AR stage's with the Pallas kernels and a 2-block KV cache."""
    dtype = DTYPE if stage.runner == "ar" else jnp.float32
    model, cfg = stage_model(family, stage.model_stage, hf_config, dtype)
    runner = stage.runner_config(num_blocks=2, backend="pallas") if stage.runner == "ar" else None
    return get_family(family).module_engines[stage.model_stage](stage, model, cfg, hf_config, runner)


def ar_engine_programs(family: str, stage: StageConfig, hf_config: dict, num_blocks: int) -> list[Program]:
    """Every program the AR engine of `stage` compiles at warm-up, with real-size KV pages."""
    text = text_config(family, stage.model_stage, hf_config)
    engine = stage_engine(family, stage, hf_config)
    runner = engine.runner
    hidden = runner.hidden_size
    shape = (num_blocks, stage.block_size, text.num_kv_heads, text.head_dim)
    pages = jax.ShapeDtypeStruct(shape, DTYPE)
    real_kv = [(pages, pages) for _ in range(text.num_layers)]
    calls: list = []
    tiny_kv = runner.kv_caches
    stand_ins = dict(
        step=lambda *a, **k: (None, tiny_kv, {}, np.zeros((k["layout"].tokens, hidden), DTYPE)),
        upload=lambda buf, ints: ints,
        upload_fed=lambda buf, ints, fed, **k: ints,
        after_sample=lambda *a, **k: (np.zeros(1), np.zeros(1)),
        embed=lambda *a, **k: np.zeros((a[1].shape[0], hidden)),
        sample=lambda *a, **k: np.zeros(1))
    runner.jitted.record(_recorder(calls, stand_ins))
    engine.jitted.record(_recorder(calls, stand_ins))
    if stage.model_stage == "thinker" and hasattr(engine, "grammars") and engine.grammars is None:
        # Served, a thinker detokenizes, and its warm-up then compiles the pre-sampler program of
        # structured outputs and logit_bias (sampling.shape_logits); this one has no tokenizer.
        engine.grammars = True
    engine.warmup(progress=False)

    base = f"{family}/{stage.name}"
    out = []
    for name, fn, args, kwargs in calls:
        if name == "step":
            kind = "decode" if kwargs["layout"].decode else "prefill"
            bucket = kwargs["layout"].tokens
            variant = "deepstack" if kwargs.get("deepstack") else ("rich" if kwargs.get("rich") else "plain")
            args = (args[0], real_kv) + tuple(args[2:])
            out.append(Program(f"{base}/{kind}/{variant}/{bucket}", kind, fn, args, kwargs, bucket,
                               info=dict(variant=variant, kv_bytes=2 * text.num_layers * int(np.prod(shape)) * 2,
                                         num_kv_heads=text.num_kv_heads)))
        elif name == "sample":
            b = int(args[0].shape[0])
            flags = kwargs["flags"]
            variant = ("greedy" if flags.all_greedy else "full" if flags.any_top_k_top_p else "random") + (
                "+logprobs" if flags.need_logprobs else "")
            out.append(Program(f"{base}/sample/{variant}/{b}", "sample", fn, args, kwargs, b,
                               info=dict(variant=variant)))
        elif name == "upload_fed":  # a decode step's inputs, fed by a step of `fed` rows
            b, fed = kwargs["tokens"], int(np.shape(args[2])[0])
            out.append(Program(f"{base}/{name}/{b}x{fed}", name, fn, args, kwargs, b))
        else:  # upload: by its packed size
            b = int(np.shape(args[1])[0])
            out.append(Program(f"{base}/{name}/{b}", name, fn, args, kwargs, b))
    return out


def sharded_step(step: Program, mesh) -> Program:
    """A step program of `ar_engine_programs` as the engine runs it over `mesh` (a stage at
    tensor / expert parallelism, engine/sharding.py): the runner's own step traced with that
    mesh, the parameters placed by PARAM_RULES, the KV pages split over their heads, the rest
    replicated."""
    runner = copy.copy(step.fn.__wrapped__.__self__)  # the one-device runner the step was recorded on
    runner.mesh = mesh
    fn = runner.step_program()
    where = sharding.param_sharding(mesh, step.info["num_kv_heads"])
    paths = [sharding.state_path(k) for k, _ in jax.tree_util.tree_flatten_with_path(runner.state)[0]]
    paths = [paths[i] for i in runner._step_params]  # the leaves the step reads, as it was called
    params = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where(p, x.shape)) for p, x in zip(paths, step.args[0])]
    pages = sharding.kv_cache_sharding(mesh)
    kv = [tuple(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=pages) for x in layer) for layer in step.args[1]]
    whole = sharding.replicated(mesh)
    rest = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=whole), step.args[2:])
    tp, ep = int(mesh.shape[TP]), int(mesh.shape[EP])
    return dataclasses.replace(step, name=f"{step.name}/tp{tp}" + (f"ep{ep}" if ep > 1 else ""), kind=f"{step.kind}_tp",
                               fn=fn, args=(params, kv, *rest), mesh=mesh,
                               info=dict(step.info, tensor_parallel_size=tp, expert_parallel_size=ep))


def media_programs(family: str, stage: StageConfig, hf_config: dict) -> list[Program]:
    """The thinker's audio and vision encoder calls at every media bucket."""
    enc = stage_engine(family, stage, hf_config).media_encoder
    calls: list = []
    vision = enc.jitted.vision
    # The encoders' outputs are sliced by the caller: stand-ins of their shapes (the vision
    # encoder's, which differ by family, from its abstract evaluation).
    enc.jitted.record(_recorder(calls, dict(
        audio=lambda p, x, *a: np.zeros((1 << 16, 1), np.float32),
        vision=lambda *a: jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), jax.eval_shape(vision, *a)))))
    enc.warmup()
    out = []
    for name, fn, args, kwargs in calls:
        size = int(args[1].shape[-1] if name == "audio" else args[1].shape[0])
        out.append(Program(f"{family}/{stage.name}/{name}/{size}", name, fn, args, kwargs, size))
    return out


def vocoder_programs(family: str, stage: StageConfig, hf_config: dict) -> list[Program]:
    """The vocoder's jitted calls at every (batch, length) bucket: whole requests and, as the
    presets serve them (async chunk), streamed chunks (`call`: the synthesizer's program name)."""
    synth = stage_engine(family, stage, hf_config).synthesizer
    calls: list = []
    synth.jitted.record(_recorder(calls, {}))  # warm-ups only compile
    synth.warmup()
    synth.warmup_stream()
    out = []
    for call, fn, args, kwargs in calls:
        x = args[1]  # codes [B, T] or [B, Q, T] (integers), or frames [B, T, D]
        b, t = x.shape[0], x.shape[-1] if x.dtype.kind == "i" else x.shape[1]
        # `parallel`: calls a step may run side by side, each with its own temporaries (CallPool).
        out.append(Program(f"{family}/{stage.name}/{call}/b{b}/t{t}", "vocoder", fn, args, kwargs, t,
                           info=dict(batch=b, call=call, parallel=synth.calls.workers)))
    return out


# ------------------------------------------------------------------ kernels
def kernel_programs(family: str, stage: StageConfig, hf_config: dict, num_blocks: int) -> list[Program]:
    """The Pallas kernels at every decode and prefill bucket of an AR stage (bf16): attention,
    and a MoE decoder's expert matmuls."""
    text = text_config(family, stage.model_stage, hf_config)
    hq, hkv, d = text.num_heads, text.num_kv_heads, text.head_dim
    width = stage.blocks_per_seq
    s = jax.ShapeDtypeStruct
    pages = s((num_blocks, stage.block_size, hkv, d), DTYPE)
    i32 = jnp.int32
    out = []
    base = f"{family}/{stage.name}"
    for b in stage.resolved_decode_buckets:
        args = (s((b, hq, d), DTYPE), pages, pages, s((b, width), i32), s((b,), i32))
        out.append(Program(f"{base}/kernel/decode/{b}", "kernel", jax.jit(kernels_pallas.paged_attention),
                           args, {}, b, info=dict(kernel="paged_attention")))
    seqs = stage.max_num_seqs
    for t in stage.resolved_token_buckets:
        args = (s((t, hq, d), DTYPE), pages, pages, s((seqs, width), i32), s((seqs,), i32),
                s((seqs + 1,), i32))
        out.append(Program(f"{base}/kernel/prefill/{t}", "kernel",
                           jax.jit(kernels_pallas.ragged_paged_attention), args, {}, t,
                           info=dict(kernel="ragged_paged_attention")))
    if getattr(text, "num_experts", 0):
        out += expert_kernel_programs(base, text, sorted({*stage.resolved_decode_buckets, *stage.resolved_token_buckets}))
    buckets = stage.resolved_decode_buckets
    out += projection_kernel_programs(base, text, sorted({buckets[0], buckets[-1]}))
    return out


def _projections(*parts):
    """A decoder layer's projections through the skinny kernel, as the models call it where a
    GPU's row turns it on (layers/linear.py): per (x, weights) pair, one launch."""
    return [kernels_pallas.skinny_matmul(x, ws) for x, ws in parts]


def projection_kernel_programs(base: str, text, batches) -> list[Program]:
    """A decoder layer's dense projections (q/k/v side by side, o_proj; the MLP's gate/up and
    down, or a MoE layer's shared expert's) in the skinny kernel, at the smallest and largest
    decode batch (its smallest and largest row block)."""
    h, d = text.hidden_size, text.head_dim
    mlp = text.intermediate_size if not getattr(text, "num_experts", 0) else \
        getattr(text, "shared_expert_intermediate_size", 0)
    s = jax.ShapeDtypeStruct
    out = []
    for b in batches:
        parts = [(s((b, h), DTYPE), [s((h, n * d), DTYPE) for n in (text.num_heads, text.num_kv_heads,
                                                                       text.num_kv_heads)]),
                 (s((b, text.num_heads * d), DTYPE), [s((text.num_heads * d, h), DTYPE)])]
        if mlp:
            parts += [(s((b, h), DTYPE), [s((h, mlp), DTYPE)] * 2), (s((b, mlp), DTYPE), [s((mlp, h), DTYPE)])]
        out.append(Program(f"{base}/kernel/projections/{b}", "kernel", jax.jit(_projections), tuple(parts), {}, b,
                           info=dict(kernel="skinny_matmul", rows=b)))
    return out


def expert_kernel_programs(base: str, text, token_counts) -> list[Program]:
    """A MoE decoder's expert matmuls for each step size in tokens, in one program each, as the
    layer runs them (`moe.sorted_experts`: a decode step's fused gate/up and down kernels, a
    prefill's scattered rows; every token routed to num_experts_per_tok)."""
    e, h, i, k = text.num_experts, text.hidden_size, text.moe_intermediate_size, text.num_experts_per_tok
    s = jax.ShapeDtypeStruct
    out = []
    for t in token_counts:
        args = (s((t, h), DTYPE), s((t, k), jnp.float32), s((t * k,), jnp.int32), s((e,), jnp.int32),
                s((e, 2 * i, h), DTYPE), s((e, h, i), DTYPE))
        out.append(Program(f"{base}/kernel/experts/{t}", "kernel", jax.jit(sorted_experts), args, {}, t,
                           info=dict(kernel="grouped_matmul", rows=t * k, experts=e)))
    return out


def preset(name_or_path: str) -> PipelineConfig:
    """A pipeline preset by name (or YAML path)."""
    return load_pipeline_config(name_or_path)


def ar_stages(pipeline: PipelineConfig) -> list[StageConfig]:
    """The stages with a paged KV cache (thinker, talker)."""
    return [s for s in pipeline.stages if s.runner == "ar"]


def text_config(family: str, model_stage: str, hf_config: dict) -> Any:
    """The decoder config of an AR stage (layers, heads, head_dim, vocab)."""
    spec = stages_of(family)[model_stage]
    return spec.parse_config(hf_config[spec.config_key]).text
