"""Sampling for the AR engine: request-level parameters and the jitted sampler.

Three pieces, used at three different times:

* `SamplingParams` -- what a caller asks for. A frozen msgspec Struct, so it crosses
  process boundaries as msgpack and can be cached by identity on the host.
* `SamplingMetadataBuilder` / `SamplingMetadata.build` -- once per step, on the host, with
  numpy: turns the params of the scheduled requests into a few padded arrays (one batch
  bucket wide) plus `SamplingFlags`, the Python-level switches that pick a compiled variant.
* `sample(logits, metadata, flags=...)` -- a pure function called inside the runner's
  jitted step: suppression, min_tokens, penalties, greedy / temperature / top-k / top-p /
  min-p, per-request PRNG, optional logprobs.

Order of operations (as vLLM v1): suppress tokens and, while a request has produced fewer
than `min_tokens`, its eos/stop ids (-> -inf); repetition / frequency / presence penalties;
greedy rows take the argmax; random rows are divided by their temperature, then top-k,
top-p and min-p masks are applied and a token is drawn by Gumbel-max with the request's
own PRNG key.

Determinism: a request's key is `fold_in(key(seed), num_output_tokens)`, and every
operation is row-wise, so a seeded request draws the same tokens whatever else is in the
batch and whichever row it sits in.

Logprobs: computed from the logits after suppression and penalties but *before*
temperature / top-k / top-p / min-p. They describe the model's (penalised) distribution
rather than the truncated sampling distribution, which is what callers comparing against
reference logprobs want; vLLM's default ("raw_logprobs") skips the penalties as well.

Cost: the common cases (all greedy; temperature only) do no sort; a small top-k draws among
its k candidates; other top-k / top-p rows search their thresholds by value (32 passes
over the row, about a tenth of a vocabulary sort on CPU; vLLM sorts); penalties scatter a
[B, W] id history into [B, V] counts on device. The host build is O(batch) numpy with
per-params caching (tens of us at batch 64); the penalty history is the one
O(batch x length) part, kept cheap by per-request incremental buffers and a one-column
append when the batch is unchanged.
"""

from __future__ import annotations

import math
import numbers
import operator
import secrets
from typing import Any, NamedTuple, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import msgspec
import msgspec.structs
import numpy as np

__all__ = [
    "SamplingParams",
    "SamplingFlags",
    "SamplingMetadata",
    "SamplingMetadataBuilder",
    "SamplerOutput",
    "LogprobsOutput",
    "sample",
    "token_logprobs",
    "apply_banned",
    "apply_penalties",
    "apply_top_k_top_p",
    "apply_min_p",
    "request_keys",
    "assign_seed",
    "MAX_LOGPROBS",
    "LOGPROBS_BUCKETS",
    "PAD_TOKEN_ID",
]

# Temperatures below this are treated as greedy (as vLLM's _SAMPLING_EPS): dividing by
# them only amplifies float noise.
_SAMPLING_EPS = 1e-5
MAX_LOGPROBS = 20
INT32_MAX = 2**31 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)
FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32
# Widths the top-logprobs output is padded to, so a batch asking for 3 and one asking
# for 4 share a compiled variant.
LOGPROBS_BUCKETS = (0, 5, MAX_LOGPROBS)
# Padding for token-id arrays: out of range for any vocab, dropped by the scatters
# (mode="drop"). A negative pad would wrap around like numpy indexing.
PAD_TOKEN_ID = np.iinfo(np.int32).max
_U64_MASK = (1 << 64) - 1
_U32_MASK = (1 << 32) - 1


