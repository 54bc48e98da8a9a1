"""Numerics are sacred: the golden run reproduces its recorded losses, gradient norms, data
positions and weight digests bit for bit (torchtitan's rule for changes that should not change
computation) on a platform it was recorded on; on another CPU, within the tolerance that
another CPU's kernels explain (tests/integration/golden.py says why)."""

from tests.integration.golden import assert_matches_golden, summarize


def test_the_golden_run_is_bitwise_unchanged(golden_run, train_data):
    assert_matches_golden(summarize(golden_run, train_data))
