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
    assert ck.newest_intact(tmp_path) == "step_00000010"
    assert ck.tags_on_disk(tmp_path) == ["step_00000010", "step_00000020"]  # an unfinished save is not moved
    with pytest.raises(RuntimeError, match="refusing"):
        ck.set_latest(tmp_path, "step_00000020")
    ck.set_latest(tmp_path, "step_00000010")
    assert ck.read_latest(tmp_path) == "step_00000010"
    assert ck.resolve_resume(tmp_path, "auto") is None and ck.resolve_resume(tmp_path, "fresh") is None
    assert ck.resolve_resume(tmp_path, "step_00000010") == "step_00000010"
    with pytest.raises(UserError, match="cannot be resumed"):
        ck.resolve_resume(tmp_path, "step_00000020")
    assert ck.newest_intact(tmp_path / "elsewhere") is None  # a fresh run


def flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))  # same size


def test_a_corrupt_checkpoint_is_set_aside_and_an_older_intact_one_used(tmp_path, capsys):
    from monitoring.protocol import read_events

    for step in (10, 20, 30):
        make_checkpoint(tmp_path, step)
    ck.set_latest(tmp_path, "step_00000030")
    ck.pin(tmp_path, "step_00000030")
    flip_a_byte(ck.checkpoints_dir(tmp_path) / "step_00000030" / "model_states.pt")
    flip_a_byte(ck.checkpoints_dir(tmp_path) / "step_00000020" / "model_states.pt")
    assert ck.newest_intact(tmp_path) == "step_00000010"
    assert ck.tags_on_disk(tmp_path) == ["step_00000010"]
    corrupt = ck.checkpoints_dir(tmp_path) / "corrupt"
    assert sorted(p.name for p in corrupt.iterdir()) == [
        "step_00000020",
        "step_00000030",
    ]  # moved, not deleted
    assert ck.read_latest(tmp_path) == "step_00000010" and ck.pinned(tmp_path) == set()
    events = [e for e in read_events(tmp_path) if e.type == "checkpoint_corrupt"]
    assert [e.tag for e in events] == ["step_00000030", "step_00000020"]
    assert all("model_states.pt does not match its sha256" in e.reason for e in events)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and "is corrupt (model_states.pt does not match its sha256)" in lines[0]
    # a rollback target: at most its step
    make_checkpoint(tmp_path, 40)
    assert ck.newest_intact(tmp_path, at_most=39) == "step_00000010"


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


def test_find_checkpoint(tmp_path, capsys):
    older = make_checkpoint(tmp_path, 10)
    newest = make_checkpoint(tmp_path, 20)
    assert ck.find_checkpoint(tmp_path) == newest
    assert ck.find_checkpoint(tmp_path / "checkpoints") == newest
    assert ck.find_checkpoint(newest) == newest
    with pytest.raises(UserError, match="holds no complete, intact checkpoint"):
        ck.find_checkpoint(tmp_path / "checkpoints" / "step_00000010" / "model_states.pt")
    with pytest.raises(UserError, match="does not exist"):
        ck.find_checkpoint(tmp_path / "nope")
    # read-only tools skip a corrupt checkpoint and move nothing
    flip_a_byte(newest / "model_states.pt")
    assert ck.find_checkpoint(tmp_path) == older
    assert "step_00000020 is corrupt" in capsys.readouterr().err
    assert ck.tags_on_disk(tmp_path) == ["step_00000010", "step_00000020"]
    with pytest.raises(UserError, match="not a usable checkpoint: model_states.pt does not match its sha256"):
        ck.find_checkpoint(newest)


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
    from pretrain.config import CheckpointConfig
    from tests.conftest import random_weights_model
    from tests.unit.fakes import ONE_PROCESS, FakeEngine

    model = random_weights_model()
    engine = FakeEngine(model, torch.optim.AdamW(model.parameters()))
    tokenizer = tmp_path / "tokenizer.model"
    tokenizer.write_bytes(b"a tokenizer")
    return engine, Checkpointer(
        tmp_path / "run",
        ONE_PROCESS,
        CheckpointConfig(keep=keep),
        run_config={"model": {}},
        tokenizer=tokenizer,
        config_hash="0123456789abcdef",
    )


