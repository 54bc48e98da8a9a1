"""What the service shows of a run (/status, the page): progress and rate, the recent verdicts,
warnings, skipped updates, rollbacks and restarts, each rank's compute time and the stragglers
named, and the judged series the page charts. Fed one judged step at a time; a service started
again rebuilds it from events.jsonl."""

from __future__ import annotations

import collections
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from monitoring.policy import Verdict
from monitoring.protocol import (
    Event,
    Outcome,
    Restart,
    Rollback,
    RollbackApplied,
    RollbackCancelled,
    StepJudged,
    StepMetrics,
    Straggler,
    WarningRaised,
)

SERIES_KEPT = 600  # judged steps kept for /status and the page
ROLLED_BACK_KEPT = 50  # judged points of abandoned timelines' rollback steps, kept for the page
RATE_STEPS = 50  # the steps /status's ETA (their median step time) and smoothed tokens/s are over


@dataclass
class Board:
    total_steps: int | None = None  # the run's last step, as the trainer (or run.json) says
    last: StepMetrics | None = None
    warnings: int = 0
    warned: collections.deque = field(default_factory=lambda: collections.deque(maxlen=50))
    skipped: list[int] = field(default_factory=list)  # steps whose update the trainer skipped in place
    applied: list[dict] = field(default_factory=list)  # outcomes of applied rollbacks
    cancelled: list[dict] = field(default_factory=list)
    restarts: list[Restart] = field(default_factory=list)  # earlier launches' too
    recent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=20))  # verdicts
    series: collections.deque = field(default_factory=lambda: collections.deque(maxlen=SERIES_KEPT))
    rolled_back: collections.deque = field(default_factory=lambda: collections.deque(maxlen=ROLLED_BACK_KEPT))
    step_times: collections.deque = field(default_factory=lambda: collections.deque(maxlen=RATE_STEPS))
    # (tokens, seconds) of the last steps whose tokens are known (not the first after a rollback)
    step_tokens: collections.deque = field(default_factory=lambda: collections.deque(maxlen=RATE_STEPS))
    tokens_per_second: float | None = None  # the last step's
    ranks: list[dict] = field(default_factory=list)  # the newest logging step's per-rank times
    ranks_step: int | None = None  # ... and its step
    stragglers: list[dict] = field(default_factory=list)  # {step, rank, host, factor}, as named

    def record(self, metrics: StepMetrics, verdict: Verdict, point: dict) -> None:
        """One judged step, and its chart `point`."""
        previous = self.recent[-1] if self.recent else None
        self.last = metrics
        reason = "; ".join(f.reason for f in verdict.findings if f.kind != "operator") or None
        self.recent.append(
            {
                "step": metrics.step,
                "loss": metrics.loss,
                "grad_norm": metrics.grad_norm,
                "level": verdict.level,
                "reason": reason,
                "tokens": metrics.tokens,
            }
        )
        if verdict.level == "warn":
            self.warnings += 1
            self.warned.append(
                {"step": metrics.step, "reason": "; ".join(f.reason for f in verdict.findings)}
            )
        if metrics.update_skipped:
            self.skipped.append(metrics.step)
        if verdict.cancelled is not None:
            self.cancelled.append(verdict.cancelled)
        if metrics.step_time > 0:
            self.step_times.append(metrics.step_time)
            if previous is not None and metrics.tokens > previous["tokens"]:
                tokens = metrics.tokens - previous["tokens"]
                self.tokens_per_second = tokens / metrics.step_time
                self.step_tokens.append((tokens, metrics.step_time))
        if metrics.total_steps is not None:
            self.total_steps = metrics.total_steps
        if metrics.ranks:
            self.ranks, self.ranks_step = metrics.ranks, metrics.step
            self.stragglers += [
                {"step": metrics.step, "rank": r["rank"], "host": r["host"], "factor": r.get("factor")}
                for r in metrics.ranks
                if r.get("straggler")
            ]
        self.chart(point)

    def resolved(self, outcome: Outcome, decision: Rollback | None) -> None:
        """The trainer's outcome of a rollback (`decision`: the pending one it resolved, if any)."""
        record = {
            "decision": outcome.decision,
            "step": outcome.decided_at,
            "applied_at": outcome.applied_at,
            "tag": outcome.tag,
            "reason": outcome.reason,
        } | ({"target": decision.target, "why": decision.reason} if decision is not None else {})
        (self.applied if outcome.applied else self.cancelled).append(record)

    def chart(self, point: dict) -> None:
        """The judged series the page draws is the timeline that goes on: a step judged again (after
        a rollback or a restart went back) replaces the abandoned points from that step on. Of
        those, the points a rollback was decided at are kept aside, so that the chart still shows
        the value that was judged and rolled back."""
        while self.series and self.series[-1]["step"] >= point["step"]:
            abandoned = self.series.pop()
            if abandoned.get("level") == "rollback":
                self.rolled_back.append(abandoned)
        self.series.append(point)

    def restore(self, events: list[Event], judged: list[dict]) -> None:
        """What a run's history shows (`judged`: its judged steps' chart points)."""
        for e in events:
            if isinstance(e, StepJudged) and e.level == "skipped":
                self.skipped.append(e.step)
            elif isinstance(e, WarningRaised):
                self.warnings += 1
                self.warned.append({"step": e.step, "reason": e.reason})
            elif isinstance(e, RollbackApplied):
                self.applied.append(
                    {"decision": e.decision, "step": e.decided_at, "applied_at": e.applied_at, "tag": e.tag}
                )
            elif isinstance(e, RollbackCancelled):
                self.cancelled.append({"decision": e.decision, "step": e.step, "reason": e.reason})
            elif isinstance(e, Restart):
                self.restarts.append(e)
            elif isinstance(e, Straggler):
                self.stragglers.append({"step": e.step, "rank": e.rank, "host": e.host, "factor": e.factor})
        for point in judged:
            self.chart(point)

    def last_judged(self) -> int | None:
        """The newest step judged, by this process or (from the history) an earlier one."""
        if self.last is not None:
            return self.last.step
        return self.series[-1]["step"] if self.series else None

    def recent_tokens_per_second(self) -> float | None:
        """The last RATE_STEPS measured steps' tokens over their summed step times (the console's
        tok/s and `tokens_per_second` are one step's)."""
        seconds = sum(s for _, s in self.step_tokens)
        return sum(t for t, _ in self.step_tokens) / seconds if seconds > 0 else None

    def eta_seconds(self) -> float | None:
        if self.last is None or not self.total_steps or not self.step_times:
            return None
        return max(self.total_steps - self.last.step, 0) * statistics.median(self.step_times)

    def status(self) -> dict:
        """/status's keys that this board holds."""
        return {
            "step": self.last_judged(),
            "total_steps": self.total_steps,
            "tokens_per_second": self.tokens_per_second,
            "tokens_per_second_last_50_steps": self.recent_tokens_per_second(),
            "eta_seconds": self.eta_seconds(),
            "latest": self.last.to_json() if self.last else None,
            "warnings": self.warnings,
            "warnings_recent": list(self.warned),
            "updates_skipped": len(self.skipped),
            "updates_skipped_recent": self.skipped[-20:],
            "rollbacks": list(self.applied),
            "rollbacks_cancelled": list(self.cancelled),
            "recent": [dict(v) for v in self.recent],
            "restarts": [r.to_json() for r in self.restarts],
            "ranks": [dict(r) for r in self.ranks],
            "ranks_step": self.ranks_step,
            "stragglers": [dict(s) for s in self.stragglers],
        }


def total_steps_of(run_dir: Path) -> int | None:
    """train.steps of the run's last start (RUN_DIR/run.json), if there is one."""
    try:
        steps = json.loads((run_dir / "run.json").read_text())["config"].get("train.steps")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return steps if isinstance(steps, int) else None
