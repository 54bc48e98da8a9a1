"""Applying every rollback, on every rank at the same step boundary (docs/monitoring.md): the
monitor's (`monitor_hook.py`) and the replica check's (`replica_hook.py`), one `Rollbacks` for both.

`Rollbacks.apply` takes the decision's record (`monitoring.protocol.Rollback`) and does all of it:
load the target checkpoint (verified first; the next older intact one if it is not), move the
abandoned timeline aside, put the data stream at the target's position and reshuffle the rest of
the epoch with the decision's seed (none: the same order), set the anomalous step's windows aside
(`monitor.quarantine`, or the decision's `quarantine`), take the decision's learning-rate scale,
record `rollback_applied` or `rollback_cancelled` (and `lr_lowered`), and tell the service the
outcome. A decision the trainer made itself (the replica check's: no `decision` number) is also
written as its `rollback` event here; the service writes its own decisions'.

The monitor's one factor on the learning rate is an `LrScale`: the newest rollback's `lr_scale`,
times a repeated rollback's `lr_factor` through its last lowered step. Checkpoints keep it with
the record of the rollback it came from (train_state.json `hooks.monitor`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from monitoring.protocol import (
    LrLowered,
    LrRestored,
    Outcome,
    Rollback,
    RollbackApplied,
    RollbackCancelled,
    RollbackDecided,
    append_event,
)
from pretrain.checkpoint import abandon_after, step_of, tag_for, trim_abandoned
from pretrain.checkpoint.checkpointer import Checkpointer, TrainState
from pretrain.parallel.distributed import DistEnv, barrier
from pretrain.reporting.metrics import MetricsWriter

QUARANTINE_FILE = "quarantine.jsonl"  # the windows set aside, one line per rollback


class Traceable(Protocol):
    """What a rollback asks of the task: its data position, the windows a step trained on, the
    documents behind them, and setting windows aside."""

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


def decider(rollback: Rollback) -> str:
    """Who decided a rollback, as the console names it: the monitor (its decisions are numbered),
    or the trainer's check that found it (`finding`: "replica_mismatch" → "replica mismatch")."""
    return "monitor" if rollback.decision is not None else rollback.finding.replace("_", " ")


class Outcomes(Protocol):
    """Where a rollback's outcome goes: the service (`pretrain.monitor_link.MonitorLink`)."""

    def outcome(self, outcome: Outcome) -> None: ...


def go_back(
    tag: str, env: DistEnv, run_dir: Path, engine: Any, task: Traceable, checkpointer: Checkpointer
) -> tuple[dict, bool | None, list[str]] | None:
    """Every rank: load checkpoint `tag` (the next older intact one if it does not verify), move
    the checkpoints after it aside (rank 0: the abandoned timeline's tags, else []) and put the
    data at its position. Its train_state.json, whether the weights loaded match those saved, the
    abandoned tags; None when no intact checkpoint is left at or before `tag`."""
    task.pause()
    loaded = checkpointer.load(engine, tag)
    if loaded is None:
        return None
    saved, matches = loaded
    barrier()  # every rank has read the target before newer checkpoints move away
    abandoned = []
    if env.is_main:
        abandoned = abandon_after(run_dir, saved["step"])
        trim_abandoned(run_dir)
    task.load_state_dict(saved["data"])
    return saved, matches, abandoned


@dataclass(frozen=True)
class LrScale:
    """The monitor's factor on the learning rate: `scale` (the newest rollback's lr_scale), times
    `factor` through step `until` (a repeated rollback's lower_lr; 1.0 when none is in force)."""

    scale: float = 1.0
    factor: float = 1.0
    until: int = 0
    decision: int | None = None  # the rollback that lowered it

    def at(self, step: int) -> float:
        return self.scale * self.factor if step <= self.until else self.scale

    @property
    def lowered(self) -> bool:
        return self.factor != 1.0