# ---------------------------------------------------------------------------------------
# Request-level parameters
# ---------------------------------------------------------------------------------------


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def is_utf8(s: str) -> bool:
    """False for text with lone surrogates (no UTF-8 form: msgpack cannot carry it to a stage)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _bad(field: str, value: Any, requirement: str) -> ValueError:
    return ValueError(f"SamplingParams.{field} must be {requirement}, got {value!r}")


class SamplingParams(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """How one request's tokens are chosen and when its generation stops.

    Frozen: derive variants with `updated(**changes)`. List-valued fields accept any
    sequence and are stored as tuples, so an instance never changes after validation (the
    host-side batch builder caches per-instance data by identity).

    `top_k` 0 or -1 means off; `top_k == 1` or `temperature == 0` (below 1e-5) is greedy.
    `logprobs=n` returns the sampled token's logprob plus the top `n` (0 = sampled only).
    `prompt_logprobs=n` returns, per prompt position after the first, the prompt token's
    logprob plus the top `n` (computed in prefill; such a request reads no prefix cache).
    `seed=None` draws fresh randomness every step; `with_seed()` / `assign_seed` fixes a
    random seed at request creation so the request can be replayed.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    suppress_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    # Stage-specific options beyond sampling (vLLM's name), e.g. a vocoder stage's
    # "initial_codec_chunk_frames"; the stage that reads a key validates its value.
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        # Normalise before validating: a bare string for `stop`, lists for the id fields,
        # numpy scalars (msgpack cannot encode them) to Python numbers.
        set_ = msgspec.structs.force_setattr
        if isinstance(self.stop, str):
            set_(self, "stop", (self.stop,))
        for name in ("stop", "stop_token_ids", "suppress_token_ids"):
            value = getattr(self, name)
            if isinstance(value, (list, np.ndarray)):
                value = tuple(value)
                set_(self, name, value)
            if name != "stop" and isinstance(value, tuple) and all(_is_int(t) for t in value):
                set_(self, name, tuple(int(t) for t in value))
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if _is_real(value) and type(value) is not float:
                set_(self, name, float(value))
        for name in ("top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if _is_int(value) and type(value) is not int:
                set_(self, name, int(value))
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first field whose value is out of range."""
        # Floats are checked in the dtype the sampler uses them in (float32): 1e308 is finite in
        # Python but inf there, and 1e-46 is > 0 but 0 there.
        t = self.temperature
        if not _is_real(t) or not (0.0 <= t <= FLOAT32_MAX):
            raise _bad("temperature", t, f"a number in [0, {FLOAT32_MAX:.4g}] (finite in float32)")
        # Counts and ids go to the device as int32 and seeds through msgpack as uint64: a
        # larger value must fail here, not wrap or fail to encode inside the engine.
        if not _is_int(self.top_k) or not -1 <= self.top_k <= INT32_MAX:
            raise _bad("top_k", self.top_k, f"an int in [-1, {INT32_MAX}] (0 or -1 disables it)")
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise _bad("top_p", self.top_p, "a number in (0, 1]")
        if not _is_real(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise _bad("min_p", self.min_p, "a number in [0, 1]")
        r = self.repetition_penalty
        if not _is_real(r) or not (FLOAT32_TINY <= r <= FLOAT32_MAX):
            raise _bad("repetition_penalty", r, f"a number in [{FLOAT32_TINY:.4g}, {FLOAT32_MAX:.4g}] (> 0 and "
                                                f"finite in float32)")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not (-2.0 <= v <= 2.0):
                raise _bad(name, v, "a number in [-2, 2]")
        if self.seed is not None and (not _is_int(self.seed) or not -(2**63) <= self.seed < 2**64):
            raise _bad("seed", self.seed, "None or an int in [-2**63, 2**64)")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s and is_utf8(s) for s in self.stop):
            raise _bad("stop", self.stop, "a list of non-empty strings of UTF-8 text")
        for name in ("stop_token_ids", "suppress_token_ids"):
            ids = getattr(self, name)
            if not isinstance(ids, tuple) or not all(_is_int(i) and 0 <= i <= INT32_MAX for i in ids):
                raise _bad(name, ids, f"a list of token ids (ints in [0, {INT32_MAX}])")
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= INT32_MAX:
            raise _bad("max_tokens", self.max_tokens, f"an int in [1, {INT32_MAX}]")
        if not _is_int(self.min_tokens) or not (0 <= self.min_tokens <= self.max_tokens):
            raise _bad("min_tokens", self.min_tokens,
                       f"an int in [0, max_tokens={self.max_tokens}]")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and (not _is_int(n) or not 0 <= n <= MAX_LOGPROBS):
                raise _bad(name, n, f"None or an int in [0, {MAX_LOGPROBS}]")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, getattr(self, name), "a bool")
        if self.extra_args is not None and (not isinstance(self.extra_args, dict)
                                            or not all(isinstance(k, str) for k in self.extra_args)):
            raise _bad("extra_args", self.extra_args, "None or a dict with string keys")

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Raise ValueError if a stop or suppressed token id is outside the vocabulary."""
        for name in ("stop_token_ids", "suppress_token_ids"):
            bad = [i for i in getattr(self, name) if i >= vocab_size]
            if bad:
                raise ValueError(
                    f"SamplingParams.{name} must be token ids < vocab_size={vocab_size}, "
                    f"got {bad[:8]!r}"
                )

    @property
    def is_greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature ~0 or top_k == 1)."""
        return self.temperature < _SAMPLING_EPS or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        """True when any repetition / presence / frequency penalty is active."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def updated(self, **changes: Any) -> "SamplingParams":
        """A validated copy with `changes` applied."""
        return msgspec.structs.replace(self, **changes)

    def with_seed(self) -> "SamplingParams":
        """This instance if it has a seed, else a copy with a fresh random 32-bit seed."""
        return self if self.seed is not None else self.updated(seed=secrets.randbits(32))


def assign_seed(params: SamplingParams) -> SamplingParams:
    """Give an unseeded request a random seed at creation, so its draws are replayable."""
    return params.with_seed()


# ---------------------------------------------------------------------------------------
# Per-step batched inputs
# ---------------------------------------------------------------------------------------


class SamplingFlags(NamedTuple):
    """Static switches (a jit static argument) selecting the compiled sampler variant.

    Only real (non-padding) rows count. `top_logprobs`: -1 no logprobs, 0 the sampled
    token's only, n > 0 also the top n (n is a LOGPROBS_BUCKETS value).
    """

    all_greedy: bool = True
    any_penalties: bool = False
    any_top_k_top_p: bool = False
    any_min_p: bool = False
    top_logprobs: int = -1

    @property
    def need_logprobs(self) -> bool:
        """Whether the sampler returns logprobs."""
        return self.top_logprobs >= 0


# Column layout of the packed per-row arrays. Packing keeps the pytree at 3-4 leaves, so
# the jitted step pays for 3-4 host->device copies, not one per field.
F_TEMPERATURE, F_TOP_P, F_MIN_P, F_REPETITION, F_PRESENCE, F_FREQUENCY = range(6)
I_TOP_K, I_SEED_HI, I_SEED_LO, I_STEP, I_GREEDY, I_HISTORY_PROMPT_LEN = range(6)
_NUM_F, _NUM_I = 6, 6


