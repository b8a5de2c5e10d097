"""Pipeline configuration: which stages a model family runs and how each stage is sized.

A `PipelineConfig` is an ordered chain of `StageConfig`s (thinker -> talker -> vocoder),
each served by its own worker process and engine. Presets live in `omni_jax/configs/*.yaml`;
`load_pipeline_config` reads a preset name or a YAML path. Every value is checked when a
config is built (from YAML, a dict, or the dataclasses directly), and an error names the
field it is about, e.g.

    pipeline 'qwen2_5_omni', stages[0] (thinker).max_num_seqs: must be a positive integer, got -1

Both classes are frozen: derive variants with `PipelineConfig.replace_stage` /
`with_overrides`, which validate the result again. They are plain picklable dataclasses,
so a stage config can be handed to a `spawn`ed worker process as is.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import os
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import msgspec.structs
import yaml

from .engine.runner import BACKENDS, RunnerConfig
from .errors import ConfigError, UnknownStageError
from .engine.sampling_params import SamplingParams
from .models.registry import family_names

__all__ = [
    "ConfigError",
    "UnknownStageError",
    "StageConfig",
    "PipelineConfig",
    "RUNNERS",
    "BACKENDS",
    "DTYPES",
    "OUTPUT_MODALITIES",
    "PRESETS_DIR",
    "list_presets",
    "load_pipeline_config",
    "pipeline_config_from_dict",
    "default_pipeline_for",
]

RUNNERS = ("ar", "oneshot")
DTYPES = ("float32", "bfloat16")
OUTPUT_MODALITIES = ("text", "audio")
PRESETS_DIR = Path(__file__).resolve().parent / "configs"
# Every preset `p` also comes as `p_thinker`: its text stage alone, for the checkpoints released
# without speech stages (Qwen3-Omni-30B-A3B-Thinking and -Captioner). PipelineConfig.thinker_only.
THINKER_ONLY_SUFFIX = "_thinker"
_NO_SOURCE = "<dict>"


# --------------------------------------------------------------------------- checks
# Each check returns the normalised value or raises _invalid(field, problem); the caller
# adds the location ("stage 'x'", "pipeline 'p', stages[i] (x)") once, in one place.


def _invalid(field: str, problem: str) -> ConfigError:
    return ConfigError(f"{field}: {problem}", field=field, problem=problem)


def _is_int(x: Any) -> bool:
    # bool is an int subclass: `max_num_seqs: yes` must not pass as 1.
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _positive_int(field: str, value: Any) -> int:
    if not _is_int(value) or value < 1:
        raise _invalid(field, f"must be a positive integer, got {value!r}")
    return int(value)


def _fraction(field: str, value: Any, *, optional: bool) -> float | None:
    if value is None and optional:
        return None
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not 0.0 < value <= 1.0:
        what = "null or a number" if optional else "a number"
        raise _invalid(field, f"must be {what} in (0, 1], got {value!r}")
    return float(value)


def _choice(field: str, value: Any, choices: Sequence[Any]) -> Any:
    if value not in choices or isinstance(value, bool):
        shown = ", ".join("null" if c is None else repr(c) for c in choices)
        raise _invalid(field, f"must be one of {shown}, got {value!r}")
    return value


def _int_tuple(field: str, value: Any, *, increasing: bool, minimum: int) -> tuple[int, ...]:
    """A list of ints >= minimum; strictly increasing when `increasing`, else distinct."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise _invalid(field, f"must be a list of integers, got {value!r}")
    for v in value:
        if not _is_int(v) or v < minimum:
            need = "positive integers" if minimum == 1 else f"integers >= {minimum}"
            raise _invalid(field, f"must contain only {need}, got {v!r} in {list(value)!r}")
    out = tuple(int(v) for v in value)
    if increasing and any(a >= b for a, b in zip(out, out[1:])):
        raise _invalid(field, f"must be strictly increasing, got {list(out)!r}")
    if not increasing and len(set(out)) != len(out):
        raise _invalid(field, f"must not repeat a value, got {list(out)!r}")
    return out


def _buckets(field: str, value: Any, *, reach: int, reach_name: str) -> tuple[int, ...]:
    out = _int_tuple(field, value, increasing=True, minimum=1)
    if not out:
        raise _invalid(field, "must not be empty (use null for the default buckets)")
    # A step larger than the last bucket could not be padded to any compiled shape.
    if out[-1] < reach:
        raise _invalid(field, f"the last bucket ({out[-1]}) must be >= {reach_name} ({reach}), "
                              f"got {list(out)!r}")
    return out


