"""`monitor.replay` in the real loop, 2 processes, ZeRO-2 bf16 (issue 46): a rejected step is run
again on every rank. A flipped gradient bit on rank 1 (a transient machine fault) gives other
values the second time: a `machine_fault` event names rank 1 and its host, the update stays
skipped, and the run goes on exactly as a run in which that step was skipped without a fault (a
NaN loss there, which the replay reproduces: the data, no `machine_fault`). A flipped weight bit
in rank 1's copy (a fault that stays) makes the replicas differ: `replica_mismatch` names rank 1,
the run goes back to the newest checkpoint whose replicas were consistent, quarantines nothing,
and completes with every later checkpoint consistent."""

import json
import math
from pathlib import Path

import pytest

from monitoring.protocol import MachineFault, ReplicaMismatch, read_events
from tests.integration.runs import metrics, torchrun, train, train_state

REPLAY = ["monitor.replay=true", "eval.every=0", "checkpoint.every=100", "train.steps=5"]


@pytest.fixture(scope="module")
def flipped_and_skipped(tmp_path_factory, train_data):
    root = tmp_path_factory.mktemp("replay")
    flipped, skipped = root / "flipped", root / "skipped"
    train(torchrun(2), flipped, train_data, *REPLAY, "faults.flip_step=3", "faults.flip_rank=1")
    train(torchrun(2), skipped, train_data, *REPLAY, "faults.nan_steps=[3]")
    return flipped, skipped


def test_under_zero3_the_skip_guard_rejects_a_flipped_gradient_and_the_replay_names_rank_1(
    tmp_path, train_data
):
    """Under ZeRO-3 the flipped gradient stays finite through its fp32 reduction (4e36): DeepSpeed
    clips it and would apply it; the skip guard (monitor.skip_step, its window warm after 2 steps)
    rejects the update, and the replay finds rank 1's gradient changed: a machine fault."""
    guard = ["monitor.skip_step=true", "monitor.skip_window=2"]
    flip = [
        "faults.flip_step=4",
        "faults.flip_rank=1",
        "engine.deepspeed_config=configs/deepspeed/zero3.json",
    ]
    train(torchrun(2), tmp_path, train_data, *REPLAY, *guard, *flip, "train.steps=4")
    events = read_events(tmp_path)
    (fault,) = [e for e in events if isinstance(e, MachineFault)]
    assert fault.step == 4 and fault.ranks == [1]
    assert not math.isfinite(float(fault.first[0][1])) and math.isfinite(float(fault.replay[0][1]))
    assert [e.step for e in events if e.type == "update_skipped"] == [4]


@pytest.fixture(scope="module", params=[1, 2, 3], ids=["zero1", "zero2", "zero3"])
def weight_flipped(request, tmp_path_factory, train_data):
    """ZeRO-1/2: a bit of rank 1's copy of rank 0's partition; ZeRO-3: of rank 1's shard, the one
    copy, with no parameter kept whole (as a large model's are not: the tiny model's all are)."""
    root = tmp_path_factory.mktemp("replicas")
    config = json.loads(Path(f"configs/deepspeed/zero{request.param}.json").read_text())
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    (root / "ds.json").write_text(json.dumps(config))
    flip = ["faults.flip_step=3", "faults.flip_rank=1", "faults.flip_target=weight"]
    overrides = [*REPLAY, *flip, f"engine.deepspeed_config={root / 'ds.json'}", "checkpoint.every=2"]
    train(torchrun(2), root / "run", train_data, *overrides, "train.steps=6")
    return root / "run"


def test_a_flipped_weight_bit_is_a_replica_mismatch_of_rank_1_rolled_back(weight_flipped):
    events = read_events(weight_flipped)
    (mismatch,) = [e for e in events if isinstance(e, ReplicaMismatch)]
    # the flip lands after step 3's update; step 4 is non-finite on rank 1, rejected, and checked
    assert mismatch.step == 4 and mismatch.ranks == [1] and len(mismatch.hosts) == 1
    assert mismatch.rolled_back_to == "step_00000002" and mismatch.tensors
    assert not [e for e in events if isinstance(e, MachineFault)]  # (checked before the replay)
    assert not (weight_flipped / "quarantine.jsonl").exists()  # the data is innocent
    records = [json.loads(line) for line in (weight_flipped / "metrics.jsonl").read_text().splitlines()]
    losses = {}
    for record in records:
        if "train/loss" in record:
            losses.setdefault(record["step"], []).append(record["train/loss"])
    assert len(losses[3]) == 2 and losses[3][0] == losses[3][1]  # step 3 again, from step 2: the same
    assert all(len(v) == 1 for step, v in losses.items() if step > 4)
    for step in (4, 6):  # every later checkpoint: its replicas found consistent as it was saved
        assert train_state(weight_flipped, step)["hooks"]["replicas"]["checked_at"] == step
    counts = json.loads((weight_flipped / "monitor" / "machine_faults.json").read_text())
    assert list(counts.values()) == [1]


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


def test_through_the_service_a_machine_fault_is_not_rolled_back_and_the_data_is_quarantined(
    tmp_path, train_data
):
    """One 2-process run reporting to the real monitoring service, replay on: a gradient flip on
    rank 1 at step 3 (a machine fault: the update skipped, judged `skipped`, no rollback, nothing
    quarantined), then a NaN loss at step 6, which the replay reproduces (the data): the service
    rolls back and that step's windows are quarantined, as without the replay."""
    from tests.integration.test_monitoring import _start_service

    process, _, _ = _start_service(tmp_path, "monitor.warmup=4", "monitor.window=16")
    try:
        faults = ["faults.flip_step=3", "faults.flip_rank=1", "faults.nan_steps=[6]"]
        monitored = ["monitor.enabled=true", "monitor.replay=true", "monitor.quarantine=true"]
        train(
            torchrun(2),
            tmp_path,
            train_data,
            *REPLAY,
            *faults,
            *monitored,
            "checkpoint.every=2",
            "train.steps=10",
        )
    finally:
        process.terminate()
        process.wait(timeout=30)
    events = read_events(tmp_path)
    assert [(e.step, e.ranks) for e in events if isinstance(e, MachineFault)] == [(3, [1])]
    lines = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["step"], e["finding"]) for e in lines if e["type"] == "rollback"] == [(6, "nonfinite")]
    assert [e["level"] for e in lines if e["type"] == "step" and e["step"] == 3] == ["skipped"]
    (quarantined,) = [json.loads(line) for line in (tmp_path / "quarantine.jsonl").read_text().splitlines()]
    assert quarantined["step"] == 6 and len(quarantined["windows"]) == 4  # (2 ranks x 2 windows)