def test_the_checkpointer_writes_complete_checkpoints_and_keeps_the_newest(tmp_path):
    from pretrain.checkpoint.checkpointer import TrainState, params_digest, weights_digest

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
    assert state == {
        "step": 4,
        "tokens": 400,
        "data": {"consumed": 4},
        "world_size": 1,
        "config_hash": "0123456789abcdef",
        "params_sha256": params_digest(engine),
        "weights_sha256": [weights_digest(engine)],
    }
    assert (directory / "tokenizer.model").read_bytes() == b"a tokenizer"
    assert json.loads((directory / "run_config.json").read_text()) == {"model": {}}


def test_resuming_finds_the_checkpoint_and_knows_when_the_world_size_changed(tmp_path):
    from pretrain.checkpoint.checkpointer import TrainState, choose_resume
    from pretrain.parallel.distributed import DistEnv
    from tests.unit.fakes import ONE_PROCESS

    engine, saver = checkpointer(tmp_path)
    saver.save(engine, TrainState(7, tokens=70, hooks={"monitor": {"lr": {"scale": 0.5}}}), {"consumed": 7})
    run_dir = tmp_path / "run"
    assert choose_resume(tmp_path / "elsewhere", "auto", ONE_PROCESS) is None
    same = choose_resume(run_dir, "auto", ONE_PROCESS)
    assert same.tag == "step_00000007" and not same.universal and same.data == {"consumed": 7}
    assert same.state == TrainState(7, 70, {"monitor": {"lr": {"scale": 0.5}}})
    assert same.deepspeed_config({"a": 1}) == {"a": 1}
    other = choose_resume(run_dir, "step_00000007", DistEnv(0, 0, 4))
    assert other.universal
    assert other.deepspeed_config({"checkpoint": {"tag_validation": "Warn"}}) == {
        "checkpoint": {"tag_validation": "Warn", "load_universal": True}
    }


def test_a_model_with_experts_resumes_at_another_layout_through_the_universal_format(tmp_path):
    """Another world size or parallel.expert: the universal conversion, which puts split experts
    and the balancing bias back (proven in tests/integration/test_experts.py)."""
    from pretrain.checkpoint.checkpointer import TrainState, choose_resume
    from pretrain.parallel.distributed import DistEnv
    from tests.unit.fakes import ONE_PROCESS

    engine, saver = checkpointer(tmp_path)
    saver.run_config = {"model": {"moe": {"experts": 8}}}
    saver.save(engine, TrainState(3), {"consumed": 3})
    run_dir = tmp_path / "run"
    assert not choose_resume(run_dir, "auto", ONE_PROCESS).universal
    assert choose_resume(run_dir, "auto", DistEnv(0, 0, 2)).universal
    assert choose_resume(run_dir, "auto", ONE_PROCESS, expert_parallel=2).universal


def test_resuming_from_an_older_checkpoint_moves_the_newer_timeline_aside(tmp_path):
    from pretrain.checkpoint.checkpointer import TrainState, choose_resume
    from tests.unit.fakes import ONE_PROCESS

    engine, saver = checkpointer(tmp_path, keep=3)
    for step in (1, 2, 3):
        saver.save(engine, TrainState(step), {"consumed": step})
    run_dir = tmp_path / "run"
    newer = (ck.checkpoints_dir(run_dir) / "step_00000003" / "model.safetensors").read_bytes()
    assert choose_resume(run_dir, "step_00000001", ONE_PROCESS).tag == "step_00000001"
    assert ck.tags_on_disk(run_dir) == ["step_00000001"] and ck.read_latest(run_dir) == "step_00000001"
    abandoned = ck.checkpoints_dir(run_dir) / "abandoned"
    assert (abandoned / "step_00000003" / "model.safetensors").read_bytes() == newer  # moved, never rewritten
    saver.save(engine, TrainState(2), {"consumed": 2})  # this timeline's own step 2
    assert sorted(p.name for p in abandoned.iterdir()) == ["step_00000002", "step_00000003"]