def _pow2_up_to(minimum: int, maximum: int) -> tuple[int, ...]:
    """minimum, 2*minimum, ... and finally `maximum` itself (as engine.buckets.pow2_buckets)."""
    out, b = [], minimum
    while b < maximum:
        out.append(b)
        b *= 2
    return (*out, maximum)


def _suggest(key: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    return f" (did you mean {close[0]}?)" if close else f" (known fields: {', '.join(known)})"


def _check_keys(d: Mapping[str, Any], known: Sequence[str]) -> None:
    for key in d:
        if not isinstance(key, str):
            raise _invalid(repr(key), "field names must be strings")
        if key not in known:
            raise _invalid(key, "unknown field" + _suggest(key, known))


def _sampling_field_names() -> tuple[str, ...]:
    return tuple(f.name for f in msgspec.structs.fields(SamplingParams))


def _default_sampling(value: Any) -> dict[str, Any]:
    field = "default_sampling"
    if not isinstance(value, Mapping):
        raise _invalid(field, f"must be a mapping of SamplingParams fields, got {value!r}")
    names = _sampling_field_names()
    for key in value:
        if key not in names:
            problem = f"unknown SamplingParams field {key!r}" + _suggest(str(key), names)
            raise _invalid(field, problem)
    try:
        SamplingParams(**value)
    except (ValueError, TypeError) as e:
        raise _invalid(field, str(e)) from None
    return dict(value)


# --------------------------------------------------------------------------- stage


@dataclasses.dataclass(frozen=True)
class StageConfig:
    """One stage of a pipeline: what it loads, how it runs, and how its engine is sized.

    Sizes follow vLLM's engine arguments. Buckets are the shapes the stage's jitted steps
    are compiled for (None: powers of two up to the limit). `hidden_layers` uses HF
    indexing: 0 is the input embeddings, num_layers the output after the final norm.
    """

    name: str
    model_stage: str | None = None  # the checkpoint stage it loads; None -> name
    runner: str = "ar"  # "ar": paged-KV autoregressive engine; "oneshot": no KV (vocoders)
    max_num_seqs: int = RunnerConfig.max_num_seqs
    max_num_batched_tokens: int = RunnerConfig.max_num_batched_tokens
    max_model_len: int = RunnerConfig.max_model_len
    block_size: int = RunnerConfig.block_size
    num_blocks: int | None = None  # None -> derived from kv_memory_fraction at load time
    kv_memory_fraction: float | None = 0.9  # of the memory left after weights
    token_buckets: tuple[int, ...] | None = None
    decode_buckets: tuple[int, ...] | None = None
    audio_chunk_buckets: tuple[int, ...] = (1, 4, 16, 64)
    vision_patch_buckets: tuple[int, ...] = (1024, 4096, 16384)
    enable_prefix_caching: bool = True
    # Host memory (MiB) for the hidden rows of cached KV blocks, so that requests returning
    # hidden states (speech replies) take prefix-cache hits too (engine/hidden_cache.py); 0: off.
    hidden_cache_mb: int = 1024
    # Launch the next decode step before this one's tokens reach the host (vLLM's async
    # scheduling); it applies to thinker stages, whose decodes need nothing from the host.
    async_scheduling: bool = True
    backend: str | None = None  # None -> from the platform ("pallas" on GPU)
    dtype: str | None = None  # None -> as stored in the checkpoint
    # Not hashed: a dict; configs hash by their sizes and names.
    default_sampling: dict[str, Any] = dataclasses.field(default_factory=dict, hash=False)
    inputs_from: str | None = None
    final_output: str | None = None
    hidden_layers: tuple[int, ...] = ()
    # Placement and parallelism within the stage (vLLM's names). `devices`: the local device
    # indices the stage uses, TP * EP of them (None: the first TP * EP); `device: N` is the
    # one-device spelling, read as `devices: [N]` (and left null). The stage's attention heads,
    # MLP width and KV heads are split over the tensor axis, MoE experts over the expert axis;
    # whether the model's sizes divide is checked when the engine is built (engine/sharding.py).
    device: int | None = None
    devices: tuple[int, ...] | None = None
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    # A stage whose devices sit in several JAX processes (jax.distributed, runtime/spmd.py): each
    # of the `num_processes` uses `devices` (its local indices, TP * EP / num_processes of them).
    # Process 0 is the stage process; it starts the others on this host, unless
    # `coordinator_address` ("host:port", this host's address on a private network) says they
    # run on other hosts, started there with `omni-jax stage-process`: process 0 then serves
    # jax.distributed's coordinator on that port and process N's input on port + N.
    num_processes: int = 1
    coordinator_address: str | None = None
    memory_fraction: float | None = None  # share of the device this stage's process may use
    ready_timeout_s: float = 600.0
    # A ready stage that answers nothing (not even the orchestrator's heartbeat) for this
    # long is declared unhealthy: its requests fail, naming it, until it answers again.
    health_timeout_s: float = 30.0
    # A stage process that died, or stayed unhealthy, is started again (its requests fail; the
    # other stages keep theirs); false: the engine is dead, and later calls raise EngineDeadError.
    auto_restart: bool = True
    # Vocoder stages with async chunk on: decode codec frames in chunks of this many (vLLM-Omni's
    # default, 25), the first chunk smaller so that the first audio comes early and the next ones
    # growing to it (engine/oneshot_engine.py next_chunk_frames). vLLM-Omni's names; a request may
    # set its own first chunk (SamplingParams.extra_args["initial_codec_chunk_frames"]).
    codec_chunk_frames: int = 25
    initial_codec_chunk_frames: int = 10
    # Streamed vocoders that need context around a chunk (Qwen2.5-Omni's DiT): codec frames
    # decoded with it before and after the ones kept; null: the model's own choice. More
    # context costs compute (and, ahead, latency) and brings the audio closer to the whole
    # decode's (models/qwen2_5_omni/token2wav.py measures the error of each).
    codec_left_context_frames: int | None = None
    codec_right_context_frames: int | None = None
    # Vocoder stages: clamp the waveform to [-1, 1], as the models' reference does; false: the
    # samples as the last convolution left them (a signal past 1 is not cut, e.g. for tests that
    # compare two decodes where the clamp would hide their difference). Saving or serving audio
    # clamps it anyway (PCM).
    clip_audio: bool = True

    def __post_init__(self) -> None:
        try:
            self._validate()
        except ConfigError as e:
            where = f"stage {self.name!r}" if isinstance(self.name, str) and self.name else "stage"
            raise ConfigError(f"{where}, {e.field}: {e.problem}", field=e.field,
                              problem=e.problem) from None

    def _validate(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731  (frozen)
        if not isinstance(self.name, str) or not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", self.name):
            raise _invalid("name", f"must be a non-empty name of letters, digits, '_', '.', '-', "
                                   f"got {self.name!r}")
        if self.model_stage is None:
            set_("model_stage", self.name)
        elif not isinstance(self.model_stage, str) or not self.model_stage:
            raise _invalid("model_stage", f"must be a non-empty string, got {self.model_stage!r}")
        _choice("runner", self.runner, RUNNERS)
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            set_(name, _positive_int(name, getattr(self, name)))
        # Kernels tile a page in powers of two (Triton requires every block dimension to be one).
        if self.block_size & (self.block_size - 1):
            raise _invalid("block_size", f"must be a power of two, got {self.block_size}")
        if self.num_blocks is not None:
            if not _is_int(self.num_blocks) or self.num_blocks < 2:
                raise _invalid("num_blocks", "must be null or an integer >= 2 (block 0 is the "
                                             f"reserved dummy block), got {self.num_blocks!r}")
            set_("num_blocks", int(self.num_blocks))
            # One request of max_model_len tokens must fit, or it could never be scheduled.
            need = self.blocks_per_seq + 1
            if self.runner == "ar" and self.num_blocks < need:
                raise _invalid("num_blocks", f"must be >= {need} so that one request of max_model_len "
                                             f"({self.max_model_len}) tokens fits in blocks of "
                                             f"{self.block_size} plus the dummy block, got {self.num_blocks}")
        set_("kv_memory_fraction", _fraction("kv_memory_fraction", self.kv_memory_fraction, optional=True))
        if self.runner == "ar" and self.num_blocks is None and self.kv_memory_fraction is None:
            raise _invalid("kv_memory_fraction", "must be set when num_blocks is null (an 'ar' "
                                                 "stage needs a KV cache size)")
        if self.runner == "oneshot":
            # A vocoder's buckets are request (or window) lengths and batch sizes per device
            # call: a step's max_num_seqs requests may take several calls, run side by side
            # (engine/oneshot_engine.py), and its stage builder checks the lengths.
            for name in ("token_buckets", "decode_buckets"):
                if getattr(self, name) is not None:
                    set_(name, _int_tuple(name, getattr(self, name), increasing=True, minimum=1))
        else:
            if self.token_buckets is not None:
                set_("token_buckets", _buckets("token_buckets", self.token_buckets,
                                               reach=self.max_num_batched_tokens,
                                               reach_name="max_num_batched_tokens"))
            if self.decode_buckets is not None:
                set_("decode_buckets", _buckets("decode_buckets", self.decode_buckets,
                                                reach=self.max_num_seqs, reach_name="max_num_seqs"))
        for name in ("audio_chunk_buckets", "vision_patch_buckets"):
            value = _int_tuple(name, getattr(self, name), increasing=True, minimum=1)
            if not value:
                raise _invalid(name, "must not be empty")
            set_(name, value)
        for name in ("enable_prefix_caching", "async_scheduling", "clip_audio"):
            if not isinstance(getattr(self, name), bool):
                raise _invalid(name, f"must be true or false, got {getattr(self, name)!r}")
        if not _is_int(self.hidden_cache_mb) or self.hidden_cache_mb < 0:
            raise _invalid("hidden_cache_mb", f"must be an integer >= 0, got {self.hidden_cache_mb!r}")
        _choice("backend", self.backend, (None, *BACKENDS))
        _choice("dtype", self.dtype, (None, *DTYPES))
        set_("default_sampling", _default_sampling(self.default_sampling))
        if self.inputs_from is not None and (not isinstance(self.inputs_from, str) or not self.inputs_from):
            raise _invalid("inputs_from", f"must be null or a stage name, got {self.inputs_from!r}")
        _choice("final_output", self.final_output, (None, *OUTPUT_MODALITIES))
        set_("hidden_layers", _int_tuple("hidden_layers", self.hidden_layers, increasing=False, minimum=0))
        self._validate_placement(set_)
        set_("memory_fraction", _fraction("memory_fraction", self.memory_fraction, optional=True))
        for name in ("codec_chunk_frames", "initial_codec_chunk_frames"):
            set_(name, _positive_int(name, getattr(self, name)))
        for name in ("codec_left_context_frames", "codec_right_context_frames"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 0):
                raise _invalid(name, f"must be null or an integer >= 0, got {v!r}")
        if not isinstance(self.auto_restart, bool):
            raise _invalid("auto_restart", f"must be true or false, got {self.auto_restart!r}")
        for name in ("ready_timeout_s", "health_timeout_s"):
            t = getattr(self, name)
            if not isinstance(t, numbers.Real) or isinstance(t, bool) or not 0 < t < math.inf:
                raise _invalid(name, f"must be a positive number of seconds, got {t!r}")
            set_(name, float(t))

    def _validate_placement(self, set_) -> None:
        for name in ("tensor_parallel_size", "expert_parallel_size", "num_processes"):
            set_(name, _positive_int(name, getattr(self, name)))
        if self.device is not None and (not _is_int(self.device) or self.device < 0):
            raise _invalid("device", f"must be null or a device index >= 0, got {self.device!r}")
        if self.devices is not None:
            devices = _int_tuple("devices", self.devices, increasing=False, minimum=0)
            if not devices:
                raise _invalid("devices", "must not be empty (use null for the first "
                                          "tensor_parallel_size * expert_parallel_size devices)")
            if self.device is not None and devices != (int(self.device),):
                raise _invalid("device", f"is the one-device spelling of devices; got device {self.device!r} "
                                         f"and devices {list(devices)!r} (set only devices)")
            set_("devices", devices)
        elif self.device is not None:
            set_("devices", (int(self.device),))
        set_("device", None)  # read as devices: one spelling after validation
        n = self.tensor_parallel_size * self.expert_parallel_size
        if n % self.num_processes:
            raise _invalid("num_processes", f"must divide tensor_parallel_size * expert_parallel_size = {n} "
                                            f"(each process holds as many devices), got {self.num_processes}")
        per_process = n // self.num_processes
        if self.devices is not None and len(self.devices) != per_process:
            each, over = ("each process's ", f" / {self.num_processes}") if self.num_processes > 1 else ("", "")
            raise _invalid("devices", f"must list {each}tensor_parallel_size * expert_parallel_size"
                                      f"{' / num_processes' if over else ''} = {self.tensor_parallel_size} * "
                                      f"{self.expert_parallel_size}{over} = {per_process} devices, "
                                      f"got {list(self.devices)!r}")
        if self.runner == "oneshot" and n > 1:
            field = "tensor_parallel_size" if self.tensor_parallel_size > 1 else "expert_parallel_size"
            raise _invalid(field, "must be 1 on a 'oneshot' stage (vocoders run replicated on one "
                                  f"device), got {getattr(self, field)}")
        address = self.coordinator_address
        if address is not None:
            match = re.fullmatch(r"([^\s:/]+):(\d+)", address) if isinstance(address, str) else None
            if match is None or not 0 < int(match[2]) <= 65535 - self.num_processes:
                raise _invalid("coordinator_address", f"must be null or 'host:port' (port + num_processes "
                                                      f"within 65535), got {address!r}")
            if self.num_processes == 1:
                raise _invalid("coordinator_address", "is for a stage over several processes (num_processes > 1)")

    @property
    def num_devices(self) -> int:
        """Devices the stage spans: tensor_parallel_size * expert_parallel_size."""
        return self.tensor_parallel_size * self.expert_parallel_size

    # ------------------------------------------------------------------ derived values
    @property
    def blocks_per_seq(self) -> int:
        """KV blocks one request of max_model_len tokens occupies (the block-table width)."""
        return -(-self.max_model_len // self.block_size)

    @property
    def resolved_token_buckets(self) -> tuple[int, ...]:
        """Prefill token buckets: the configured ones, else powers of two from 16."""
        n = self.max_num_batched_tokens
        return self.token_buckets or _pow2_up_to(min(16, n), n)

    @property
    def resolved_decode_buckets(self) -> tuple[int, ...]:
        """Decode batch-size buckets: the configured ones, else powers of two from 1."""
        return self.decode_buckets or _pow2_up_to(1, self.max_num_seqs)

    def kv_num_blocks(self, available_bytes: int, bytes_per_block: int) -> int:
        """num_blocks if set, else kv_memory_fraction of `available_bytes` (the memory left
        after weights) in blocks of `bytes_per_block` (all layers, K and V)."""
        if self.num_blocks is not None:
            return self.num_blocks
        n = int(self.kv_memory_fraction * available_bytes) // int(bytes_per_block)
        if n < self.blocks_per_seq + 1:
            raise ConfigError(
                f"stage {self.name!r}: {available_bytes / 2**30:.2f} GiB left for the KV cache holds "
                f"{n} blocks, fewer than the {self.blocks_per_seq + 1} one request of max_model_len "
                f"({self.max_model_len}) needs; lower max_model_len or raise memory_fraction / "
                f"kv_memory_fraction", field="kv_memory_fraction")
        return n

    def sampling_params(self, **overrides: Any):
        """This stage's default SamplingParams (the preset is their one source), with `overrides` applied."""
        return SamplingParams(**{**self.default_sampling, **overrides})

    def runner_config(self, **changes: Any) -> RunnerConfig:
        """The engine's RunnerConfig of an "ar" stage (its sizes, buckets, backend and captured
        layers), with `changes` applied."""
        return dataclasses.replace(RunnerConfig(
            num_blocks=self.num_blocks, block_size=self.block_size, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, max_model_len=self.max_model_len,
            token_buckets=self.token_buckets, decode_buckets=self.decode_buckets, backend=self.backend,
            capture_layers=self.hidden_layers, kv_memory_fraction=self.kv_memory_fraction or 0.9,
            devices=self.devices, tensor_parallel_size=self.tensor_parallel_size,
            expert_parallel_size=self.expert_parallel_size), **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML/JSON-ready form (lists, not tuples); `from_dict` reads it back."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "StageConfig":
        """Build from a mapping; unknown keys are errors with a spelling suggestion."""
        if not isinstance(d, Mapping):
            raise _invalid("stage", f"must be a mapping of stage fields, got {d!r}")
        _check_keys(d, _STAGE_FIELDS)
        if "name" not in d:
            raise _invalid("name", "is required")
        return cls(**d)


_STAGE_FIELDS = tuple(f.name for f in dataclasses.fields(StageConfig))


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


# --------------------------------------------------------------------------- pipeline


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """A model family's stages in order; stage i takes its inputs from an earlier stage.

    Invariants (checked on construction): at least one stage; unique names; exactly the
    first stage has `inputs_from` None and every other names an earlier stage; some stage
    delivers "text", and no modality is delivered by two stages.
    """

    name: str
    family: str
    stages: tuple[StageConfig, ...]
    source: str = dataclasses.field(default=_NO_SOURCE, compare=False)  # file it came from
    # Stream between stages (vLLM-Omni's name): the talker starts once the thinker has prefilled
    # and written its first tokens, the vocoder decodes codec chunks while the talker goes on.
    # Off: each stage waits for the whole output of the one before it.
    async_chunk: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.async_chunk, bool):
            raise self._error("async_chunk", f"must be true or false, got {self.async_chunk!r}")
        if not isinstance(self.name, str) or not self.name:
            raise self._error("name", f"must be a non-empty string, got {self.name!r}")
        if self.family not in family_names() or isinstance(self.family, bool):
            raise self._error("family", f"must be one of {', '.join(map(repr, family_names()))}, "
                                        f"got {self.family!r}")
        stages = self.stages
        if isinstance(stages, (str, bytes, Mapping)) or not isinstance(stages, Sequence) or not stages:
            raise self._error("stages", f"must be a non-empty list of stages, got {stages!r}")
        built = []
        for i, s in enumerate(stages):
            if not isinstance(s, (StageConfig, Mapping)):
                raise self._error(f"stages[{i}]", f"must be a mapping of stage fields, got {s!r}")
            try:
                built.append(s if isinstance(s, StageConfig) else StageConfig.from_dict(s))
            except ConfigError as e:
                label = f"stages[{i}]"
                if isinstance(s, Mapping) and isinstance(s.get("name"), str) and e.field != "name":
                    label += f" ({s['name']})"
                raise self._error(f"{label}.{e.field}", e.problem, field=f"stages[{i}].{e.field}") from None
        object.__setattr__(self, "stages", tuple(built))
        self._validate_graph()

    def _error(self, path: str, problem: str, *, field: str | None = None) -> ConfigError:
        where = f" (in {self.source})" if self.source != _NO_SOURCE else ""
        return ConfigError(f"pipeline {self.name!r}, {path}: {problem}{where}",
                           field=field or path, problem=problem)

    def _stage_error(self, i: int, field: str, problem: str) -> ConfigError:
        return self._error(f"stages[{i}] ({self.stages[i].name}).{field}", problem,
                           field=f"stages[{i}].{field}")

    def _validate_graph(self) -> None:
        index: dict[str, int] = {}
        delivered: dict[str, int] = {}
        for i, s in enumerate(self.stages):
            if s.name in index:
                raise self._stage_error(i, "name", f"duplicate stage name {s.name!r} "
                                                   f"(also stages[{index[s.name]}])")
            index[s.name] = i
        for i, s in enumerate(self.stages):
            if i == 0:
                if s.inputs_from is not None:
                    raise self._stage_error(0, "inputs_from", "must be null: the first stage takes "
                                                              f"the user's inputs, got {s.inputs_from!r}")
            else:
                earlier = [t.name for t in self.stages[:i]]
                if s.inputs_from is None:
                    raise self._stage_error(i, "inputs_from", "must name an earlier stage (one of "
                                                              f"{earlier}); only the first stage has none")
                if s.inputs_from not in index:
                    raise self._stage_error(i, "inputs_from", f"no stage named {s.inputs_from!r}; "
                                                              f"earlier stages: {earlier}")
                if index[s.inputs_from] >= i:
                    raise self._stage_error(
                        i, "inputs_from", f"stage {s.inputs_from!r} is stages[{index[s.inputs_from]}], not "
                                          f"an earlier stage; stages run in list order (earlier: {earlier})")
            if s.final_output is not None:
                if s.final_output in delivered:
                    j = delivered[s.final_output]
                    raise self._stage_error(i, "final_output", f"{s.final_output!r} is already delivered "
                                                               f"by stages[{j}] ({self.stages[j].name})")
                delivered[s.final_output] = i
        if "text" not in delivered:
            raise self._error("stages", "no stage has final_output 'text'; set it on the stage "
                                        "whose tokens are the text reply (the thinker)")

    # ------------------------------------------------------------------ lookups
    @property
    def stage_names(self) -> tuple[str, ...]:
        """The stage names in pipeline order."""
        return tuple(s.name for s in self.stages)

    @property
    def output_modalities(self) -> tuple[str, ...]:
        """The modalities this pipeline can deliver, in stage order."""
        return tuple(s.final_output for s in self.stages if s.final_output is not None)

    def stage(self, name: str) -> StageConfig:
        """The stage called `name`; UnknownStageError (a ConfigError and KeyError) otherwise."""
        for s in self.stages:
            if s.name == name:
                return s
        raise UnknownStageError(f"pipeline {self.name!r} has no stage {name!r}; "
                                f"stages: {list(self.stage_names)}", field="stages")

    def missing_stages(self, checkpoint_stages: Sequence[str]) -> list[str]:
        """The stages of this pipeline whose weights (`model_stage`) are not among `checkpoint_stages`."""
        return [s.name for s in self.stages if s.model_stage not in checkpoint_stages]

    def stage_index(self, name: str) -> int:
        """Position of stage `name` in the pipeline."""
        return self.stages.index(self.stage(name))

    def stages_for(self, output_modalities: Sequence[str] | str) -> tuple[StageConfig, ...]:
        """The prefix of stages a request needs to deliver `output_modalities`.

        ["text"] stops at the stage delivering text (the thinker); ["text", "audio"] runs
        up to the vocoder. Stages only take inputs from earlier ones, so a prefix is
        always self-contained.
        """
        mods = [output_modalities] if isinstance(output_modalities, str) else list(output_modalities)
        supported = self.output_modalities
        if not mods:
            raise ConfigError(f"pipeline {self.name!r}: output_modalities must not be empty; "
                              f"supported: {list(supported)}", field="output_modalities")
        last = 0
        for m in mods:
            if m not in supported:
                raise ConfigError(f"pipeline {self.name!r}: unknown output modality {m!r}; "
                                  f"supported: {list(supported)}", field="output_modalities")
            last = max(last, next(i for i, s in enumerate(self.stages) if s.final_output == m))
        return self.stages[: last + 1]

    # ------------------------------------------------------------------ variants
    def thinker_only(self) -> "PipelineConfig":
        """The stages up to the text reply (the thinker) alone, named `<name>_thinker`: the
        pipeline of a checkpoint without speech stages. A kept stage captures no hidden layers
        when no kept stage reads them (they were the talker's input)."""
        kept = self.stages_for(["text"])
        read = {s.inputs_from for s in kept}
        stages = [s.to_dict() | ({} if s.name in read else {"hidden_layers": []}) for s in kept]
        return pipeline_config_from_dict(self.to_dict() | {"name": self.name + THINKER_ONLY_SUFFIX, "stages": stages},
                                         source=self.source)

    def replace_stage(self, name: str, **changes: Any) -> "PipelineConfig":
        """A validated copy with stage `name`'s fields changed (unknown fields are errors)."""
        i = self.stage_index(name)
        return self.with_overrides(**{self.stages[i].name: changes})

    def with_overrides(self, **stage_overrides: Mapping[str, Any]) -> "PipelineConfig":
        """A validated copy with per-stage field changes: `with_overrides(thinker={...}, ...)`."""
        for name in stage_overrides:
            self.stage(name)  # unknown stage -> UnknownStageError listing the names
        stages = []
        for s in self.stages:
            d = s.to_dict()
            changes = stage_overrides.get(s.name, {})
            if not isinstance(changes, Mapping):
                raise ConfigError(f"pipeline {self.name!r}: overrides for stage {s.name!r} must be a "
                                  f"mapping of fields, got {changes!r}", field=s.name)
            if "device" in changes and "devices" not in changes:
                d["devices"] = None  # `device: N` replaces the stage's placement
            d.update(changes)
            stages.append(d)
        return pipeline_config_from_dict(self.to_dict() | {"stages": stages}, source=self.source)

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML/JSON-ready form; `pipeline_config_from_dict` reads it back."""
        return {"name": self.name, "family": self.family, "async_chunk": self.async_chunk,
                "stages": [s.to_dict() for s in self.stages]}


_PIPELINE_KEYS = ("name", "family", "stages")
_OPTIONAL_PIPELINE_KEYS = ("async_chunk",)


# --------------------------------------------------------------------------- loading


def pipeline_config_from_dict(d: Mapping[str, Any], source: str = _NO_SOURCE) -> PipelineConfig:
    """Build and validate a PipelineConfig from a mapping (a parsed YAML file).

    `source` (a file path) is appended to error messages.
    """
    where = f" (in {source})" if source != _NO_SOURCE else ""
    if not isinstance(d, Mapping):
        raise ConfigError(f"pipeline config must be a mapping with keys {list(_PIPELINE_KEYS)}, "
                          f"got {type(d).__name__}{where}")
    label = f"pipeline {d.get('name')!r}" if isinstance(d.get("name"), str) else "pipeline"
    try:
        _check_keys(d, _PIPELINE_KEYS + _OPTIONAL_PIPELINE_KEYS)
        for key in _PIPELINE_KEYS:
            if key not in d:
                raise _invalid(key, "is required")
    except ConfigError as e:
        raise ConfigError(f"{label}, {e.field}: {e.problem}{where}", field=e.field, problem=e.problem) from None
    return PipelineConfig(name=d["name"], family=d["family"], stages=d["stages"], source=source,
                          async_chunk=d.get("async_chunk", False))


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (PyYAML silently keeps the last one)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping", node.start_mark, f"found duplicate key {key!r}",
                key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def list_presets() -> list[str]:
    """Names of the bundled pipeline presets: the YAML files in omni_jax/configs/, and each
    one's thinker-only variant (`<name>_thinker`)."""
    return sorted(n for p in PRESETS_DIR.glob("*.yaml") for n in (p.stem, p.stem + THINKER_ONLY_SUFFIX))


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read pipeline config {path}: {e.strerror or e}") from None
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as e:
        raise ConfigError(f"invalid YAML in pipeline config {path}: {e}") from None


def load_pipeline_config(name_or_path: str | os.PathLike | PipelineConfig) -> PipelineConfig:
    """A preset by name ("qwen2_5_omni", "qwen2_5_omni_tiny", "qwen3_omni") or a YAML file.

    A PipelineConfig is returned as is, so callers can accept either.
    """
    if isinstance(name_or_path, PipelineConfig):
        return name_or_path
    text = os.fspath(name_or_path)
    path = Path(text).expanduser()
    is_path = (os.sep in text or "/" in text or text.endswith((".yaml", ".yml")) or path.is_file())
    if not is_path:
        path = PRESETS_DIR / f"{text}.yaml"
        base = text.removesuffix(THINKER_ONLY_SUFFIX)
        if not path.is_file() and base != text and (PRESETS_DIR / f"{base}.yaml").is_file():
            return load_pipeline_config(base).thinker_only()
        if not path.is_file():
            raise ConfigError(f"unknown pipeline preset {text!r}; presets: {list_presets()} "
                              "(or pass the path of a YAML file)")
    elif not path.is_file():
        raise ConfigError(f"pipeline config file not found: {path}")
    d = _read_yaml(path)
    if isinstance(d, Mapping) and "name" not in d:
        d = {"name": path.stem, **d}  # a user's file may leave the name to its file name
    return pipeline_config_from_dict(d, source=str(path))


def default_pipeline_for(family: str, tiny: bool = False, checkpoint_stages: Sequence[str] | None = None
                         ) -> PipelineConfig:
    """The bundled preset of a model family (the tiny one for the built-in test model); its
    thinker-only variant where `checkpoint_stages` (the stages a converted checkpoint holds)
    lack the speech stages, as the Qwen3-Omni Thinking and Captioner checkpoints do."""
    if family not in family_names():
        raise ConfigError(f"unknown model family {family!r}; families: {list(family_names())}")
    name = f"{family}_tiny" if tiny else family
    if name not in list_presets():
        raise ConfigError(f"no {'tiny ' if tiny else ''}preset for {family!r}; presets: {list_presets()}")
    pipeline = load_pipeline_config(name)
    if checkpoint_stages is not None and pipeline.missing_stages(checkpoint_stages):
        pipeline = pipeline.thinker_only()
    return pipeline