@flax.struct.dataclass
class SamplingMetadata:
    """Per-step sampler inputs for a batch padded to a bucket B (numpy on host, jnp inside jit).

    floats [B, 6] f32: temperature (1 for greedy rows), top_p, min_p, repetition, presence
      and frequency penalties -- see the F_* column constants and properties below.
    ints [B, 6] i32: top_k (0 = off), seed high/low 32 bits (bit patterns), step (= number of
      output tokens so far, folded into the key), is_greedy, history_prompt_len.
    banned_ids [B, S] i32: ids forced to -inf this step (suppress_token_ids, plus eos and
      stop_token_ids while num_output_tokens < min_tokens); padded with PAD_TOKEN_ID.
    history_ids [B, W] i32 or None: per row the prompt ids (first history_prompt_len
      entries) then the output ids, padded with PAD_TOKEN_ID; None unless penalties are on.
    Padding rows are greedy with no penalties and nothing banned.
    """

    floats: Any
    ints: Any
    banned_ids: Any
    history_ids: Any = None

    # Named views of the packed columns (work on numpy and jax arrays alike).
    @property
    def temperature(self):
        return self.floats[:, F_TEMPERATURE]

    @property
    def top_p(self):
        return self.floats[:, F_TOP_P]

    @property
    def min_p(self):
        return self.floats[:, F_MIN_P]

    @property
    def repetition_penalty(self):
        return self.floats[:, F_REPETITION]

    @property
    def presence_penalty(self):
        return self.floats[:, F_PRESENCE]

    @property
    def frequency_penalty(self):
        return self.floats[:, F_FREQUENCY]

    @property
    def top_k(self):
        return self.ints[:, I_TOP_K]

    @property
    def step(self):
        return self.ints[:, I_STEP]

    @property
    def is_greedy(self):
        return self.ints[:, I_GREEDY] != 0

    @property
    def history_prompt_len(self):
        return self.ints[:, I_HISTORY_PROMPT_LEN]

    @classmethod
    def build(
        cls,
        params_list: Sequence[SamplingParams],
        output_token_ids_list: Sequence[Sequence[int]],
        prompt_token_ids_list: Sequence[Sequence[int]] | None,
        batch_bucket: int,
        vocab_size: int,
        **kwargs: Any,
    ) -> tuple["SamplingMetadata", SamplingFlags]:
        """`SamplingMetadataBuilder.build` with a module-level builder (tests, scripts).

        An engine should own a `SamplingMetadataBuilder`, so its caches live with it.
        """
        return _default_builder().build(
            params_list, output_token_ids_list, prompt_token_ids_list, batch_bucket,
            vocab_size, **kwargs)


def _pow2_at_least(n: int, minimum: int) -> int:
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


# Per-params host row: packed float columns (F_*) and int columns (_C_*), so a batch's
# rows become arrays with one np.fromiter over cached 0-d records (about 1 us for 64).
_C_TOP_K, _C_SEED_HI, _C_SEED_LO, _C_GREEDY, _C_SEEDED, _C_PENALTIES, _C_TOP_P, \
    _C_MIN_P, _C_LOGPROBS, _C_MIN_TOKENS, _C_SUPPRESS = range(11)
_ROW_DTYPE = np.dtype([("f", np.float32, (_NUM_F,)), ("i", np.int64, (11,))])


class _Prepared(NamedTuple):
    """Host data derived once per SamplingParams instance."""

    params: SamplingParams  # keeps the instance alive, so its id() cannot be reused
    row: np.ndarray  # 0-d record of _ROW_DTYPE
    suppress: np.ndarray
    stop_ids: np.ndarray


class _History:
    """One request's penalty history on the host: [unique prompt ids | output ids] int32.

    Holds its prompt and output lists, so their id()s cannot be reused while cached.
    """

    __slots__ = ("outputs", "prompt", "buf", "prompt_len", "num_out", "used")

    def __init__(self, outputs: Any, prompt: Any, used: int):
        uniq = np.unique(np.asarray(prompt if prompt is not None else (), np.int32))
        n = len(outputs)
        self.outputs, self.prompt, self.used = outputs, prompt, used
        self.prompt_len, self.num_out = uniq.size, n
        self.buf = np.empty(_pow2_at_least(uniq.size + n, 64), np.int32)
        self.buf[:uniq.size] = uniq
        self.buf[uniq.size:uniq.size + n] = outputs

    def extend(self, used: int) -> np.ndarray:
        """Copy in the ids appended since the last step; return the row's ids."""
        self.used = used
        n = len(self.outputs)
        if n > self.num_out:
            end = self.prompt_len + n
            if end > self.buf.size:
                buf = np.empty(_pow2_at_least(end, 64), np.int32)
                buf[:self.prompt_len + self.num_out] = self.buf[:self.prompt_len + self.num_out]
                self.buf = buf
            self.buf[self.prompt_len + self.num_out:end] = self.outputs[self.num_out:]
            self.num_out = n
        return self.buf[:self.prompt_len + n]