def test_a_failed_save_leaves_nothing_behind_and_stops_once_the_retries_are_spent(tmp_path, capsys):
    import errno

    from pretrain.checkpoint.checkpointer import CheckpointSaveError, TrainState

    engine, saver = checkpointer(tmp_path)
    saver.save_retries = 1
    assert saver.save(engine, TrainState(1), {"consumed": 1}) == "step_00000001"

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    engine.save_checkpoint = full_disk
    assert saver.save(engine, TrainState(2), {"consumed": 2}) is None
    run_dir = tmp_path / "run"
    assert ck.tags_on_disk(run_dir) == ["step_00000001"] and ck.read_latest(run_dir) == "step_00000001"
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert (
        "checkpoint step_00000002 could not be saved in" in line and "free): No space left on device" in line
    )
    with pytest.raises(CheckpointSaveError, match="2 failed save\\(s\\) in a row") as failure:
        saver.save(engine, TrainState(3), {"consumed": 3})
    assert failure.value.exit_code == 4 and ck.tags_on_disk(run_dir) == ["step_00000001"]
    saver.failures = 0
    with pytest.raises(CheckpointSaveError, match="it was the run's last save"):  # no next save to retry at
        saver.save(engine, TrainState(4), {"consumed": 4}, last=True)


def test_a_save_is_not_tried_without_room_for_it(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from pretrain.checkpoint.checkpointer import TrainState

    engine, saver = checkpointer(tmp_path)
    saver.save(engine, TrainState(1), {"consumed": 1})
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 100, 100))
    engine.save_checkpoint = lambda *a, **k: pytest.fail("a save without room was tried")
    saver.save_retries = 5
    assert saver.save(engine, TrainState(2), {"consumed": 2}) is None


def test_restore_brings_back_weights_and_rng(tmp_path):
    import torch

    from pretrain.checkpoint.checkpointer import TrainState, choose_resume
    from tests.unit.fakes import ONE_PROCESS

    engine, saver = checkpointer(tmp_path)
    saver.save(engine, TrainState(2), {"consumed": 2})
    weights = {k: v.clone() for k, v in engine.module.state_dict().items()}
    expected = torch.rand(4)  # what is drawn right after the save
    with torch.no_grad():
        for p in engine.module.parameters():
            p.add_(1.0)
    torch.rand(100)
    state = saver.restore(engine, choose_resume(tmp_path / "run", "auto", ONE_PROCESS))
    assert state.step == 2
    assert all(torch.equal(engine.module.state_dict()[k], v) for k, v in weights.items())
    assert torch.equal(torch.rand(4), expected)
    assert saver.matches(
        engine,
        json.loads((ck.checkpoints_dir(tmp_path / "run") / "step_00000002" / "train_state.json").read_text()),
    )


def test_the_run_builder_restores_the_engine_and_the_tasks_data_position(tmp_path):
    """`run_builder.restore`: resuming, the checkpoint's weights, optimizer and RNG states go into
    the engine and its data position into the task (a position from its step where it recorded
    none: fine-tuning's older checkpoints); a fresh start is step 0 with nothing loaded."""
    import dataclasses

    import torch

    from pretrain.checkpoint.checkpointer import TrainState, choose_resume, weights_digest
    from pretrain.run_builder import restore
    from tests.unit.fakes import ONE_PROCESS

    class Task:
        def __init__(self):
            self.loaded = []

        def load_state_dict(self, state):
            self.loaded.append(state)

    engine, saver = checkpointer(tmp_path)
    saver.save(engine, TrainState(3, tokens=300), {"consumed": 3})
    saved, expected = weights_digest(engine), torch.rand(4)  # (drawn right after the save)
    with torch.no_grad():
        for p in engine.module.parameters():
            p.add_(1.0)
    task, resume = Task(), choose_resume(tmp_path / "run", "auto", ONE_PROCESS)
    assert restore(
        saver, engine, task, resume, lambda step: pytest.fail("it has its position")
    ) == TrainState(3, tokens=300)
    assert weights_digest(engine) == saved and torch.equal(torch.rand(4), expected)
    assert task.loaded == [{"consumed": 3}]
    unrecorded = dataclasses.replace(resume, saved={k: v for k, v in resume.saved.items() if k != "data"})
    assert restore(saver, engine, task, unrecorded, lambda step: {"examples": 4 * step}).step == 3
    assert task.loaded[-1] == {"examples": 12}
    assert restore(saver, engine, task, None) == TrainState() and len(task.loaded) == 2


