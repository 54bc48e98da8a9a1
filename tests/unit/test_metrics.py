"""What rank 0 writes for TensorBoard and the run summary, read back with TensorBoard's own readers
(EventAccumulator, EventMultiplexer, the Custom Scalars layout): the monitor's charts, the run's
name, and the summary's counts over every attempt of a run."""

import json
import time
from types import SimpleNamespace

from monitoring.protocol import (
    Judgement,
    Restart,
    RollbackApplied,
    RollbackCancelled,
    RollbackDecided,
    StepJudged,
    StepMetrics,
    append_event,
)
from monitoring.service import MonitorState
from pretrain.config import MonitorConfig, load_config
from pretrain.reporting.metrics import MetricsWriter, tensorboard_dir
from pretrain.run_dir import start_over
from pretrain.train.loop import run_history
from pretrain.train.monitor_hook import Monitored
from tests.helpers import FAST, TINY
from tests.unit.fakes import pretraining_trainer


class Judged:
    """The monitor link as `Monitored.chart_verdicts` uses it: the service's answers since the last call."""

    def __init__(self):
        self.answers = []

    def judged(self) -> list[dict]:
        answers, self.answers = self.answers, []
        return answers


def charting_hook(run_dir, writer, monitor) -> Monitored:
    """The monitor's step hook with only what charting the verdicts uses."""
    return Monitored(link=monitor, rollbacks=None, task=None, writer=writer)


