"""What a model family is: the one object that describes it (`ModelFamily`) and its stages' checkpoint specs.

Each family package (`models/<family>/family.py`) defines one `FAMILY`; the registry
(`models/registry.py`) finds it by name or by the HF `model_type`. Everything family-specific
that the layers above need comes from that object: how to build each stage's engine, the
stage-input processors that turn one stage's output into the next stage's request, the prompt
processor, the conversion mapping and side files, and the built-in tiny model if there is one.
Default sampling per stage lives in the family's pipeline presets (`omni_jax/configs/*.yaml`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from flax import nnx

from .thinker_media import MediaBuckets


@dataclasses.dataclass(frozen=True)
class StageSpec:
    """How one stage of a family is built and where its weights live in the HF checkpoint."""

    name: str
    hf_prefix: str
    config_key: str
    parse_config: Callable[[dict], Any]
    build: Callable[..., nnx.Module]
    renames: tuple[tuple[str, str], ...] = ()
    ignore: tuple[str, ...] = ()
    # Wraps the checkpoint (keys()/get()) when the stage's names are not 1:1 with the
    # files, e.g. per-expert tensors presented fused (models/qwen3_omni/expert_keys.py).
    tensor_view: Callable[[Any], Any] | None = None


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """Everything OmniJax knows about one model family, in one place.

    stages: checkpoint stage name -> StageSpec (the conversion mapping and the module builder).
    engines: model stage name -> `build(stage_config, ckpt_dir, async_chunk)`, the warmed-up
        engine of a stage process (runs inside that process); `async_chunk`: the pipeline
        streams between stages, so requests arrive streamed (it decides what is compiled).
    module_engines: model stage name -> `build(stage_config, module, module_config, hf_config,
        runner_config)`, the same engine around a module already built (the GPU tier's abstract
        one), without the checkpoint's files (tokenizer, end ids, voices) and not warmed up:
        its programs (`engine.runner.jitted`, `engine.jitted`, `engine.media_encoder.jitted`,
        `engine.synthesizer.jitted`) are the ones the stage compiles.
    handoff: `ckpt_dir -> handoff`, the stage-input functions of speech chains, which run in the
        receiving stage: `handoff.stage_input(kind, control, upstream)` builds the request of a
        stage of model kind `kind` from the stage before it; `handoff.voices.get(name)` resolves a
        speaker; `handoff.check_pipeline(pipeline)` checks the thinker returns the hidden layers
        the talker needs; `handoff.check_prompt(prompt_token_ids)` refuses, before anything is
        sent, a speech prompt the talker could not be built on.
    prompt_processor: `(ckpt_dir, **options) -> InputProcessor` (chat template, media, token ids).
    side_files: `(hf_dir, get_tensor, hf_config, out_dir, **kw)` writes the files a family keeps
        beside the stage checkpoints (voices, embedding rows).
    tiny_checkpoint: builds (once) and returns the built-in tiny checkpoint, if the family has one.
    """

    name: str
    stages: dict[str, StageSpec]
    engines: dict[str, Callable[[Any, str, bool], Any]]
    module_engines: dict[str, Callable[..., Any]]
    handoff: Callable[[str], Any]
    prompt_processor: Callable[..., Any]
    side_files: Callable[..., None] | None = None
    tiny_checkpoint: Callable[[], str] | None = None


def served_thinker(build):
    """The `engines` entry of a thinker loaded by `build(ckpt_dir, runner_config, ...)` (both families')."""
    def make(stage, ckpt_dir: str, async_chunk: bool):
        return build(ckpt_dir, stage.runner_config(), dtype=stage.dtype, media_buckets=MediaBuckets.of(stage),
                     enable_prefix_caching=stage.enable_prefix_caching, hidden_cache_bytes=stage.hidden_cache_mb << 20,
                     async_scheduling=stage.async_scheduling, progress=False)
    return make


def served_talker(build):
    """The `engines` entry of a talker loaded by `build(ckpt_dir, runner_config, ...)` (both families')."""
    return lambda stage, ckpt_dir, async_chunk: build(ckpt_dir, stage.runner_config(), dtype=stage.dtype,
                                                      progress=False)


def prefixed_renames(renames, sub: str) -> tuple[tuple[str, str], ...]:
    """Re-anchor a sub-module's key renames (written relative to `sub.`) at the stage level."""
    out = []
    for pattern, repl in renames:
        anchored = pattern[1:] if pattern.startswith("^") else pattern
        out.append(("^" + sub.replace(".", r"\.") + r"\." + anchored, sub + "." + repl))
    return tuple(out)
