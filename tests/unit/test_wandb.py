"""W&B's missing package is bad input found before anything is written. (W&B itself starts a
service process: its runs are tested in tests/integration/test_wandb.py.)"""

import sys

import pytest

from pretrain.config import WandbConfig
from pretrain.errors import ConfigError
from pretrain.reporting.metrics import MetricsWriter


@pytest.fixture
def without_wandb(monkeypatch):
    """The wandb package as if not installed: Python's import system finds no module named None."""
    monkeypatch.setitem(sys.modules, "wandb", None)


@pytest.mark.usefixtures("without_wandb")
def test_a_project_without_the_package_is_one_line_saying_what_to_install(tmp_path):
    with pytest.raises(ConfigError) as error:
        MetricsWriter(tmp_path, 10, enabled=True, wandb=WandbConfig(project="pretrain"))
    message = str(error.value)
    assert "\n" not in message and "logging.wandb.project='pretrain'" in message
    assert 'pip install -e ".[wandb]"' in message
    assert list(tmp_path.iterdir()) == []  # found before metrics.jsonl or TensorBoard were opened


@pytest.mark.usefixtures("without_wandb")
def test_without_a_project_the_package_is_not_needed(tmp_path):
    writer = MetricsWriter(tmp_path, 10, enabled=True, tensorboard=False, wandb=WandbConfig())
    writer.scalars(1, {"train/loss": 2.0})
    writer.text("monitor/rollbacks", "step 1: ...", 1)
    writer.close()
    assert writer.wandb is None and (tmp_path / "metrics.jsonl").exists()