class SamplingMetadataBuilder:
    """Builds `SamplingMetadata` + `SamplingFlags` for each step with vectorised numpy.

    Caches, all keyed by object identity (so they stay O(1) per row):
    * per SamplingParams instance: its packed row and id arrays (params are frozen);
    * per output list (with its prompt list): an int32 row [unique prompt ids | output
      ids], extended each step with the newly appended ids only (the repetition penalty
      needs only the set of prompt ids). Output lists must be append-only while a request
      lives, as an engine's are. numpy arrays are never cached, just copied (prompt
      arrays as given: dedupe them yourself if they are long).

    Pass the same list objects every step (the request's own lists), or the caches miss.

    `banned_min_width` / `history_min_width`: the smallest widths of the banned-ids and
    history arrays; widths grow in powers of two, each width a separate compilation, so
    pass minimums that cover the common case to bound compilations. `cache_size`: the
    number of per-params entries kept before unused ones are dropped. `rng`: the source of
    per-step seeds for unseeded requests.
    """

    def __init__(self, *, banned_min_width: int = 8, history_min_width: int = 64,
                 cache_size: int = 4096, rng: np.random.Generator | None = None):
        self.banned_min_width = banned_min_width
        self.history_min_width = history_min_width
        self.cache_size = cache_size
        self._rng = rng if rng is not None else np.random.default_rng()
        self._prepared: dict[int, _Prepared] = {}
        self._histories: dict[int, _History] = {}
        self._last: _LastHistory | None = None
        self._last_banned: tuple[list, np.ndarray] | None = None
        self._last_build: _LastBuild | None = None
        self._builds = 0

    # -- caches ---------------------------------------------------------------------------

    def _prepare(self, p: SamplingParams) -> _Prepared:
        greedy = p.is_greedy
        seed = 0 if p.seed is None else p.seed & _U64_MASK
        # Greedy rows get neutral temperature / top-k / top-p / min-p, so the random path
        # is a no-op for them and never divides by 0.
        floats = (1.0 if greedy else p.temperature, 1.0 if greedy else p.top_p,
                  0.0 if greedy else p.min_p, p.repetition_penalty, p.presence_penalty,
                  p.frequency_penalty)
        ints = [0] * 11
        ints[_C_TOP_K] = 0 if (greedy or p.top_k < 0) else p.top_k
        # int32 bit patterns of the two halves of the 64-bit seed.
        ints[_C_SEED_HI] = int(np.uint32(seed >> 32).view(np.int32))
        ints[_C_SEED_LO] = int(np.uint32(seed & _U32_MASK).view(np.int32))
        ints[_C_GREEDY] = greedy
        ints[_C_SEEDED] = p.seed is not None
        ints[_C_PENALTIES] = p.uses_penalties
        ints[_C_TOP_P] = not greedy and p.top_p < 1.0
        ints[_C_MIN_P] = not greedy and p.min_p > 0.0
        ints[_C_LOGPROBS] = -1 if p.logprobs is None else p.logprobs
        ints[_C_MIN_TOKENS] = p.min_tokens
        ints[_C_SUPPRESS] = len(p.suppress_token_ids)
        prep = _Prepared(
            params=p,
            row=np.array((floats, ints), _ROW_DTYPE),
            suppress=np.asarray(p.suppress_token_ids, np.int32),
            stop_ids=np.asarray(p.stop_token_ids, np.int32),
        )
        self._prepared[id(p)] = prep
        return prep

    # -- the step -------------------------------------------------------------------------

    def build(
        self,
        params_list: Sequence[SamplingParams],
        output_token_ids_list: Sequence[Sequence[int]],
        prompt_token_ids_list: Sequence[Sequence[int]] | None,
        batch_bucket: int,
        vocab_size: int,
        *,
        eos_token_ids: Sequence[int] = (),
        output_offset: int = 0,
    ) -> tuple[SamplingMetadata, SamplingFlags]:
        """Pack one step's sampler inputs for rows 0..n-1 of a batch padded to `batch_bucket`.

        `output_token_ids_list[i]`: the tokens request i has generated so far (list or
        int32 array); its length plus `output_offset` (the tokens a step scheduled ahead has
        not appended yet) is the PRNG step and drives min_tokens. `prompt_token_ids_list[i]`: the
        prompt ids, used only by the repetition penalty (may be None when no request has
        penalties). `eos_token_ids`: the stage's eos ids, banned during min_tokens.
        `vocab_size`: the width of the logits the sampler will see.
        """
        n = len(params_list)
        if n > batch_bucket:
            raise ValueError(f"{n} requests do not fit batch bucket {batch_bucket}")
        self._builds += 1
        B = batch_bucket
        num_out = np.fromiter(map(len, output_token_ids_list), np.int64, n) + output_offset
        built = (self._build_again(params_list, output_token_ids_list, prompt_token_ids_list, B, vocab_size, num_out)
                 or self._build_new(params_list, output_token_ids_list, prompt_token_ids_list, B, vocab_size,
                                    eos_token_ids, num_out))
        if self._builds % 64 == 0:
            self._evict(params_list)
        return built

    def _build_new(self, params_list, output_token_ids_list, prompt_token_ids_list, B, vocab_size, eos_token_ids,
                   num_out):
        """`build` row by row, from the params' packed rows."""
        n = len(params_list)
        cache = self._prepared
        preps = []
        for p in params_list:
            prep = cache.get(id(p))
            if prep is None or prep.params is not p:
                prep = self._prepare(p)
            preps.append(prep)
        rec = np.fromiter([q.row for q in preps], _ROW_DTYPE, n)
        cols = rec["i"]

        floats = np.empty((B, _NUM_F), np.float32)
        floats[:n] = rec["f"]
        floats[n:] = (1.0, 1.0, 0.0, 1.0, 0.0, 0.0)  # padding rows: greedy, neutral
        ints = np.zeros((B, _NUM_I), np.int32)
        top_k = cols[:, _C_TOP_K]
        top_k[top_k >= vocab_size] = 0  # "keep everything" is off: keeps the flags honest
        ints[:n, I_TOP_K] = top_k
        ints[:n, I_SEED_HI] = cols[:, _C_SEED_HI]
        ints[:n, I_SEED_LO] = cols[:, _C_SEED_LO]
        ints[:n, I_STEP] = num_out
        ints[:n, I_GREEDY] = cols[:, _C_GREEDY]
        ints[n:, I_GREEDY] = 1
        greedy = cols[:, _C_GREEDY].astype(bool)
        random_rows = ~greedy
        unseeded = np.flatnonzero(random_rows & (cols[:, _C_SEEDED] == 0))
        if unseeded.size:
            # No seed: fresh randomness each step (not replayable).
            ints[unseeded, I_SEED_HI:I_SEED_LO + 1] = self._rng.integers(
                np.iinfo(np.int32).min, np.iinfo(np.int32).max, (unseeded.size, 2),
                dtype=np.int32, endpoint=True)
        penalties = cols[:, _C_PENALTIES].astype(bool)
        flags = SamplingFlags(
            all_greedy=bool(greedy.all()),
            any_penalties=bool(penalties.any()),
            any_top_k_top_p=bool((random_rows & ((top_k > 0) | (cols[:, _C_TOP_P] != 0))).any()),
            any_min_p=bool((random_rows & (cols[:, _C_MIN_P] != 0)).any()),
            top_logprobs=_logprobs_bucket(int(cols[:, _C_LOGPROBS].max(initial=-1))),
        )

        # Rows with something to ban: their own suppress list, plus eos and stop ids
        # while they are below min_tokens.
        gated = num_out < cols[:, _C_MIN_TOKENS]
        banned_rows = np.flatnonzero(gated | (cols[:, _C_SUPPRESS] > 0)).tolist()
        banned_ids = self._banned(banned_rows, preps, gated, eos_token_ids, B)
        history_ids = None
        if flags.any_penalties:
            history_ids = self._history(
                penalties, output_token_ids_list, prompt_token_ids_list, ints, B)
        self._last_build = _LastBuild(list(params_list), B, vocab_size, cols, floats, ints,
                                      None if gated.any() else banned_ids, flags)
        return SamplingMetadata(floats, ints, banned_ids, history_ids), flags

    def _build_again(self, params_list, outputs, prompts, B, vocab_size, num_out):
        """The steady state of decoding: the same params in the same rows as the last build and
        no row below its min_tokens. Then only the step column (and fresh seeds of unseeded
        rows) changes: the last build's arrays are reused instead of packed row by row."""
        last = self._last_build
        n = len(params_list)
        if (last is None or last.banned is None or last.batch_bucket != B or last.vocab_size != vocab_size
                or len(last.params) != n
                or not all(map(operator.is_, last.params, params_list))
                or (num_out < last.cols[:, _C_MIN_TOKENS]).any()):
            return None
        ints = last.ints.copy()  # a fresh array: the last one may still be read by an in-flight step
        ints[:n, I_STEP] = num_out
        cols = last.cols
        unseeded = np.flatnonzero((cols[:, _C_GREEDY] == 0) & (cols[:, _C_SEEDED] == 0))
        if unseeded.size:
            ints[unseeded, I_SEED_HI:I_SEED_LO + 1] = self._rng.integers(
                np.iinfo(np.int32).min, np.iinfo(np.int32).max, (unseeded.size, 2), dtype=np.int32, endpoint=True)
        history_ids = None
        if last.flags.any_penalties:
            history_ids = self._history(cols[:, _C_PENALTIES].astype(bool), outputs, prompts, ints, B)
        return SamplingMetadata(last.floats, ints, last.banned, history_ids), last.flags

    def _evict(self, params_list: Sequence[SamplingParams]) -> None:
        # Finished requests leave entries behind. Histories hold whole token buffers, so
        # drop those unused for a few builds (a request skipped for a step or two keeps
        # its entry); per-params rows are small, dropped only past cache_size.
        live = set() if self._last is None else {id(o) for o in self._last.outputs}
        old = [k for k, v in self._histories.items()
               if v.used < self._builds - 8 and k not in live]
        for k in old:
            del self._histories[k]
        if len(self._prepared) > self.cache_size:
            # Cheap to recompute: keep only what this batch uses.
            keep = {id(p) for p in params_list}
            self._prepared = {k: v for k, v in self._prepared.items() if k in keep}

    def _banned(self, rows, preps, gated, eos_token_ids, B) -> np.ndarray:
        if not gated.any():
            # Without min_tokens gating the array depends only on the params in each row:
            # reuse the last one (never mutated once returned) when those are unchanged.
            last = self._last_banned
            if (last is not None and last[1].shape[0] == B and len(last[0]) == len(preps)
                    and all(a is b for a, b in zip(last[0], preps))):
                return last[1]
        pieces = []
        eos = None
        for i in rows:
            q = preps[i]
            if gated[i]:
                if eos is None:
                    eos = np.asarray(eos_token_ids, np.int32).reshape(-1)
                pieces.append(np.concatenate([q.suppress, eos, q.stop_ids]))
            else:
                pieces.append(q.suppress)
        width = _pow2_at_least(max((x.size for x in pieces), default=0), self.banned_min_width)
        banned = np.full((B, width), PAD_TOKEN_ID, np.int32)
        for i, piece in zip(rows, pieces):
            banned[i, :piece.size] = piece
        self._last_banned = None if gated.any() else (preps, banned)
        return banned

    def _history(self, penalties, outputs, prompts, ints, B) -> np.ndarray:
        rows = np.flatnonzero(penalties)
        outs = [outputs[i] for i in rows]
        prms = [None] * len(outs) if prompts is None else [prompts[i] for i in rows]
        lens = np.fromiter([len(o) for o in outs], np.int64, len(outs))
        hist = self._append_to_last(rows, outs, prms, lens, B)
        if hist is None:
            hist, prompt_lens = self._history_rows(rows.tolist(), outs, prms, B)
            self._last = _LastHistory(rows, outs, prms, lens, prompt_lens, hist)
        ints[rows, I_HISTORY_PROMPT_LEN] = self._last.prompt_lens
        return hist

    def _append_to_last(self, rows, outs, prms, lens, B) -> np.ndarray | None:
        """Steady-state decode: same requests in the same rows, each one token longer.

        Then the new history is the last one plus one column write, with no per-row work.
        """
        last = self._last
        if (last is None or last.hist.shape[0] != B or len(last.outputs) != len(outs)
                or not np.array_equal(last.rows, rows)
                or not all(a is b for a, b in zip(last.outputs, outs))
                or not all(a is b for a, b in zip(last.prompts, prms))
                or not (lens == last.lens + 1).all()):
            return None
        end = last.prompt_lens + lens
        if end.size and end.max() > last.hist.shape[1]:
            return None
        # A fresh array: the previous one may still be read by an in-flight step.
        hist = last.hist.copy()
        hist[rows, end - 1] = [o[-1] for o in outs]
        self._last = last._replace(lens=lens, hist=hist)
        return hist

    def _history_rows(self, rows, outs, prms, B) -> tuple[np.ndarray, np.ndarray]:
        cache, used = self._histories, self._builds
        heads, tails, prompt_lens = [], [], []  # row i = heads[i] ++ tails[i]
        for out, prompt in zip(outs, prms):
            if isinstance(out, np.ndarray) or isinstance(prompt, np.ndarray):
                # Arrays are the caller's buffers (possibly views that change): no caching,
                # prompt ids taken as given.
                head = np.asarray(prompt if prompt is not None else (), np.int32)
                heads.append(head)
                tails.append(np.asarray(out))
                prompt_lens.append(head.size)
                continue
            h = cache.get(id(out))
            if h is None or h.outputs is not out or h.prompt is not prompt or h.num_out > len(out):
                h = cache[id(out)] = _History(out, prompt, used)
            heads.append(h.extend(used))
            tails.append(None)
            prompt_lens.append(h.prompt_len)
        longest = max((a.size + (0 if b is None else b.size) for a, b in zip(heads, tails)),
                      default=0)
        width = _pow2_at_least(longest, self.history_min_width)
        # np.full + row copies beats any masked fill of the padding (measured).
        hist = np.full((B, width), PAD_TOKEN_ID, np.int32)
        for i, head, tail in zip(rows, heads, tails):
            hist[i, :head.size] = head
            if tail is not None:
                hist[i, head.size:head.size + tail.size] = tail
        return hist, np.asarray(prompt_lens, np.int64)


