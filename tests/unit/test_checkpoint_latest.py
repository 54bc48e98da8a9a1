"""Where `checkpoints/latest` points once a corrupt checkpoint is set aside
(pretrain/checkpoint/integrity.py): at the newest intact checkpoint, never at an older one, with
several intact checkpoints older than the corrupt one (so that "the newest" and "the oldest" differ).
Retention always keeps what `latest` names, and DeepSpeed's own readers (zero_to_fp32, a load
without a tag) follow it. With real processes: tests/integration/test_latest_after_corruption.py."""

import json
import os

from pretrain import checkpoint as ck
from pretrain.checkpoint.checkpointer import choose_resume
from tests.unit.fakes import ONE_PROCESS


def make_checkpoints(run_dir, *steps) -> None:
    """Complete checkpoints at `steps`, `latest` at the last, as saves leave them."""
    for step in steps:
        directory = ck.checkpoints_dir(run_dir) / ck.tag_for(step)
        directory.mkdir(parents=True)
        (directory / "model_states.pt").write_bytes(os.urandom(1000))
        (directory / ck.TRAIN_STATE).write_text(json.dumps({"step": step, "world_size": 1}))
        ck.mark_complete(directory, {"step": step})
        ck.set_latest(run_dir, ck.tag_for(step))


def corrupt(run_dir, step) -> None:
    """Same size, other bytes: only its sha256 tells."""
    path = ck.checkpoints_dir(run_dir) / ck.tag_for(step) / "model_states.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_latest_names_the_newest_intact_checkpoint_once_a_corrupt_newest_is_set_aside(tmp_path, capsys):
    make_checkpoints(tmp_path, 10, 20, 30, 40, 50)
    corrupt(tmp_path, 50)
    assert ck.newest_intact(tmp_path) == "step_00000040"
    assert ck.read_latest(tmp_path) == "step_00000040"  # not step_00000010, the oldest
    # Retention keeps the newest two, and what `latest` names is among them: nothing old stays.
    ck.apply_retention(tmp_path, keep=2)
    assert ck.tags_on_disk(tmp_path) == ["step_00000030", "step_00000040"]
    assert "step_00000050 is corrupt" in capsys.readouterr().err


def test_latest_skips_every_corrupt_checkpoint_down_to_the_newest_intact(tmp_path):
    """Two corrupt checkpoints in a row above three intact ones: `latest` ends at the newest
    intact, past the newest complete one (which is corrupt too)."""
    make_checkpoints(tmp_path, 10, 20, 30, 40, 50)
    corrupt(tmp_path, 50)
    corrupt(tmp_path, 40)
    assert ck.newest_intact(tmp_path) == "step_00000030"
    assert ck.read_latest(tmp_path) == "step_00000030"
    assert sorted(p.name for p in (ck.checkpoints_dir(tmp_path) / "corrupt").iterdir()) == [
        "step_00000040",
        "step_00000050",
    ]


def test_a_resume_past_a_corrupt_checkpoint_leaves_latest_at_the_one_it_resumed_from(tmp_path):
    """The training path (checkpoint.resume=auto, what a restart runs): the corrupt newest is set
    aside, the run resumes from the newest intact one, and `latest` names it."""
    make_checkpoints(tmp_path, 10, 20, 30, 40)
    corrupt(tmp_path, 40)
    resume = choose_resume(tmp_path, "auto", ONE_PROCESS, log=lambda line: None)
    assert resume.tag == "step_00000030" and resume.state.step == 30
    assert ck.read_latest(tmp_path) == "step_00000030"


def test_a_corrupt_rollback_target_below_latest_leaves_latest_alone(tmp_path):
    """A rollback's target (at most step 35) is corrupt while `latest` names an intact, newer
    checkpoint: the next older intact one is loaded and `latest` does not move."""
    make_checkpoints(tmp_path, 10, 20, 30, 40)
    corrupt(tmp_path, 30)
    assert ck.newest_intact(tmp_path, at_most=35, log=lambda line: None) == "step_00000020"
    assert ck.read_latest(tmp_path) == "step_00000040"
