"""`monitor.skip_step` in the real loop, 2 processes, ZeRO-2 bf16: an injected loss spike's update
never lands (the checkpoints before and after it hold the same fp32 master weights, as DeepSpeed's
own zero_to_fp32 reads them), the step is recorded (metrics, an `update_skipped` event) and
training goes on; the running levels are kept in the checkpoint, so a resumed run judges a spike
at once, as the run would have."""

import math

import pytest
import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from monitoring.protocol import UpdateSkipped, read_events
from tests.integration.runs import metrics, torchrun, train, train_state

SKIP = [
    "monitor.skip_step=true",
    "monitor.skip_window=8",
    "eval.every=0",
    "checkpoint.every=1",
    "checkpoint.keep=20",
]


@pytest.fixture(scope="module")
def skipped_run(tmp_path_factory, train_data):
    run_dir = tmp_path_factory.mktemp("skip") / "run"
    train(
        torchrun(2),
        run_dir,
        train_data,
        *SKIP,
        "train.steps=10",
        "faults.spike_steps=[9]",
        "faults.spike_factor=20",
    )
    return run_dir


def weights(run_dir, step) -> dict[str, torch.Tensor]:
    return get_fp32_state_dict_from_zero_checkpoint(str(run_dir / "checkpoints"), tag=f"step_{step:08d}")


def test_a_spiking_steps_update_never_lands_and_training_goes_on(skipped_run):
    per_step = metrics(skipped_run)
    assert [s for s, m in per_step.items() if m.get("train/update_skipped")] == [9]
    assert per_step[9]["train/loss"] > 10 * per_step[8]["train/loss"]  # the spike, as judged
    assert math.isfinite(per_step[9]["train/grad_norm"])  # the real norm (DeepSpeed says inf)
    assert per_step[9]["train/skipped_steps"] == 1 and per_step[10]["train/skipped_steps"] == 1
    (event,) = [e for e in read_events(skipped_run) if isinstance(e, UpdateSkipped)]
    assert event.step == 9 and "loss_spike" in event.reasons and event.loss_level > 0
    before, after, next_ = (weights(skipped_run, s) for s in (8, 9, 10))
    assert all(torch.equal(before[k], after[k]) for k in before)  # bit for bit: nothing landed
    assert any(not torch.equal(after[k], next_[k]) for k in after)  # the next step trained
    assert len(train_state(skipped_run, 10)["hooks"]["skip_step"]["loss"]) == 8  # (skip_window)


def test_the_levels_survive_a_resume(skipped_run, train_data):
    """With the levels back from step 10's checkpoint, a spike at step 11 is skipped at once;
    with empty levels (8 values needed first) it would have landed."""
    train(
        torchrun(2),
        skipped_run,
        train_data,
        *SKIP,
        "train.steps=12",
        "faults.spike_steps=[9,11]",
        "faults.spike_factor=20",
    )
    per_step = metrics(skipped_run)
    assert [s for s, m in per_step.items() if m.get("train/update_skipped")] == [9, 11]
    assert all(
        torch.equal(a, b)
        for a, b in zip(weights(skipped_run, 10).values(), weights(skipped_run, 11).values(), strict=True)
    )
