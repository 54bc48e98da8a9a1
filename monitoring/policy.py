"""The rollback policy: from a step's findings to a response, and which checkpoint to go back to.

Each finding of the detector (`monitoring.detectors`) maps to a response by `monitor.on_<finding>`:
`ignore`, `warn` (recorded, counted, shown; no action), `rollback` or `stop`. The most drastic
response of a step's findings is the step's verdict.

A rollback is a *decision*, numbered, that stays pending until the trainer reports its outcome
(applied, or cancelled with a reason). While it is pending no step is judged: the steps the
trainer reports meanwhile belong to the timeline the rollback abandons, and their answer repeats
the decision, so an answer lost on the way is sent again. The target is the newest complete
checkpoint at or before s − 1 − margin for an anomaly at step s (the weights before the anomalous
update): every step it contains was judged (steps are judged in order) and none of them was
rolled back. A step whose rollback could not be applied taints the checkpoints after it: they
are never targets. Each rollback may scale the learning rate (lr_scale ** rollbacks) and
reshuffles the data with a new seed. A circuit breaker stops the job after `max_rollbacks`
rollbacks that did not get past the step of the previous anomaly. The current target is pinned
so that checkpoint retention never deletes it; a rollback's target stays pinned until a
checkpoint past its anomaly is complete, then is released.
"""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import asdict, dataclass, field

from monitoring.config import RESPONSES, ServiceConfig
from monitoring.detectors import Detector, Finding
from monitoring.protocol import (
    CONTINUE,
    Action,
    Event,
    Outcome,
    RepeatsStopped,
    RollbackApplied,
    RollbackCancelled,
    RollbackDecided,
    StepJudged,
    StepMetrics,
    WarningRaised,
)
from pretrain import checkpoint


@dataclass
class Decision:
    """A rollback decided at `step`, to checkpoint `target`."""

    id: int
    step: int
    reason: str
    finding: str
    value: float | None
    threshold: float | None
    target: str
    seed: int
    lr_scale: float
    # monitor.on_repeat (None when off): how many rollbacks in a row this one repeats, the stage it
    # reached and what that stage adds (see `Rung`)
    repeat: int | None = None
    stage: str | None = None
    quarantine: bool | None = None
    lr_factor: float | None = None
    lr_factor_steps: int | None = None

    def action(self) -> Action:
        return Action(
            "rollback",
            tag=self.target,
            seed=self.seed,
            lr_scale=self.lr_scale,
            reason=self.reason,
            decision=self.id,
            step=self.step,
            stage=self.stage,
            quarantine=self.quarantine,
            lr_factor=self.lr_factor,
            lr_factor_steps=self.lr_factor_steps,
        )

    def event(self) -> RollbackDecided:
        """Its `rollback` event: the same fields, `id` named `decision`."""
        return RollbackDecided(decision=self.id, **{name: getattr(self, name) for name in _SHARED})

    @classmethod
    def of(cls, event: RollbackDecided) -> Decision:
        """The decision a `rollback` event records (a service started again reads them back)."""
        return cls(id=event.decision, **{name: getattr(event, name) for name in _SHARED})


_SHARED = tuple(f.name for f in dataclasses.fields(Decision) if f.name != "id")  # with RollbackDecided


@dataclass
class Verdict:
    """What the policy says about one reported step.

    level: `ok`, `warmup` (no band yet), `warn`, `rollback` (decided at this step; or, with no
    checkpoint to go back to, recorded as `unresolved`), `stop`, or `superseded` (trained after a
    pending rollback's anomaly: not judged, the answer repeats the decision)."""

    action: Action
    level: str
    findings: list[Finding] = field(default_factory=list)
    decision: Decision | None = None
    note: str | None = None
    cancelled: dict | None = None  # a pending decision this report showed the trainer will not apply
    stopped: RepeatsStopped | None = None  # the stop that ended a chain of repeated rollbacks

    def to_json(self) -> dict:
        out = {"level": self.level, "findings": [asdict(f) | {"reason": f.reason} for f in self.findings]}
        return out | ({"note": self.note} if self.note else {})