class _LastBuild(NamedTuple):
    """The previous build's inputs and arrays, for the steady-state path (`_build_again`)."""

    params: list  # the SamplingParams of its rows (compared by identity)
    batch_bucket: int
    vocab_size: int
    cols: np.ndarray     # the rows' packed integer columns
    floats: np.ndarray
    ints: np.ndarray
    banned: np.ndarray | None  # None: some row was below its min_tokens (its eos/stop ids banned)
    flags: SamplingFlags


class _LastHistory(NamedTuple):
    """The previous build's penalty history, for the steady-state append path."""

    rows: np.ndarray
    outputs: list  # the request lists themselves (kept alive, compared by identity)
    prompts: list
    lens: np.ndarray
    prompt_lens: np.ndarray
    hist: np.ndarray


def _logprobs_bucket(n: int) -> int:
    if n < 0:
        return -1
    return next(b for b in LOGPROBS_BUCKETS if b >= n)


_DEFAULT_BUILDER: SamplingMetadataBuilder | None = None


def _default_builder() -> SamplingMetadataBuilder:
    global _DEFAULT_BUILDER
    if _DEFAULT_BUILDER is None:
        _DEFAULT_BUILDER = SamplingMetadataBuilder()
    return _DEFAULT_BUILDER


# ---------------------------------------------------------------------------------------
# The sampler (device side, pure, called inside jit)
# ---------------------------------------------------------------------------------------


