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

Modules: `checks.py` (the value checks), `stage.py` (`StageConfig`), `pipeline.py`
(`PipelineConfig`), `presets.py` (the bundled YAML presets and loading).
"""

from ..engine.runner import BACKENDS
from ..errors import ConfigError, UnknownStageError
from .pipeline import THINKER_ONLY_SUFFIX, PipelineConfig, pipeline_config_from_dict
from .presets import PRESETS_DIR, default_pipeline_for, list_presets, load_pipeline_config
from .stage import DTYPES, OUTPUT_MODALITIES, RUNNERS, StageConfig

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
    "THINKER_ONLY_SUFFIX",
    "list_presets",
    "load_pipeline_config",
    "pipeline_config_from_dict",
    "default_pipeline_for",
]
