"""What DeepSpeed's bf16 ZeRO does with a non-finite gradient in the real loop, on a 2-process ZeRO-3
job (docs/monitoring.md, "A NaN on the real engine"): the step is skipped, and the checkpoint after
it holds the weights and the optimizer state of the checkpoint before it, as DeepSpeed's own
zero_to_fp32 reads them and as the optimizer files hold them. The same skip on ZeRO-1, ZeRO-2 and
both offloads, every tensor compared on the engine itself, is in test_skip_step.py (one shared job)."""

import math

import pytest
import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from tests.integration.runs import metrics, torchrun, train, train_state

OVERFLOW = "[deepspeed] OVERFLOW! Skipping step. Gradients are non-finite, weights were not updated."


def optimizer_tensors(checkpoint) -> dict[str, torch.Tensor]:
    """Every tensor in every rank's optimizer file, by its path in the file: Adam's step, exp_avg,
    exp_avg_sq and the fp32 master partitions, in whichever layout the stage writes."""
    found = {}

    def walk(value, path):
        if torch.is_tensor(value):
            found[path] = value
        elif isinstance(value, dict | list | tuple):
            for key, item in value.items() if isinstance(value, dict) else enumerate(value):
                walk(item, f"{path}/{key}")

    for file in sorted(checkpoint.glob("*optim_states.pt")):
        walk(torch.load(file, weights_only=False)["optimizer_state_dict"], file.name)
    return found


@pytest.mark.parametrize("stage", [3], ids=["zero3"])  # ZeRO-1/2: test_skip_step.py, on the engine
def test_a_nan_gradient_is_skipped_and_leaves_weights_and_optimizer_unchanged(tmp_path, train_data, stage):
    """Step 2's loss is NaN (so is every gradient); checkpoints after steps 1, 2 and 3."""
    result = train(
        torchrun(2),
        tmp_path,
        train_data,
        "train.steps=3",
        "checkpoint.every=1",
        "checkpoint.keep=3",
        "eval.every=0",
        "faults.nan_steps=[2]",
        f"engine.deepspeed_config=configs/deepspeed/zero{stage}.json",
    )
    assert result.stdout.count(OVERFLOW) == 1, result.stdout[-3000:]
    steps = metrics(tmp_path)
    assert math.isnan(steps[2]["train/loss"]) and steps[2]["train/grad_norm"] == math.inf
    assert [steps[s]["train/skipped_steps"] for s in (1, 2, 3)] == [0, 1, 1]
    assert math.isfinite(steps[3]["train/loss"]) and math.isfinite(steps[3]["train/grad_norm"])

    root = tmp_path / "checkpoints"
    fp32 = {s: get_fp32_state_dict_from_zero_checkpoint(str(root), tag=f"step_{s:08d}") for s in (1, 2, 3)}
    optim = {s: optimizer_tensors(root / f"step_{s:08d}") for s in (1, 2, 3)}
    assert {"step", "exp_avg", "exp_avg_sq"} <= {path.rsplit("/", 1)[1] for path in optim[1]}
    assert fp32[1] and fp32[1].keys() == fp32[2].keys() == fp32[3].keys()
    assert optim[1].keys() == optim[2].keys() == optim[3].keys()
    # Across the NaN step nothing moved: fp32 master weights, Adam's moments, its step count.
    assert all(torch.equal(fp32[1][name], fp32[2][name]) for name in fp32[1])
    assert all(torch.equal(optim[1][path], optim[2][path]) for path in optim[1])
    # The next step trains: every parameter tensor changes, and Adam counts its second step.
    assert not any(torch.equal(fp32[2][name], fp32[3][name]) for name in fp32[2])
    adam_steps = {s: {t.item() for path, t in optim[s].items() if path.endswith("/step")} for s in (1, 2, 3)}
    assert adam_steps == {1: {1.0}, 2: {1.0}, 3: {2.0}}
    # The bf16 module weights every rank holds (ZeRO-3 keeps only shards, and no bf16 copy in its
    # checkpoint: there they are the fp32 master weights cast, compared above).
    digests = [train_state(tmp_path, s)["params_sha256"] for s in (1, 2, 3)]
    if stage < 3:
        assert digests[0] == digests[1] != digests[2]
    # What each rank holds of the weights (module and fp32 master; its shards under ZeRO-3), the
    # digest a rollback compares after loading (Checkpointer.matches), is unchanged too.
    held = [train_state(tmp_path, s)["weights_sha256"] for s in (1, 2, 3)]
    assert held[0] == held[1] and all(a != b for a, b in zip(held[1], held[2], strict=True))
