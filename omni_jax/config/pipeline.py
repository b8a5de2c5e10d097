"""A model family's stages in order (`PipelineConfig`), checked as a whole, and built from a
mapping (`pipeline_config_from_dict`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from ..errors import ConfigError, UnknownStageError
from ..models.registry import family_names
from .checks import check_keys, invalid
from .stage import StageConfig

# Every preset `p` also comes as `p_thinker`: its text stage alone, for the checkpoints released
# without speech stages (Qwen3-Omni-30B-A3B-Thinking and -Captioner). PipelineConfig.thinker_only.
THINKER_ONLY_SUFFIX = "_thinker"
_NO_SOURCE = "<dict>"

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
        check_keys(d, _PIPELINE_KEYS + _OPTIONAL_PIPELINE_KEYS)
        for key in _PIPELINE_KEYS:
            if key not in d:
                raise invalid(key, "is required")
    except ConfigError as e:
        raise ConfigError(f"{label}, {e.field}: {e.problem}{where}", field=e.field, problem=e.problem) from None
    return PipelineConfig(name=d["name"], family=d["family"], stages=d["stages"], source=source,
                          async_chunk=d.get("async_chunk", False))
