"""The engines of the Qwen3-Omni AR stages: around a stage module (`*_engine`), and loaded from a
converted checkpoint and warmed up (`build_*_engine`); the talker's input projector."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import msgspec.structs
import numpy as np
from flax import nnx

from ...checkpoint import load_checkpoint
from ...engine.ar_engine import AREngine, EngineConfig
from ...engine.buckets import pick_bucket, pow2_buckets
from ...engine.jitted import Jitted
from ...engine.protocol import StageInputs
from ...engine.runner import RunnerConfig, stage_mesh
from ..thinker_engine import load_thinker_engine, media_ar_engine
from ..thinker_media import MediaBuckets
from .media_encoder import Qwen3ThinkerMediaEncoder



def thinker_engine(model, cfg, runner: RunnerConfig, *, media_buckets: MediaBuckets = MediaBuckets(),
                   **options) -> AREngine:
    """The Qwen3-Omni thinker's engine with its media encoders (`engine.media_encoder`);
    `options`: `media_ar_engine`'s.

    The runner gets the overlay variants (encoder features) and, when the vision
    encoder has DeepStack taps, the DeepStack prefill variant.

    MoE and bucket padding: the decoder layers route padding tokens to no expert
    (AttentionMetadata.valid_tokens), so expert work follows the real tokens.
    """
    media = Qwen3ThinkerMediaEncoder(model, cfg, media_buckets)
    # The talker reads the reply's layer-0 rows (input embeddings): sent with each sampled token.
    runner = dataclasses.replace(runner, rich_inputs=True, deepstack_layers=cfg.num_deepstack_layers,
                                 sampled_embeddings=0 in runner.capture_layers)
    return media_ar_engine(model, cfg, runner, media, **options)


def build_thinker_engine(ckpt_dir: str, runner: RunnerConfig, *, dtype: str | None = None,
                         media_buckets: MediaBuckets = MediaBuckets(), enable_prefix_caching: bool = True,
                         hidden_cache_bytes: int = EngineConfig.hidden_cache_bytes, async_scheduling: bool = True,
                         warmup: bool = True, progress: bool = True) -> AREngine:
    """Load the Qwen3-Omni thinker, its media encoders and tokenizer, and warm everything up."""
    return load_thinker_engine(thinker_engine, ckpt_dir, runner, dtype=dtype, warmup=warmup, progress=progress,
                               media_buckets=media_buckets, enable_prefix_caching=enable_prefix_caching,
                               hidden_cache_bytes=hidden_cache_bytes, async_scheduling=async_scheduling)


class TalkerInputProjector:
    """Maps the thinker-space rows of a talker request into the talker's input space.

    pipeline.py sends the talker prompt and trailing text as thinker embeddings / hidden
    states with a projection index per row (0: text_projection, 1: hidden_projection)
    and a codec id to add (-1: none); the MLPs are talker weights, so this runs in the
    talker stage, jitted over row-count buckets (warmed up with the engine).
    """

    def __init__(self, model, cfg, max_rows: int):
        self.cfg = cfg
        self.buckets = tuple(pow2_buckets(16, max(16, max_rows)))
        # Parameters as a flat leaf list (as the runner): nnx.jit would walk the whole
        # talker graph on every request (~20 ms).
        graphdef, state = nnx.split(model)
        self._leaves, treedef = jax.tree.flatten(state)
        self.jitted = Jitted(project=jax.jit(lambda leaves, *args: _project_rows(
            nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves)), *args)))

    def _project(self, rows: np.ndarray, proj: np.ndarray, add_ids: np.ndarray) -> np.ndarray:
        out, step = [], self.buckets[-1]
        for a in range(0, len(rows), step):
            n = min(step, len(rows) - a)
            b = pick_bucket(n, self.buckets)
            r = np.zeros((b, rows.shape[1]), np.float32)
            r[:n] = rows[a:a + n]
            k = np.zeros(b, np.int32)
            k[:n] = proj[a:a + n]
            i = np.full(b, -1, np.int32)
            i[:n] = add_ids[a:a + n]
            out.append(np.asarray(self.jitted.project(self._leaves, r, k, i))[:n])
        return np.concatenate(out)

    def __call__(self, inputs: StageInputs) -> StageInputs:
        cfg = self.cfg
        parts, proj, add = [], [], []
        if inputs.overlay_proj is not None:
            rows = np.asarray(inputs.overlay_rows, np.float32)
            if rows.ndim != 2 or rows.shape[1] != cfg.thinker_hidden_size:
                raise ValueError(f"talker overlay rows must be [N, {cfg.thinker_hidden_size}], got {rows.shape}")
            k = np.asarray(inputs.overlay_proj)
            ids = np.full(len(rows), -1) if inputs.overlay_add_ids is None else np.asarray(inputs.overlay_add_ids)
            if k.shape != (len(rows),) or ids.shape != (len(rows),):
                raise ValueError("overlay_proj / overlay_add_ids need one entry per overlay row")
            if not np.isin(k, (0, 1)).all():
                raise ValueError("overlay_proj entries must be 0 (text) or 1 (hidden) for the talker")
            if ((ids < -1) | (ids >= cfg.text.vocab_size)).any():
                raise ValueError(f"overlay_add_ids must be -1 or codec ids in [0, {cfg.text.vocab_size})")
            parts.append(rows)
            proj.append(k)
            add.append(ids)
        n_overlay = sum(len(x) for x in parts)
        extra = []
        if inputs.extra_proj >= 0:
            if inputs.extra_proj not in (0, 1):
                raise ValueError("extra_proj must be 0 (text) or 1 (hidden) for the talker")
            h = cfg.thinker_hidden_size
            extra = [np.asarray(x, np.float32) for x in (inputs.extra_embeds, inputs.extra_embeds_pad) if x is not None]
            if any(x.ndim not in (1, 2) or x.shape[-1] != h for x in extra):
                raise ValueError(f"extra_embeds to project (extra_proj) must be rows of the thinker's width {h}, "
                                 f"got {[x.shape for x in extra]}")
            extra = [x.reshape(-1, h) for x in extra]
            for x in extra:
                parts.append(x)
                proj.append(np.full(len(x), inputs.extra_proj))
                add.append(np.full(len(x), -1))
        if not parts:
            return inputs
        out = self._project(np.concatenate(parts), np.concatenate(proj), np.concatenate(add))
        new = msgspec.structs.replace(inputs, overlay_proj=None, overlay_add_ids=None, extra_proj=-1)
        if inputs.overlay_proj is not None:
            new.overlay_rows = out[:n_overlay]
        if extra:
            rest = out[n_overlay:]
            if inputs.extra_embeds is not None:
                new.extra_embeds, rest = rest[:len(inputs.extra_embeds)], rest[len(inputs.extra_embeds):]
            if inputs.extra_embeds_pad is not None:
                new.extra_embeds_pad = rest[0]
        return new

    def warmup(self) -> None:
        for b in self.buckets:
            self.jitted.project(self._leaves, np.zeros((b, self.cfg.thinker_hidden_size), np.float32),
                     np.zeros(b, np.int32), np.full(b, -1, np.int32))


def _project_rows(model, rows, proj, add_ids):
    text = model.project_text(rows)
    hidden = model.project_hidden(rows)
    out = jnp.where((proj == 1)[:, None], hidden, text)
    codec = model.embed(jnp.maximum(add_ids, 0))
    return (out + jnp.where((add_ids >= 0)[:, None], codec, 0)).astype(jnp.float32)


def talker_engine(model, cfg, runner: RunnerConfig) -> AREngine:
    """The talker's engine (group-0 codes, code predictor for the rest) with its input
    projector (`engine.projector`).

    Its prompts are embeddings and every step's input depends on the code predictor,
    so prefix caching is off. The banned-id width covers the 1023 suppressed ids.
    """
    text = cfg.text
    projector = TalkerInputProjector(model, cfg, runner.max_model_len)
    engine = AREngine(
        model, EngineConfig(runner=dataclasses.replace(runner, rich_inputs=True, after_sample=True),
                            enable_prefix_caching=False, eos_token_ids=(cfg.codec_eos_token_id,),
                            vocab_size=text.vocab_size, banned_width=len(cfg.suppressed_token_ids) + 64),
        num_layers=text.num_layers, num_kv_heads=text.num_kv_heads, head_dim=text.head_dim,
        hidden_size=text.hidden_size, project_inputs=projector)
    engine.projector = projector
    return engine


def build_talker_engine(ckpt_dir: str, runner: RunnerConfig, *, dtype: str | None = None,
                        warmup: bool = True, progress: bool = True) -> AREngine:
    """Load the talker stage and warm it and its input projector up."""
    model, cfg = load_checkpoint(ckpt_dir, stage="talker", dtype=dtype, mesh=stage_mesh(runner))
    engine = talker_engine(model, cfg, runner)
    if warmup:
        engine.projector.warmup()
        engine.warmup(progress=progress)
    return engine