class LogprobsOutput(NamedTuple):
    """Logprobs of the penalised, pre-temperature distribution (see module docstring).

    sampled_logprob [B] f32, sampled_rank [B] i32 (1 = most likely), top_token_ids [B, n]
    i32 and top_logprobs [B, n] f32 sorted descending, n = flags.top_logprobs (padded:
    slice each row to its request's `logprobs`).
    """

    sampled_logprob: jax.Array
    sampled_rank: jax.Array
    top_token_ids: jax.Array
    top_logprobs: jax.Array


class SamplerOutput(NamedTuple):
    """token_ids [B] int32; logprobs when flags.need_logprobs, else None."""

    token_ids: jax.Array
    logprobs: LogprobsOutput | None


def apply_banned(logits: jax.Array, banned_ids: jax.Array) -> jax.Array:
    """Set logits[b, banned_ids[b, j]] to -inf; PAD_TOKEN_ID entries are dropped."""
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, banned_ids].set(-jnp.inf, mode="drop")


def apply_penalties(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """Repetition (prompt + output tokens), frequency and presence (output tokens) penalties.

    Repetition as transformers/vLLM: seen logits > 0 are divided by the penalty, others
    multiplied. Frequency and presence as OpenAI/vLLM: subtract penalty * count and
    penalty * (count > 0) over output tokens. Rows with neutral values are unchanged.
    """
    B, V = logits.shape
    hist = md.history_ids
    rows = jnp.arange(B)[:, None]
    is_output = jnp.arange(hist.shape[1])[None, :] >= md.history_prompt_len[:, None]
    counts = jnp.zeros((B, V), jnp.int32).at[rows, hist].add(
        is_output.astype(jnp.int32), mode="drop")
    seen = jnp.zeros((B, V), jnp.bool_).at[rows, hist].set(True, mode="drop")
    rep = jnp.where(seen, md.repetition_penalty[:, None], 1.0)
    logits = jnp.where(logits > 0, logits / rep, logits * rep)
    counts_f = counts.astype(logits.dtype)
    logits = logits - md.frequency_penalty[:, None] * counts_f
    logits = logits - md.presence_penalty[:, None] * (counts > 0).astype(logits.dtype)
    return logits


def _order_keys(x: jax.Array) -> jax.Array:
    """uint32 keys in the order of the float32 values x (-inf lowest), for searching by value."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where((bits >> 31) == 1, ~bits, bits | jnp.uint32(0x80000000))


def _smallest_key(keys: jax.Array, ok) -> jax.Array:
    """Per row of keys [B, V], the smallest key K (a [B, 1] column) with ok(K) true, for an ok
    that is false below some key and true from it on, and true at the row's largest key.

    32 halvings of the uint32 range, each one pass over the row: at batch 8 over Qwen's
    152k vocabulary, 39 ms against 453 ms for a sort on CPU."""

    def halve(_, bounds):
        lo, hi = bounds  # ok(lo) false, ok(hi) true
        mid = lo + (hi - lo) // 2
        good = ok(mid)
        return jnp.where(good, lo, mid), jnp.where(good, mid, hi)

    lo, hi = jnp.min(keys, axis=-1, keepdims=True) - 1, jnp.max(keys, axis=-1, keepdims=True)
    return jax.lax.fori_loop(0, 32, halve, (lo, hi))[1]


def apply_top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Mask (-inf) tokens outside each row's top-k, then outside its top-p nucleus.

    top_k <= 0 or >= V means off; top_p >= 1 means off. Each threshold is found by a
    search over values (`_smallest_key`) rather than a sort; tokens are kept by value
    (>= threshold), so ties at the boundary are all kept (as transformers'
    TopKLogitsWarper; its TopPLogitsWarper may split ties).
    Top-p follows transformers: drop the low tokens whose cumulative probability is
    <= 1 - top_p, always keeping the most likely one.
    """
    V = logits.shape[-1]
    keys = _order_keys(logits)
    k = jnp.where((top_k <= 0) | (top_k >= V), V, top_k)[:, None]
    # The k-th largest value: the smallest K with fewer than k values above it.
    thr_k = jax.lax.cond(jnp.any(k < V),
                         lambda: _smallest_key(keys, lambda K: jnp.sum(keys > K, -1, keepdims=True) < k),
                         lambda: jnp.min(keys, axis=-1, keepdims=True))
    probs = jax.nn.softmax(jnp.where(keys >= thr_k, logits, -jnp.inf), axis=-1)
    drop = (1.0 - top_p)[:, None]
    # The lowest kept value: the smallest K whose cumulative probability (values <= K) exceeds 1 - top_p.
    thr_p = _smallest_key(keys, lambda K: jnp.sum(jnp.where(keys <= K, probs, 0.0), -1, keepdims=True) > drop)
    thr = jnp.where((top_p < 1.0)[:, None], jnp.maximum(thr_k, thr_p), thr_k)
    return jnp.where(keys < thr, -jnp.inf, logits)


def top_k_top_p_candidates(logits: jax.Array, top_k: int, top_p,
                           row_k: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The top-k / top-p candidates of each row for one static k < V: (logits [B, k] with
    -inf outside the nucleus, their token ids [B, k]). `row_k` [B] (each <= k): a smaller
    top-k per row.

    Sampling among these k instead of the whole masked row skips the vocabulary-wide
    threshold search and draws k random numbers per row instead of V (threefry dominates on
    CPU). Same nucleus as `apply_top_k_top_p` except where logits tie exactly with the k-th
    largest.
    """
    vals, ids = _candidates(logits, top_k, row_k)
    top_p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), logits.shape[:1])
    return _nucleus(vals, jax.nn.logsumexp(vals, axis=-1, keepdims=True), top_p)[0], ids


def _candidates(logits: jax.Array, k: int, row_k: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """Each row's k largest logits (descending, -inf past its own `row_k`) and their ids."""
    vals, ids = jax.lax.top_k(logits, k)
    if row_k is not None:
        vals = jnp.where(jnp.arange(k)[None, :] < row_k[:, None], vals, -jnp.inf)
    return vals, ids


def _nucleus(vals: jax.Array, log_z: jax.Array, top_p: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The top-p nucleus among candidate logits `vals` [B, k] (descending; -inf outside the
    nucleus) and whether all of it is among them. `log_z` [B, 1]: the log of the mass the
    probabilities are taken over (the candidates' own after a top-k, else the whole row's).
    transformers' rule: a token is kept when the mass above it is below top_p (the most likely
    always); by value, as `apply_top_k_top_p`: ties with the lowest kept one are kept."""
    q = jnp.exp(vals - log_z)
    kept = jnp.cumsum(q, axis=-1) - q < top_p[:, None]
    thr = jnp.min(jnp.where(kept, vals, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(vals < thr, -jnp.inf, vals), ~kept[:, -1]


def apply_min_p(logits: jax.Array, min_p: jax.Array) -> jax.Array:
    """Mask tokens with prob < min_p * max prob, i.e. logit < max logit + log(min_p)."""
    thr = jnp.max(logits, axis=-1, keepdims=True) + jnp.log(min_p)[:, None]
    return jnp.where(logits < thr, -jnp.inf, logits)


def request_keys(md: SamplingMetadata) -> jax.Array:
    """One PRNG key per row: fold_in(key(seed), step), threefry2x32 like jax.random.PRNGKey."""
    seed = jax.lax.bitcast_convert_type(md.ints[:, I_SEED_HI:I_SEED_LO + 1], jnp.uint32)
    keys = jax.random.wrap_key_data(seed, impl="threefry2x32")
    return jax.vmap(jax.random.fold_in)(keys, md.step)


def gumbel_argmax(x: jax.Array, keys: jax.Array) -> jax.Array:
    """One seeded draw per row of logits x [B, N] (Gumbel-max, as jax.random.categorical):
    row-local, so a row's draw depends only on its own key and logits."""
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, x.shape[-1:], jnp.float32))(keys)
    return jnp.argmax(x + gumbel, axis=-1).astype(jnp.int32)


