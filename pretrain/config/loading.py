"""Reading configs: YAML files and dotted overrides merged onto the schema's defaults, in order of
precedence, lowest first: dataclass defaults ← model preset (`configs/model/NAME.yaml`, named by
`model.preset`) ← the run config file ← dotted CLI overrides (`model.n_layers=12`). Merging and
type checking are OmegaConf's structured configs; any problem is a `ConfigError` with one line
that names the key and the file. A renamed key (`RENAMED`) is still read under its former name,
with a one-line note."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import typing
from dataclasses import MISSING, asdict, fields, is_dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from monitoring.config import SettingError
from pretrain.config.packaged import find_preset, resolve_config
from pretrain.config.schema import RUN_SECTIONS, FinetuneConfig, ModelConfig, RunConfig
from pretrain.errors import ConfigError


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path} is a directory, not a config file: pass a .yaml file")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist: check the path")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not UTF-8 text: pass a YAML config file") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}: not valid YAML{where}: fix the syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of keys to values, got {type(data).__name__}")
    return data


def is_model_preset(data: dict[str, Any]) -> bool:
    """A run config has sections at top level; a model preset holds flat ModelConfig fields (a file
    with neither is taken as a run config, so its unknown keys are reported against the sections)."""
    model_fields = {f.name for f in fields(ModelConfig)}
    return not set(data) & set(RUN_SECTIONS) and bool(set(data) & model_fields)


def parse_overrides(overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r} is not KEY=VALUE (for example model.n_layers=12)")
    try:
        parsed = OmegaConf.from_dotlist(list(overrides))
    except (OmegaConfBaseException, yaml.YAMLError) as exc:
        raise ConfigError(f"could not parse overrides {' '.join(overrides)!r}: {_first_line(exc)}") from None
    return OmegaConf.to_container(parsed)


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _schema(cls: type) -> DictConfig:
    """The typed, empty-of-derived-values config that YAML layers are merged onto."""
    schema = OmegaConf.structured(cls)
    if cls is ModelConfig or "model" in schema:
        model = schema if cls is ModelConfig else schema.model
        for name in ModelConfig.DERIVED:
            model[name] = None
    return schema


def _sections(cls: type) -> dict[str, type]:
    """The fields of `cls` that are sections: a dataclass made by default, or an optional one
    (`model.rope_scaling`: null unless set)."""
    hints = typing.get_type_hints(cls)
    found = {}
    for f in fields(cls):
        if f.default_factory is not MISSING and is_dataclass(f.default_factory):
            found[f.name] = f.default_factory
            continue
        options = typing.get_args(hints[f.name]) if f.default is None else ()  # X | None
        inner = [t for t in options if is_dataclass(t)]
        if inner:
            found[f.name] = inner[0]
    return found


def _check_shape(layer: dict[str, Any], cls: type, source: str, prefix: str = "") -> None:
    """Sections must be mappings and list fields lists, before OmegaConf sees them (its own
    messages for these cases name internals, not keys)."""
    sections = _sections(cls)
    for f in fields(cls):
        if f.name not in layer or layer[f.name] is None:
            continue
        key, value = prefix + f.name, layer[f.name]
        if f.name in sections:
            if not isinstance(value, dict):
                raise ConfigError(
                    f"{source}: {key} must be a section (a mapping of keys to values), got {value!r}"
                )
            _check_shape(value, sections[f.name], source, key + ".")
        elif f.default_factory is list and not isinstance(value, list):
            raise ConfigError(f"{source}: {key} must be a list, for example {key}=[10,20]; got {value!r}")


# Keys renamed, read under their former names too: (section, former name, name).
RENAMED = (("checkpoint", "async", "async_save"),)


def _renamed(layer: dict[str, Any], source: str, *, note: bool = True) -> dict[str, Any]:
    """`layer` with each former name of `RENAMED` replaced by the key's name; with a note (stderr,
    once per process, from rank 0) unless the layer is a saved config, which its user did not write."""
    for section, former, name in RENAMED:
        values = layer.get(section)
        if not isinstance(values, dict) or former not in values:
            continue
        if name in values:
            raise ConfigError(
                f"{source}: {section}.{former} and {section}.{name} are both set: keep {section}.{name}"
            )
        layer = layer | {section: {(name if k == former else k): v for k, v in values.items()}}
        if note:
            _note_renamed(f"{section}.{former}", f"{section}.{name}")
    return layer


@functools.cache
def _note_renamed(former: str, name: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"note: {former} is deprecated, read as {name}: rename it", file=sys.stderr, flush=True)


def _merge_layer(
    base: DictConfig, layer: dict[str, Any], cls: type, source: str, *, note: bool = True
) -> DictConfig:
    """Merge one layer onto the typed config, naming the key and the source on failure."""
    layer = _renamed(layer, source, note=note)
    _check_shape(layer, cls, source)
    try:
        return OmegaConf.merge(base, layer)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        message = _first_line(exc)
        if message.startswith("Key ") and "not in" in message:
            section = key.rsplit(".", 1)[0] if "." in key else None
            raise ConfigError(
                f"{source}: unknown key {key!r}: check the spelling; valid keys"
                f"{' in ' + repr(section) if section else ''} are {', '.join(_known_keys(cls, section))}"
            ) from None
        raise ConfigError(f"{source}: {key}: {message}: set it to a value of the field's type") from None


def _known_keys(cls: type, section: str | None) -> list[str]:
    for part in section.split(".") if section else []:
        owner = _sections(cls).get(part)
        if owner is None:
            return []
        cls = owner
    return [f.name for f in fields(cls)]


def _to_object(merged: DictConfig) -> Any:
    try:
        return OmegaConf.to_object(merged)
    except SettingError as exc:  # monitoring's own sections say it in the same words
        raise ConfigError(str(exc)) from None
    except OmegaConfBaseException as exc:
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, ConfigError):
            raise cause from None
        if isinstance(cause, SettingError):
            raise ConfigError(str(cause)) from None
        key = getattr(exc, "full_key", None) or "?"
        raise ConfigError(f"{key}: {_first_line(exc)}") from None


def load_model_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> ModelConfig:
    """Load a model preset file (flat ModelConfig fields). Overrides may be written `n_layers=2`
    or, as for run configs, `model.n_layers=2`."""
    path = resolve_config(path)
    data = read_yaml(path)
    if "preset" in data:
        raise ConfigError(f"{path}: a model preset cannot name another preset; list the fields instead")
    cli = parse_overrides(overrides)
    cli = {**{k: v for k, v in cli.items() if k != "model"}, **(cli.get("model") or {})}
    merged = _merge_layer(_schema(ModelConfig), data, ModelConfig, str(path))
    merged = _merge_layer(merged, cli, ModelConfig, "override")
    model = _to_object(merged)
    if model.preset is None:
        model.preset = path.stem
    return model


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Load a run config: defaults ← model preset ← file ← dotted overrides, then validate."""
    path = resolve_config(path)
    data = read_yaml(path)
    if is_model_preset(data):
        raise ConfigError(
            f"{path} is a model preset, not a run config: name it from a run config as "
            f"`model: {{preset: {path.stem}}}` (see configs/train/)"
        )
    cli = parse_overrides(overrides)
    _check_shape(data, RunConfig, str(path))
    _check_shape(cli, RunConfig, "override")
    preset = (cli.get("model") or {}).get("preset") or (data.get("model") or {}).get("preset")
    merged = _schema(RunConfig)
    if preset is not None:
        preset_path = find_preset(str(preset), path)
        preset_data = read_yaml(preset_path)
        merged = _merge_layer(merged, {"model": preset_data}, RunConfig, str(preset_path))
    merged = _merge_layer(merged, data, RunConfig, str(path))
    merged = _merge_layer(merged, cli, RunConfig, "override")
    return _to_object(merged)


