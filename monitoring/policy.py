"""The rollback policy: from a step's findings to a response, and which checkpoint to go back to.

Pure: a step's metrics and the run's complete checkpoints in, a `Verdict` out; no files, no
clock. What the service shows, the pins it writes and the events it appends are
`monitoring/service.py`'s, from the verdicts.

Each finding of the detector (`monitoring.detectors`), and of the experts' watch
(`monitoring.experts`: a collapsed routing), maps to a response by `monitor.on_<finding>`:
`ignore`, `warn` (recorded, counted, shown; no action), `rollback` or `stop`. The most drastic
response of a step's findings is the step's verdict.

A rollback is a decision, numbered (a `Rollback` record), that stays pending until the trainer
reports its outcome (applied, or cancelled with a reason). While it is pending no step is judged:
the steps the trainer reports meanwhile belong to the timeline the rollback abandons, and their
answer repeats the decision, so an answer lost on the way is sent again. The target is the newest
complete checkpoint at or before s − 1 − margin for an anomaly at step s (the weights before the
anomalous update): every step it contains was judged (steps are judged in order) and none of them
was rolled back. A step whose rollback could not be applied taints the checkpoints after it: they
are never targets. Each rollback reshuffles the data with a new seed and may scale the learning
rate (lr_scale ** rollbacks). A circuit breaker stops the job after `max_rollbacks` rollbacks that
did not get past the step of the previous anomaly; `monitor.on_repeat` adds measures to rollbacks
that repeat one another (`rung`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from monitoring.config import RESPONSES, ServiceConfig
from monitoring.detectors import Detector, Finding
from monitoring.experts import ExpertWatch
from monitoring.protocol import (
    CONTINUE,
    Action,
    Event,
    Outcome,
    RepeatsStopped,
    Rollback,
    RollbackApplied,
    RollbackCancelled,
    RollbackDecided,
    StepJudged,
    StepMetrics,
)
from pretrain.checkpoint.layout import step_of

# A spike in one step: skipping that step's update in place fixed it (not so for a trend).
STEP_LOCAL = ("nonfinite", "loss_spike", "grad_norm_surge", "grad_norm_spike")


@dataclass
class Verdict:
    """What the policy says about one reported step.

    level: `warmup` (no band yet), `ok`, `warn`, `skipped` (a spike the trainer skipped in place:
    no rollback), `rollback` (decided at this step; with no checkpoint to go back to, `note` says
    so and the action is `continue`), `stop`, or `superseded` (trained after a pending rollback's
    anomaly: not judged, the answer repeats the decision)."""

    action: Action
    level: str
    findings: list[Finding] = field(default_factory=list)
    decision: Rollback | None = None  # the rollback decided at this step
    note: str | None = None
    cancelled: dict | None = None  # a pending decision this report showed the trainer will not apply
    stopped: dict | None = None  # monitor.on_repeat's stop: {reason, diagnosis, tried}

    def to_json(self) -> dict:
        out = {"level": self.level, "findings": [asdict(f) | {"reason": f.reason} for f in self.findings]}
        return out | ({"note": self.note} if self.note else {})


@dataclass
class Policy:
    config: ServiceConfig
    base_seed: int = 0
    detector: Detector = field(init=False)
    experts: ExpertWatch = field(init=False)  # a model with experts: whether its routing collapsed
    decisions: list[Rollback] = field(default_factory=list)  # every rollback decided
    pending: Rollback | None = None  # decided, its outcome not yet reported
    cancelled: set[int] = field(default_factory=set)  # decisions that were not applied
    skipped_in_a_row: int = 0  # steps in a row whose update the trainer skipped in place
    stuck: int = 0  # rollbacks in a row that did not get past the previous anomaly
    tripped: bool = False
    manual: str | None = None  # reason of an operator's rollback request, decided at the next step
    tainted_from: int | None = None  # a rollback-worthy step still in the weights: no target after it
    diagnosis: str | None = None  # monitor.on_repeat's stop, when it came
    last_step: int | None = None

    def __post_init__(self) -> None:
        self.detector = Detector.of(self.config)
        self.experts = ExpertWatch(self.config)

    # ------------------------------------------------------------------------------ judging

    def observe(self, metrics: StepMetrics, checkpoints: Sequence[str]) -> Verdict:
        """One step's metrics in, in the order the trainer ran them, with the tags of the run's
        complete checkpoints (oldest first); the verdict out."""
        self.last_step = metrics.step
        if self.tripped:
            return Verdict(Action("stop", reason="circuit breaker tripped earlier"), "stop")
        cancelled = None
        if self.pending is not None:
            if metrics.step > self.pending.step:
                return Verdict(Action("rollback", rollback=self.pending), "superseded")
            why = f"the job went back to step {metrics.step - 1} without applying it (restarted)"
            cancelled = self._cancel(self.pending, why)
        verdict = self._judge(metrics, checkpoints)
        verdict.cancelled = cancelled
        return verdict

    def _judge(self, metrics: StepMetrics, checkpoints: Sequence[str]) -> Verdict:
        findings = self.detector.findings(metrics.loss, metrics.grad_norm)
        findings += self.detector.precursor_findings(metrics.precursors)
        findings += self.experts.findings(metrics.step, metrics.experts)
        if self.manual is not None:
            findings.insert(0, Finding("operator", "operator", float("nan")))
        responses = ["rollback" if f.kind == "operator" else self.config_response(f.kind) for f in findings]
        worst = max(responses, key=RESPONSES.index, default="ignore")
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if metrics.update_skipped else 0
        if metrics.update_skipped and worst == "rollback" and self._fixed_by_the_skip(findings, responses):
            return Verdict(CONTINUE, "skipped", findings)
        if worst in ("ignore", "warn"):
            self.detector.admit(metrics.loss, metrics.grad_norm)
            self.detector.admit_precursors(metrics.precursors)
            if worst == "warn":
                return Verdict(CONTINUE, "warn", findings)
            level = "ok" if self.detector.grad_norm.band() and self.detector.loss.band() else "warmup"
            return Verdict(CONTINUE, level, findings)
        finding = findings[responses.index(worst)]
        reason = self.manual if finding.kind == "operator" else finding.reason
        self.manual = None
        if worst == "stop":
            self.tripped = True
            return Verdict(Action("stop", reason=reason), "stop", findings)
        return self._decide(metrics.step, finding, reason, findings, checkpoints)

    def config_response(self, finding: str) -> str:
        return getattr(self.config, f"on_{finding}")

    def _fixed_by_the_skip(self, findings: list[Finding], responses: list[str]) -> bool:
        """A skipped step's update never landed, so a spike in that step alone left the weights as
        they were: no rollback. Not so for a trend (divergence), an operator's request, or more
        than skip_max_consecutive skipped steps in a row (the run, not a batch, is in trouble)."""
        return self.skipped_in_a_row <= self.config.skip_max_consecutive and all(
            f.kind in STEP_LOCAL for f, r in zip(findings, responses, strict=True) if r == "rollback"
        )

    def _decide(
        self, step: int, finding: Finding, reason: str, findings: list[Finding], checkpoints: Sequence[str]
    ) -> Verdict:
        target = self.target(step, checkpoints)
        if target is None:
            # Nothing to go back to yet (a NaN step was skipped by the trainer all the same).
            if finding.kind != "nonfinite":
                self._taint(step)
            note = f"no checkpoint before step {step}: nothing to roll back to"
            return Verdict(CONTINUE, "rollback", findings, note=note)
        previous = self.decisions[-1].step if self.decisions else None
        self.stuck = self.stuck + 1 if previous is not None and step <= previous else 1
        if self.stuck > self.config.max_rollbacks:
            self.tripped = True
            why = f"circuit breaker: {self.stuck - 1} rollbacks made no progress past step {previous}"
            if self.config.on_repeat and self.chain():  # (monitor.on_repeat: what the chain tried)
                why += f"; tried: {describe_chain(self.chain())}"
            return Verdict(Action("stop", reason=why), "stop", findings)
        repeat = rung(self.config, step, self.chain())
        if repeat.get("stage") == "stop":
            return self._stop_repeats(step, reason, findings)
        n = len(self.decisions) + 1
        decision = Rollback(
            decision=(self.decisions[-1].decision if self.decisions else 0) + 1,
            step=step,
            target=target,
            seed=self.base_seed + 1_000_003 * n,
            lr_scale=self.config.lr_scale**n,
            reason=reason,
            finding=finding.kind,
            value=finding.value if finding.kind != "operator" else None,
            threshold=finding.threshold,
            **repeat,
        )
        self.decisions.append(decision)
        self.pending = decision
        return Verdict(Action("rollback", rollback=decision), "rollback", findings, decision)

    # ---------------------------------------------------------------------- repeated rollbacks

    def chain(self) -> list[Rollback]:
        """The rollbacks, oldest first, that repeated one another up to the newest (monitor.on_repeat:
        each within repeat_window steps of the one before; a cancelled one was no rollback)."""
        chain = []
        for decision in reversed(self.decisions):
            if decision.decision in self.cancelled:
                continue
            chain.insert(0, decision)
            if not decision.repeat:
                break
        return chain

    def _stop_repeats(self, step: int, reason: str, findings: list[Finding]) -> Verdict:
        """The last stage: stop, with a diagnosis naming every rollback of the chain and what it tried."""
        self.tripped = True
        chain = self.chain()
        self.diagnosis = (
            f"rollbacks kept repeating within {self.config.repeat_window} steps (monitor.repeat_window): "
            f"{describe_chain(chain)}; then {reason} at step {step}: stopping after "
            f"monitor.on_repeat [{', '.join(self.config.on_repeat)}]"
        )
        stopped = {"reason": reason, "diagnosis": self.diagnosis, "tried": [d.to_json() for d in chain]}
        return Verdict(Action("stop", reason=self.diagnosis), "stop", findings, stopped=stopped)

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
            "chain": [d.to_json() for d in chain],
            "stopped": self.diagnosis,
        }

    # ------------------------------------------------------------------------ decisions' lives

    def resolve(self, outcome: Outcome) -> Rollback | None:
        """The trainer's report of what became of a decision; the pending decision it resolved."""
        resolved = (
            self.pending if self.pending is not None and self.pending.decision == outcome.decision else None
        )
        if resolved is not None:
            self.pending = None
        if outcome.applied:
            if self.tainted_from is not None and outcome.tag and step_of(outcome.tag) < self.tainted_from:
                self.tainted_from = None  # the weights are from before it again
        else:
            self.cancelled.add(outcome.decision)
            self._taint(outcome.decided_at)
        return resolved

    def _cancel(self, decision: Rollback, reason: str) -> dict:
        self.pending = None
        self.cancelled.add(decision.decision)
        return {
            "decision": decision.decision,
            "step": decision.step,
            "target": decision.target,
            "reason": reason,
        }

    def _taint(self, step: int) -> None:
        self.tainted_from = step if self.tainted_from is None else min(self.tainted_from, step)

    def request(self, reason: str, checkpoints: Sequence[str]) -> str | None:
        """An operator's rollback, decided at the next reported step; the reason it cannot be, if so."""
        if self.tripped:
            return "the circuit breaker has tripped: the job is stopping"
        if self.pending is not None:
            return (
                f"rollback {self.pending.decision} (decided at step {self.pending.step}) is not applied yet"
            )
        next_step = self.last_step + 1 if self.last_step is not None else 1
        if self.target(next_step, checkpoints) is None:
            return f"no complete checkpoint before step {next_step} to roll back to"
        self.manual = reason
        return None

    # --------------------------------------------------------------------------------- targets

    def target(self, anomalous_step: int, checkpoints: Sequence[str]) -> str | None:
        """Of the complete `checkpoints`, the newest saved before the anomalous update, `margin`
        steps back, and before any step whose rollback could not be applied."""
        limit = anomalous_step - 1 - self.config.rollback_margin
        if self.tainted_from is not None:
            limit = min(limit, self.tainted_from - 1)
        return max((t for t in checkpoints if step_of(t) <= limit), key=step_of, default=None)

    def pins(self, step: int, checkpoints: Sequence[str]) -> set[str]:
        """The checkpoints retention must keep: the one a rollback at `step` would use, and the
        last rollback's target until a complete checkpoint newer than its anomaly exists."""
        keep = {self.target(step, checkpoints)} - {None}
        if self.decisions and not any(step_of(t) > self.decisions[-1].step for t in checkpoints):
            keep.add(self.decisions[-1].target)
        return keep

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
                if e.level in ("ok", "warmup", "warn"):
                    loss, grad_norm = (float("nan") if v is None else float(v) for v in (e.loss, e.grad_norm))
                    self.detector.admit(loss, grad_norm)
            elif isinstance(e, RollbackDecided) and isinstance(e.decision, int):
                decision = Rollback.of(e)
                self.decisions.append(decision)
                self.pending = None if decision.decision in resolved else decision
            elif isinstance(e, RollbackCancelled) and e.decision is not None:
                self.cancelled.add(e.decision)
            elif isinstance(e, RepeatsStopped):
                self.diagnosis = e.diagnosis  # (shown; a job started again goes on from the chain)
        return judged


