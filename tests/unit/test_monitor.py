import math

import numpy as np
import pytest

from monitoring.detectors import DivergenceDetector, SpikeDetector, band
from monitoring.policy import Policy
from monitoring.protocol import StepMetrics
from pretrain import checkpoint as ck
from pretrain.config import MonitorConfig


def clean_run(steps: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A healthy run's shape: loss decaying with noise, grad norm log-normal around a slow trend."""
    rng = np.random.default_rng(seed)
    t = np.arange(1, steps + 1)
    loss = 2.5 + 5.0 * np.exp(-t / 300) + rng.normal(0, 0.05, steps)
    grad = (0.4 + 0.6 * np.exp(-t / 500)) * rng.lognormal(0, 0.15, steps)
    return loss, grad


def test_band_definition():
    b = band([1.0, 2.0, 3.0], sigma=2, min_rel_std=0)
    assert (
        b.mean == 2.0
        and b.std == pytest.approx(math.sqrt(2 / 3))
        and b.threshold == pytest.approx(2 + 2 * b.std)
    )
    assert band([5.0, 5.0], sigma=6, min_rel_std=0.02).threshold == pytest.approx(5.0 + 6 * 0.1)


def test_false_alarm_rate_on_clean_runs_and_spikes_caught():
    alarms = 0
    for seed in range(10):  # 10 clean runs of 5000 steps, heavy-tailed (log-normal) gradient norms
        loss, grad = clean_run(5000, seed)
        loss_d, grad_d = SpikeDetector(), SpikeDetector()
        alarms += sum(
            loss_d.update(a).anomaly or grad_d.update(b).anomaly for a, b in zip(loss, grad, strict=True)
        )
    assert alarms <= 2  # measured: 1 in 50,000 steps with the defaults (README)
    detector = SpikeDetector()
    _, grad = clean_run(400, 99)
    verdicts = [detector.update(g) for g in grad[:300]]
    assert not any(v.anomaly for v in verdicts)
    spike = detector.update(grad[300] * 50)
    assert spike.anomaly and spike.rule == "spike" and spike.value > spike.threshold
    assert not detector.update(grad[301]).anomaly  # the spike did not widen the band
    assert detector.update(float("nan")).rule == "nonfinite" and detector.update(float("inf")).anomaly


def test_no_spike_judged_during_warmup():
    detector = SpikeDetector(warmup=32)
    assert not any(detector.update(v).anomaly for v in [1.0] * 31 + [100.0])
    assert detector.update(1000.0).anomaly


def test_divergence():
    detector = DivergenceDetector(steps=20)
    assert not any(detector.update(5.0 - 0.01 * i).anomaly for i in range(200))
    verdicts = [detector.update(3.0 + 0.05 * i).anomaly for i in range(40)]
    assert 20 <= verdicts.index(True) <= 25  # 20 rising steps of the average, once it turns
    assert not DivergenceDetector(steps=0).update(1e9).anomaly


def fake_checkpoint(run_dir, step):
    directory = ck.checkpoints_dir(run_dir) / ck.tag_for(step)
    directory.mkdir(parents=True)
    (directory / "weights").write_text(str(step))
    ck.mark_complete(directory, {"step": step})


def metrics(step, loss=3.0, grad=1.0):
    return StepMetrics(step=step, loss=loss, grad_norm=grad, lr=1e-3, step_time=0.1, tokens=step * 100)


def test_policy_targets_pins_and_circuit_breaker(tmp_path):
    config = MonitorConfig(warmup=4, window=16, max_rollbacks=2, lr_scale=0.5, rollback_margin=1)
    policy = Policy(config, str(tmp_path), base_seed=7)
    for step in (5, 10):
        fake_checkpoint(tmp_path, step)
    for step in range(1, 12):
        action, _ = policy.observe(metrics(step, grad=1.0 + 0.01 * (step % 3)))
        assert action.kind == "continue"
    assert ck.pinned(tmp_path) == {"step_00000005"}  # a rollback at step 11 would go to <= 11 - 1 - margin
    action, incident = policy.observe(metrics(12, grad=80.0))
    # target: at or before 12 - 1 - margin 1 = 10
    assert action.kind == "rollback" and action.tag == "step_00000010" and action.lr_scale == 0.5
    assert incident.series == "grad_norm" and incident.verdict.rule == "spike"
    # The same step spikes again after each rollback: no progress → the breaker trips after 2.
    assert policy.observe(metrics(11))[0].kind == "continue"
    second, _ = policy.observe(metrics(12, grad=80.0))
    assert second.kind == "rollback" and second.seed != action.seed and second.lr_scale == 0.25
    third, _ = policy.observe(metrics(12, grad=80.0))
    assert third.kind == "stop" and "circuit breaker" in third.reason
    assert policy.observe(metrics(13))[0].kind == "stop"


def test_policy_without_a_checkpoint_continues(tmp_path):
    policy = Policy(MonitorConfig(warmup=4, window=16), str(tmp_path))
    action, incident = policy.observe(metrics(1, loss=float("nan")))
    assert action.kind == "continue" and incident.verdict.rule == "nonfinite"
