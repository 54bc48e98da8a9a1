"""The monitor at the loop's step boundaries (a `StepHook`): every step reported to the service,
its answers acted on — a rollback applied (and its windows set aside with `monitor.quarantine`, or
when the service asks it of a repeated rollback, `monitor.on_repeat`, which may also lower the
learning rate for a number of steps), a stop obeyed — and its verdicts charted on TensorBoard. The
trainer's side of the wire (the reporter thread, the broadcast of an action to every rank, loading
the target) is `pretrain/monitor_link.py`."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from monitoring.protocol import Action, Judgement, LrLowered, LrRestored, append_event
from pretrain.checkpoint import tag_for
from pretrain.checkpoint.checkpointer import Checkpointer, TrainState
from pretrain.distributed import DistEnv
from pretrain.metrics import MARK_TAGS, MetricsWriter, band_tags
from pretrain.monitor_link import MonitorLink, apply_rollback
from pretrain.train.hooks import CONTINUE, Answer, Rewind, StepHook, Stop

LR_FACTOR_TAG = "monitor/lr_factor"  # TensorBoard: the monitor's factor on the learning rate
QUARANTINE_FILE = "quarantine.jsonl"  # monitor.quarantine: the windows set aside, one line per rollback
DATA_POSITIONS_KEPT = 1024  # steps back a verdict can be about and still name its windows


class Traceable(Protocol):
    """What a rollback asks of the task beyond its data position (`monitor_link.Rewindable`): the
    windows a step trained on, the documents behind them, and setting windows aside."""

    def state_dict(self) -> dict: ...
    def pause(self) -> None: ...
    def load_state_dict(self, state: dict) -> None: ...
    def reshuffle(self, seed: int) -> None: ...

    def windows_of(self, state: dict) -> list[tuple[int, int]]:
        """The (window id, epoch) of every rank's windows in the step that starts at data position
        `state` (recomputed: the order is deterministic)."""

    def evidence(self, windows: list[int]) -> dict:
        """What a rollback event says about these windows: {"documents": [...]}, or why not."""

    def quarantine(self, entries: list[tuple[int, int]]) -> None:
        """Never serve these (window id, epoch) again in that epoch."""


@dataclass
class Monitored(StepHook):
    """Named: its state in a checkpoint (train_state.json `hooks.monitor`) is the learning rate's
    factor while a repeated rollback has it lowered ({factor, until, decision}); none otherwise."""

    name = "monitor"
    link: MonitorLink
    env: DistEnv
    run_dir: Path
    engine: Any  # a DeepSpeed engine (or anything with its interface)
    task: Traceable
    checkpointer: Checkpointer
    writer: MetricsWriter
    quarantine: bool = False  # monitor.quarantine: a rollback also sets the anomalous step's windows aside
    charted_to: int = 0  # the newest step whose verdict is on TensorBoard
    quarantined: list = field(default_factory=list)  # (window, epoch) set aside by this process's rollbacks
    data_at: dict = field(default_factory=dict)  # step → the data position it started at (recent steps)
    lowered: dict | None = None  # monitor.on_repeat's lower_lr: {factor, until (its last step), decision}
    lr_restored_at: int | None = None  # the step the lowered learning rate was lifted at

    def before_step(self, step: int) -> None:
        """Where the data stood as `step` began, for the steps a verdict may still be about."""
        self.data_at[step] = self.task.state_dict()
        for old in [s for s in self.data_at if s <= step - DATA_POSITIONS_KEPT]:
            del self.data_at[old]
        if self.lowered is not None and step > self.lowered["until"]:
            self.lift_lr(step)

    def lr_factor(self, step: int) -> float:
        return self.lowered["factor"] if self.lowered is not None and step <= self.lowered["until"] else 1.0

    def vote(self) -> float:
        return self.link.pending()  # rank 0 holds an action (about an earlier step) for every rank

    def after_step(self, step: int, metrics: dict, batch_ids: list, vote: float) -> Answer:
        self.link.report(step, metrics, int(metrics["train/tokens"]))  # judged while the next step runs
        if self.lowered is not None or self.lr_restored_at == step:
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
            return Stop(action.reason)
        if action is not None and action.kind == "rollback":
            return self.rollback(step, action)
        return CONTINUE

    def rollback(self, step: int, action: Action) -> Answer:
        """At the boundary after `step`: the monitor's rollback (decided at step `action.step`);
        `CONTINUE` when it is cancelled (no intact checkpoint to go back to)."""
        self.writer.text(
            "monitor/rollbacks",
            f"step {action.step}: {action.reason} -> {action.tag}, "
            f"seed {action.seed} (applied after step {step})",
            action.step or step,
        )
        self.writer.message(
            f"monitor: {action.reason} at step {action.step}: rolling back to {action.tag} "
            f"with data seed {action.seed}, lr scale {action.lr_scale:g}"
            + (f" (a repeated rollback: monitor.on_repeat's {action.stage})" if action.stage else "")
        )
        windows = self.task.windows_of(self.data_at[action.step]) if action.step in self.data_at else []
        evidence = self.task.evidence([w for w, _ in windows]) if self.env.is_main else {}
        state = apply_rollback(action, step, self.engine, self.task, self.checkpointer, evidence)
        if state is not None and (self.quarantine or action.quarantine) and windows:
            self.quarantine_windows(action, windows, evidence)
        if state is None:
            reason = f"no intact checkpoint at or before {action.tag}"
            self.writer.message(f"monitor: {reason}: rollback cancelled")
            self.link.resolved(action, step, None, reason)
            return CONTINUE
        state = self.lower_lr(action, state)
        self.link.resolved(action, step, tag_for(state.step))
        return Rewind(state)

    # ------------------------------------------------------- the lowered learning rate (on_repeat)

    def lower_lr(self, action: Action, state: TrainState) -> TrainState:
        """After a rollback to `state`: the learning rate times the action's factor for its steps
        after the target (the state the loop rewinds to holds it, so the loop gives it back to this
        hook); without one, the target checkpoint's own (if it held a lowered rate, the loop gives
        it back), else none."""
        self.lowered, self.lr_restored_at = None, None
        if action.lr_factor is None:
            return state
        until = state.step + (action.lr_factor_steps or 0)
        self.lowered = {"factor": action.lr_factor, "until": until, "decision": action.decision}
        if self.env.is_main:
            append_event(
                self.run_dir,
                LrLowered(step=state.step, decision=action.decision, factor=action.lr_factor, until=until),
            )
        self.writer.message(
            f"monitor: rollback {action.decision} repeats earlier ones: learning rate x{action.lr_factor:g} "
            f"for steps {state.step + 1}..{until}"
        )
        return dataclasses.replace(state, hooks=state.hooks | {self.name: self.state_dict()})

    def lift_lr(self, step: int) -> None:
        """The lowered learning rate's last step is behind: the schedule's again from `step`."""
        lowered, self.lowered, self.lr_restored_at = self.lowered, None, step
        if self.env.is_main:
            append_event(
                self.run_dir, LrRestored(step=step, decision=lowered["decision"], factor=lowered["factor"])
            )
        self.writer.message(
            f"monitor: learning rate back on its schedule from step {step} "
            f"(x{lowered['factor']:g} through step {lowered['until']})"
        )

    def state_dict(self) -> dict | None:
        return dict(self.lowered) if self.lowered is not None else None

    def load_state_dict(self, state: dict) -> None:
        self.lowered = {
            "factor": float(state["factor"]),
            "until": int(state["until"]),
            "decision": state.get("decision"),
        }

    def quarantine_windows(self, action: Action, windows: list[tuple[int, int]], evidence: dict) -> None:
        """Quarantine the anomalous step's windows (and those of earlier rollbacks, which an older
        checkpoint's position does not hold yet); rank 0 lists them in RUN_DIR/quarantine.jsonl."""
        self.quarantined += [w for w in windows if w not in self.quarantined]
        self.task.quarantine(self.quarantined)
        if self.env.is_main:
            record = {"step": action.step, "decision": action.decision, "windows": [list(w) for w in windows]}
            with open(self.run_dir / QUARANTINE_FILE, "a") as f:
                f.write(json.dumps(evidence | record) + "\n")  # (windows with their epochs)
            self.writer.message(
                f"monitor: {len(windows)} windows of step {action.step} set aside for their epoch"
            )

    def chart_verdicts(self) -> None:
        """Rank 0: what the monitor judged (every step, at the step it judged): the series with
        its band, and warnings and rollbacks as marks (1 at their step, 0 elsewhere)."""
        for judgement in self.link.judged():
            step, scalars = judgement.step, monitor_scalars(judgement)
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
