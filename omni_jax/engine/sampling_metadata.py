"""Per-step sampler inputs, built on the host once per step with numpy.

`SamplingMetadataBuilder` (or `SamplingMetadata.build`) turns the params of the scheduled
requests into a few padded arrays, one batch bucket wide, plus `SamplingFlags`: the
Python-level switches that pick a compiled sampler variant (`sampling.sample`). The build is
O(batch) numpy with per-params caching (tens of us at batch 64); the penalty history is the
one O(batch x length) part, kept cheap by per-request incremental buffers and a one-column
append when the batch is unchanged.
"""

from __future__ import annotations

import operator
from typing import Any, NamedTuple, Sequence

import flax.struct
import numpy as np

from .sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams

# Widths the top-logprobs output is padded to, so a batch asking for 3 and one asking
# for 4 share a compiled variant.
LOGPROBS_BUCKETS = (0, 5, MAX_LOGPROBS)
# Padding for token-id arrays: out of range for any vocab, dropped by the scatters
# (mode="drop"). A negative pad would wrap around like numpy indexing.
PAD_TOKEN_ID = np.iinfo(np.int32).max
_U64_MASK = (1 << 64) - 1
_U32_MASK = (1 << 32) - 1


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


def logit_bias_arrays(params_list: Sequence[SamplingParams], rows: int) -> tuple[np.ndarray, np.ndarray]:
    """`sampling.shape_logits`' bias inputs: ids [rows, MAX_LOGIT_BIAS] i32 (PAD_TOKEN_ID past a
    request's own) and their biases f32, a request's in its row."""
    ids = np.full((rows, MAX_LOGIT_BIAS), PAD_TOKEN_ID, np.int32)
    bias = np.zeros((rows, MAX_LOGIT_BIAS), np.float32)
    for j, p in enumerate(params_list):
        if p.logit_bias:
            ids[j, :len(p.logit_bias)] = list(p.logit_bias)
            bias[j, :len(p.logit_bias)] = list(p.logit_bias.values())
    return ids, bias


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
