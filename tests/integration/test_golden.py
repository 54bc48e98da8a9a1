"""Numerics are sacred: the golden run reproduces its recorded losses, gradient norms, data
positions and weight digests bit for bit (torchtitan's rule for changes that should not change
computation) on a platform it was recorded on; on another CPU, within the tolerance that
another CPU's kernels explain (tests/integration/golden.py says why)."""

import json

from tests.integration.golden import (
    TOLERANCE,
    assert_matches_golden,
    differences,
    measured_drift,
    records,
    summarize,
)


def test_the_golden_run_is_bitwise_unchanged(golden_run, train_data):
    assert_matches_golden(summarize(golden_run, train_data))


def test_the_cross_platform_tolerances_follow_the_measured_drift():
    """Off a recorded platform the comparison is only as strict as its tolerances: each is set at
    about twice the largest difference between two recorded platforms, never loose enough to let
    a real change through as "another CPU"."""
    drift = measured_drift()
    assert all(drift.values()), drift  # every tolerance is backed by a measured difference
    for key, tolerance in TOLERANCE.items():
        assert 1.5 * drift[key] <= tolerance <= 3 * drift[key], (key, tolerance, drift[key])


def test_off_its_platform_a_run_that_lost_an_evaluation_or_drifted_fails():
    """The comparison a machine without a record makes, against a recorded run changed as a
    regression would change it."""
    record = records()[-1]
    same = {k: record[k] for k in ("steps", "eval", "checkpoints")}
    assert differences(same, record, exact=False) == []
    lost = same | {"eval": record["eval"][:-1]}
    assert any("evaluations at steps" in d for d in differences(lost, record, exact=False))
    step, numbers = next(iter(record["steps"].items()))
    drifted = json.loads(json.dumps(same))
    drifted["steps"][step]["train/loss"] = numbers["train/loss"] * (1 + 4 * drift_of("train/loss"))
    assert differences(drifted, record, exact=False) == [
        f"step {step} train/loss: {drifted['steps'][step]['train/loss']} != {numbers['train/loss']}"
    ]


def drift_of(key: str) -> float:
    return measured_drift()[key]
