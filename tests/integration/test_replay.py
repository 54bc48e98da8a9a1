"""`monitor.replay` in the real loop, 2 processes, ZeRO-2 bf16 (issue 46): a rejected step is run
again on every rank. A flipped gradient bit on rank 1 (a transient machine fault) gives other
values the second time: a `machine_fault` event names rank 1 and its host, the update stays
skipped, and the run goes on exactly as a run in which that step was skipped without a fault (a
NaN loss there, which the replay reproduces: the data, no `machine_fault`)."""

import pytest

from monitoring.protocol import MachineFault, read_events
from tests.integration.runs import metrics, torchrun, train

REPLAY = ["monitor.replay=true", "eval.every=0", "checkpoint.every=100", "train.steps=5"]


@pytest.fixture(scope="module")
def flipped_and_skipped(tmp_path_factory, train_data):
    root = tmp_path_factory.mktemp("replay")
    flipped, skipped = root / "flipped", root / "skipped"
    train(torchrun(2), flipped, train_data, *REPLAY, "faults.flip_step=3", "faults.flip_rank=1")
    train(torchrun(2), skipped, train_data, *REPLAY, "faults.nan_steps=[3]")
    return flipped, skipped


def test_a_flipped_gradient_bit_is_a_machine_fault_of_rank_1(flipped_and_skipped):
    flipped, skipped = flipped_and_skipped
    (fault,) = [e for e in read_events(flipped) if isinstance(e, MachineFault)]
    assert fault.step == 3 and fault.ranks == [1] and len(fault.hosts) == 1
    assert float(fault.first[0][1]) > 1e6 * float(fault.replay[0][1])  # its gradient norm: the flip, then not
    per_step = metrics(flipped)
    assert per_step[2]["train/skipped_steps"] == 0 and per_step[3]["train/skipped_steps"] == 1  # skipped
    assert not [e for e in read_events(skipped) if isinstance(e, MachineFault)]  # a NaN replays as NaN
    other = metrics(skipped)
    for step in (4, 5):  # after the skipped step: bit for bit the run that skipped it for the data
        assert per_step[step]["train/loss"] == other[step]["train/loss"], step
