"""The monitor at the loop's step boundaries (a `StepHook`): every step reported to the service,
its answers acted on — a rollback applied (`rollback.py`), a stop obeyed — and its verdicts
charted on TensorBoard. The wire to the service (the reporter thread, the broadcast of an answer
to every rank) is `pretrain/monitor_link.py`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from monitoring.protocol import Action, Judgement
from pretrain.monitor_link import MonitorLink
from pretrain.reporting.metrics import MARK_TAGS, MetricsWriter, band_tags
from pretrain.train.hooks import BY_THE_MONITOR, CONTINUE, Answer, Rewind, StepHook, Stop
from pretrain.train.rollback import Rollbacks, Traceable

LR_FACTOR_TAG = "monitor/lr_factor"  # TensorBoard: the monitor's factor on the learning rate
DATA_POSITIONS_KEPT = 1024  # steps back a verdict can be about and still name its windows


@dataclass
class Monitored(StepHook):
    """Named: its state in a checkpoint (train_state.json `hooks.monitor`) is the rollbacks' (the
    newest one's record and the learning rate's scale)."""

    priority = 100  # (the order of the hooks: pretrain/train/hooks.py)

    name = "monitor"
    link: MonitorLink
    rollbacks: Rollbacks  # the run's one way back (the replica check's too)
    task: Traceable
    writer: MetricsWriter
    charted_to: int = 0  # the newest step whose verdict is on TensorBoard
    data_at: dict = field(default_factory=dict)  # step → the data position it started at (recent steps)
    lr_restored_at: int | None = None  # the step the lowered learning rate was lifted at

    def before_step(self, step: int) -> None:
        """Where the data stood as `step` began, for the steps a verdict may still be about."""
        self.data_at[step] = self.task.state_dict()
        for old in [s for s in self.data_at if s <= step - DATA_POSITIONS_KEPT]:
            del self.data_at[old]
        if self.rollbacks.lift_lr(step):
            self.lr_restored_at = step

    def lr_factor(self, step: int) -> float:
        return self.rollbacks.lr.at(step)

    def vote(self) -> float:
        return self.link.pending()  # rank 0 holds an action (about an earlier step) for every rank

    def after_step(self, step: int, metrics: dict, batch_ids: list, vote: float) -> Answer:
        self.link.report(step, metrics, int(metrics["train/tokens"]))  # judged while the next step runs
        if self.lr_factor(step) != 1.0 or self.lr_restored_at == step:
            self.writer.scalars(step, {LR_FACTOR_TAG: self.lr_factor(step)})
        return self.act(step, self.link.take() if vote > 0 else None)  # about an earlier step

    def before_eval(self, step: int) -> Answer:
        """An evaluation is of a step the monitor has judged: a rollback of it comes first, and the
        step's evaluation is left to its re-run."""
        return self.act(step, self.link.verdict(going_on="evaluating"))

    def before_checkpoint(self, step: int, stopping: bool, last: bool) -> Answer:
        """A checkpoint holds only steps the monitor has judged."""
        return self.act(step, self.link.verdict(wait=not stopping, last=last))

    def close(self) -> None:
        self.link.close()

    def act(self, step: int, action: Action | None) -> Answer:
        """The monitor's action at the boundary after `step`; also charts the verdicts that arrived."""
        self.chart_verdicts()
        if action is not None and action.kind == "stop":
            self.writer.message(f"monitor: {action.reason}; stopping the job")
            return Stop(action.reason, BY_THE_MONITOR)
        if action is None or action.rollback is None:
            return CONTINUE
        rollback = action.rollback
        windows = self.task.windows_of(self.data_at[rollback.step]) if rollback.step in self.data_at else []
        state = self.rollbacks.apply(rollback, step, windows)
        self.lr_restored_at = None
        return CONTINUE if state is None else Rewind(state)

    def state_dict(self) -> dict | None:
        return self.rollbacks.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.rollbacks.load_state_dict(state)

    def chart_verdicts(self) -> None:
        """Rank 0: what the monitor judged (every step, at the step it judged): the series with
        its band, and warnings and rollbacks as marks (1 at their step, 0 elsewhere); an expert
        collapse's warning also on the console."""
        for judgement in self.link.judged():
            step, scalars = judgement.step, monitor_scalars(judgement)
            for finding in judgement.findings:  # (once per episode: monitoring/experts.py)
                if finding.get("kind") == "expert_collapse" and judgement.level == "warn":
                    self.writer.message(f"monitor: warning at step {step}: {finding.get('reason')}")
            if step <= self.charted_to:  # a step run again after a rollback: keep the marks it had
                scalars = {k: v for k, v in scalars.items() if k not in MARK_TAGS or v}
            self.charted_to = max(self.charted_to, step)
            self.writer.scalars(step, scalars)


def monitor_scalars(judgement: Judgement) -> dict[str, float]:
    """TensorBoard's `monitor/*` scalars for one judged step."""
    rollback, warning = MARK_TAGS
    judged = {"loss": judgement.loss, "grad_norm": judgement.grad_norm}
    out = _finite(
        {
            "monitor/loss": judgement.loss,
            "monitor/grad_norm": judgement.grad_norm,
            warning: float(judgement.level == "warn"),
            rollback: float(judgement.level == "rollback"),
        }
    )
    for series, value in judged.items():
        out |= in_band(series, value, judgement.bands.get(series) or {})
    return out


def in_band(series: str, value, band: dict) -> dict[str, float]:
    """The Margin chart's three tags of `series` (metrics.py), all or none: TensorBoard draws a
    Margin chart only when its value, lower and upper tags have the same steps, and there is no
    band in the warm-up (nor a value to draw when the judged one is not finite)."""
    value_tag, level_tag, threshold_tag = band_tags(series)
    three = _finite({value_tag: value, level_tag: band.get("level"), threshold_tag: band.get("threshold")})
    return three if len(three) == 3 else {}


def _finite(values: dict) -> dict[str, float]:
    numbers = {k: _number(v) for k, v in values.items()}
    return {k: v for k, v in numbers.items() if v is not None and math.isfinite(v)}


def _number(value) -> float | None:
    try:
        return float(value)  # (a non-finite value arrives as the string "nan" or "inf")
    except (TypeError, ValueError):
        return None