def test_a_rollback_is_seen_not_to_match_its_checkpoint_when_any_held_weight_differs(tmp_path):
    """`matches_checkpoint` (the rollback_applied event): the bf16 module weights and the fp32 master
    weights the optimizer holds apart from them (as DeepSpeed's bf16 optimizers do) are both in the
    digest, so a load that restored one and not the other is seen."""
    import torch

    from pretrain.checkpoint.checkpointer import TrainState

    engine, saver = checkpointer(tmp_path)
    masters = [p.detach().float().clone().view(-1) for p in engine.module.parameters()]
    engine.optimizer.single_partition_of_fp32_groups = masters  # where ZeRO-1/2 keeps them
    saver.save(engine, TrainState(2), {"consumed": 2})
    saved = json.loads(
        (ck.checkpoints_dir(tmp_path / "run") / "step_00000002" / "train_state.json").read_text()
    )
    assert saver.matches(engine, saved) is True
    kept = masters[0][0].item()
    masters[0][0] += 1.0  # the master weights alone differ (the module's are as saved)
    assert saver.matches(engine, saved) is False
    masters[0][0] = kept
    assert saver.matches(engine, saved) is True
    with torch.no_grad():
        next(engine.module.parameters()).view(-1)[0] += 1.0  # the module's alone
    assert saver.matches(engine, saved) is False
    assert saver.matches(engine, saved | {"weights_sha256": ["x", "y"]}) is None  # another world size


def test_a_checkpoint_from_before_the_monitors_hook_kept_the_lr_scale_still_gives_it():
    """train_state.json once held the rollbacks' learning-rate scale at its top level; the
    monitor's hook gets it (the one scale is its `LrScale` now)."""
    from pretrain.checkpoint.checkpointer import Resume

    old = Resume("step_00000007", {"step": 7, "tokens": 70, "lr_scale": 0.25}, universal=False)
    assert old.state.hooks == {"monitor": {"lr": {"scale": 0.25}}}
    assert Resume("step_00000007", {"step": 7, "lr_scale": 1.0}, universal=False).state.hooks == {}


def test_a_load_keeps_each_groups_learning_rate_scale_from_the_config(tmp_path):
    """torch's load_state_dict puts the saved parameter groups' keys in place: the scale of each
    group's learning rate (Muon's muon_lr / lr) stays the config's, also when optim.muon_lr changed
    or the checkpoint was saved before groups carried one."""
    from pretrain.checkpoint.checkpointer import TrainState
    from pretrain.optim.muon import LR_SCALE

    engine, saver = checkpointer(tmp_path, keep=3)
    group = engine.optimizer.param_groups
    group[0][LR_SCALE] = 20.0
    saved_with_20 = saver.save(engine, TrainState(3), {"consumed": 3})
    del group[0][LR_SCALE]
    saved_without = saver.save(engine, TrainState(4), {"consumed": 4})
    engine.optimizer.param_groups[0][LR_SCALE] = 30.0  # (the config now: optim.muon_lr raised)
    for tag in (saved_with_20, saved_without):
        saver.load(engine, tag)
        assert engine.optimizer.param_groups[0][LR_SCALE] == 30.0, tag