def board(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(tensorboard_dir(run_dir)), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def test_every_margin_chart_has_its_value_and_band_at_the_same_steps(tmp_path):
    """TensorBoard draws a Margin chart only when its value, lower and upper tags share their steps
    (else: "The steps for value, lower, and upper tags do not match"). The real service judges a
    warm-up (no band), a NaN loss (a band, no value to draw), and steps run again after a rollback."""
    from tensorboard.plugins.custom_scalar import layout_pb2

    service, monitor = MonitorState(tmp_path, MonitorConfig(warmup=4, window=16)), Judged()
    writer = MetricsWriter(tmp_path, 10, enabled=True)
    writer.band_layout()
    hook = charting_hook(tmp_path, writer, monitor)
    # The losses reported between two step boundaries; after step 9, a rollback to 6: 7.. run again.
    boundaries = [
        {step: 3.0 - 0.01 * step for step in range(1, 6)},
        {6: 2.94, 7: 2.93, 8: float("nan"), 9: 2.91},
        {step: 2.9 for step in range(7, 11)},
    ]
    for losses in boundaries:
        for step, loss in losses.items():
            metrics = StepMetrics(
                step=step, loss=loss, grad_norm=1.0 + 0.01 * step, lr=1e-3, step_time=0.1, tokens=100 * step
            )
            monitor.answers.append(Judgement.from_answer(service.handle_metrics(metrics)))
        hook.chart_verdicts()
    writer.close()
    events = board(tmp_path)
    layout = layout_pb2.Layout()
    layout.ParseFromString(events.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    margins = [s for c in layout.category for chart in c.chart for s in chart.margin.series]
    assert len(margins) == 2
    for series in margins:
        steps = [[e.step for e in events.Scalars(tag)] for tag in (series.value, series.lower, series.upper)]
        assert steps[0] == steps[1] == steps[2], (series.value, steps)
        assert steps[0][0] == 4  # from the first step with a band (monitor.warmup=4)
    assert [e.step for e in events.Scalars("monitor/loss_in_band")] == [4, 5, 6, 7, 9, 7, 8, 9, 10]  # no NaN
    # The values judged and the marks stay at every judged step, warm-up included.
    judged = [e.step for e in events.Scalars("monitor/grad_norm")]
    assert judged == [*range(1, 10), *range(7, 11)]
    assert [e.step for e in events.Scalars("monitor/rollback")] == [*range(1, 10), 10]  # (re-run: marks kept)


def test_tensorboard_names_the_run_after_its_directory(tmp_path, monkeypatch):
    """`tensorboard --logdir RUN_DIR/tensorboard` shows the run by name (not "."), `--logdir runs/`
    tells runs apart; a run resumed from the older layout (event files in RUN_DIR/tensorboard itself)
    goes on, shown as two runs."""
    from tensorboard.backend.event_processing.plugin_event_multiplexer import EventMultiplexer
    from tensorboard.summary.writer import event_file_writer
    from torch.utils.tensorboard import SummaryWriter

    def runs(logdir) -> list[str]:
        multiplexer = EventMultiplexer().AddRunsFromDirectory(str(logdir))
        multiplexer.Reload()
        return sorted(multiplexer.Runs())

    run_dir = tmp_path / "runs" / "125m"
    run_dir.mkdir(parents=True)
    clock = time.time
    for step, given in ((1, run_dir), (2, ".")):  # two starts of the run, the second as run.dir=.
        monkeypatch.chdir(run_dir if given == "." else tmp_path)
        # Starts seconds apart, as two processes' are: event files sort by their start time, then
        # by a per-process counter whose "10" sorts before "9" after earlier tests' writers.
        monkeypatch.setattr(
            event_file_writer, "time", SimpleNamespace(time=lambda step=step: clock() + 10 * step)
        )
        writer = MetricsWriter(given, 2, enabled=True)
        writer.scalars(step, {"train/loss": 3.0 / step})
        writer.close()
    assert runs(run_dir / "tensorboard") == ["125m"]
    assert runs(tmp_path / "runs") == ["125m/tensorboard/125m"]
    assert [e.step for e in board(run_dir).Scalars("train/loss")] == [1, 2]
    older = tmp_path / "older"
    older.mkdir()
    earlier = SummaryWriter(log_dir=str(older / "tensorboard"))
    earlier.add_scalar("train/loss", 3.0, 1)
    earlier.close()
    resumed = MetricsWriter(older, 2, enabled=True)
    resumed.scalars(2, {"train/loss": 2.5})
    resumed.close()
    assert runs(older / "tensorboard") == [".", "older"]


def summary_config(run_dir, data_dir):
    return load_config(
        TINY,
        [
            *FAST,
            f"run.dir={run_dir}",
            f"data.dir={data_dir}",
            "train.steps=1",
            "checkpoint.every=1",
            "eval.every=0",
        ],
    )


def test_the_summary_counts_the_rollbacks_and_restarts_of_every_attempt(tmp_path, train_data):
    """An earlier attempt rolled a spike back, then the supervisor restarted a killed rank: this
    attempt's own process applied no rollback, and its summary still counts the run's (but the
    rollback decided or cancelled); --fresh moves those events aside with the rest of the run."""
    earlier = [
        StepJudged(step=8, loss=9.0, grad_norm=1.0, action="rollback", level="rollback"),
        RollbackDecided(
            step=8,
            decision=1,
            reason="loss spike",
            finding="loss_spike",
            value=9.0,
            threshold=4.0,
            target="step_00000006",
            seed=1,
            lr_scale=1.0,
        ),
        RollbackApplied(
            step=6,
            tag="step_00000006",
            requested="step_00000006",
            seed=1,
            decision=1,
            decided_at=8,
            applied_at=9,
            matches_checkpoint=True,
            abandoned=[],
        ),
        RollbackCancelled(step=9, decision=2, reason="no intact checkpoint"),
        Restart(step=11, reason="exit status 1", restart=1, max_restarts=3, resume_from="step_00000010"),
    ]
    for event in earlier:
        append_event(tmp_path, event)
    summary = pretraining_trainer(summary_config(tmp_path, train_data)).train()
    assert summary["completed"] and summary["rollbacks"] == 1 and summary["restarts"] == 1
    assert json.loads((tmp_path / "train_summary.json").read_text()) == summary
    start_over(tmp_path)  # what --fresh does before the next start
    assert run_history(tmp_path) == {"rollbacks": 0, "restarts": 0}
