"""Anomaly detection on training metrics, as pure functions and a small stateful wrapper.

Three rules, applied to each step's loss and global gradient norm:

* **non-finite**: NaN or ±Inf, always an anomaly.
* **spike**: a value above mean + k·σ of the last `window` healthy values, once `warmup` values
  have been seen (OLMo-core's stability monitor flags gradient norms this way). σ has a floor of
  `min_rel_std` × mean, so a series that has been nearly constant does not turn every wiggle into
  an alarm. Anomalous values never enter the window, so a spike cannot widen its own band.
* **divergence**: the exponential moving average of the loss has risen for `divergence_steps`
  consecutive steps (a slow blow-up that never crosses the spike band).

Why mean + kσ rather than a ratio to the median: the band adapts to each series' own noise (the
gradient norm of a small model fluctuates by ±30% while its loss moves by 1%), and with k = 6 a
clean run needs a 6σ excursion to alarm; the false-alarm rate on clean runs is measured in the
tests and the README.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Band:
    mean: float
    std: float
    threshold: float


def band(history: Sequence[float], sigma: float, min_rel_std: float) -> Band:
    """mean + sigma·max(std, min_rel_std·|mean|) of the history (at least two values)."""
    mean = math.fsum(history) / len(history)
    variance = math.fsum((x - mean) ** 2 for x in history) / len(history)  # population σ, two-pass
    std = max(math.sqrt(variance), min_rel_std * abs(mean))
    return Band(mean, std, mean + sigma * std)


def is_nonfinite(value: float) -> bool:
    return not math.isfinite(value)


@dataclass(frozen=True)
class Verdict:
    anomaly: bool
    rule: str | None = None  # nonfinite | spike | divergence
    value: float | None = None
    threshold: float | None = None


HEALTHY = Verdict(False)


class SpikeDetector:
    """Rolling band for one series (loss or gradient norm)."""

    def __init__(self, window: int = 128, warmup: int = 32, sigma: float = 6.0, min_rel_std: float = 0.02):
        if warmup < 2 or window < warmup:
            raise ValueError("need 2 <= warmup <= window")
        self.history: deque[float] = deque(maxlen=window)
        self.warmup, self.sigma, self.min_rel_std = warmup, sigma, min_rel_std

    def band(self) -> Band | None:
        if len(self.history) < self.warmup:
            return None
        return band(self.history, self.sigma, self.min_rel_std)

    def update(self, value: float) -> Verdict:
        if is_nonfinite(value):
            return Verdict(True, "nonfinite", value)
        current = self.band()
        if current is not None and value > current.threshold:
            return Verdict(True, "spike", value, current.threshold)
        self.history.append(value)
        return HEALTHY

    def reset(self) -> None:
        self.history.clear()


class DivergenceDetector:
    """The loss's moving average rising for `steps` steps in a row."""

    def __init__(self, steps: int = 50, alpha: float = 0.05):
        self.steps, self.alpha = steps, alpha
        self.ema: float | None = None
        self.rising = 0

    def update(self, loss: float) -> Verdict:
        if self.steps <= 0 or is_nonfinite(loss):
            return HEALTHY
        previous = self.ema
        self.ema = loss if previous is None else (1 - self.alpha) * previous + self.alpha * loss
        self.rising = self.rising + 1 if previous is not None and self.ema > previous else 0
        if self.rising >= self.steps:
            return Verdict(True, "divergence", self.ema, previous)
        return HEALTHY

    def reset(self) -> None:
        self.ema, self.rising = None, 0