@dataclass
class Policy:
    config: ServiceConfig
    run_dir: str
    base_seed: int = 0
    detector: Detector = field(init=False)
    decisions: list[Decision] = field(default_factory=list)  # every rollback decided
    pending: Decision | None = None  # decided, its outcome not yet reported
    applied: list[dict] = field(default_factory=list)  # outcomes of applied rollbacks
    cancelled: list[dict] = field(default_factory=list)
    warnings: int = 0
    skipped: list[int] = field(default_factory=list)  # steps whose update the trainer skipped in place
    skipped_in_a_row: int = 0
    stuck: int = 0  # rollbacks in a row that did not get past the previous anomaly
    tripped: bool = False
    manual: str | None = None  # reason of an operator's rollback request, decided at the next step
    tainted_from: int | None = None  # a rollback-worthy step still in the weights: no target after it
    pinned_tag: str | None = None
    repeats_stopped: RepeatsStopped | None = None  # monitor.on_repeat's stop, when it came
    last: StepMetrics | None = None
    recent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=20))  # verdicts
    warned: collections.deque = field(default_factory=lambda: collections.deque(maxlen=50))  # warnings
    _complete: set[str] = field(default_factory=set)  # tags known to be complete

    def __post_init__(self) -> None:
        self.detector = Detector.of(self.config)

    def response(self, finding: str) -> str:
        return getattr(self.config, f"on_{finding}")

    # ------------------------------------------------------------------------------ judging

    def observe(self, metrics: StepMetrics) -> Verdict:
        """One step's metrics in, in the order the trainer ran them; the verdict out."""
        self.last = metrics
        if self.tripped:
            return self._remember(
                metrics, Verdict(Action("stop", reason="circuit breaker tripped earlier"), "stop")
            )
        cancelled = None
        if self.pending is not None:
            if metrics.step > self.pending.step:
                return self._remember(metrics, Verdict(self.pending.action(), "superseded"))
            why = f"the job went back to step {metrics.step - 1} without applying it (restarted)"
            cancelled = self._cancel(self.pending, why)
        verdict = self._judge(metrics)
        verdict.cancelled = cancelled
        return self._remember(metrics, verdict)

    def _judge(self, metrics: StepMetrics) -> Verdict:
        self.refresh_pin(metrics.step)
        findings = self.detector.findings(metrics.loss, metrics.grad_norm)
        findings += self.detector.precursor_findings(metrics.precursors)
        if self.manual is not None:
            findings.insert(0, Finding("operator", "operator", float("nan")))
        responses = ["rollback" if f.kind == "operator" else self.response(f.kind) for f in findings]
        worst = max(responses, key=RESPONSES.index, default="ignore")
        if metrics.update_skipped:
            self.skipped.append(metrics.step)
            self.skipped_in_a_row += 1
            if worst == "rollback" and self._fixed_by_the_skip(findings, responses):
                return Verdict(CONTINUE, "skipped", findings)
        else:
            self.skipped_in_a_row = 0
        if worst in ("ignore", "warn"):
            self.detector.admit(metrics.loss, metrics.grad_norm)
            self.detector.admit_precursors(metrics.precursors)
            if worst == "warn":
                self.warnings += 1
                self.warned.append({"step": metrics.step, "reason": "; ".join(f.reason for f in findings)})
                return Verdict(CONTINUE, "warn", findings)
            level = "ok" if self.detector.grad_norm.band() and self.detector.loss.band() else "warmup"
            return Verdict(CONTINUE, level, findings)
        finding = findings[responses.index(worst)]
        reason = self.manual if finding.kind == "operator" else finding.reason
        self.manual = None
        if worst == "stop":
            self.tripped = True
            return Verdict(Action("stop", reason=reason), "stop", findings)
        return self._decide(metrics.step, finding, reason, findings)

    def _fixed_by_the_skip(self, findings: list[Finding], responses: list[str]) -> bool:
        """A skipped step's update never landed, so a spike in that step alone left the weights as
        they were: no rollback. Not so for a trend (divergence), an operator's request, or more
        than skip_max_consecutive skipped steps in a row (the run, not a batch, is in trouble)."""
        step_local = ("nonfinite", "loss_spike", "grad_norm_surge", "grad_norm_spike")
        return self.skipped_in_a_row <= self.config.skip_max_consecutive and all(
            f.kind in step_local for f, r in zip(findings, responses, strict=True) if r == "rollback"
        )

    def _decide(self, step: int, finding: Finding, reason: str, findings: list[Finding]) -> Verdict:
        target = self.target(step)
        if target is None:
            # Nothing to go back to yet (a NaN step was skipped by the trainer all the same).
            if finding.kind != "nonfinite":
                self.tainted_from = step if self.tainted_from is None else min(self.tainted_from, step)
            return Verdict(
                CONTINUE,
                "rollback",
                findings,
                note=f"no checkpoint before step {step}: nothing to roll back to",
            )
        previous = self.decisions[-1].step if self.decisions else None
        self.stuck = self.stuck + 1 if previous is not None and step <= previous else 1
        if self.stuck > self.config.max_rollbacks:
            self.tripped = True
            why = f"circuit breaker: {self.stuck - 1} rollbacks made no progress past step {previous}"
            if self.config.on_repeat and self.chain():  # (monitor.on_repeat: what the chain tried)
                why += f"; tried: {describe_chain(self.chain())}"
            return Verdict(Action("stop", reason=why), "stop", findings)
        rung = Rung.of(self.config, step, self.chain())
        if rung is not None and rung.stage == "stop":
            return self._stop_repeats(step, finding, reason, findings)
        n = len(self.decisions) + 1
        decision = Decision(
            id=(self.decisions[-1].id if self.decisions else 0) + 1,
            step=step,
            reason=reason,
            finding=finding.kind,
            value=finding.value if finding.kind != "operator" else None,
            threshold=finding.threshold,
            target=target,
            seed=self.base_seed + 1_000_003 * n,
            lr_scale=self.config.lr_scale**n,
            **(asdict(rung) if rung is not None else {}),
        )
        self.decisions.append(decision)
        self.pending = decision
        return Verdict(decision.action(), "rollback", findings, decision)

    # ---------------------------------------------------------------------- repeated rollbacks

    def chain(self) -> list[Decision]:
        """The rollbacks, oldest first, that repeated one another up to the newest (monitor.on_repeat:
        each within repeat_window steps of the one before; a cancelled one was no rollback)."""
        cancelled = {c["decision"] for c in self.cancelled}
        chain = []
        for decision in reversed(self.decisions):
            if decision.id in cancelled:
                continue
            chain.insert(0, decision)
            if not decision.repeat:
                break
        return chain

    def _stop_repeats(self, step: int, finding: Finding, reason: str, findings: list[Finding]) -> Verdict:
        """The last stage: stop, with a diagnosis naming every rollback of the chain and what it tried."""
        self.tripped = True
        chain = self.chain()
        diagnosis = (
            f"rollbacks kept repeating within {self.config.repeat_window} steps (monitor.repeat_window): "
            f"{describe_chain(chain)}; then {reason} at step {step}: stopping after "
            f"monitor.on_repeat [{', '.join(self.config.on_repeat)}]"
        )
        self.repeats_stopped = RepeatsStopped(
            step=step,
            reason=reason,
            diagnosis=diagnosis,
            tried=[tried(d) for d in chain],
        )
        return Verdict(Action("stop", reason=diagnosis), "stop", findings, stopped=self.repeats_stopped)

    def escalation(self) -> dict | None:
        """/status's `escalation` (None when monitor.on_repeat is off): the stages, the chain of
        repeated rollbacks so far, and the stop's diagnosis if it came."""
        if not self.config.on_repeat:
            return None
        chain = self.chain()
        return {
            "on_repeat": list(self.config.on_repeat),
            "repeat_window": self.config.repeat_window,
            "repeat": chain[-1].repeat or 0 if chain else None,
            "chain": [tried(d) for d in chain],
            "stopped": self.repeats_stopped.diagnosis if self.repeats_stopped else None,
        }

    def _remember(self, metrics: StepMetrics, verdict: Verdict) -> Verdict:
        self.recent.append(
            {
                "step": metrics.step,
                "loss": metrics.loss,
                "grad_norm": metrics.grad_norm,
                "level": verdict.level,
                "reason": "; ".join(f.reason for f in verdict.findings if f.kind != "operator") or None,
            }
        )
        return verdict

    # ------------------------------------------------------------------------ decisions' lives

    def resolve(self, outcome: Outcome) -> bool:
        """The trainer's report of what became of a decision; whether it was the pending one."""
        record = {
            "decision": outcome.decision,
            "step": outcome.decided_at,
            "applied_at": outcome.applied_at,
            "tag": outcome.tag,
            "reason": outcome.reason,
        }
        known = self.pending is not None and self.pending.id == outcome.decision
        if known:
            record |= {"target": self.pending.target, "why": self.pending.reason}
            self.pending = None
        if outcome.applied:
            self.applied.append(record)
            if (
                self.tainted_from is not None
                and outcome.tag
                and checkpoint.step_of(outcome.tag) < self.tainted_from
            ):
                self.tainted_from = None  # the weights are from before it again
        else:
            self.cancelled.append(record)
            self._taint(outcome.decided_at)
        return known

    def _cancel(self, decision: Decision, reason: str) -> dict:
        self.pending = None
        record = {"decision": decision.id, "step": decision.step, "target": decision.target, "reason": reason}
        self.cancelled.append(record)
        return record

    def _taint(self, step: int) -> None:
        self.tainted_from = step if self.tainted_from is None else min(self.tainted_from, step)

    def request(self, reason: str) -> str | None:
        """An operator's rollback, decided at the next reported step; the reason it cannot be, if so."""
        if self.tripped:
            return "the circuit breaker has tripped: the job is stopping"
        if self.pending is not None:
            return f"rollback {self.pending.id} (decided at step {self.pending.step}) is not applied yet"
        next_step = self.last.step + 1 if self.last else 1
        if self.target(next_step) is None:
            return f"no complete checkpoint before step {next_step} to roll back to"
        self.manual = reason
        return None

    # --------------------------------------------------------------------------------- targets

    def target(self, anomalous_step: int) -> str | None:
        """Newest complete checkpoint saved before the anomalous update, `margin` steps back, and
        before any step whose rollback could not be applied."""
        limit = anomalous_step - 1 - self.config.rollback_margin
        if self.tainted_from is not None:
            limit = min(limit, self.tainted_from - 1)
        tags = checkpoint.tags_on_disk(self.run_dir)
        self._complete &= set(tags)  # one moved away (abandoned, deleted) is checked again if it returns
        for tag in reversed(tags):
            if checkpoint.step_of(tag) > limit:
                continue
            if tag in self._complete or (
                checkpoint.check_complete(checkpoint.checkpoints_dir(self.run_dir) / tag, verify_hashes=False)
                is None
            ):
                self._complete.add(tag)  # a complete checkpoint stays complete: not read again each step
                return tag
        return None

    def refresh_pin(self, step: int) -> None:
        """Pin the checkpoint a rollback at this step would use, and the last rollback's target
        until a checkpoint newer than that rollback's anomaly is complete; release every other pin
        (also those an earlier service left), so retention treats them like any other."""
        keep = {self.target(step)} - {None}
        if self.decisions:
            last = self.decisions[-1]
            root = checkpoint.checkpoints_dir(self.run_dir)
            past = [
                t
                for t in checkpoint.tags_on_disk(self.run_dir)
                if checkpoint.step_of(t) > last.step
                and checkpoint.check_complete(root / t, verify_hashes=False) is None
            ]
            if not past:
                keep.add(last.target)
        current = checkpoint.pinned(self.run_dir)
        try:
            for tag in keep - current:
                checkpoint.pin(self.run_dir, tag)
            for tag in current - keep:
                checkpoint.unpin(self.run_dir, tag)
        except OSError:
            pass  # a full disk: the pins are tried again at the next step
        self.pinned_tag = self.target(step)

    # --------------------------------------------------------------------------------- restart

    def restore(self, events: list[Event]) -> list[dict]:
        """A service started again for a run that has history: decision numbers go on from the
        last one, an unresolved decision is pending again, and the bands start from the last
        judged values instead of an empty window (no warm-up, no false alarm after a restart).
        Returns the judged steps with the bands they had, for the charts."""
        resolved = {e.decision for e in events if isinstance(e, RollbackApplied | RollbackCancelled)}
        judged = []
        for e in events:
            if isinstance(e, StepJudged):
                judged.append(self.detector.chart_point(e.step, e.loss, e.grad_norm, e.level))
                if e.level == "skipped":
                    self.skipped.append(e.step)
                if e.level in ("ok", "warmup", "warn"):
                    loss, grad_norm = (float("nan") if v is None else float(v) for v in (e.loss, e.grad_norm))
                    self.detector.admit(loss, grad_norm)
            elif isinstance(e, WarningRaised):
                self.warnings += 1
                self.warned.append({"step": e.step, "reason": e.reason})
            elif isinstance(e, RollbackDecided) and isinstance(e.decision, int):
                decision = Decision.of(e)
                self.decisions.append(decision)
                self.pending = None if decision.id in resolved else decision
            elif isinstance(e, RollbackApplied):
                self.applied.append(
                    {"decision": e.decision, "step": e.decided_at, "applied_at": e.applied_at, "tag": e.tag}
                )
            elif isinstance(e, RollbackCancelled):
                self.cancelled.append({"decision": e.decision, "step": e.step, "reason": e.reason})
            elif isinstance(e, RepeatsStopped):
                self.repeats_stopped = e  # (shown; a job started again goes on from the chain)
        return judged