# Rows whose top_k is at most this draw among their top-k candidates: no vocabulary-wide
# search, k random numbers instead of V. Covers transformers' default (50) and the talkers' (40).
# So do top-p rows without top-k whose nucleus lies among them (usual for a trained model).
TOP_K_CANDIDATES = 64


def _draw(logits: jax.Array, md: SamplingMetadata, flags: SamplingFlags, greedy_tokens: jax.Array) -> jax.Array:
    """One token per row: greedy rows their argmax, the others a seeded draw.

    Gumbel-max with each row's own key: row-local, so batch composition and row position
    cannot change a seeded request's draw. Whether a row draws among its candidates or over
    the whole vocabulary depends only on its own parameters and logits, for the same reason.
    """
    x = logits / md.temperature[:, None]
    keys = request_keys(md)

    def full_vocab():
        y = apply_top_k_top_p(x, md.top_k, md.top_p) if flags.any_top_k_top_p else x
        if flags.any_min_p:
            y = apply_min_p(y, md.min_p)
        return gumbel_argmax(y, keys)

    k, V = TOP_K_CANDIDATES, logits.shape[-1]
    if not flags.any_top_k_top_p or k >= V:
        return jnp.where(md.is_greedy, greedy_tokens, full_vocab())
    capped = (md.top_k > 0) & (md.top_k <= k)
    top_p_only = ((md.top_k <= 0) | (md.top_k >= V)) & (md.top_p < 1.0) & ~md.is_greedy
    vals, ids = _candidates(x, k, jnp.where(capped, md.top_k, k))
    # A top-k row's nucleus is taken over its candidates, a top-p-only row's over its whole row.
    row_z = jax.lax.cond(jnp.any(top_p_only), lambda: jax.nn.logsumexp(x, axis=-1, keepdims=True),
                         lambda: jnp.zeros((x.shape[0], 1), x.dtype))
    log_z = jnp.where(top_p_only[:, None], row_z, jax.nn.logsumexp(vals, axis=-1, keepdims=True))
    vals, fits = _nucleus(vals, log_z, md.top_p)
    among = capped | (top_p_only & fits)
    if flags.any_min_p:  # the row's max logit is among its candidates
        vals = apply_min_p(vals, md.min_p)
    pick = gumbel_argmax(vals, keys)
    from_candidates = jnp.take_along_axis(ids, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)
    # The whole-vocabulary path runs only when a sampled row cannot draw among its candidates.
    need_full = jnp.any(~among & ~md.is_greedy)
    from_vocab = jax.lax.cond(need_full, full_vocab, lambda: greedy_tokens)
    return jnp.where(md.is_greedy, greedy_tokens, jnp.where(among, from_candidates, from_vocab))


