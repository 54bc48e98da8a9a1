"""Weights & Biases in offline mode, for real: the wandb package and its service process (wandb-core,
a subprocess: hence this tier). A short training in this process (tests/unit/fakes.py) with a
monitor rollback, stopped and started again, is read back from W&B's transaction logs
(RUN_DIR/wandb/offline-run-*/run-<id>.wandb) with W&B's own reader, and compared with
metrics.jsonl and TensorBoard."""

import json
import subprocess
import threading
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from monitoring.service import serve
from pretrain.config import MonitorConfig, WandbConfig, load_config
from pretrain.reporting.metrics import MetricsWriter, tensorboard_dir
from pretrain.reporting.wandb_sink import RUN_ID_FILE
from tests.helpers import FAST, TINY
from tests.unit.fakes import pretraining_trainer

WANDB = ["logging.wandb.project=test", "logging.wandb.mode=offline"]
MONITOR = ["monitor.enabled=true", "monitor.warmup=4", "monitor.window=16", "eval.every=0"]


@pytest.fixture(scope="module")
def wandb_home(tmp_path_factory):
    """W&B kept offline and inside the test's directories; its service stopped at the end."""
    import wandb

    home = tmp_path_factory.mktemp("wandb_home")
    with pytest.MonkeyPatch.context() as env:
        for name in (
            "WANDB_API_KEY",
            "WANDB_BASE_URL",
            "WANDB_PROJECT",
            "WANDB_ENTITY",
            "WANDB_RUN_ID",
            "WANDB_RESUME",
            "WANDB_NAME",
            "WANDB_SILENT",
            "WANDB_CONSOLE",
        ):
            env.delenv(name, raising=False)
        env.setenv("WANDB_MODE", "offline")  # (the config says so too: this is the safety net)
        env.setenv("WANDB_ERROR_REPORTING", "false")  # no error reports to W&B's servers
        for name in (
            "WANDB_DIR",
            "WANDB_CONFIG_DIR",
            "WANDB_CACHE_DIR",
            "WANDB_DATA_DIR",
            "WANDB_ARTIFACT_DIR",
        ):
            env.setenv(name, str(home / name.lower()))
        yield home
        wandb.teardown()


def config(run_dir, data_dir, *overrides):
    return load_config(
        TINY,
        [
            *FAST,
            f"run.dir={run_dir}",
            f"data.dir={data_dir}",
            *MONITOR,
            *WANDB,
            "train.steps=12",
            "checkpoint.every=3",
            "faults.spike_steps=[8]",
            *overrides,
        ],
    )


@pytest.fixture(scope="module")
def two_starts(tmp_path_factory, train_data, wandb_home):
    """A spike at step 8 rolled back to step 6; the job stops at step 10 and a second start
    resumes it to step 12. Returns the run directory and the two starts' configs."""
    run_dir = tmp_path_factory.mktemp("wandb_run")
    server, _ = serve(run_dir, MonitorConfig(warmup=4, window=16))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    configs = [config(run_dir, train_data, "train.stop_at_step=10"), config(run_dir, train_data)]
    try:
        first = pretraining_trainer(configs[0]).train()
        second = pretraining_trainer(configs[1]).train()
    finally:
        server.shutdown()
        server.server_close()
    assert first["rollbacks"] == 1 and first["step"] == 10 and second["completed"] and second["step"] == 12
    return run_dir, configs


def offline_runs(run_dir: Path) -> list[list[dict]]:
    """Each start's records, in the order of the starts."""
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    return [inspect(f) for f in files]


def inspect(wandb_file: Path) -> list[dict]:
    """The records of a transaction log, read by W&B itself: `wandb leet inspect --json FILE` runs
    this wandb-core command (called directly, without the CLI's two seconds of start-up)."""
    from wandb.util import get_core_path

    command = [
        get_core_path(),
        "leet",
        "inspect",
        "--no-observability",
        "--json",
        "--run-file",
        str(wandb_file),
        str(wandb_file.parent.parent),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)
    return [json.loads(line) for line in result.stdout.splitlines()]