@dataclass
class Rung:
    """Where a rollback stands on monitor.on_repeat's ladder: `repeat` rollbacks in a row came within
    repeat_window steps of the one before (0: none did, a plain rollback); the stage reached is
    on_repeat[repeat - 1] (the last one beyond the list), and each stage keeps the earlier ones'
    measures: quarantine (the anomalous step's windows set aside), lower_lr (the learning rate times
    repeat_lr_factor, per lower_lr reached, for repeat_lr_steps steps), stop."""

    repeat: int
    stage: str | None
    quarantine: bool | None
    lr_factor: float | None
    lr_factor_steps: int | None

    @classmethod
    def of(cls, config: ServiceConfig, step: int, chain: list[Decision]) -> Rung | None:
        """The rung of a rollback at anomalous `step` after the chain so far; None when off."""
        stages = list(config.on_repeat)
        if not stages:
            return None
        previous = chain[-1] if chain else None
        repeat = 0
        if previous is not None and step - previous.step <= config.repeat_window:
            repeat = (previous.repeat or 0) + 1
        reached = stages[: min(repeat, len(stages))]
        lowered = reached.count("lower_lr")
        return cls(
            repeat,
            reached[-1] if reached else None,
            True if "quarantine" in reached else None,
            config.repeat_lr_factor**lowered if lowered else None,
            config.repeat_lr_steps if lowered else None,
        )


def tried(decision: Decision) -> dict:
    """A rollback of a chain, as /status and the `repeats_stopped` event list it."""
    return {
        "decision": decision.id,
        "step": decision.step,
        "finding": decision.finding,
        "target": decision.target,
        "repeat": decision.repeat,
        "stage": decision.stage,
        "quarantine": decision.quarantine,
        "lr_factor": decision.lr_factor,
        "lr_factor_steps": decision.lr_factor_steps,
    }


def describe_chain(chain: list[Decision]) -> str:
    """ "rollback 1 at step 10 (loss_spike) to step_00000008; rollback 2 at step 12 (loss_spike) to
    step_00000010, its windows quarantined; ..." """
    parts = []
    for d in chain:
        measures = ["its windows quarantined"] if d.quarantine else []
        if d.lr_factor is not None:
            measures.append(f"learning rate x{d.lr_factor:g} for {d.lr_factor_steps} steps")
        parts.append(
            f"rollback {d.id} at step {d.step} ({d.finding}) to {d.target}"
            + (f", {' and '.join(measures)}" if measures else "")
        )
    return "; ".join(parts)
