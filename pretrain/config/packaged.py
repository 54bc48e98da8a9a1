"""Where configs are found: the packaged ones (`configs/` of the source tree, or the copy a wheel
installs under `<prefix>/share/pretrain/configs`) by the names `--config` takes, and model presets."""

from __future__ import annotations

import sys
from pathlib import Path

from pretrain.errors import ConfigError

REPO_CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def available_presets() -> list[str]:
    return sorted(p.stem for p in (config_dir() / "model").glob("*.yaml"))


def config_dir() -> Path:
    """configs/ of the source tree (editable installs), else the copy a wheel installs."""
    if REPO_CONFIG_DIR.is_dir():
        return REPO_CONFIG_DIR
    return Path(sys.prefix) / "share" / "pretrain" / "configs"


CONFIG_KINDS = ("train", "finetune", "model", "ablation")  # the packaged config directories, by name


def packaged_configs() -> dict[str, Path]:
    """The packaged configs by the name `--config` takes: run configs (configs/train/) by their file's
    stem (`demo`, `tiny`, `gpt3-125m`), the others as KIND/STEM (`finetune/classification`)."""
    found: dict[str, Path] = {}
    for kind in CONFIG_KINDS:
        for path in sorted((config_dir() / kind).glob("*.yaml")):
            found[path.stem if kind == "train" else f"{kind}/{path.stem}"] = path
    return found


def resolve_config(name: str | Path) -> Path:
    """A config file: the path as given when it exists, else a packaged config by name (from any
    directory), so `--config demo` and `--config configs/train/demo.yaml` are the same file — the
    latter, as the docs print it, also outside the repository (the shipped `configs/`)."""
    path = Path(name)
    if not path.is_file() and not path.is_absolute() and path.parts[:1] == ("configs",):
        shipped = config_dir() / Path(*path.parts[1:])
        if shipped.is_file():
            return shipped
    if path.is_file() or path.suffix in (".yaml", ".yml") or len(path.parts) > 2:
        return path  # a path: read_yaml reports a missing file with the path
    packaged = packaged_configs()
    key = str(name).removeprefix("train/")
    if key in packaged:  # also beside a directory of that name (`runs/demo` after `pretrain demo`)
        return packaged[key]
    if path.exists():
        return path  # read_yaml says what it is
    raise ConfigError(
        f"no config {str(name)!r}: not a file, nor a packaged config name; "
        "`pretrain config list` shows the names (or pass a path to a .yaml file)"
    )


def find_preset(name: str, config_path: Path | None = None) -> Path:
    """Resolve `model.preset`: a path to a YAML file, or a name under some `configs/model/`."""
    candidates: list[Path] = []
    if name.endswith((".yaml", ".yml")):
        if config_path is not None:
            candidates.append(config_path.parent / name)
        candidates.append(Path(name))
    else:
        if config_path is not None:
            candidates.append(config_path.resolve().parent.parent / "model" / f"{name}.yaml")
        candidates.append(Path("configs/model") / f"{name}.yaml")
        candidates.append(config_dir() / "model" / f"{name}.yaml")
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise ConfigError(
        f"unknown model preset {name!r}: no configs/model/{name}.yaml; "
        f"available presets: {', '.join(available_presets()) or 'none found'}"
    )
