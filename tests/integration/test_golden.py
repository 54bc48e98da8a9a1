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
    same = {k: record[k] for k in ("steps", "eval", "checkpoints", "weights") if k in record}
    assert differences(same, record, exact=False) == []
    lost = same | {"eval": record["eval"][:-1]}
    assert any("evaluations at steps" in d for d in differences(lost, record, exact=False))
    step, numbers = next(iter(record["steps"].items()))
    drifted = json.loads(json.dumps(same))
    drifted["steps"][step]["train/loss"] = numbers["train/loss"] * (1 + 4 * drift_of("train/loss"))
    assert differences(drifted, record, exact=False) == [
        f"step {step} train/loss: {drifted['steps'][step]['train/loss']} != {numbers['train/loss']}"
    ]


def test_off_its_platform_weights_that_lost_updates_or_drifted_fail():
    """The fp32 master weights (DeepSpeed's zero_to_fp32 of each checkpoint) are compared off a
    recorded platform too: within tolerance of another platform's, but not a run whose step-20
    checkpoint holds step 10's weights (ten updates lost), nor one tensor moved by 4× the drift."""
    with_weights = [r for r in records() if "weights" in r]
    assert len(with_weights) >= 2, "the weights' drift is measured between at least two platforms"
    record, other = with_weights[0], with_weights[1]
    assert differences(other, record, exact=False) == []  # another platform's run passes
    assert differences(other, record, exact=True) != []  # (and is not the same bits)
    lost = json.loads(json.dumps(record))
    lost["weights"]["20"] = lost["weights"]["10"]
    failed = differences(lost, record, exact=False)
    assert failed and all(line.startswith("weights at step 20") for line in failed)
    nudged = json.loads(json.dumps(record))
    name, digest = next(iter(nudged["weights"]["20"].items()))
    digest["sample"][0] += 4 * drift_of("weights") * digest["rms"]
    assert differences(nudged, record, exact=False) == [
        f"weights at step 20 {name}: off by {4 * drift_of('weights'):.3g} of its RMS"
    ]


def drift_of(key: str) -> float:
    return measured_drift()[key]
