"""The Qwen3-Omni talker and its code predictor, in Flax NNX.

Mirrors transformers' ``Qwen3OmniMoeTalkerForConditionalGeneration`` (checkpoint prefix
``talker.``)::

    model             Qwen3-MoE decoder: layers (q/k-norm attention, interleaved M-RoPE,
                      MoE with a sigmoid-gated shared expert on EVERY layer), norm, and
                      codec_embedding (the codec vocabulary; there is no embed_tokens)
    text_projection   thinker token embeddings -> talker hidden (ResizeMLP: fc1, act, fc2)
    hidden_projection thinker hidden states (layer accept_hidden_layer) -> talker hidden
    codec_head        talker hidden -> codec logits (code group 0)
    code_predictor    small dense Qwen3 decoder predicting code groups 1..G-1

One talker step (transformers' ``prepare_inputs_for_generation``):

1. the talker's final (normed) hidden state h of the last position gives group-0
   logits through ``codec_head``; a group-0 code c0 is chosen;
2. the code predictor runs on ``[h, codec_embedding(c0)]`` and generates codes
   c1..c_{G-1} autoregressively: step s (1-based) reads the last position through
   ``lm_head[s-1]``, then appends ``code_predictor.codec_embedding[s-1](c_s)``
   (:meth:`Qwen3OmniTalker.predict_residual_codes`);
3. the talker's next input is the sum of all G group embeddings
   (``codec_embedding(c0) + sum_s code_predictor.codec_embedding[s-1](c_s)``,
   :meth:`Qwen3OmniTalker.codec_input_embeds`) plus the next trailing text embedding
   (``tts_pad`` once the text is exhausted); the pipeline adds that last term.

The decoder follows the project's stage-model contract
(``__call__(inputs_embeds, positions, meta, kv_caches=None, capture_layers=())``,
as omni_jax/models/layers/decoder.py), so the AR engine runs it with a paged KV cache.
The code predictor's sequences are at most G tokens long, so it is re-run over the
whole (dense, causal) sequence at every code-group step instead of keeping a cache.

Experts are fused in memory (``mlp.experts.gate_up_proj [E, 2I, H]``, ``down_proj
[E, H, I]``, as transformers holds them); on disk they are per-expert keys that
conversion/moe.py stacks.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from ...errors import require
from ...engine.sampling import apply_top_k_top_p, gumbel_argmax, top_k_top_p_candidates
from ..layers.attention import AttentionMetadata
from ..layers.linear import Linear
from ..layers.mlp import ACTIVATIONS
from ..layers.norms import RMSNorm
from ..layers.rope import inv_frequencies, mrope_band_rows, rope_cos_sin
from .thinker_text import Qwen3DecoderLayer, Qwen3TextConfig

# transformers' talker rotary embedding falls back to this when the config has none.
_DEFAULT_MROPE_SECTION = (24, 20, 20)
# HF's code predictor samples with top_k 50 / top_p 0.8 (prepare_inputs_for_generation)
# and its own generation config's temperature (1.0).
CODE_PREDICTOR_SAMPLING = dict(temperature=1.0, top_k=50, top_p=0.8)

# Where from_hf reads its token ids (errors name it).
SECTION = "talker_config"


def talker_text_config(d: dict) -> Qwen3TextConfig:
    """The talker decoder's config from an HF talker ``text_config`` dict.

    transformers gives every talker layer the shared-expert MoE block whatever
    ``mlp_only_layers`` / ``decoder_sparse_step`` say, and always interleaves M-RoPE.
    """
    cfg = Qwen3TextConfig.from_hf(d)
    if not cfg.shared_expert_intermediate_size:
        raise ValueError("talker text_config needs shared_expert_intermediate_size > 0")
    return dataclasses.replace(cfg, mlp_only_layers=(), decoder_sparse_step=1,
                               mrope_section=cfg.mrope_section or _DEFAULT_MROPE_SECTION)


def code_predictor_config(d: dict) -> Qwen3TextConfig:
    """The code predictor's config (a dense Qwen3 decoder: no experts) from its HF dict.

    Its sliding-window layer types are irrelevant here: sequences are at most
    num_code_groups tokens long, far below any window.
    """
    dense = dict(d, moe_intermediate_size=0, num_experts=0, num_experts_per_tok=0)
    dense.pop("num_local_experts", None)
    rope = dict(d.get("rope_parameters") or {})
    rope.pop("mrope_section", None)  # plain 1-D RoPE (transformers' Qwen3OmniMoeRotaryEmbedding)
    dense["rope_parameters"] = rope
    return dataclasses.replace(Qwen3TextConfig.from_hf(dense), mrope_section=None)


@dataclasses.dataclass(frozen=True)
class TalkerConfig:
    """The talker's parts and codec ids, read from an HF ``talker_config`` dict."""

    text: Qwen3TextConfig
    code_predictor: Qwen3TextConfig
    num_code_groups: int = 16
    thinker_hidden_size: int = 2048
    accept_hidden_layer: int = 24
    codec_eos_token_id: int = 2150
    codec_pad_id: int = 2148
    codec_bos_id: int = 2149
    codec_nothink_id: int = 2155
    codec_think_bos_id: int = 2156
    codec_think_eos_id: int = 2157
    speaker_ids: tuple[tuple[str, int], ...] = ()
    audio_token_id: int = 151675
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    audio_start_token_id: int = 151669
    position_id_per_seconds: int = 25
    spatial_merge_size: int = 2

    @classmethod
    def from_hf(cls, d: dict) -> "TalkerConfig":
        groups = d.get("num_code_groups", 16)
        cp = d["code_predictor_config"]
        if cp.get("num_code_groups", groups) != groups:
            raise ValueError(f"talker num_code_groups {groups} != code predictor's {cp.get('num_code_groups')}")
        text = talker_text_config(d["text_config"])
        predictor = code_predictor_config(cp)
        if predictor.hidden_size != text.hidden_size:
            # The predictor reads the talker's hidden state and its embeddings feed the talker.
            raise ValueError("code predictor hidden_size must equal the talker's")
        return cls(
            text=text, code_predictor=predictor, num_code_groups=groups,
            thinker_hidden_size=d.get("thinker_hidden_size", 2048),
            accept_hidden_layer=d.get("accept_hidden_layer", 24),
            codec_eos_token_id=require(d, "codec_eos_token_id", section=SECTION),
            codec_pad_id=require(d, "codec_pad_id", section=SECTION),
            codec_bos_id=require(d, "codec_bos_id", section=SECTION),
            codec_nothink_id=require(d, "codec_nothink_id", section=SECTION),
            codec_think_bos_id=require(d, "codec_think_bos_id", section=SECTION),
            codec_think_eos_id=require(d, "codec_think_eos_id", section=SECTION),
            speaker_ids=tuple(sorted((k.lower(), int(v)) for k, v in (d.get("speaker_id") or {}).items())),
            audio_token_id=require(d, "audio_token_id", section=SECTION),
            image_token_id=require(d, "image_token_id", section=SECTION),
            video_token_id=require(d, "video_token_id", section=SECTION),
            vision_start_token_id=require(d, "vision_start_token_id", section=SECTION),
            audio_start_token_id=require(d, "audio_start_token_id", section=SECTION),
            position_id_per_seconds=d.get("position_id_per_seconds", 25),
            spatial_merge_size=d.get("spatial_merge_size", 2),
        )

    @property
    def suppressed_token_ids(self) -> tuple[int, ...]:
        """Group-0 ids never sampled: the top 1024 of the codec vocab except eos (HF generate)."""
        v = self.text.vocab_size
        return tuple(i for i in range(max(v - 1024, 0), v) if i != self.codec_eos_token_id)

    def speaker_id(self, name: str) -> int:
        """Codec id of a voice ("ethan", "chelsie", "aiden" in the real model)."""
        ids = dict(self.speaker_ids)
        if name.lower() not in ids:
            raise ValueError(f"unknown speaker {name!r}; known: {sorted(ids)}")
        return ids[name.lower()]


