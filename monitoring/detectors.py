"""Anomaly detection on training metrics: robust bands, and the rules that grade each step.

Each series (the loss, the global gradient norm) has a band computed from its last `window`
values, once `warmup` values have been seen:

    level      the median of the window (robust: one outlier does not move it)
    spread     1.4826 × the median absolute deviation (σ for normal noise), floored at
               `min_rel_std` × level so that a series that has been nearly flat does not turn
               every wiggle into an alarm
    threshold  level + sigma × spread; for the loss, never above `loss_spike_ratio` × level (early
               in a run the window still holds the first, much higher losses, and the band is wide)

The findings, from the most to the least severe (each mapped to an action by the policy):

* `nonfinite`: a NaN or ±Inf loss or gradient norm.
* `loss_spike`: the loss above its threshold.
* `grad_norm_surge`: the gradient norm above its threshold *and* at least `surge_ratio` times its
  level: an excursion large against the series' own robust level.
* `divergence`: the loss's moving average has risen for `divergence_steps` steps in a row (a slow
  blow-up that never crosses the band).
* `grad_norm_spike`: the gradient norm above its threshold, but less than `surge_ratio` times its
  level. Clean runs do this now and then (the calibration in docs/monitoring.md shows how often).
* `instability_precursor`: one of the precursors a report may carry (monitoring.protocol's
  PRECURSORS: the largest attention logit, the output logits' largest log Z and |logit|, the
  largest update/weight RMS ratio), non-finite or above its own band (`precursor_window`
  measurements, `precursor_sigma`, judged after `precursor_warmup`): what grows before a loss
  diverges (Wortsman et al. 2023), seen before the loss moves.

Values judged a rollback never enter their window, so a spike cannot widen its own band; values
that only warned do, so a lasting change of regime (a gradient norm that grows as the learning
rate decays) moves the band instead of warning for ever.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from monitoring.config import FINDINGS

NORMAL_MAD = 1.4826  # MAD × this estimates σ for normally distributed noise


@dataclass(frozen=True)
class Band:
    level: float
    spread: float
    threshold: float


def band(history, sigma: float, min_rel_std: float, cap_ratio: float | None = None) -> Band:
    """level + sigma × max(1.4826·MAD, min_rel_std·|level|) of the history (at least one value),
    and never above cap_ratio × level when a cap is given."""
    level = statistics.median(history)
    mad = statistics.median(abs(x - level) for x in history)
    spread = max(NORMAL_MAD * mad, min_rel_std * abs(level))
    threshold = level + sigma * spread
    if cap_ratio is not None:
        threshold = min(threshold, cap_ratio * level)
    return Band(level, spread, threshold)


@dataclass(frozen=True)
class Finding:
    kind: str  # one of FINDINGS
    series: str  # loss | grad_norm
    value: float
    threshold: float | None = None
    level: float | None = None

    @property
    def reason(self) -> str:
        text = f"{self.series} {self.kind.removeprefix(self.series + '_')} {self.value:.4g}"
        if self.threshold is not None:
            text += f" > {self.threshold:.4g}"
        if self.kind == "grad_norm_surge" and self.level:
            text += f" ({self.value / self.level:.1f}x its level {self.level:.4g})"
        return text


class Series:
    """The rolling window of one series."""

    def __init__(
        self, window: int, warmup: int, sigma: float, min_rel_std: float, cap_ratio: float | None = None
    ):
        if warmup < 2 or window < warmup:
            raise ValueError("need 2 <= warmup <= window")
        self.history: deque[float] = deque(maxlen=window)
        self.warmup, self.sigma, self.min_rel_std, self.cap_ratio = warmup, sigma, min_rel_std, cap_ratio

    def band(self) -> Band | None:
        if len(self.history) < self.warmup:
            return None
        return band(self.history, self.sigma, self.min_rel_std, self.cap_ratio)

    def add(self, value: float) -> None:
        if math.isfinite(value):
            self.history.append(value)


class Divergence:
    """The loss's moving average rising for `steps` steps in a row (0: never)."""

    def __init__(self, steps: int = 100, alpha: float = 0.05):
        self.steps, self.alpha = steps, alpha
        self.ema: float | None = None
        self.rising = 0

    def update(self, loss: float) -> bool:
        if self.steps <= 0 or not math.isfinite(loss):
            return False
        previous = self.ema
        self.ema = loss if previous is None else (1 - self.alpha) * previous + self.alpha * loss
        self.rising = self.rising + 1 if previous is not None and self.ema > previous else 0
        return self.rising >= self.steps


