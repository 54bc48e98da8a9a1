"""The detector's bands and findings, and the policy's graded responses and decisions."""

import math

import numpy as np
import pytest

from monitoring.detectors import Detector, band
from monitoring.policy import Policy
from monitoring.protocol import Outcome, StepMetrics
from pretrain import checkpoint as ck
from pretrain.config import MonitorConfig


def clean_run(steps: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A healthy run's shape: loss decaying with noise, grad norm log-normal around a slow trend."""
    rng = np.random.default_rng(seed)
    t = np.arange(1, steps + 1)
    loss = 2.5 + 5.0 * np.exp(-t / 300) + rng.normal(0, 0.05, steps)
    grad = (0.4 + 0.6 * np.exp(-t / 500)) * rng.lognormal(0, 0.15, steps)
    return loss, grad


def test_band_is_median_plus_sigma_robust_spreads():
    b = band([1.0, 2.0, 3.0, 100.0], sigma=2, min_rel_std=0)
    # median 2.5; absolute deviations 1.5, 0.5, 0.5, 97.5 → MAD 1.0; the outlier moves neither much
    assert (
        b.level == 2.5
        and b.spread == pytest.approx(1.4826)
        and b.threshold == pytest.approx(2.5 + 2 * 1.4826)
    )
    assert band([5.0, 5.0], sigma=6, min_rel_std=0.02).threshold == pytest.approx(5.0 + 6 * 0.1)


def judge(detector, loss, grad):
    findings = detector.findings(loss, grad)
    if not any(f.kind in ("nonfinite", "loss_spike", "grad_norm_surge") for f in findings):
        detector.admit(loss, grad)
    return [f.kind for f in findings]


def test_graded_findings_on_a_synthetic_run():
    detector = Detector(warmup=32)
    loss, grad = clean_run(400, 99)
    assert not any(judge(detector, a, b) for a, b in zip(loss[:300], grad[:300], strict=True))
    assert judge(detector, loss[300], grad[300] * 5) == ["grad_norm_spike"]  # warns: small against its level
    assert judge(detector, loss[301], grad[301] * 50) == ["grad_norm_surge"]  # large: rolls back
    assert judge(detector, loss[302], grad[302]) == []  # the surge did not widen the band
    assert judge(detector, loss[303] * 3, grad[303] * 3)[0] == "loss_spike"
    assert judge(detector, float("nan"), float("nan")) == ["nonfinite", "nonfinite"]
    assert judge(detector, loss[304], float("inf")) == ["nonfinite"]


def test_a_lasting_change_of_regime_warns_briefly_then_moves_the_band():
    detector = Detector(warmup=32, window=64)
    rng = np.random.default_rng(0)
    for g in rng.lognormal(0, 0.1, 100):
        judge(detector, 3.0, float(g))
    later = [judge(detector, 3.0, float(3 * g)) for g in rng.lognormal(0, 0.1, 200)]
    warned = [i for i, kinds in enumerate(later) if kinds]
    assert all(kinds in ([], ["grad_norm_spike"]) for kinds in later)  # never a surge, never a rollback
    assert warned and max(warned) < 40  # the median moved within half a window


def test_no_band_during_warmup():
    detector = Detector(warmup=32)
    assert not any(judge(detector, 3.0, v) for v in [1.0] * 31 + [100.0])
    assert judge(detector, 3.0, 1000.0) == ["grad_norm_surge"]


def test_divergence():
    detector = Detector(divergence_steps=20, warmup=2, window=400, loss_sigma=1e9)
    assert not any(judge(detector, 5.0 - 0.01 * i, 1.0) for i in range(200))
    found = [judge(detector, 3.0 + 0.05 * i, 1.0) for i in range(40)]
    assert 20 <= found.index(["divergence"]) <= 25  # 20 rising steps of the average, once it turns
    assert not Detector(divergence_steps=0).findings(1e9, 1.0)


def fake_checkpoint(run_dir, step):
    directory = ck.checkpoints_dir(run_dir) / ck.tag_for(step)
    directory.mkdir(parents=True)
    (directory / "weights").write_text(str(step))
    ck.mark_complete(directory, {"step": step})


def metrics(step, loss=3.0, grad=1.0):
    return StepMetrics(step=step, loss=loss, grad_norm=grad, lr=1e-3, step_time=0.1, tokens=step * 100)


def applied(verdict, at, tag=None):
    d = verdict.decision
    return Outcome(d.decision, d.step, True, at, tag or d.target)


def tags(*steps: int) -> list[str]:
    """The complete checkpoints a policy is told of, by step."""
    return [ck.tag_for(step) for step in steps]


def warm(policy, steps, checkpoints=()) -> None:
    """Healthy steps, each judged."""
    for step in steps:
        assert (
            policy.observe(metrics(step, grad=1.0 + 0.01 * (step % 3)), list(checkpoints)).action.kind
            == "continue"
        )


def test_a_decision_stays_pending_until_its_outcome_and_is_repeated_meanwhile():
    policy = Policy(MonitorConfig(warmup=4, window=16))
    warm(policy, range(1, 8), tags(5))
    decided = policy.observe(metrics(8, grad=80.0), tags(5))
    assert decided.level == "rollback" and decided.decision.target == "step_00000005"
    assert decided.decision.decision == 1 and decided.action.rollback == decided.decision
    # The trainer ran steps 9 and 10 before the answer arrived: not judged, the decision repeated.
    for step in (9, 10):
        later = policy.observe(metrics(step, grad=500.0), tags(5))
        assert later.level == "superseded" and later.action == decided.action
    assert policy.decisions == [decided.decision]
    assert policy.resolve(applied(decided, 10)) == decided.decision
    assert policy.pending is None and not policy.cancelled
    assert policy.observe(metrics(6), tags(5)).level == "ok"  # judged again from the target on


def test_a_restart_before_the_outcome_cancels_the_decision():
    policy = Policy(MonitorConfig(warmup=4, window=16))
    warm(policy, range(1, 8), tags(5))
    policy.observe(metrics(8, loss=float("nan")), tags(5))
    verdict = policy.observe(metrics(6), tags(5))  # the job restarted from step 5 and never applied it
    assert verdict.cancelled["decision"] == 1 and "restarted" in verdict.cancelled["reason"]
    assert policy.pending is None and policy.cancelled == {1}


def test_a_step_that_could_not_be_rolled_back_taints_the_checkpoints_after_it():
    policy = Policy(MonitorConfig(warmup=4, window=16))
    warm(policy, range(1, 8))
    unresolved = policy.observe(metrics(8, loss=30.0), [])  # no checkpoint yet
    assert unresolved.level == "rollback" and unresolved.action.kind == "continue"
    assert "nothing to roll back" in unresolved.note
    warm(policy, range(9, 13), tags(10))  # step_00000010 was saved with step 8's update in it
    assert policy.target(13, tags(10)) is None  # never a target: it holds the anomalous step
    assert policy.request("try", tags(10)) == "no complete checkpoint before step 13 to roll back to"


def test_the_target_is_the_newest_complete_checkpoint_before_the_anomalous_update_and_margin():
    """For an anomaly at step s: the newest of the complete checkpoints at or before
    s - 1 - monitor.rollback_margin (the weights before the anomalous update)."""
    for margin, anomaly, expected in ((0, 11, 10), (0, 10, 5), (1, 11, 5), (1, 12, 10), (0, 5, None)):
        policy = Policy(MonitorConfig(warmup=4, window=16, rollback_margin=margin))
        got = policy.target(anomaly, tags(5, 10, 15))
        assert got == (ck.tag_for(expected) if expected else None), (margin, anomaly)


def test_every_rollback_reshuffles_with_a_seed_of_its_own():
    policy = Policy(MonitorConfig(warmup=4, window=16, max_rollbacks=10, on_repeat=[]), base_seed=7)
    warm(policy, range(1, 12), tags(5, 10))
    seeds = []
    for _ in range(4):
        verdict = policy.observe(metrics(12, grad=80.0), tags(5, 10))
        seeds.append(verdict.decision.seed)
        policy.resolve(applied(verdict, 12))
        policy.observe(metrics(11), tags(5, 10))
    assert len(set(seeds)) == 4 and 7 not in seeds  # never the run's own seed, never one used before


def test_the_learning_rate_scale_compounds_with_each_rollback():
    policy = Policy(MonitorConfig(warmup=4, window=16, max_rollbacks=10, lr_scale=0.5, on_repeat=[]))
    warm(policy, range(1, 12), tags(10))
    scales = []
    for _ in range(3):
        verdict = policy.observe(metrics(12, grad=80.0), tags(10))
        scales.append(verdict.decision.lr_scale)
        policy.resolve(applied(verdict, 12))
        policy.observe(metrics(11), tags(10))
    assert scales == [0.5, 0.25, 0.125]


def test_pins_keep_the_next_target_and_the_last_rollbacks_until_a_checkpoint_past_its_anomaly():
    policy = Policy(MonitorConfig(warmup=4, window=16, rollback_margin=1))
    warm(policy, range(1, 12), tags(5, 10))
    assert policy.pins(11, tags(5, 10)) == {"step_00000005"}  # a rollback at 11 would go to <= 9
    decided = policy.observe(metrics(12, grad=80.0), tags(5, 10))
    policy.resolve(applied(decided, 12))
    assert policy.pins(13, tags(5, 10)) == {"step_00000010"}
    assert policy.pins(11, tags(5, 10)) == {"step_00000005", "step_00000010"}  # back before 12: kept
    assert policy.pins(17, tags(5, 10, 15)) == {"step_00000015"}  # past the anomaly: released


def test_the_circuit_breaker_stops_rollbacks_that_make_no_progress():
    config = MonitorConfig(warmup=4, window=16, max_rollbacks=2, lr_scale=0.5, rollback_margin=1)
    policy = Policy(config, base_seed=7)
    warm(policy, range(1, 12), tags(5, 10))
    first = policy.observe(metrics(12, grad=80.0), tags(5, 10))
    assert first.decision.target == "step_00000010" and first.findings[0].kind == "grad_norm_surge"
    assert "surge" in first.decision.reason
    policy.resolve(applied(first, 12))
    # The same step spikes again after each rollback: no progress → the breaker trips after 2.
    assert policy.observe(metrics(11), tags(5, 10)).action.kind == "continue"
    second = policy.observe(metrics(12, grad=80.0), tags(5, 10))
    assert second.decision.decision == 2
    policy.resolve(applied(second, 12))
    third = policy.observe(metrics(12, grad=80.0), tags(5, 10))
    assert third.action.kind == "stop" and "circuit breaker" in third.action.reason
    assert policy.observe(metrics(13), tags(5, 10)).action.kind == "stop"


def test_responses_are_configurable():
    strict = Policy(MonitorConfig(warmup=4, window=16, on_grad_norm_spike="rollback"))
    quiet = Policy(MonitorConfig(warmup=4, window=16, on_grad_norm_surge="warn", on_nonfinite="ignore"))
    warm(strict, range(1, 8), tags(2))
    warm(quiet, range(1, 8), tags(2))
    assert strict.observe(metrics(8, grad=1.5), tags(2)).level == "rollback"
    assert quiet.observe(metrics(8, grad=80.0), tags(2)).level == "warn"
    assert quiet.observe(metrics(9, loss=math.nan), tags(2)).level == "ok"
    with pytest.raises(Exception, match="on_loss_spike"):
        MonitorConfig(on_loss_spike="panic")


def test_an_operator_request():
    policy = Policy(MonitorConfig(warmup=4, window=16))
    policy.observe(metrics(1), [])
    assert "no complete checkpoint" in policy.request("bad data", [])  # nothing to go back to: refused
    assert policy.request("operator: bad data", tags(1)) is None
    verdict = policy.observe(metrics(2), tags(1))
    assert verdict.level == "rollback" and verdict.decision.reason == "operator: bad data"
    assert verdict.decision.finding == "operator" and verdict.decision.value is None
    assert "not applied yet" in policy.request("again", tags(1))


def test_a_restarted_service_goes_on_from_the_events():
    from monitoring.protocol import RollbackDecided, StepJudged

    config = MonitorConfig(warmup=4, window=16)
    first = Policy(config)
    events = []
    for step in range(1, 6):
        verdict = first.observe(metrics(step), tags(3))
        events.append(
            StepJudged(step=step, loss=3.0, grad_norm=1.0, action=verdict.action.kind, level=verdict.level)
        )
    decided = first.observe(metrics(6, grad=90.0), tags(3))
    events.append(RollbackDecided(**decided.decision.to_json()))
    again = Policy(config)
    again.restore(events)
    assert again.pending == decided.decision  # the answer may have been lost: it is sent again
    assert again.observe(metrics(7), tags(3)).action == decided.action
    again.resolve(applied(decided, 7))
    assert again.detector.grad_norm.band() is not None  # no warm-up again
    assert again.observe(metrics(4, grad=1.0), tags(3)).level == "ok"
    assert again.observe(metrics(5, grad=90.0), tags(3)).decision.decision == 2  # numbers go on


def test_the_default_policy_on_recorded_clean_runs():
    """Six real clean runs (recorded series): no rollback; every injected loss spike of factor
    >= 3, gradient surge of 50 and NaN is rolled back wherever it lands after the warm-up, and a
    gradient-only excursion of 3 never is."""
    import json
    from pathlib import Path

    from pretrain.bench.detection import replay

    runs = json.loads((Path(__file__).parent / "data" / "clean_runs.json").read_text())["runs"]
    assert len(runs) == 6
    for name, run in runs.items():
        result = replay(list(zip(run["loss"], run["grad_norm"], strict=True)), MonitorConfig(), every=10)
        assert result["steps"] == 300 and result["clean"]["rollback"] == 0 and result["clean"]["warn"] <= 2, (
            name
        )
        injected = result["injected"]
        for fault in ("loss x3", "loss x5", "loss x50", "grad x50", "nan"):
            assert injected[fault]["rollback"] == injected[fault]["trials"] > 20, (name, fault)
        assert injected["grad x3"]["rollback"] == 0, name


def test_a_slow_divergence_reaches_a_rollback_through_the_services_policy(tmp_path):
    """`divergence`: no single step stands out of its band, but the loss's moving average rises
    `divergence_steps` steps in a row; the service's state (what POST /v1/metrics runs) decides a
    rollback to the newest checkpoint before it, with the finding named, and records it."""
    from monitoring.protocol import read_events
    from monitoring.service import MonitorState

    service = MonitorState(tmp_path, MonitorConfig(warmup=4, window=64, divergence_steps=6))
    fake_checkpoint(tmp_path, 4)
    answers = [service.handle_metrics(metrics(step, loss=3.0 + 0.001 * (step % 2))) for step in range(1, 9)]
    rising = [service.handle_metrics(metrics(step, loss=3.0 + 0.004 * (step - 8))) for step in range(9, 16)]
    assert all(a["action"] == "continue" for a in answers + rising[:5])
    decided = next(a for a in rising if a["action"] == "rollback")
    assert decided["rollback"]["target"] == "step_00000004" and [
        f["kind"] for f in decided["verdict"]["findings"]
    ] == ["divergence"]
    (event,) = [e for e in read_events(tmp_path) if e.type == "rollback"]
    assert event.finding == "divergence" and event.target == "step_00000004"


def test_a_restart_while_a_rollback_is_pending_cancels_it_and_judging_goes_on(tmp_path):
    """The service decided a rollback; before the trainer applied it, the job was restarted from a
    checkpoint (its reports begin again at an earlier step). The decision is cancelled, with the
    reason, never counted as a rollback, and the resumed steps are judged as usual."""
    from monitoring.protocol import read_events
    from monitoring.service import MonitorState

    service = MonitorState(tmp_path, MonitorConfig(warmup=4, window=16))
    fake_checkpoint(tmp_path, 4)
    for step in range(1, 8):
        service.handle_metrics(metrics(step, grad=1.0 + 0.01 * (step % 3)))
    decided = service.handle_metrics(metrics(8, grad=90.0))
    assert decided["action"] == "rollback" and service.status()["rollback_pending"] is not None
    resumed = service.handle_metrics(metrics(5, grad=1.01))  # the restarted job, from step_00000004
    assert resumed["action"] == "continue" and service.status()["rollback_pending"] is None
    status = service.status()
    assert status["rollbacks"] == [] and len(status["rollbacks_cancelled"]) == 1
    assert "restarted" in status["rollbacks_cancelled"][0]["reason"]
    cancelled = [e for e in read_events(tmp_path) if e.type == "rollback_cancelled"]
    assert len(cancelled) == 1 and cancelled[0].decision == status["rollbacks_cancelled"][0]["decision"]
    assert service.handle_metrics(metrics(6, grad=1.02))["verdict"]["level"] == "ok"


def test_a_skipped_spike_is_not_rolled_back_but_repeated_skips_and_trends_are(tmp_path):
    """The trainer skipped a spiking step's update in place (monitor.skip_step): its weights never
    changed, so the service rolls nothing back and counts it; more than skip_max_consecutive
    skipped steps in a row are the run in trouble, not one batch: then it rolls back. An update
    that landed (not skipped) is rolled back as before. A service started again counts the skips."""
    from dataclasses import replace

    from monitoring.protocol import read_events
    from monitoring.service import MonitorState

    service = MonitorState(tmp_path, MonitorConfig(warmup=4, window=16, skip_max_consecutive=2))
    fake_checkpoint(tmp_path, 4)
    for step in range(1, 9):
        service.handle_metrics(metrics(step, grad=1.0 + 0.01 * (step % 3)))

    def skipped(step, **values):
        return replace(metrics(step, **values), update_skipped=True)

    answers = [service.handle_metrics(skipped(step, loss=40.0)) for step in (9, 10)]
    assert [a["action"] for a in answers] == ["continue", "continue"]
    assert [a["verdict"]["level"] for a in answers] == ["skipped", "skipped"]
    assert service.handle_metrics(metrics(11))["verdict"]["level"] == "ok"  # the run in a row again
    assert [service.handle_metrics(skipped(s, loss=40.0))["action"] for s in (12, 13)] == ["continue"] * 2
    third = service.handle_metrics(skipped(14, loss=40.0))
    assert third["action"] == "rollback" and third["rollback"]["target"] == "step_00000004"  # 3 in a row > 2
    status = service.status()
    assert status["updates_skipped"] == 5 and status["updates_skipped_recent"] == [9, 10, 12, 13, 14]
    again = MonitorState(tmp_path, MonitorConfig(warmup=4, window=16, skip_max_consecutive=2))
    assert again.status()["updates_skipped"] == 4  # the four judged "skipped" (14 was a rollback)
    assert [e.level for e in read_events(tmp_path) if e.type == "step"][8:10] == ["skipped", "skipped"]

    landed = MonitorState(tmp_path / "b", MonitorConfig(warmup=4, window=16))
    fake_checkpoint(tmp_path / "b", 4)
    for step in range(1, 9):
        landed.handle_metrics(metrics(step, grad=1.0 + 0.01 * (step % 3)))
    assert landed.handle_metrics(metrics(9, loss=40.0))["action"] == "rollback"


def test_an_instability_precursor_above_its_band_warns_before_the_loss_moves(tmp_path):
    """A report's precursors (monitoring.protocol.PRECURSORS) are graded against their own bands:
    a largest attention logit far above its usual level warns (on_instability_precursor=warn by
    default) while the loss is still normal, and rolls back when configured so; a non-finite one
    warns too; the page draws the precursor's chart once a run reports it."""
    from dataclasses import replace

    from monitoring.page import render_page
    from monitoring.service import MonitorState

    config = MonitorConfig(warmup=4, window=16, precursor_warmup=4)
    service = MonitorState(tmp_path, config)
    fake_checkpoint(tmp_path, 4)

    def measured(step, logit):
        precursors = {"attn_logit_max": logit, "update_ratio_max": 0.01}
        return replace(metrics(step, grad=1.0 + 0.01 * (step % 3)), precursors=precursors)

    for step in range(1, 9):
        assert service.handle_metrics(measured(step, 5.0 + 0.1 * (step % 2)))["verdict"]["level"] in (
            "warmup",
            "ok",
        )
    answer = service.handle_metrics(measured(9, 40.0))
    assert answer["action"] == "continue" and answer["verdict"]["level"] == "warn"
    assert [f["kind"] for f in answer["verdict"]["findings"]] == ["instability_precursor"]
    assert "attn_logit_max" in answer["verdict"]["findings"][0]["series"]
    assert service.handle_metrics(measured(10, float("inf")))["verdict"]["level"] == "warn"
    page = render_page(service.status(series=True))
    assert 'aria-label="largest attention logit, over layers (a precursor)"' in page
    strict = MonitorState(tmp_path / "b", replace(config, on_instability_precursor="rollback"))
    fake_checkpoint(tmp_path / "b", 4)
    for step in range(1, 9):
        strict.handle_metrics(measured(step, 5.0 + 0.1 * (step % 2)))
    assert strict.handle_metrics(measured(9, 40.0))["action"] == "rollback"
