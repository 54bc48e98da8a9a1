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


# --------------------------------------------------------------------------- writing and reading, with an engine


def test_rng_states_round_trip_through_json():
    import random

    import numpy as np
    import torch

    from pretrain.checkpoint import rng

    state = json.loads(json.dumps(rng.capture()))  # what the file holds
    drawn = (random.random(), np.random.rand(), torch.rand(3).tolist())
    rng.restore(state)
    assert (random.random(), np.random.rand(), torch.rand(3).tolist()) == drawn


def checkpointer(tmp_path, keep=2):
    import torch

    from pretrain.checkpoint.checkpointer import Checkpointer
    from tests.conftest import random_weights_model
    from tests.unit.fakes import ONE_PROCESS, FakeEngine

    model = random_weights_model()
    engine = FakeEngine(model, torch.optim.AdamW(model.parameters()))
    tokenizer = tmp_path / "tokenizer.model"
    tokenizer.write_bytes(b"a tokenizer")
    return engine, Checkpointer(
        tmp_path / "run", ONE_PROCESS, keep, {"model": {}}, tokenizer, "0123456789abcdef"
    )


def test_the_checkpointer_writes_complete_checkpoints_and_keeps_the_newest(tmp_path):
    from pretrain.checkpoint.checkpointer import TrainState, params_digest

    engine, saver = checkpointer(tmp_path, keep=2)
    run_dir = tmp_path / "run"
    ck.pin(run_dir, "step_00000001")
    for step in (1, 2, 3, 4):
        assert saver.save(engine, TrainState(step, tokens=100 * step), {"consumed": step}) == ck.tag_for(step)
    assert ck.tags_on_disk(run_dir) == ["step_00000001", "step_00000003", "step_00000004"]  # 1 is pinned
    assert ck.read_latest(run_dir) == "step_00000004"
    directory = ck.checkpoints_dir(run_dir) / "step_00000004"
    assert ck.check_complete(directory) is None
    state = json.loads((directory / "train_state.json").read_text())
    assert state == {"step": 4, "tokens": 400, "lr_scale": 1.0, "data": {"consumed": 4}, "world_size": 1,
                     "config_hash": "0123456789abcdef", "params_sha256": params_digest(engine)}  # fmt: skip
    assert (directory / "tokenizer.model").read_bytes() == b"a tokenizer"
    assert json.loads((directory / "run_config.json").read_text()) == {"model": {}}


def test_resuming_finds_the_checkpoint_and_knows_when_the_world_size_changed(tmp_path):
    from pretrain.checkpoint.checkpointer import TrainState, find_resume

    engine, saver = checkpointer(tmp_path)
    saver.save(engine, TrainState(7, tokens=70, lr_scale=0.5), {"consumed": 7})
    run_dir = tmp_path / "run"
    assert find_resume(run_dir, None, 1) is None
    same = find_resume(run_dir, "auto", 1)
    assert same.tag == "step_00000007" and not same.universal and same.data == {"consumed": 7}
    assert same.state == TrainState(7, 70, 0.5) and same.deepspeed_config({"a": 1}) == {"a": 1}
    other = find_resume(run_dir, "step_00000007", 4)
    assert other.universal
    assert other.deepspeed_config({"checkpoint": {"tag_validation": "Warn"}}) == {
        "checkpoint": {"tag_validation": "Warn", "load_universal": True}
    }


def test_restore_brings_back_weights_and_rng(tmp_path):
    import torch

    from pretrain.checkpoint.checkpointer import TrainState, find_resume

    engine, saver = checkpointer(tmp_path)
    saver.save(engine, TrainState(2), {"consumed": 2})
    weights = {k: v.clone() for k, v in engine.module.state_dict().items()}
    expected = torch.rand(4)  # what is drawn right after the save
    with torch.no_grad():
        for p in engine.module.parameters():
            p.add_(1.0)
    torch.rand(100)
    state = saver.restore(engine, find_resume(tmp_path / "run", "auto", 1))
    assert state.step == 2
    assert all(torch.equal(engine.module.state_dict()[k], v) for k, v in weights.items())
    assert torch.equal(torch.rand(4), expected)