@dataclass
class Rollbacks:
    """Every rank: the rollbacks applied by this process, and the learning rate's scale."""

    env: DistEnv
    run_dir: Path
    engine: Any  # a DeepSpeed engine (or anything with its interface)
    task: Traceable
    checkpointer: Checkpointer
    link: Outcomes | None  # rank 0's way to the service (None: nobody to tell)
    writer: MetricsWriter
    quarantine: bool = False  # monitor.quarantine: every rollback sets the anomalous step's windows aside
    lr: LrScale = field(default_factory=LrScale)
    record: dict | None = None  # the newest applied rollback's record, as checkpoints keep it
    quarantined: list = field(default_factory=list)  # (window, epoch) set aside by this process

    def apply(self, rollback: Rollback, applied_at: int, windows: list[tuple[int, int]]) -> TrainState | None:
        """At the boundary after step `applied_at`: the rollback, `windows` being the anomalous
        step's; the state to go on from, or None when it is cancelled (no intact checkpoint at or
        before its target)."""
        self.announce(rollback, applied_at)
        evidence = self.task.evidence([w for w, _ in windows]) if self.env.is_main else {}
        decided = {"decision": rollback.decision, "decided_at": rollback.step, "applied_at": applied_at}
        loaded = go_back(rollback.target, self.env, self.run_dir, self.engine, self.task, self.checkpointer)
        if loaded is None:
            reason = f"no intact checkpoint at or before {rollback.target}"
            self.writer.message(f"{decider(rollback)}: {reason}: rollback cancelled")
            if self.env.is_main:
                cancelled = RollbackCancelled(
                    step=step_of(rollback.target), tag=rollback.target, reason=reason, **decided, **evidence
                )
                append_event(self.run_dir, cancelled)
            self.tell(rollback, applied_at, None, reason)
            return None
        saved, matches, abandoned = loaded
        if self.env.is_main:
            applied = RollbackApplied(
                step=saved["step"],
                tag=tag_for(saved["step"]),
                requested=rollback.target,
                seed=rollback.seed,
                matches_checkpoint=matches,
                abandoned=abandoned,
                **decided,
                **evidence,
            )
            append_event(self.run_dir, applied)
        if rollback.seed is not None:
            self.task.reshuffle(rollback.seed)
        if (self.quarantine or rollback.quarantine) and windows:
            self.set_aside(rollback, windows, evidence)
        hooks = saved.get("hooks", {})
        self.load_state_dict(hooks.get("monitor") or {})  # (a lowered rate the target held goes on)
        self.take_lr(rollback, saved["step"])
        self.tell(rollback, applied_at, tag_for(saved["step"]))
        return TrainState(
            step=saved["step"], tokens=saved["tokens"], hooks=hooks | {"monitor": self.state_dict()}
        )

    def announce(self, rollback: Rollback, applied_at: int) -> None:
        """Every rollback on TensorBoard (`monitor/rollbacks`); the service's on the console (the
        replica check says its own finding), the trainer's own as its `rollback` event."""
        seed = "the same data order" if rollback.seed is None else f"seed {rollback.seed}"
        self.writer.text(
            "monitor/rollbacks",
            f"step {rollback.step}: {rollback.reason} -> {rollback.target}, {seed} (applied after step {applied_at})",
            rollback.step,
        )
        if rollback.decision is None:
            if self.env.is_main:
                append_event(self.run_dir, RollbackDecided(**dataclasses.asdict(rollback)))
            return
        self.writer.message(
            f"monitor: {rollback.reason} at step {rollback.step}: rolling back to {rollback.target} "
            f"with data seed {rollback.seed}, lr scale {rollback.lr_scale:g}"
            + (f" (a repeated rollback: monitor.on_repeat's {rollback.stage})" if rollback.stage else "")
        )

    def tell(self, rollback: Rollback, applied_at: int, tag: str | None, reason: str | None = None) -> None:
        """Rank 0: the outcome, to the service."""
        if self.link is not None:
            outcome = Outcome(rollback.decision, rollback.step, tag is not None, applied_at, tag, reason)
            self.link.outcome(outcome)

    # ------------------------------------------------------------------------ the learning rate

    def take_lr(self, rollback: Rollback, target: int) -> None:
        """The rollback's scale from the `target` step on; with a repeated rollback's lr_factor,
        also that factor for its steps after the target (else a lowered rate the target held)."""
        self.record = rollback.to_json()
        self.lr = dataclasses.replace(self.lr, scale=rollback.lr_scale)
        if rollback.lr_factor is None:
            return
        until = target + (rollback.lr_factor_steps or 0)
        self.lr = LrScale(rollback.lr_scale, rollback.lr_factor, until, rollback.decision)
        if self.env.is_main:
            lowered = LrLowered(
                step=target, decision=rollback.decision, factor=rollback.lr_factor, until=until
            )
            append_event(self.run_dir, lowered)
        self.writer.message(
            f"monitor: rollback {rollback.decision} repeats earlier ones: learning rate "
            f"x{rollback.lr_factor:g} for steps {target + 1}..{until}"
        )

    def lift_lr(self, step: int) -> bool:
        """Before `step`: when the lowered rate's last step is behind, the schedule's again (times
        the scale); whether it was lifted here."""
        if not self.lr.lowered or step <= self.lr.until:
            return False
        lowered, self.lr = self.lr, LrScale(self.lr.scale)
        if self.env.is_main:
            append_event(
                self.run_dir, LrRestored(step=step, decision=lowered.decision, factor=lowered.factor)
            )
        self.writer.message(
            f"monitor: learning rate back on its schedule from step {step} "
            f"(x{lowered.factor:g} through step {lowered.until})"
        )
        return True

    def state_dict(self) -> dict | None:
        """What checkpoints keep: the newest rollback's record and the learning rate's scale."""
        if self.record is None and self.lr == LrScale():
            return None
        return {"rollback": self.record, "lr": dataclasses.asdict(self.lr)}

    def load_state_dict(self, state: dict) -> None:
        if "factor" in state:  # written before the rollback record was kept: the lowered rate alone
            state = {
                "lr": {"factor": state["factor"], "until": state["until"], "decision": state.get("decision")}
            }
        self.record = state.get("rollback")
        lr = state.get("lr") or {}
        self.lr = LrScale(
            float(lr.get("scale", 1.0)),
            float(lr.get("factor", 1.0)),
            int(lr.get("until", 0)),
            lr.get("decision"),
        )

    # ---------------------------------------------------------------------------- the windows

    def set_aside(self, rollback: Rollback, windows: list[tuple[int, int]], evidence: dict) -> None:
        """Quarantine the anomalous step's windows (and those of earlier rollbacks, which an older
        checkpoint's position does not hold yet); rank 0 lists them in RUN_DIR/quarantine.jsonl."""
        self.quarantined += [w for w in windows if w not in self.quarantined]
        self.task.quarantine(self.quarantined)
        if self.env.is_main:
            record = {
                "step": rollback.step,
                "decision": rollback.decision,
                "windows": [list(w) for w in windows],
            }
            with open(self.run_dir / QUARANTINE_FILE, "a") as f:
                f.write(json.dumps(evidence | record) + "\n")  # (windows with their epochs)
            self.writer.message(
                f"monitor: {len(windows)} windows of step {rollback.step} set aside for their epoch"
            )
