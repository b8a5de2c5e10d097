"""One stage of a pipeline (`StageConfig`): its model stage, engine, placement, buckets and
default sampling, each value checked when the config is built."""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from typing import Any, Mapping

from ..engine.runner import BACKENDS, RunnerConfig
from ..engine.sampling_params import SamplingParams
from ..errors import ConfigError
from .checks import (buckets, check_keys, choice, default_sampling, fraction, int_tuple, invalid, is_int, positive_int,
                     pow2_up_to)

RUNNERS = ("ar", "oneshot")
DTYPES = ("float32", "bfloat16")
OUTPUT_MODALITIES = ("text", "audio")

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
            raise invalid("name", f"must be a non-empty name of letters, digits, '_', '.', '-', "
                                   f"got {self.name!r}")
        if self.model_stage is None:
            set_("model_stage", self.name)
        elif not isinstance(self.model_stage, str) or not self.model_stage:
            raise invalid("model_stage", f"must be a non-empty string, got {self.model_stage!r}")
        choice("runner", self.runner, RUNNERS)
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            set_(name, positive_int(name, getattr(self, name)))
        # Kernels tile a page in powers of two (Triton requires every block dimension to be one).
        if self.block_size & (self.block_size - 1):
            raise invalid("block_size", f"must be a power of two, got {self.block_size}")
        if self.num_blocks is not None:
            if not is_int(self.num_blocks) or self.num_blocks < 2:
                raise invalid("num_blocks", "must be null or an integer >= 2 (block 0 is the "
                                             f"reserved dummy block), got {self.num_blocks!r}")
            set_("num_blocks", int(self.num_blocks))
            # One request of max_model_len tokens must fit, or it could never be scheduled.
            need = self.blocks_per_seq + 1
            if self.runner == "ar" and self.num_blocks < need:
                raise invalid("num_blocks", f"must be >= {need} so that one request of max_model_len "
                                             f"({self.max_model_len}) tokens fits in blocks of "
                                             f"{self.block_size} plus the dummy block, got {self.num_blocks}")
        set_("kv_memory_fraction", fraction("kv_memory_fraction", self.kv_memory_fraction, optional=True))
        if self.runner == "ar" and self.num_blocks is None and self.kv_memory_fraction is None:
            raise invalid("kv_memory_fraction", "must be set when num_blocks is null (an 'ar' "
                                                 "stage needs a KV cache size)")
        if self.runner == "oneshot":
            # A vocoder's buckets are request (or window) lengths and batch sizes per device
            # call: a step's max_num_seqs requests may take several calls, run side by side
            # (engine/oneshot_engine.py), and its stage builder checks the lengths.
            for name in ("token_buckets", "decode_buckets"):
                if getattr(self, name) is not None:
                    set_(name, int_tuple(name, getattr(self, name), increasing=True, minimum=1))
        else:
            if self.token_buckets is not None:
                set_("token_buckets", buckets("token_buckets", self.token_buckets,
                                               reach=self.max_num_batched_tokens,
                                               reach_name="max_num_batched_tokens"))
            if self.decode_buckets is not None:
                set_("decode_buckets", buckets("decode_buckets", self.decode_buckets,
                                                reach=self.max_num_seqs, reach_name="max_num_seqs"))
        for name in ("audio_chunk_buckets", "vision_patch_buckets"):
            value = int_tuple(name, getattr(self, name), increasing=True, minimum=1)
            if not value:
                raise invalid(name, "must not be empty")
            set_(name, value)
        for name in ("enable_prefix_caching", "async_scheduling", "clip_audio"):
            if not isinstance(getattr(self, name), bool):
                raise invalid(name, f"must be true or false, got {getattr(self, name)!r}")
        if not is_int(self.hidden_cache_mb) or self.hidden_cache_mb < 0:
            raise invalid("hidden_cache_mb", f"must be an integer >= 0, got {self.hidden_cache_mb!r}")
        choice("backend", self.backend, (None, *BACKENDS))
        choice("dtype", self.dtype, (None, *DTYPES))
        set_("default_sampling", default_sampling(self.default_sampling))
        if self.inputs_from is not None and (not isinstance(self.inputs_from, str) or not self.inputs_from):
            raise invalid("inputs_from", f"must be null or a stage name, got {self.inputs_from!r}")
        choice("final_output", self.final_output, (None, *OUTPUT_MODALITIES))
        set_("hidden_layers", int_tuple("hidden_layers", self.hidden_layers, increasing=False, minimum=0))
        self._validate_placement(set_)
        set_("memory_fraction", fraction("memory_fraction", self.memory_fraction, optional=True))
        for name in ("codec_chunk_frames", "initial_codec_chunk_frames"):
            set_(name, positive_int(name, getattr(self, name)))
        for name in ("codec_left_context_frames", "codec_right_context_frames"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or v < 0):
                raise invalid(name, f"must be null or an integer >= 0, got {v!r}")
        if not isinstance(self.auto_restart, bool):
            raise invalid("auto_restart", f"must be true or false, got {self.auto_restart!r}")
        for name in ("ready_timeout_s", "health_timeout_s"):
            t = getattr(self, name)
            if not isinstance(t, numbers.Real) or isinstance(t, bool) or not 0 < t < math.inf:
                raise invalid(name, f"must be a positive number of seconds, got {t!r}")
            set_(name, float(t))

    def _validate_placement(self, set_) -> None:
        for name in ("tensor_parallel_size", "expert_parallel_size", "num_processes"):
            set_(name, positive_int(name, getattr(self, name)))
        if self.device is not None and (not is_int(self.device) or self.device < 0):
            raise invalid("device", f"must be null or a device index >= 0, got {self.device!r}")
        if self.devices is not None:
            devices = int_tuple("devices", self.devices, increasing=False, minimum=0)
            if not devices:
                raise invalid("devices", "must not be empty (use null for the first "
                                          "tensor_parallel_size * expert_parallel_size devices)")
            if self.device is not None and devices != (int(self.device),):
                raise invalid("device", f"is the one-device spelling of devices; got device {self.device!r} "
                                         f"and devices {list(devices)!r} (set only devices)")
            set_("devices", devices)
        elif self.device is not None:
            set_("devices", (int(self.device),))
        set_("device", None)  # read as devices: one spelling after validation
        n = self.tensor_parallel_size * self.expert_parallel_size
        if n % self.num_processes:
            raise invalid("num_processes", f"must divide tensor_parallel_size * expert_parallel_size = {n} "
                                            f"(each process holds as many devices), got {self.num_processes}")
        per_process = n // self.num_processes
        if self.devices is not None and len(self.devices) != per_process:
            each, over = ("each process's ", f" / {self.num_processes}") if self.num_processes > 1 else ("", "")
            raise invalid("devices", f"must list {each}tensor_parallel_size * expert_parallel_size"
                                      f"{' / num_processes' if over else ''} = {self.tensor_parallel_size} * "
                                      f"{self.expert_parallel_size}{over} = {per_process} devices, "
                                      f"got {list(self.devices)!r}")
        if self.runner == "oneshot" and n > 1:
            field = "tensor_parallel_size" if self.tensor_parallel_size > 1 else "expert_parallel_size"
            raise invalid(field, "must be 1 on a 'oneshot' stage (vocoders run replicated on one "
                                  f"device), got {getattr(self, field)}")
        address = self.coordinator_address
        if address is not None:
            match = re.fullmatch(r"([^\s:/]+):(\d+)", address) if isinstance(address, str) else None
            if match is None or not 0 < int(match[2]) <= 65535 - self.num_processes:
                raise invalid("coordinator_address", f"must be null or 'host:port' (port + num_processes "
                                                      f"within 65535), got {address!r}")
            if self.num_processes == 1:
                raise invalid("coordinator_address", "is for a stage over several processes (num_processes > 1)")

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
        return self.token_buckets or pow2_up_to(min(16, n), n)

    @property
    def resolved_decode_buckets(self) -> tuple[int, ...]:
        """Decode batch-size buckets: the configured ones, else powers of two from 1."""
        return self.decode_buckets or pow2_up_to(1, self.max_num_seqs)

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
            raise invalid("stage", f"must be a mapping of stage fields, got {d!r}")
        check_keys(d, _STAGE_FIELDS)
        if "name" not in d:
            raise invalid("name", "is required")
        return cls(**d)


_STAGE_FIELDS = tuple(f.name for f in dataclasses.fields(StageConfig))


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value
