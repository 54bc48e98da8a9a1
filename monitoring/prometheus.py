"""The service's /metrics: Prometheus gauges of the latest step and counters of what the policy
found and decided."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from monitoring.policy import Verdict
from monitoring.protocol import StepMetrics


class ServiceMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.step = Gauge("pretrain_step", "last reported optimizer step", registry=r)
        self.loss = Gauge("pretrain_loss", "last reported training loss", registry=r)
        self.grad_norm = Gauge("pretrain_grad_norm", "last reported global gradient norm", registry=r)
        self.lr = Gauge("pretrain_lr", "last reported learning rate", registry=r)
        self.tokens_per_second = Gauge(
            "pretrain_tokens_per_second", "tokens per second, all ranks", registry=r
        )
        self.threshold = Gauge("pretrain_spike_threshold", "detector threshold", ["series"], registry=r)
        self.findings = Counter(
            "pretrain_anomalies", "findings of the detector", ["series", "rule"], registry=r
        )
        self.warnings = Counter("pretrain_warnings", "steps that warned", registry=r)
        self.skipped = Counter(
            "pretrain_updates_skipped", "steps whose update the trainer skipped in place", registry=r
        )
        self.decided = Counter("pretrain_rollbacks_decided", "rollbacks decided", registry=r)
        self.rollbacks = Counter("pretrain_rollbacks", "rollbacks applied by the trainer", registry=r)
        self.cancelled = Counter(
            "pretrain_rollbacks_cancelled", "rollbacks decided, then cancelled", registry=r
        )
        self.restarts = Counter("pretrain_restarts", "restarts of a crashed or hung job", registry=r)
        self.rank_step_seconds = Gauge(
            "pretrain_rank_step_seconds",
            "a rank's forward seconds per step, median over the last straggler window",
            ["rank", "host"],
            registry=r,
        )
        self.stragglers = Counter("pretrain_stragglers", "stragglers named by the trainer", registry=r)

    def observe(
        self, metrics: StepMetrics, verdict: Verdict, point: dict, tokens_per_second: float | None
    ) -> None:
        """One judged step (`point`: its chart point, with the bands' thresholds)."""
        for finding in verdict.findings:
            self.findings.labels(finding.series, finding.kind).inc()
        for counter, counts in (
            (self.skipped, metrics.update_skipped),
            (self.warnings, verdict.level == "warn"),
            (self.decided, verdict.decision is not None),
            (self.cancelled, verdict.cancelled is not None),
        ):
            if counts:
                counter.inc()
        for gauge, value in (
            (self.step, metrics.step),
            (self.loss, metrics.loss),
            (self.grad_norm, metrics.grad_norm),
            (self.lr, metrics.lr),
            (self.tokens_per_second, tokens_per_second),
        ):
            if value is not None:
                gauge.set(value)
        for series in ("loss", "grad_norm"):
            if f"{series}_threshold" in point:
                self.threshold.labels(series).set(point[f"{series}_threshold"])
        if metrics.ranks:  # (a logging step's: the set of ranks reported replaces the last one's)
            self.rank_step_seconds.clear()
            for entry in metrics.ranks:
                self.rank_step_seconds.labels(str(entry["rank"]), entry["host"]).set(entry["step_seconds"])
                if entry.get("straggler"):
                    self.stragglers.inc()
