"""The loss-spike cap (`monitor.loss_spike_ratio`, monitoring/detectors.py) in a real run: a
1-process job and the monitoring service as its own process. The job's first losses fall from 13
to 5.5 in eight steps (init_std 0.5, lr 3e-2), as a real run's fall from ln(vocabulary) to a
fraction of it in its first hundreds of steps; so early on the loss's window holds them, its band
is wide, and a ×3 spike at step 10 stays inside it: only the cap (2 × the level) rolls it back.
The same ×3 spike late in the run, once the window is calm, is above the narrow band and rolled
back by it. The unit tier tests the thresholds case by case (tests/unit/test_detectors.py)."""

import json
import signal
import statistics

import pytest

from tests.integration.runs import events, torchrun, train
from tests.integration.test_monitoring import _start_service

WINDOW, WARMUP = 16, 8
SIGMA, MIN_REL_STD, CAP = (
    6.0,
    0.02,
    2.0,
)  # the service's defaults: monitor.loss_sigma, min_rel_std, loss_spike_ratio
EARLY, LATE = 10, 22


def band_alone(losses: list[float]) -> tuple[float, float]:
    """(level, threshold) of the loss's band without the cap, computed here from the judged losses."""
    level = statistics.median(losses)
    mad = statistics.median(abs(x - level) for x in losses)
    return level, level + SIGMA * max(1.4826 * mad, MIN_REL_STD * level)


def window_before(log: list[dict], decision: dict) -> list[float]:
    """The losses in the window when `decision`'s step was judged: the last WINDOW admitted (judged
    ok, warmup or warn) before it, in the order the service judged them."""
    judged = []
    for event in log:
        if event is decision:
            return judged[-WINDOW:]
        if event["type"] == "step" and event["level"] in ("ok", "warmup", "warn"):
            judged.append(event["loss"])
    raise AssertionError("the decision is not in the events")


def test_a_loss_spike_three_times_its_level_is_rolled_back_early_by_the_cap_and_late_by_the_band(
    tmp_path, train_data
):
    service, _, _ = _start_service(tmp_path, f"monitor.warmup={WARMUP}", f"monitor.window={WINDOW}")
    try:
        result = train(
            torchrun(1),
            tmp_path,
            train_data,
            "model.init_std=0.5",
            "optim.lr=3e-2",
            "train.steps=24",
            "checkpoint.every=4",
            "eval.every=0",
            "monitor.enabled=true",
            f"faults.spike_steps=[{EARLY},{LATE}]",
            "faults.spike_factor=3",
        )
    finally:
        service.send_signal(signal.SIGTERM)
        service.wait(timeout=30)
    log = events(tmp_path)
    decided = [e for e in log if e["type"] == "rollback"]
    assert [(e["step"], e["finding"], e["target"]) for e in decided] == [
        (EARLY, "loss_spike", "step_00000008"),
        (LATE, "loss_spike", "step_00000020"),
    ], result.stdout[-3000:]
    early, late = decided

    # Early: the window holds the first, high losses; the band alone is above the spike, which is
    # above 2× the level: the threshold it was judged against is the cap.
    losses = window_before(log, early)
    assert len(losses) == EARLY - 1
    level, uncapped = band_alone(losses)
    assert uncapped > early["value"] > CAP * level, (losses, early)
    assert early["threshold"] == pytest.approx(CAP * level, rel=1e-9)

    # Late: a calm window, a band far below the cap; the band caught it.
    level, uncapped = band_alone(window_before(log, late))
    assert uncapped < 1.5 * level and early["value"] > late["value"] > CAP * level
    assert late["threshold"] == pytest.approx(uncapped, rel=1e-9)

    applied = [e for e in log if e["type"] == "rollback_applied"]
    assert [(e["decided_at"], e["tag"]) for e in applied] == [
        (EARLY, "step_00000008"),
        (LATE, "step_00000020"),
    ]
    summary = json.loads((tmp_path / "train_summary.json").read_text())
    assert summary["completed"] and summary["step"] == 24 and summary["rollbacks"] == 2
