"""The loss's spike threshold (monitoring/detectors.py): its robust band, capped at
`monitor.loss_spike_ratio` × its level. Early in a run the window still holds the first, much
higher losses, so the band is wide, and the cap is what catches a loss at two or three times its
level; late in a calm run the band is narrow and is below the cap. Each case is on both sides of
the line that decides it. End to end, in a real run: tests/integration/test_spike_cap.py."""

import pytest

from monitoring.detectors import NORMAL_MAD, Detector, band
from pretrain.config import MonitorConfig


def history(level: float, mad: float) -> list[float]:
    """Values whose median is `level` and whose median absolute deviation is `mad`."""
    return [level - mad, level, level + mad]


# level, MAD, cap ratio, the band alone (level + 6 × spread), the threshold (the band, capped)
CASES = [
    # late in a calm run: a narrow band, well below the cap, decides
    pytest.param(5.0, 0.1, 2.0, 5.0 + 6 * NORMAL_MAD * 0.1, 5.0 + 6 * NORMAL_MAD * 0.1, id="calm-band"),
    # a band floored by min_rel_std (2% of the level): still below the cap
    pytest.param(5.0, 0.0, 2.0, 5.0 + 6 * 0.1, 5.0 + 6 * 0.1, id="flat-floored-band"),
    # early in a run: a wide band (the first, high losses in the window) above the cap; the cap decides
    pytest.param(5.0, 1.0, 2.0, 5.0 + 6 * NORMAL_MAD * 1.0, 10.0, id="wide-band-cap-2"),
    pytest.param(
        5.0, 1.0, 3.0, 5.0 + 6 * NORMAL_MAD * 1.0, 5.0 + 6 * NORMAL_MAD * 1.0, id="wide-band-below-cap-3"
    ),
    pytest.param(5.0, 2.0, 3.0, 5.0 + 6 * NORMAL_MAD * 2.0, 15.0, id="wider-band-cap-3"),
    pytest.param(8.0, 3.0, 2.0, 8.0 + 6 * NORMAL_MAD * 3.0, 16.0, id="early-level-8-cap-2"),
]


@pytest.mark.parametrize("level, mad, ratio, uncapped, threshold", CASES)
def test_the_loss_threshold_is_the_band_capped_at_the_ratio_times_the_level(
    level, mad, ratio, uncapped, threshold
):
    values = history(level, mad)
    free = band(values, sigma=6, min_rel_std=0.02)
    assert free.level == level and free.threshold == pytest.approx(uncapped)  # (the case is what it says)
    capped = band(values, sigma=6, min_rel_std=0.02, cap_ratio=ratio)
    assert capped.level == level and capped.spread == free.spread
    assert capped.threshold == pytest.approx(threshold)
    assert capped.threshold <= ratio * level  # a cap, never a floor
    assert capped.threshold <= free.threshold  # it only ever lowers the band


@pytest.mark.parametrize("level, mad, ratio, uncapped, threshold", CASES)
def test_a_loss_is_a_spike_exactly_when_above_the_capped_threshold(level, mad, ratio, uncapped, threshold):
    """Values just below and above the threshold, and (where the cap decides) between the cap
    and the band: a loss the band alone would let through is a spike."""
    detector = Detector(window=16, warmup=3, loss_spike_ratio=ratio, divergence_steps=0)
    for value in history(level, mad):
        detector.admit(value, 1.0)
    assert detector.loss.band().threshold == pytest.approx(threshold)

    def kinds(loss):
        return [f.kind for f in detector.findings(loss, 1.0)]

    assert kinds(threshold * 0.999) == []
    assert kinds(threshold * 1.001) == ["loss_spike"]
    if threshold < uncapped:  # the cap decides: between it and the band
        between = (threshold + uncapped) / 2
        assert kinds(between) == ["loss_spike"]
        (finding,) = detector.findings(between, 1.0)
        assert finding.threshold == pytest.approx(ratio * level) and finding.level == level
        assert kinds(ratio * level) == []  # exactly at the cap: not above it
    else:  # the band decides: a loss above it and below the cap is a spike
        assert kinds(ratio * level * 0.999) == ["loss_spike"]


def test_early_in_a_run_a_loss_twice_its_level_is_a_spike_though_the_band_is_wider():
    """A run's first losses fall fast (10.4 → 3 in a real run): the window's spread is large, the
    band far above 2× the level, and a loss at 2–3× its level is caught by the cap alone. The same
    loss late in a calm run is caught by the narrow band as well."""
    early = Detector(window=128, warmup=8, divergence_steps=0)
    for loss in [10.4, 9.1, 7.9, 6.8, 5.9, 5.1, 4.5, 4.0, 3.6, 3.3]:
        early.admit(loss, 1.0)
    b = early.loss.band()
    assert b.level == pytest.approx(5.5)
    uncapped = band(early.loss.history, early.loss.sigma, early.loss.min_rel_std).threshold
    assert uncapped > 3 * b.level and b.threshold == pytest.approx(2 * b.level)
    for factor in (2.1, 2.5, 3.0):
        assert [f.kind for f in early.findings(factor * b.level, 1.0)] == ["loss_spike"], factor
    assert early.findings(1.9 * b.level, 1.0) == []

    late = Detector(window=128, warmup=8, divergence_steps=0)
    for i in range(64):
        late.admit(3.0 + 0.01 * (i % 5), 1.0)
    calm = late.loss.band()
    assert calm.threshold < 1.2 * calm.level  # the band decides here, far below the cap
    for factor in (1.3, 2.1, 2.5, 3.0):
        assert [f.kind for f in late.findings(factor * calm.level, 1.0)] == ["loss_spike"], factor


def test_only_the_loss_is_capped():
    """The gradient norm has no cap: a value between 2× its level and a wide band is no surge and
    no spike (it stays in its band)."""
    detector = Detector(window=16, warmup=3, divergence_steps=0)
    for norm in history(5.0, 1.0):
        detector.admit(3.0, norm)
    assert detector.grad_norm.band().threshold == pytest.approx(5.0 + 6 * NORMAL_MAD)
    assert detector.findings(3.0, 12.0) == []


def test_the_cap_is_monitor_loss_spike_ratio():
    detector = Detector.of(MonitorConfig(warmup=3, loss_spike_ratio=3.0))
    for value in history(5.0, 2.0):
        detector.admit(value, 1.0)
    assert detector.loss.band().threshold == pytest.approx(15.0)
    assert detector.findings(14.9, 1.0) == [] and detector.findings(15.1, 1.0)[0].kind == "loss_spike"
