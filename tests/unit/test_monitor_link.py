"""The trainer's side of the monitor in this process: the action broadcast, the client, and the loop
with the real service (its HTTP server on a thread here; as its own process in the integration
tier) ordering a rollback, which the trainer applies, or a stop."""

import json
import threading

import pytest

from monitoring.protocol import CONTINUE, Action, StepMetrics, read_events
from monitoring.service import serve
from pretrain.checkpoint import checkpoints_dir, newest_complete, pinned
from pretrain.config import MonitorConfig, load_config
from pretrain.monitor_link import MonitorClient, broadcast_action
from tests.helpers import FAST, TINY
from tests.unit.fakes import pretraining_trainer

MONITOR = ["monitor.enabled=true", "monitor.warmup=4", "monitor.window=16", "eval.every=0"]


@pytest.mark.parametrize(
    "action",
    [
        CONTINUE,
        Action("rollback", tag="step_00000012", seed=1_000_003, lr_scale=0.5, reason="grad_norm spike"),
        Action("stop", reason="circuit breaker: 3 rollbacks made no progress past step 9"),
    ],
    ids=["continue", "rollback", "stop"],
)
def test_every_action_survives_the_broadcast(action):
    assert broadcast_action(action, "cpu") == action


def test_ranks_without_the_answer_still_act():
    # Other ranks pass None and receive rank 0's action; alone, None means there was no answer.
    assert broadcast_action(None, "cpu") == CONTINUE


@pytest.fixture
def service(tmp_path):
    """The monitoring service for tmp_path, serving on a thread of this process."""
    server, state = serve(tmp_path, MonitorConfig(warmup=4, window=16, max_rollbacks=1))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state
    server.shutdown()
    server.server_close()


def test_the_client_reports_and_reads_the_bands(service, tmp_path):
    client = MonitorClient(tmp_path)
    for step in range(1, 6):
        action = client.report(StepMetrics(step, 3.0, 1.0 + 0.01 * step, 1e-3, 0.1, step * 100))
    assert action == CONTINUE and client.band("grad_norm") > 1.0 and client.band("loss") > 3.0
    assert [e["step"] for e in read_events(tmp_path) if e["type"] == "step"] == [1, 2, 3, 4, 5]


def test_the_client_goes_on_when_the_service_is_gone_and_finds_it_again(tmp_path, capsys):
    client = MonitorClient(tmp_path, timeout=0.5)
    assert client.report(StepMetrics(1, 3.0, 1.0, 1e-3, 0.1, 100)) == CONTINUE
    assert client.report(StepMetrics(2, 3.0, 1.0, 1e-3, 0.1, 200)) == CONTINUE
    err = capsys.readouterr().err
    assert err.count("monitor unreachable") == 1 and "at step 1" in err  # warned once
    server, _ = serve(tmp_path, MonitorConfig())  # (re)started: a new endpoint file is read
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert client.report(StepMetrics(3, 3.0, 1.0, 1e-3, 0.1, 300)) == CONTINUE
        assert "monitor reachable again at step 3" in capsys.readouterr().err
    finally:
        server.shutdown()
        server.server_close()


def config(run_dir, data_dir, *overrides):
    return load_config(TINY, [*FAST, f"run.dir={run_dir}", f"data.dir={data_dir}", *MONITOR, *overrides])


def test_a_spike_is_rolled_back_to_a_healthy_checkpoint_with_reshuffled_data(
    service, tmp_path, train_data, capsys
):
    trainer = pretraining_trainer(config(tmp_path, train_data, "train.steps=10", "checkpoint.every=3",
                                         "faults.spike_steps=[8]", "logging.data_trace=true"))  # fmt: skip
    summary = trainer.train()
    assert summary["completed"] and summary["step"] == 10 and summary["rollbacks"] == 1
    assert "rolling back to step_00000006" in capsys.readouterr().out
    log = read_events(tmp_path)
    assert [e["step"] for e in log if e["type"] == "step"] == [1, 2, 3, 4, 5, 6, 7, 8, 7, 8, 9, 10]
    (ordered,) = [e for e in log if e["type"] == "rollback"]
    assert (
        ordered["step"] == 8
        and ordered["target"] == "step_00000006"
        and ordered["reason"] == "grad_norm spike"
    )
    (applied,) = [e for e in log if e["type"] == "rollback_applied"]
    assert applied["step"] == 6 and applied["matches_checkpoint"] and applied["seed"] == ordered["seed"]
    # The data position is an uninterrupted run's; the order after the target was reshuffled.
    state = json.loads((checkpoints_dir(tmp_path) / "step_00000009" / "train_state.json").read_text())["data"]
    assert state["consumed"] == 18 and [start for start, _ in state["epoch_seeds"]] == [0, 12]
    trace = [
        json.loads(line) for line in (tmp_path / "data_trace" / "rank_00000.jsonl").read_text().splitlines()
    ]
    tries_of_7 = [r["windows"] for r in trace if r["step"] == 7]
    assert len(tries_of_7) == 2 and tries_of_7[0] != tries_of_7[1]
    assert "step_00000009" in pinned(tmp_path)  # the monitor pins the next rollback's target


def test_the_circuit_breaker_stops_the_run_and_nothing_after_the_refused_state_is_saved(
    service, tmp_path, train_data, capsys
):
    """Step 6 fails twice (a NaN, rolled back, then a spike at the same step): with max_rollbacks=1
    the second failure stops the run."""
    trainer = pretraining_trainer(config(tmp_path, train_data, "train.steps=10", "checkpoint.every=4",
                                         "faults.nan_steps=[6]", "faults.spike_steps=[6]"))  # fmt: skip
    summary = trainer.train()
    assert not summary["completed"] and "circuit breaker" in summary["stopped_by_monitor"]
    assert "stopping the job" in capsys.readouterr().out
    assert newest_complete(tmp_path) == "step_00000004"
    assert [e["type"] for e in read_events(tmp_path) if e["type"] != "step"] == [
        "rollback", "rollback_applied", "circuit_breaker"
    ]  # fmt: skip


def test_without_a_service_the_run_goes_on(tmp_path, train_data, capsys):
    summary = pretraining_trainer(config(tmp_path, train_data, "train.steps=3", "checkpoint.every=3")).train()
    assert summary["completed"] and summary["rollbacks"] == 0
    assert capsys.readouterr().err.count("monitor unreachable at step 1") == 1
