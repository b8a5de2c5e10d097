"""The bundled pipeline presets (`omni_jax/configs/*.yaml`) and YAML files: listing, loading
(duplicate keys refused) and the default pipeline of a family."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from ..errors import ConfigError
from ..models.registry import family_names
from .pipeline import THINKER_ONLY_SUFFIX, PipelineConfig, pipeline_config_from_dict

PRESETS_DIR = Path(__file__).resolve().parent.parent / "configs"

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