def of_type(records: list[dict], kind: str) -> list[dict]:
    return [r[kind] for r in records if r["type"] == kind]


def history(runs: list[list[dict]], tag: str) -> list[tuple[int, float]]:
    """(train/step, value) of every row that holds `tag`, in the order logged."""
    rows = [h["item"] for records in runs for h in of_type(records, "history")]
    return [(row["train/step"], row[tag]) for row in rows if tag in row]


def test_every_logged_step_is_in_the_history_at_its_training_step(two_starts):
    """Steps 7-9 ran twice (the rollback was applied after step 9), and the second start went on
    from step 10: every try is a row at its training step, in the order of metrics.jsonl."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _ = two_starts
    runs = offline_runs(run_dir)
    assert len(runs) == 2  # one transaction log per start
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    ours = history(runs, "train/loss")
    assert ours == [(r["step"], r["train/loss"]) for r in logged]  # logging.every=1: every record
    assert [s for s, _ in ours].count(7) == 2 and sorted({s for s, _ in ours}) == list(range(1, 13))
    board = EventAccumulator(str(tensorboard_dir(run_dir)), size_guidance={"scalars": 0})
    board.Reload()
    seen = sorted((e.step, e.value) for e in board.Scalars("train/loss"))
    assert seen == sorted((step, float(np.float32(loss))) for step, loss in ours)  # (TensorBoard: float32)
    judged = history(runs, "monitor/rollback")
    assert [step for step, mark in judged if mark] == [8]
    (metric,) = [m for m in of_type(runs[0], "metric") if m.get("glob_name") == "*"]
    assert metric["step_metric"] == "train/step"


def test_the_rollback_is_an_alert_and_a_row_of_its_table(two_starts):
    run_dir, _ = two_starts
    runs = offline_runs(run_dir)
    (alert,) = of_type(runs[0], "alert")
    assert alert["title"] == "rollback at step 8" and alert["level"] == "WARN"
    assert alert["text"].startswith("step 8: ") and "-> step_00000006" in alert["text"]
    assert not of_type(runs[1], "alert")
    # (the reader flattens a table's reference into "<tag>.<field>")
    assert history(runs, "monitor/rollbacks._type") == [(8, "table-file")]
    ((_, path),) = history(runs, "monitor/rollbacks.path")
    rows = json.loads(next(run_dir.glob(f"wandb/offline-run-*/files/{path}")).read_text())
    assert rows["columns"] == ["step", "text"] and rows["data"] == [[8, alert["text"]]]


def test_each_start_continues_the_same_run_with_its_config(two_starts):
    run_dir, configs = two_starts
    run_id = (run_dir / RUN_ID_FILE).read_text().strip()
    for records, cfg in zip(offline_runs(run_dir), configs, strict=True):
        (run,) = of_type(records, "run")
        assert run["run_id"] == run_id and run["resume"] and run["project"] == "test"
        assert run["display_name"] == run_dir.name
        recorded = {k: v for k, v in run["config"]["update"].items() if k != "_wandb"}
        assert recorded == json.loads(json.dumps(asdict(cfg)))


def test_a_wandb_failure_is_one_warning_and_the_rest_is_still_written(tmp_path, wandb_home, capsys):
    import wandb

    writer = MetricsWriter(
        tmp_path, 4, enabled=True, tensorboard=False, wandb=WandbConfig(project="test", mode="offline")
    )
    writer.scalars(1, {"train/loss": 2.0})
    wandb.run.finish()  # from outside: W&B refuses whatever the writer logs next
    for step in (2, 3):
        writer.record(step, {"train/loss": 1.0})
        writer.scalars(step, {"train/loss": 1.0})
    writer.text("monitor/rollbacks", "step 3: loss_spike -> step_00000000", 3)
    writer.close()
    err = capsys.readouterr().err
    assert err.count("W&B:") == 1 and "W&B: logging failed (UsageError" in err
    assert "training goes on without W&B" in err
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        2,
        3,
    ]
