"""Where `checkpoints/latest` points after a real job sets a corrupt checkpoint aside: at the newest
intact checkpoint, with several intact ones older than the corrupt one. A 1-process job saves
checkpoints at steps 2, 4, 6, 8 and 10; step 10's fp32 master weights are then changed on disk
(same size, other bytes); the same command run again verifies step 10 before loading it, sets it
aside, resumes from step 8, and is killed as step 9 begins, before any save could move `latest`
again. What it leaves is what the next reader sees: `latest` names step 8, and DeepSpeed's own
zero_to_fp32, given checkpoints/ and no tag, reads step 8's weights. The unit tier:
tests/unit/test_checkpoint_latest.py."""

import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from pretrain import checkpoint as ck
from tests.integration.runs import events, torchrun, train

JOB = ["train.steps=12", "checkpoint.every=2", "checkpoint.keep=5", "eval.every=0"]


def test_latest_names_the_newest_intact_checkpoint_after_a_resume_sets_a_corrupt_one_aside(
    tmp_path, train_data
):
    train(torchrun(1), tmp_path, train_data, *JOB, "train.stop_at_step=10")
    assert ck.tags_on_disk(tmp_path) == [ck.tag_for(s) for s in (2, 4, 6, 8, 10)]
    assert ck.read_latest(tmp_path) == "step_00000010"
    (optimizer_file,) = (ck.checkpoints_dir(tmp_path) / "step_00000010").glob("*optim_states.pt")
    data = bytearray(optimizer_file.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 256] = bytes(
        b ^ 0xFF for b in data[len(data) // 2 : len(data) // 2 + 256]
    )
    optimizer_file.write_bytes(bytes(data))

    killed = train(torchrun(1), tmp_path, train_data, *JOB, "faults.kill_step=9", check=False)
    assert killed.returncode != 0
    assert "faults: killing rank 0 as step 9 begins" in killed.stderr, killed.stderr[-3000:]
    (corrupt,) = [e for e in events(tmp_path) if e["type"] == "checkpoint_corrupt"]
    assert (
        corrupt["tag"] == "step_00000010" and "optim_states.pt does not match its sha256" in corrupt["reason"]
    )
    assert "resumed from step_00000008" in killed.stdout, killed.stdout[-3000:]

    assert ck.read_latest(tmp_path) == "step_00000008"  # the newest intact, not step_00000002
    assert ck.tags_on_disk(tmp_path) == [ck.tag_for(s) for s in (2, 4, 6, 8)]
    root = str(ck.checkpoints_dir(tmp_path))
    following_latest = get_fp32_state_dict_from_zero_checkpoint(root)  # (no tag: DeepSpeed reads `latest`)
    step_8 = get_fp32_state_dict_from_zero_checkpoint(root, tag="step_00000008")
    step_2 = get_fp32_state_dict_from_zero_checkpoint(root, tag="step_00000002")
    assert all(torch.equal(following_latest[k], step_8[k]) for k in step_8)
    assert any(not torch.equal(following_latest[k], step_2[k]) for k in step_2)