class Detector:
    """Judges one step at a time; `findings` lists every rule the step breaks, most severe first.
    `severe(findings)` (from the policy) says whether the values stay out of the windows."""

    def __init__(
        self,
        window=128,
        warmup=32,
        grad_norm_sigma=6.0,
        loss_sigma=6.0,
        min_rel_std=0.02,
        surge_ratio=8.0,
        divergence_steps=100,
        loss_spike_ratio=2.0,
    ):
        self.loss = Series(window, warmup, loss_sigma, min_rel_std, cap_ratio=loss_spike_ratio)
        self.grad_norm = Series(window, warmup, grad_norm_sigma, min_rel_std)
        self.divergence = Divergence(divergence_steps)
        self.surge_ratio = surge_ratio
        self.precursors: dict[str, Series] = {}
        self.precursor_settings = (64, 8, 6.0, min_rel_std)  # window, warmup, sigma, min_rel_std

    @classmethod
    def of(cls, config) -> Detector:
        c = config
        detector = cls(
            c.window,
            c.warmup,
            c.grad_norm_sigma,
            c.loss_sigma,
            c.min_rel_std,
            c.grad_norm_surge_ratio,
            c.divergence_steps,
            c.loss_spike_ratio,
        )
        detector.precursor_settings = (
            c.precursor_window,
            c.precursor_warmup,
            c.precursor_sigma,
            c.min_rel_std,
        )
        return detector

    def precursor(self, name: str) -> Series:
        if name not in self.precursors:
            self.precursors[name] = Series(*self.precursor_settings)
        return self.precursors[name]

    def precursor_findings(self, values: dict[str, float]) -> list[Finding]:
        """Each precursor measured at this step, non-finite or above its own band."""
        found = []
        for name, value in values.items():
            b = self.precursor(name).band()
            if not math.isfinite(value):
                found.append(Finding("instability_precursor", name, value))
            elif b is not None and value > b.threshold:
                found.append(Finding("instability_precursor", name, value, b.threshold, b.level))
        return found

    def admit_precursors(self, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.precursor(name).add(value)

    def bands(self) -> dict[str, Band | None]:
        precursors = {name: series.band() for name, series in self.precursors.items()}
        return {"loss": self.loss.band(), "grad_norm": self.grad_norm.band()} | precursors

    def chart_point(self, step: int, loss, grad_norm, level: str, precursors: dict | None = None) -> dict:
        """One judged step as the page draws it: its values, its verdict's level, and the band
        (`<series>_level`, `<series>_threshold`) it was judged against; precursors only at the
        steps that measured them."""
        precursors = precursors or {}
        point = {"step": step, "loss": loss, "grad_norm": grad_norm, "level": level} | precursors
        for series, b in self.bands().items():
            if b is not None and (series in ("loss", "grad_norm") or series in precursors):
                point |= {f"{series}_level": b.level, f"{series}_threshold": b.threshold}
        return point

    def findings(self, loss: float, grad_norm: float) -> list[Finding]:
        found = []
        for series, value in (("loss", loss), ("grad_norm", grad_norm)):
            if not math.isfinite(value):
                found.append(Finding("nonfinite", series, value))
        loss_band, grad_band = self.loss.band(), self.grad_norm.band()
        if loss_band is not None and math.isfinite(loss) and loss > loss_band.threshold:
            found.append(Finding("loss_spike", "loss", loss, loss_band.threshold, loss_band.level))
        if grad_band is not None and math.isfinite(grad_norm) and grad_norm > grad_band.threshold:
            surge = grad_norm >= self.surge_ratio * grad_band.level
            found.append(
                Finding(
                    "grad_norm_surge" if surge else "grad_norm_spike",
                    "grad_norm",
                    grad_norm,
                    grad_band.threshold,
                    grad_band.level,
                )
            )
        if self.divergence.update(loss):
            found.append(Finding("divergence", "loss", self.divergence.ema, None, None))
        return sorted(found, key=lambda f: FINDINGS.index(f.kind))

    def admit(self, loss: float, grad_norm: float) -> None:
        """The step's values enter their windows (a step that was not rolled back)."""
        self.loss.add(loss)
        self.grad_norm.add(grad_norm)
