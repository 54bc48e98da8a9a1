"""The trainer's side of the monitor in this process: the action broadcast, the client, and the loop
with the real service (its HTTP server on a thread here; as its own process in the integration
tier) ordering a rollback, which the trainer applies, or a stop."""

import contextlib
import json
import threading
import time

import pytest

from monitoring.protocol import CONTINUE, Action, Rollback, StepMetrics, read_events
from monitoring.service import serve
from pretrain.checkpoint import checkpoints_dir, newest_complete, pinned
from pretrain.config import MonitorConfig, load_config
from pretrain.monitor_link import Reporter, broadcast_action
from tests.helpers import FAST, TINY
from tests.unit.fakes import pretraining_trainer

MONITOR = ["monitor.enabled=true", "monitor.warmup=4", "monitor.window=16", "eval.every=0"]


@pytest.mark.parametrize(
    "action",
    [
        CONTINUE,
        Action(
            "rollback",
            rollback=Rollback(
                decision=3,
                step=14,
                target="step_00000012",
                seed=1_000_003,
                lr_scale=0.5,
                reason="grad_norm surge",
                finding="grad_norm_surge",
                value=80.5,
                threshold=1.7,
            ),
        ),
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


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def said(capsys, text: str, timeout: float = 60.0) -> str:
    """Stderr up to the moment it says `text`: the reporter's thread prints its lines on its own
    schedule (after it has woken a waiting drain(), say), so one read right after may miss them."""
    err = []

    def says() -> bool:
        err.append(capsys.readouterr().err)
        return text in "".join(err)

    wait_for(says, timeout)
    return "".join(err)


def test_the_reporter_posts_in_the_background_and_keeps_the_answers(service, tmp_path):
    reporter = Reporter(tmp_path)
    try:
        for step in range(1, 6):
            reporter.report(
                StepMetrics(
                    step=step,
                    loss=3.0,
                    grad_norm=1.0 + 0.01 * step,
                    lr=1e-3,
                    step_time=0.1,
                    tokens=step * 100,
                    total_steps=50,
                )
            )
        assert reporter.drain(10)
        answers = reporter.answered()
        assert [a.step for a in answers] == [1, 2, 3, 4, 5]
        assert answers[-1].bands["grad_norm"]["threshold"] > 1.0 and not reporter.pending()
        assert [e.step for e in read_events(tmp_path) if e.type == "step"] == [1, 2, 3, 4, 5]
        assert service.status()["total_steps"] == 50
    finally:
        reporter.close()


def test_reports_wait_for_a_service_that_is_away_and_are_all_judged_when_it_is_back(tmp_path, capsys):
    reporter = Reporter(tmp_path, timeout=0.5)
    try:
        for step in (1, 2, 3):
            reporter.report(
                StepMetrics(step=step, loss=3.0, grad_norm=1.0, lr=1e-3, step_time=0.1, tokens=step * 100)
            )
        assert not reporter.drain(0.5) and reporter.waiting() == 3  # kept, not dropped
        err = said(capsys, "monitor unreachable")
        assert err.count("monitor unreachable") == 1 and "at step 1" in err  # warned once
        server, _ = serve(tmp_path, MonitorConfig())  # (re)started: a new endpoint file is read
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            reporter.report(StepMetrics(step=4, loss=3.0, grad_norm=1.0, lr=1e-3, step_time=0.1, tokens=400))
            assert reporter.drain(10)
            assert [e.step for e in read_events(tmp_path) if e.type == "step"] == [1, 2, 3, 4]
            said(capsys, "monitor reachable again: every step since 1 judged")
        finally:
            server.shutdown()
            server.server_close()
    finally:
        reporter.close()


def test_a_report_sent_again_is_answered_without_being_judged_twice(service, tmp_path):
    from monitoring.protocol import parse_report

    report = StepMetrics(step=1, loss=3.0, grad_norm=1.0, lr=1e-3, step_time=0.1, tokens=100).to_json() | {
        "session": "s1",
        "seq": 1,
    }
    first = service.handle_metrics(*parse_report(report))
    again = service.handle_metrics(*parse_report(report))
    assert again == first and [e.step for e in read_events(tmp_path) if e.type == "step"] == [1]


def config(run_dir, data_dir, *overrides):
    return load_config(TINY, [*FAST, f"run.dir={run_dir}", f"data.dir={data_dir}", *MONITOR, *overrides])


def test_a_spike_is_rolled_back_to_a_healthy_checkpoint_with_reshuffled_data(
    service, tmp_path, train_data, capsys
):
    trainer = pretraining_trainer(
        config(
            tmp_path,
            train_data,
            "train.steps=10",
            "checkpoint.every=3",
            "faults.spike_steps=[8]",
            "logging.data_trace=true",
        )
    )
    summary = trainer.train()
    assert summary["completed"] and summary["step"] == 10 and summary["rollbacks"] == 1
    assert "rolling back to step_00000006" in capsys.readouterr().out
    log = read_events(tmp_path)
    (ordered,) = [e for e in log if e.type == "rollback"]
    assert ordered.step == 8 and ordered.target == "step_00000006" and ordered.finding == "loss_spike"
    (applied,) = [e for e in log if e.type == "rollback_applied"]
    assert applied.step == 6 and applied.matches_checkpoint and applied.seed == ordered.seed
    assert applied.decision == ordered.decision and applied.decided_at == 8 and applied.applied_at >= 8
    # Every step ran once up to where the rollback was applied (one step or so after the spike),
    # then again from the target on.
    steps = [e.step for e in log if e.type == "step"]
    assert steps == [*range(1, applied.applied_at + 1), 7, 8, 9, 10]
    assert service.status()["rollbacks"][0]["decision"] == ordered.decision  # counted once applied
    # TensorBoard (read with its own reader): every judged step is charted, at the step judged;
    # the rollback is a mark at step 8; the Custom Scalars charts name exactly the monitor's tags.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2

    from pretrain.reporting.metrics import tensorboard_dir

    board = EventAccumulator(str(tensorboard_dir(tmp_path)), size_guidance={"scalars": 0, "tensors": 0})
    board.Reload()
    judged = board.Scalars("monitor/grad_norm")
    assert sorted({e.step for e in judged}) == list(range(1, 11))
    marks = [(e.step, e.value) for e in board.Scalars("monitor/rollback")]
    assert [step for step, value in marks if value] == [8] and [s for s, _ in marks] == list(range(1, 11))
    assert {e.step for e in board.Scalars("monitor/grad_norm_threshold")} >= set(
        range(5, 11)
    )  # after warm-up
    layout = layout_pb2.Layout()
    layout.ParseFromString(board.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    charts = {c.title: c for category in layout.category for c in category.chart}
    grad_chart = next(c for title, c in charts.items() if title.startswith("gradient norm"))
    series = grad_chart.margin.series[0]
    assert (series.value, series.lower, series.upper) == (
        "monitor/grad_norm_in_band",
        "monitor/grad_norm_level",
        "monitor/grad_norm_threshold",
    )
    marks_chart = next(c for title, c in charts.items() if title.startswith("rollbacks"))
    assert list(marks_chart.multiline.tag) == ["^monitor/rollback$", "^monitor/warning$"]
    # The data position is an uninterrupted run's; the order after the target was reshuffled.
    state = json.loads((checkpoints_dir(tmp_path) / "step_00000009" / "train_state.json").read_text())["data"]
    assert state["consumed"] == 18 and [start for start, _ in state["epoch_seeds"]] == [0, 12]
    trace = [
        json.loads(line) for line in (tmp_path / "data_trace" / "rank_00000.jsonl").read_text().splitlines()
    ]
    tries_of_7 = [r["windows"] for r in trace if r["step"] == 7]
    assert len(tries_of_7) == 2 and tries_of_7[0] != tries_of_7[1]
    assert "step_00000009" in pinned(tmp_path)  # the monitor pins the next rollback's target


def test_a_step_the_monitor_rolls_back_is_not_evaluated(service, tmp_path, train_data, capsys):
    """The spike at step 8, an evaluation step (not a checkpoint's): the evaluation waits for the
    verdicts, the rollback comes first, and only the re-run step 8 is evaluated: one line, one
    entry in the summary, one point on TensorBoard."""
    summary = pretraining_trainer(
        config(
            tmp_path,
            train_data,
            "train.steps=10",
            "checkpoint.every=3",
            "eval.every=8",
            "faults.spike_steps=[8]",
        )
    ).train()
    out = capsys.readouterr().out
    assert summary["rollbacks"] == 1 and "rolling back to step_00000006" in out
    assert out.count("eval at step 8:") == 1 and out.index("rolling back") < out.index("eval at step 8:")
    assert [e["step"] for e in summary["eval"]] == [0, 8, 10]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from pretrain.reporting.metrics import tensorboard_dir

    board = EventAccumulator(str(tensorboard_dir(tmp_path)), size_guidance={"scalars": 0})
    board.Reload()
    assert [e.step for e in board.Scalars("eval/loss")] == [0, 8, 10]


def test_the_circuit_breaker_stops_the_run_and_nothing_after_the_refused_state_is_saved(
    service, tmp_path, train_data, capsys
):
    """Step 6 fails twice (a NaN, rolled back, then a spike at the same step): with max_rollbacks=1
    the second failure stops the run."""
    trainer = pretraining_trainer(
        config(
            tmp_path,
            train_data,
            "train.steps=10",
            "checkpoint.every=4",
            "faults.nan_steps=[6]",
            "faults.spike_steps=[6]",
        )
    )
    summary = trainer.train()
    assert not summary["completed"] and "circuit breaker" in summary["stopped_by_monitor"]
    assert "stopping the job" in capsys.readouterr().out
    assert newest_complete(tmp_path) == "step_00000004"
    assert [e.type for e in read_events(tmp_path) if e.type not in ("step", "warning")] == [
        "rollback",
        "rollback_applied",
        "circuit_breaker",
    ]


def test_without_a_service_the_run_goes_on_and_never_applies_a_nan(tmp_path, train_data, capsys):
    import math

    import torch

    cfg = config(
        tmp_path,
        train_data,
        "train.steps=4",
        "checkpoint.every=4",
        "monitor.timeout=0.1",
        "faults.nan_steps=[2]",
    )
    trainer = pretraining_trainer(cfg)
    summary = trainer.train()
    assert summary["completed"] and summary["rollbacks"] == 0
    err = capsys.readouterr().err
    assert err.count("monitor unreachable at step 1") == 1 and "saving the checkpoint all the same" in err
    steps = {r["step"]: r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())}
    assert math.isnan(steps[2]["train/loss"]) and steps[4]["train/skipped_steps"] == 1  # the step was skipped
    assert all(torch.isfinite(p).all() for p in trainer.engine.module.parameters())


@contextlib.contextmanager
def service_with(run_dir, **settings):
    """The monitoring service for `run_dir` with these monitor settings, on a thread."""
    server, state = serve(run_dir, MonitorConfig(warmup=4, window=16, **settings))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()


def test_a_rollback_with_no_intact_checkpoint_is_cancelled_by_the_trainer_and_the_run_goes_on(
    tmp_path, train_data, capsys
):
    """The service picks step_00000005 (complete by its sizes); the trainer finds its files changed
    (faults.corrupt_checkpoint_step), sets it aside, has nothing older, cancels with the reason,
    and trains on; the service records the decision as cancelled, not as a rollback."""
    with service_with(tmp_path) as service:
        summary = pretraining_trainer(
            config(
                tmp_path,
                train_data,
                "train.steps=10",
                "checkpoint.every=5",
                "faults.corrupt_checkpoint_step=6",
                "faults.spike_steps=[7]",
            )
        ).train()
        status = service.status()
    assert summary["completed"] and summary["step"] == 10 and summary["rollbacks"] == 0
    assert "no intact checkpoint at or before step_00000005: rollback cancelled" in capsys.readouterr().out
    log = read_events(tmp_path)
    assert [e.type for e in log if e.type not in ("step", "warning")] == [
        "rollback",
        "checkpoint_corrupt",
        "rollback_cancelled",
    ]
    (cancelled,) = [e for e in log if e.type == "rollback_cancelled"]
    assert cancelled.tag == "step_00000005" and cancelled.decided_at == 7
    assert status["rollbacks"] == [] and [c["decision"] for c in status["rollbacks_cancelled"]] == [
        cancelled.decision
    ]
    assert [e.step for e in log if e.type == "step"] == list(range(1, 11))  # nothing trained twice


def test_a_finding_answered_with_stop_ends_the_run_at_once_without_saving_the_refused_state(
    tmp_path, train_data, capsys
):
    """monitor.on_loss_spike=stop: the spike's verdict is the stop; the loop ends at the boundary
    where it arrives, saves nothing after the refused state, and says why."""
    with service_with(tmp_path, on_loss_spike="stop"):
        summary = pretraining_trainer(
            config(
                tmp_path,
                train_data,
                "train.steps=10",
                "checkpoint.every=4",
                "faults.spike_steps=[6]",
                "monitor.on_loss_spike=stop",
            )
        ).train()
    assert not summary["completed"] and summary["stopped_by_monitor"].startswith("loss")
    assert "stopping the job" in capsys.readouterr().out
    assert newest_complete(tmp_path) == "step_00000004"
    assert [e.type for e in read_events(tmp_path) if e.type == "rollback"] == []
