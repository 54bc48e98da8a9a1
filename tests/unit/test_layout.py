"""The package's promises about itself: what installs, what it depends on, what Docker copies."""

import re
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the dev extra installs tomli
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def requirement_names(requirements: list[str]) -> dict[str, str]:
    return {re.split(r"[<>=!~\[ ;]", r, maxsplit=1)[0].lower(): r for r in requirements}


def test_top_level_layout():
    for name in (
        "README.md",
        "pyproject.toml",
        "pretrain",
        "launch",
        "configs",
        "monitoring",
        "tests",
        "docker",
    ):
        assert (ROOT / name).exists(), name


def test_dependencies():
    core = requirement_names(PYPROJECT["project"]["dependencies"])
    for name in (
        "torch",
        "deepspeed",
        "accelerate",
        "datasets",
        "tensorboard",
        "sentencepiece",
        "safetensors",
    ):
        assert name in core, name
    # A range that an installed torch can satisfy, never a pinned (CUDA) build.
    assert ">=" in core["torch"] and "==" not in core["torch"] and "+" not in core["torch"]
    assert "transformers" not in core
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert "transformers" in requirement_names(extras["hf"])
    assert "transformers" in requirement_names(extras["dev"])


def test_packages_and_script():
    assert PYPROJECT["project"]["scripts"]["pretrain"] == "pretrain.cli:entry"
    import monitoring
    import pretrain

    assert Path(pretrain.__file__).parent == ROOT / "pretrain"
    assert Path(monitoring.__file__).parent == ROOT / "monitoring"


def test_dockerfile_copies_what_exists():
    text = (ROOT / "docker" / "Dockerfile").read_text()
    assert re.search(r"^FROM \S*pytorch\S*cuda", text, re.M), "the image must start from a CUDA PyTorch base"
    for tool in ("pdsh", "openssh"):
        assert tool in text
    copies = re.findall(r"^COPY\s+(.+)$", text, re.M)
    assert copies
    for line in copies:
        *sources, _dest = line.split()
        for source in sources:
            assert (ROOT / source).exists(), f"Dockerfile copies {source}, which is not in the repository"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    command = 'pip install -e ".[dev]" && python -m pytest'
    assert command in readme[:2000], "the test command belongs at the top of the README"
    assert command in ci.splitlines()


def test_every_config_ships_with_the_package():
    """A non-editable install finds configs/ under <prefix>/share/pretrain (pretrain.config.config_dir)."""
    data_files = PYPROJECT["tool"]["setuptools"]["data-files"]
    shipped = {path for target, globs in data_files.items() for g in globs for path in ROOT.glob(g)}
    for target, globs in data_files.items():
        for g in globs:
            assert target == "share/pretrain/" + str(Path(g).parent), (target, g)
    in_repo = {p for p in (ROOT / "configs").rglob("*") if p.is_file()}
    assert in_repo and in_repo == shipped, sorted(str(p.relative_to(ROOT)) for p in in_repo ^ shipped)