def rung(config: ServiceConfig, step: int, chain: list[Rollback]) -> dict:
    """Where a rollback at anomalous `step` stands on monitor.on_repeat's ladder, as the `Rollback`
    fields it sets (none when on_repeat is off): `repeat` rollbacks in a row came within
    repeat_window steps of the one before (0: none did, a plain rollback); the stage reached is
    on_repeat[repeat - 1] (the last one beyond the list), and each stage keeps the earlier ones'
    measures: quarantine (the anomalous step's windows set aside), lower_lr (the learning rate
    times repeat_lr_factor, per lower_lr reached, for repeat_lr_steps steps), stop."""
    stages = list(config.on_repeat)
    if not stages:
        return {}
    previous = chain[-1] if chain else None
    repeat = 0
    if previous is not None and step - previous.step <= config.repeat_window:
        repeat = (previous.repeat or 0) + 1
    reached = stages[: min(repeat, len(stages))]
    lowered = reached.count("lower_lr")
    return {
        "repeat": repeat,
        "stage": reached[-1] if reached else None,
        "quarantine": True if "quarantine" in reached else None,
        "lr_factor": config.repeat_lr_factor**lowered if lowered else None,
        "lr_factor_steps": config.repeat_lr_steps if lowered else None,
    }


def describe_chain(chain: list[Rollback]) -> str:
    """ "rollback 1 at step 10 (loss_spike) to step_00000008; rollback 2 at step 12 (loss_spike) to
    step_00000010, its windows quarantined; ..." """
    parts = []
    for d in chain:
        measures = ["its windows quarantined"] if d.quarantine else []
        if d.lr_factor is not None:
            measures.append(f"learning rate x{d.lr_factor:g} for {d.lr_factor_steps} steps")
        parts.append(
            f"rollback {d.decision} at step {d.step} ({d.finding}) to {d.target}"
            + (f", {' and '.join(measures)}" if measures else "")
        )
    return "; ".join(parts)
