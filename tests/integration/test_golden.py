"""Numerics are sacred: the golden run reproduces its recorded losses, gradient norms, data
positions and weight digests bit for bit (torchtitan's rule for changes that should not change
computation)."""

import json

from tests.integration.golden import GOLDEN_FILE, summarize


def test_the_golden_run_is_bitwise_unchanged(golden_run, train_data):
    expected = json.loads(GOLDEN_FILE.read_text())
    actual = summarize(golden_run, train_data)
    assert actual["data_fingerprint"] == expected["data_fingerprint"], (
        "the test corpus is not the one the golden run was recorded on (another Python's pydoc "
        "topics or another sentencepiece): the comparison below would mean nothing"
    )
    for step, numbers in expected["steps"].items():
        assert actual["steps"][step] == numbers, f"step {step}"
    assert actual["steps"].keys() == expected["steps"].keys()
    assert actual["eval"] == expected["eval"]
    assert actual["checkpoints"] == expected["checkpoints"]