def sample(logits: jax.Array, metadata: SamplingMetadata, *, flags: SamplingFlags) -> SamplerOutput:
    """Choose one token per row of `logits` [B, V]; pure, for use inside a jitted step.

    `flags` must be static (jit `static_argnames=("flags",)`); take it from the builder
    together with `metadata`.
    """
    md = metadata
    logits = logits.astype(jnp.float32)
    logits = apply_banned(logits, md.banned_ids)
    if flags.any_penalties:
        logits = apply_penalties(logits, md)

    # argmax returns the lowest index among ties, as torch/transformers.
    greedy_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if flags.all_greedy:
        tokens = greedy_tokens
    else:
        # A batch whose real rows are all greedy (e.g. greedy with a repetition penalty)
        # skips the draws: on CPU they cost far more than the rest of a small model's step.
        tokens = jax.lax.cond(jnp.all(md.is_greedy), lambda: greedy_tokens,
                              lambda: _draw(logits, md, flags, greedy_tokens))

    lp_out = token_logprobs(logits, tokens, flags.top_logprobs) if flags.need_logprobs else None
    return SamplerOutput(tokens, lp_out)


def token_logprobs(logits: jax.Array, token_ids: jax.Array, n: int) -> LogprobsOutput:
    """Log-softmax of each row of `logits` [B, V] (f32) at `token_ids` [B], that token's rank,
    and the row's top `n` (static): the generated tokens' logprobs and the prompt's alike."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    token_lp = jnp.take_along_axis(lp, token_ids[:, None], axis=-1)
    rank = jnp.sum(lp > token_lp, axis=-1).astype(jnp.int32) + 1
    if n > 0:
        top_lp, top_ids = jax.lax.top_k(lp, n)
    else:
        top_lp = jnp.zeros((lp.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((lp.shape[0], 0), jnp.int32)
    return LogprobsOutput(token_lp[:, 0], rank, top_ids.astype(jnp.int32), top_lp)
