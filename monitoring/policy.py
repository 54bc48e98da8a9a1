"""The rollback policy: from detector verdicts to an action, and which checkpoint to go back to.

On an anomaly at step s, the target is the newest complete checkpoint at or before s − 1 − margin
(the weights before the anomalous update), and the data stream is reshuffled with a new seed from
there. Each rollback may scale the learning rate (lr_scale ** rollbacks). A circuit breaker stops
the job after `max_rollbacks` rollbacks that did not get past the step of the previous anomaly.
The current rollback target is pinned so that checkpoint retention never deletes it; a rollback's
target stays pinned until a checkpoint past its anomaly is complete, then is released.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from monitoring.detectors import DivergenceDetector, SpikeDetector, Verdict
from monitoring.protocol import CONTINUE, Action, StepMetrics
from pretrain import checkpoint
from pretrain.config import MonitorConfig


@dataclass
class Incident:
    step: int
    series: str
    verdict: Verdict


@dataclass
class Policy:
    config: MonitorConfig
    run_dir: str
    base_seed: int = 0
    grad_norm: SpikeDetector = field(init=False)
    loss: SpikeDetector = field(init=False)
    divergence: DivergenceDetector = field(init=False)
    rollbacks: list[dict] = field(default_factory=list)
    stuck: int = 0  # rollbacks in a row that did not get past the previous anomaly
    tripped: bool = False
    manual: str | None = None  # reason of an operator's pending rollback request
    pinned_tag: str | None = None
    last: StepMetrics | None = None
    _complete: set[str] = field(default_factory=set)  # tags known to be complete

    def __post_init__(self) -> None:
        c = self.config
        self.grad_norm = SpikeDetector(c.window, c.warmup, c.grad_norm_sigma, c.min_rel_std)
        self.loss = SpikeDetector(c.window, c.warmup, c.loss_sigma, c.min_rel_std)
        self.divergence = DivergenceDetector(c.divergence_steps)

    def observe(self, metrics: StepMetrics) -> tuple[Action, Incident | None]:
        """One step's metrics in, the action for this step boundary out."""
        self.last = metrics
        if self.tripped:
            return Action("stop", reason="circuit breaker tripped earlier"), None
        self.refresh_pin(metrics.step)
        incident = self._detect(metrics)
        if incident is None:
            return CONTINUE, None
        target = self.target(metrics.step)
        if target is None:
            return CONTINUE, incident  # nothing to go back to yet; a NaN step was skipped by the trainer
        previous = self.rollbacks[-1]["step"] if self.rollbacks else None
        self.stuck = self.stuck + 1 if previous is not None and metrics.step <= previous else 1
        if self.stuck > self.config.max_rollbacks:
            self.tripped = True
            return Action(
                "stop",
                reason=f"circuit breaker: {self.stuck - 1} rollbacks made no progress past step {previous}",
            ), incident
        lr_scale = self.config.lr_scale ** (len(self.rollbacks) + 1)
        seed = self.base_seed + 1_000_003 * (len(self.rollbacks) + 1)
        reason = f"{incident.series} {incident.verdict.rule}"
        self.rollbacks.append(
            {"step": metrics.step, "reason": reason, "value": incident.verdict.value,
             "threshold": incident.verdict.threshold, "target": target, "seed": seed, "lr_scale": lr_scale}
        )  # fmt: skip
        return Action("rollback", tag=target, seed=seed, lr_scale=lr_scale, reason=reason), incident

    def _detect(self, m: StepMetrics) -> Incident | None:
        if self.manual is not None:
            reason, self.manual = self.manual, None
            return Incident(m.step, "operator", Verdict(True, reason))
        for series, verdict in (
            ("grad_norm", self.grad_norm.update(m.grad_norm)),
            ("loss", self.loss.update(m.loss)),
            ("loss", self.divergence.update(m.loss)),
        ):
            if verdict.anomaly:
                return Incident(m.step, series, verdict)
        return None

    def target(self, anomalous_step: int) -> str | None:
        """Newest complete checkpoint saved before the anomalous update, `margin` steps back."""
        limit = anomalous_step - 1 - self.config.rollback_margin
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
        if self.rollbacks:
            last = self.rollbacks[-1]
            root = checkpoint.checkpoints_dir(self.run_dir)
            past = [t for t in checkpoint.tags_on_disk(self.run_dir) if checkpoint.step_of(t) > last["step"]
                    and checkpoint.check_complete(root / t, verify_hashes=False) is None]  # fmt: skip
            if not past:
                keep.add(last["target"])
        current = checkpoint.pinned(self.run_dir)
        try:
            for tag in keep - current:
                checkpoint.pin(self.run_dir, tag)
            for tag in current - keep:
                checkpoint.unpin(self.run_dir, tag)
        except OSError:
            pass  # a full disk: the pins are tried again at the next step
        self.pinned_tag = self.target(step)