def load_finetune_config(
    path: str | Path, overrides: list[str] | tuple[str, ...] = (), *, runnable: bool = True
) -> FinetuneConfig:
    """Load a fine-tuning config: defaults ← file ← dotted overrides, then validate (`runnable`:
    also that it names its initial checkpoint and training data, which `config show` does not need)."""
    path = resolve_config(path)
    data = read_yaml(path)
    if "finetune" not in data:
        raise ConfigError(
            f"{path} has no finetune: section, so it is not a fine-tuning config: start from "
            "configs/finetune/classification.yaml or configs/finetune/sft.yaml"
        )
    cli = parse_overrides(overrides)
    merged = _merge_layer(_schema(FinetuneConfig), data, FinetuneConfig, str(path))
    merged = _merge_layer(merged, cli, FinetuneConfig, "override")
    cfg = _to_object(merged)
    return cfg.check_runnable() if runnable else cfg


def finetune_config_from_dict(values: dict[str, Any]) -> FinetuneConfig:
    """A FinetuneConfig from a saved run_config.json (its extra keys, such as model, are ignored)."""
    sections = {k: v for k, v in values.items() if k in {f.name for f in fields(FinetuneConfig)}}
    return _to_object(
        _merge_layer(_schema(FinetuneConfig), sections, FinetuneConfig, "run_config.json", note=False)
    ).check_runnable()


def load_defaults(overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """The default run config with dotted overrides (for tools that take no config file)."""
    cli = parse_overrides(overrides)
    _check_shape(cli, RunConfig, "override")
    return _to_object(_merge_layer(_schema(RunConfig), cli, RunConfig, "override"))


def load_any(
    path: str | Path, overrides: list[str] | tuple[str, ...] = (), *, runnable: bool = True
) -> RunConfig | ModelConfig | FinetuneConfig:
    """A run config, a model preset file (as `pretrain flops configs/model/gpt3-125m.yaml` takes) or
    a fine-tuning config (`runnable`: see load_finetune_config)."""
    path = resolve_config(path)
    data = read_yaml(path)
    if is_model_preset(data):
        return load_model_config(path, overrides)
    if "finetune" in data:
        return load_finetune_config(path, overrides, runnable=runnable)
    return load_config(path, overrides)


def to_yaml(cfg: RunConfig | ModelConfig | FinetuneConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def config_hash(cfg: RunConfig | ModelConfig) -> str:
    """A stable digest of the resolved values (for checkpoints to say what produced them)."""
    text = json.dumps(asdict(cfg), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
