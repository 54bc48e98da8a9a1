import json
import os

import pytest

from pretrain import checkpoint as ck
from pretrain.errors import UserError


def make_checkpoint(run_dir, step, complete=True):
    directory = ck.checkpoints_dir(run_dir) / ck.tag_for(step)
    directory.mkdir(parents=True)
    (directory / "model_states.pt").write_bytes(os.urandom(1000))
    (directory / ck.TRAIN_STATE).write_text(json.dumps({"step": step}))
    if complete:
        ck.mark_complete(directory, {"step": step})
    return directory


def test_completion_marker_detects_every_kind_of_damage(tmp_path):
    directory = make_checkpoint(tmp_path, 10)
    assert ck.check_complete(directory) is None
    manifest = json.loads((directory / ck.COMPLETE).read_text())
    assert set(manifest["files"]) == {"model_states.pt", ck.TRAIN_STATE}
    data = (directory / "model_states.pt").read_bytes()
    (directory / "model_states.pt").write_bytes(
        data[:-1] + bytes([data[-1] ^ 1])
    )  # same size, one bit flipped
    assert "sha256" in ck.check_complete(directory)
    assert ck.check_complete(directory, verify_hashes=False) is None
    (directory / "model_states.pt").write_bytes(data[:500])
    assert "bytes" in ck.check_complete(directory, verify_hashes=False)
    (directory / "model_states.pt").unlink()
    assert "missing" in ck.check_complete(directory)
    assert "no completion marker" in ck.check_complete(make_checkpoint(tmp_path, 20, complete=False))


def test_resume_skips_incomplete_and_latest_only_names_complete(tmp_path):
    make_checkpoint(tmp_path, 10)
    make_checkpoint(tmp_path, 20, complete=False)
    with pytest.warns(UserWarning, match="skipping checkpoint .*step_00000020: no completion marker"):
        assert ck.resolve_resume(tmp_path, "auto") == "step_00000010"
    with pytest.raises(RuntimeError, match="refusing"):
        ck.set_latest(tmp_path, "step_00000020")
    ck.set_latest(tmp_path, "step_00000010")
    assert ck.read_latest(tmp_path) == "step_00000010"
    assert ck.resolve_resume(tmp_path, None) is None
    assert ck.resolve_resume(tmp_path, "step_00000010") == "step_00000010"
    with pytest.raises(UserError, match="cannot be resumed"):
        ck.resolve_resume(tmp_path, "step_00000020")
    assert ck.resolve_resume(tmp_path / "elsewhere", "auto") is None  # a fresh run


@pytest.mark.parametrize(
    "bad", ["../step_00000010", "step_10", "/etc/passwd", "step_00000010/../../x", "latest"]
)
def test_tags_cannot_escape_the_run_directory(tmp_path, bad):
    make_checkpoint(tmp_path, 10)
    with pytest.raises(UserError):
        ck.resolve_resume(tmp_path, bad)


def test_resume_by_path_must_be_inside_this_run(tmp_path):
    other = make_checkpoint(tmp_path / "other_run", 10)
    make_checkpoint(tmp_path / "run", 10)
    with pytest.raises(UserError, match="not a checkpoint of this run"):
        ck.resolve_resume(tmp_path / "run", str(other))
    assert (
        ck.resolve_resume(tmp_path / "run", str(tmp_path / "run" / "checkpoints" / "step_00000010"))
        == "step_00000010"
    )


def test_retention_keeps_newest_and_pinned(tmp_path):
    for step in (10, 20, 30, 40, 50):
        make_checkpoint(tmp_path, step)
    make_checkpoint(tmp_path, 25, complete=False)  # a crashed save: never completes
    make_checkpoint(tmp_path, 60, complete=False)  # newer than the newest complete: may be in progress
    ck.pin(tmp_path, "step_00000020")
    ck.set_latest(tmp_path, "step_00000050")
    deleted = ck.apply_retention(tmp_path, keep=2)
    assert sorted(deleted) == ["step_00000010", "step_00000025", "step_00000030"]
    assert ck.tags_on_disk(tmp_path) == ["step_00000020", "step_00000040", "step_00000050", "step_00000060"]
    ck.unpin(tmp_path, "step_00000020")
    assert ck.apply_retention(tmp_path, keep=2) == ["step_00000020"]


def test_find_checkpoint(tmp_path):
    make_checkpoint(tmp_path, 10)
    newest = make_checkpoint(tmp_path, 20)
    assert ck.find_checkpoint(tmp_path) == newest
    assert ck.find_checkpoint(tmp_path / "checkpoints") == newest
    assert ck.find_checkpoint(newest) == newest
    with pytest.raises(UserError, match="holds no complete checkpoint"):
        ck.find_checkpoint(tmp_path / "checkpoints" / "step_00000010" / "model_states.pt")
    with pytest.raises(UserError, match="does not exist"):
        ck.find_checkpoint(tmp_path / "nope")