def _run_layers(layers, x, positions, meta, cfg: Qwen3TextConfig, kv_caches, capture_layers, interleaved):
    """Shared body of both decoders: RoPE tables, layers, hidden-state capture (HF indexing)."""
    inv_freq = inv_frequencies(cfg.head_dim, cfg.rope_theta)
    band_rows = mrope_band_rows(cfg.mrope_section, cfg.head_dim // 2, interleaved=interleaved)
    cos, sin = rope_cos_sin(positions, inv_freq, band_rows, dtype=x.dtype)
    captured = {0: x} if 0 in capture_layers else {}
    new_caches = [] if kv_caches is not None else None
    for i, layer in enumerate(layers):
        x, cache = layer(x, cos, sin, meta, None if kv_caches is None else kv_caches[i])
        if new_caches is not None:
            new_caches.append(cache)
        if 0 < i + 1 < cfg.num_layers and i + 1 in capture_layers:
            captured[i + 1] = x
    return x, new_caches, captured


class TalkerResizeMLP(nnx.Module):
    """linear_fc2(act(linear_fc1(x))), both with bias (HF ``Qwen3OmniMoeTalkerResizeMLP``)."""

    def __init__(self, in_dim: int, inter: int, out_dim: int, act: str, *, dtype=jnp.float32,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.linear_fc1 = Linear(in_dim, inter, **kw)
        self.linear_fc2 = Linear(inter, out_dim, **kw)
        self.act = ACTIVATIONS[act]

    def __call__(self, x):
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3OmniTalkerModel(nnx.Module):
    """The talker decoder: layers -> norm, plus the codec embedding table."""

    def __init__(self, cfg: Qwen3TextConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        self.dtype = dtype
        self.layers = nnx.List([Qwen3DecoderLayer(cfg, i, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
                                for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.codec_embedding = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype,
                                         param_dtype=param_dtype, rngs=rngs)

    def embed(self, codec_ids):
        """Codec ids [...] -> embeddings [..., hidden]."""
        return jnp.take(self.codec_embedding.embedding[...], codec_ids, axis=0).astype(self.dtype)

    def __call__(self, inputs_embeds, positions, meta: AttentionMetadata, kv_caches=None,
                 capture_layers: Sequence[int] = ()):
        """positions [3, T] (interleaved M-RoPE) or [T]. Returns (normed hidden, kv caches, captured).

        Captured indexing as transformers' ``hidden_states``: 0 = inputs, i = output of
        layer i-1, num_layers = final normed output.
        """
        x, caches, captured = _run_layers(self.layers, inputs_embeds, positions, meta, self.cfg,
                                          kv_caches, capture_layers, interleaved=True)
        x = self.norm(x, meta.backend)
        if self.cfg.num_layers in capture_layers:
            captured[self.cfg.num_layers] = x
        return x, caches, captured


class CodePredictorModel(nnx.Module):
    """Dense Qwen3 decoder of the code predictor, with one embedding table per residual group."""

    def __init__(self, cfg: Qwen3TextConfig, num_code_groups: int, *, dtype=jnp.float32,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        self.dtype = dtype
        self.layers = nnx.List([Qwen3DecoderLayer(cfg, i, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
                                for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.codec_embedding = nnx.List([
            nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
            for _ in range(num_code_groups - 1)])

    def embed(self, group: int, codes):
        """Embedding of residual group `group` (1..G-1) codes [...] -> [..., hidden]."""
        return jnp.take(self.codec_embedding[group - 1].embedding[...], codes, axis=0).astype(self.dtype)

    def __call__(self, inputs_embeds, positions, meta: AttentionMetadata, kv_caches=None):
        """inputs [T, hidden], positions [T] -> normed hidden [T, hidden] (dense metadata), or
        (hidden, updated caches) with per-layer paged `kv_caches` and paged metadata."""
        x, caches, _ = _run_layers(self.layers, inputs_embeds, positions, meta, self.cfg, kv_caches, (),
                                   interleaved=False)
        x = self.norm(x, meta.backend)
        return x if kv_caches is None else (x, caches)


class _CachedSteps:
    """The code predictor's steps over a small paged KV cache built for one call.

    Row r of the batch owns page r + 1 (page 0 is never written, as the engine's dummy
    block); a page holds the whole sequence (<= G tokens). Every step decodes one token per
    row, the two input rows included: the reference's prompt path loops over sequences
    (XLA while loops, which a GPU runs from the host, outside the step's CUDA graph).
    `backend`: the stage's; a GPU's Pallas decode kernel is one launch where the XLA
    reference attention is several per layer and step; elsewhere the reference serves (at
    most G keys per row).
    """

    def __init__(self, model: CodePredictorModel, batch: int, groups: int, dtype, backend: str = "reference"):
        cfg = model.cfg
        self.model, self.b, self.page = model, batch, groups
        self.backend = "pallas" if backend == "pallas" else "reference"
        shape = (batch + 1, groups, cfg.num_kv_heads, cfg.head_dim)
        self.caches = [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.num_layers)]
        self.tables = jnp.arange(1, batch + 1, dtype=jnp.int32)[:, None]

    def __call__(self, row, s: int):
        """row [B, H]: each row's token at position s -> its hidden state [B, H]."""
        b = row.shape[0]
        positions = jnp.full((b,), s, jnp.int32)
        meta = AttentionMetadata(
            mode="paged", backend=self.backend, decode_only=True,
            slot_mapping=self.tables[:, 0] * self.page + positions,
            block_tables=self.tables, kv_lens=jnp.full((b,), s + 1, jnp.int32),
            cu_q_lens=jnp.arange(b + 1, dtype=jnp.int32))
        hidden, self.caches = self.model(row, positions, meta, self.caches)
        return hidden


class Qwen3OmniCodePredictor(nnx.Module):
    """``code_predictor``: the dense decoder (``model``) and one ``lm_head`` per residual group."""

    def __init__(self, cfg: Qwen3TextConfig, num_code_groups: int, *, dtype=jnp.float32,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.model = CodePredictorModel(cfg, num_code_groups, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.lm_head = nnx.List([
            Linear(cfg.hidden_size, cfg.vocab_size, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                   rngs=rngs)
            for _ in range(num_code_groups - 1)])


def _row_keys(key, b: int):
    """One PRNG key per row: keys [B] (typed) / [B, 2] (raw) pass through, a single key is split."""
    per_row_ndim = 1 if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else 2
    return key if key.ndim == per_row_ndim else jax.random.split(key, b)


def _choose(logits, keys, temperature, top_k, top_p, greedy=None, skip_greedy_draws: bool = True):
    """Greedy argmax (keys None) or one seeded draw per row after temperature/top-k/top-p.

    `greedy` [B] bool (with keys): those rows take the argmax instead of a draw.
    `skip_greedy_draws`: an all-greedy batch skips the vocabulary sort and the draws (most
    of the step's cost on CPU) behind a conditional. A GPU reads a conditional's predicate
    on the host: a wait for the device and launches outside the step's CUDA graph at each
    of the G-1 groups, dearer there than the draws, which then always run.
    """
    best = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if keys is None:
        return best
    b = logits.shape[0]

    def draw():
        scaled = logits / jnp.asarray(temperature, jnp.float32)
        if isinstance(top_k, int) and 0 < top_k < logits.shape[-1]:
            kept, ids = top_k_top_p_candidates(scaled, top_k, top_p)
            return jnp.take_along_axis(ids, gumbel_argmax(kept, keys)[:, None], axis=-1)[:, 0].astype(jnp.int32)
        kept = apply_top_k_top_p(scaled, jnp.full((b,), top_k, jnp.int32), jnp.full((b,), top_p, jnp.float32))
        return gumbel_argmax(kept, keys)

    if greedy is None:
        return draw()
    if not skip_greedy_draws:
        return jnp.where(greedy, best, draw())
    return jax.lax.cond(jnp.all(greedy), lambda: best, lambda: jnp.where(greedy, best, draw()))


class Qwen3OmniTalker(nnx.Module):
    """Talker stage model: MoE decoder, input projections, codec head, code predictor."""

    def __init__(self, cfg: TalkerConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        text = cfg.text
        self.model = Qwen3OmniTalkerModel(text, **kw)
        self.text_projection = TalkerResizeMLP(cfg.thinker_hidden_size, text.intermediate_size,
                                               text.hidden_size, text.hidden_act, **kw)
        self.hidden_projection = TalkerResizeMLP(cfg.thinker_hidden_size, text.intermediate_size,
                                                 text.hidden_size, text.hidden_act, **kw)
        self.codec_head = Linear(text.hidden_size, text.vocab_size, use_bias=False, **kw)
        self.code_predictor = Qwen3OmniCodePredictor(cfg.code_predictor, cfg.num_code_groups, **kw)

    # --- stage-model contract (AR engine) -----------------------------------------------

    def embed(self, codec_ids):
        """Group-0 codec ids [T] -> talker input embeddings [T, hidden]."""
        return self.model.embed(codec_ids)

    def __call__(self, inputs_embeds, positions, meta: AttentionMetadata, kv_caches=None,
                 capture_layers: Sequence[int] = ()):
        """Decoder forward; returns (final normed hidden [T, H], kv caches, captured hidden states)."""
        return self.model(inputs_embeds, positions, meta, kv_caches, capture_layers)

    def compute_logits(self, hidden):
        """Group-0 codec logits in fp32."""
        return self.codec_head(hidden).astype(jnp.float32)

    # --- thinker -> talker inputs --------------------------------------------------------

    def project_text(self, thinker_embeds):
        """Thinker token embeddings (hidden_states[0]) [..., thinker_hidden] -> talker hidden."""
        return self.text_projection(thinker_embeds)

    def project_hidden(self, thinker_hidden):
        """Thinker layer-`accept_hidden_layer` states (multimodal positions) -> talker hidden."""
        return self.hidden_projection(thinker_hidden)

    def after_sample(self, talker_hidden, group0_ids, greedy, seeds, steps, *, backend: str = "reference"):
        """The AR engine's after-sample hook (engine/runner.py): residual codes of each
        sampled row and what they add to that token's next input.

        A row is greedy when its talker sampling is (transformers mirrors the talker's
        do_sample onto the code predictor); otherwise its key is its request's seed
        folded with the output index, so it does not depend on the rest of the batch.
        Returns (codes [B, G-1] int32, sum of their G-1 embeddings [B, hidden]); the
        group-0 embedding is the token's own input embedding. `backend`: the stage's
        attention backend (see `predict_residual_codes`).
        """
        keys = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(seeds, steps)
        codes = self.predict_residual_codes(talker_hidden, group0_ids, keys, greedy=greedy, backend=backend)
        pred = self.code_predictor.model
        embeds = sum(pred.embed(g, codes[:, g - 1]) for g in range(1, self.cfg.num_code_groups))
        return codes, embeds.astype(jnp.float32)

    # --- residual code groups -----------------------------------------------------------

    def codec_input_embeds(self, codes):
        """codes [B, G] (group 0 first) -> the sum of the G group embeddings [B, hidden].

        This is the talker's next input before the trailing text embedding is added.
        """
        out = self.model.embed(codes[:, 0])
        for g in range(1, self.cfg.num_code_groups):
            out = out + self.code_predictor.model.embed(g, codes[:, g])
        return out

    def predict_residual_codes(self, talker_hidden, group0_ids, key=None, *,
                               temperature: float = CODE_PREDICTOR_SAMPLING["temperature"],
                               top_k: int = CODE_PREDICTOR_SAMPLING["top_k"],
                               top_p: float = CODE_PREDICTOR_SAMPLING["top_p"],
                               greedy=None, return_logits: bool = False, cache: bool = True,
                               backend: str = "reference"):
        """Codes of groups 1..G-1 [B, G-1] (int32) for one talker step of a batch.

        talker_hidden [B, H]: the talker's final normed hidden state at the position
        that produced group 0; group0_ids [B]. key None -> greedy (argmax); else a PRNG
        key (one per batch: split per row) or keys [B] (one per row, so a row's draws do
        not depend on the rest of the batch), folded in with the group index per step.
        Sampling defaults are transformers' for the code predictor (temperature 1,
        top_k 50, top_p 0.8); `greedy` [B] bool makes those rows argmax. Jittable: static
        shapes, the G-1 steps are unrolled. With return_logits, also returns the per-step
        logits [B, G-1, vocab] (fp32).

        cache=True keeps each layer's K/V in a one-page-per-row paged cache local to the
        call: the two input rows one after the other, then each step only the new code's
        row (G rows per request in all). cache=False re-runs the whole sequence every
        step (G(G+1)/2 - 1 rows); benchmarks/code_predictor.py measures both.
        backend: the stage's attention backend (`_CachedSteps`; on a GPU's, "pallas", the draws of
        an all-greedy batch are not skipped: `_choose`).
        """
        pred = self.code_predictor
        b, h = talker_hidden.shape
        groups = self.cfg.num_code_groups
        keys = None if key is None else _row_keys(key, b)
        dtype = pred.model.dtype
        seq = [talker_hidden.astype(dtype), self.model.embed(group0_ids).astype(dtype)]
        step = _CachedSteps(pred.model, b, groups, dtype, backend) if cache else None
        codes, all_logits = [], []
        for s in range(1, groups):
            if step is not None:
                if s == 1:
                    step(seq[0], 0)  # the talker's hidden state first, then one code per step
                hidden = step(seq[-1], s)
            else:
                length = s + 1
                x = jnp.stack(seq, axis=1).reshape(b * length, h)
                positions = jnp.tile(jnp.arange(length, dtype=jnp.int32), b)
                # Rows of the batch are packed segments of one dense causal attention.
                meta = AttentionMetadata.dense(b * length, jnp.repeat(jnp.arange(b, dtype=jnp.int32), length))
                hidden = pred.model(x, positions, meta).reshape(b, length, h)[:, -1]
            logits = pred.lm_head[s - 1](hidden).astype(jnp.float32)
            step_keys = None if keys is None else jax.vmap(lambda k: jax.random.fold_in(k, s))(keys)
            code = _choose(logits, step_keys, temperature, top_k, top_p, greedy, skip_greedy_draws=backend != "pallas")
            codes.append(code)
            all_logits.append(logits)
            if s < groups - 1:
                seq.append(pred.model.embed(s, code))
        codes = jnp.stack(codes, axis=1)
        if return_logits:
            return codes, jnp.stack(all_logits, axis=1)
        return codes
