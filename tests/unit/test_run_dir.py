"""Owning a run directory: the lock, the run's identity, starting over; the data checked before it
is trusted; rollback pins released; the supervisor's own state on a full disk."""

import errno
import json
import os
import shutil
import socket

import numpy as np
import pytest

from pretrain import checkpoint as ck
from pretrain.config import load_config
from pretrain.errors import UserError
from pretrain.run_dir import LOCK_FILE, RUN_FILE, RunLock, claim
from tests.helpers import FAST, TINY, assert_one_line_error
from tests.unit.fakes import pretraining_trainer


def test_one_lock_per_run_directory_and_a_dead_holder_never_blocks(tmp_path):
    first = RunLock(tmp_path / "run").acquire()
    holder = json.loads((tmp_path / "run" / LOCK_FILE).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    with pytest.raises(UserError, match=f"is in use by pid {os.getpid()} on {socket.gethostname()} since"):
        RunLock(tmp_path / "run").acquire()
    first.release()  # what the OS does when the holder dies, however it dies
    with RunLock(tmp_path / "run"):
        pass


def test_identity_is_checked_and_other_changes_listed(tmp_path, capsys):
    run_dir = tmp_path / "run"
    identity = {"model.d_model": 64, "data.fingerprint": "abc", "data.seq_len": 512}
    config = {"optim": {"lr": 3e-3}, "checkpoint": {"resume": "auto"}, "model": {"d_model": 64}}
    assert claim(run_dir, identity, config, "auto") == "auto"
    (ck.checkpoints_dir(run_dir) / "step_00000010").mkdir(parents=True)
    before = (run_dir / RUN_FILE).read_bytes()
    with pytest.raises(
        UserError, match=r"holds another run \(data.seq_len 512 → 1024; model.d_model 64 → 128\)"
    ):
        claim(run_dir, identity | {"model.d_model": 128, "data.seq_len": 1024}, config, "auto")
    assert (run_dir / RUN_FILE).read_bytes() == before  # nothing written
    capsys.readouterr()
    claim(
        run_dir, identity, config | {"optim": {"lr": 1e-3}, "checkpoint": {"resume": "step_00000010"}}, "auto"
    )
    assert capsys.readouterr().out.strip() == "changed since the last start: optim.lr 0.003 → 0.001"


def test_a_run_recorded_before_a_key_was_added_is_the_same_run_at_the_keys_old_value(tmp_path, capsys):
    """A run directory recorded before `model.qk_norm` or `loss.z_loss` existed resumes with them at
    the value its run had (off), with no "changed" line; turned on, it is another run."""
    run_dir = tmp_path / "run"
    identity, config = {"model.d_model": 64}, {"optim": {"lr": 3e-3}, "model": {"d_model": 64}}
    claim(run_dir, identity, config, "auto")
    (ck.checkpoints_dir(run_dir) / "step_00000010").mkdir(parents=True)
    capsys.readouterr()
    now = config | {"model": {"d_model": 64, "qk_norm": False}, "loss": {"z_loss": 0.0}}
    claim(run_dir, identity | {"model.qk_norm": False}, now, "auto")
    assert capsys.readouterr().out.strip() == ""
    with pytest.raises(UserError, match=r"holds another run \(model.qk_norm False → True\)"):
        claim(run_dir, identity | {"model.qk_norm": True}, now, "auto")


def test_a_run_recorded_before_head_dim_and_moe_is_the_same_dense_run(tmp_path, capsys):
    """`model.head_dim` (derived: d_model / n_heads) and `model.moe` (null) came later: a dense run
    recorded without them resumes with no "changed" line; experts make it another run."""
    run_dir = tmp_path / "run"
    identity = {"model.d_model": 64, "model.n_heads": 4}
    config = {"model": {"d_model": 64, "n_heads": 4}}
    claim(run_dir, identity, config, "auto")
    (ck.checkpoints_dir(run_dir) / "step_00000010").mkdir(parents=True)
    capsys.readouterr()
    now = identity | {"model.head_dim": 16, "model.moe": None}
    claim(run_dir, now, {"model": {"d_model": 64, "n_heads": 4, "head_dim": 16, "moe": None}}, "auto")
    assert capsys.readouterr().out.strip() == ""
    with pytest.raises(UserError, match=r"model.head_dim 16 → 32"):
        claim(run_dir, identity | {"model.head_dim": 32}, config, "auto")
    with pytest.raises(UserError, match=r"model.moe None → \{'experts': 8\}"):
        claim(run_dir, now | {"model.moe": {"experts": 8}}, config, "auto")


def test_fresh_moves_the_earlier_run_aside_and_deletes_nothing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    claim(run_dir, {"model.d_model": 64}, {}, "auto")
    (ck.checkpoints_dir(run_dir) / "step_00000010").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("{}\n")
    with RunLock(run_dir):
        assert claim(run_dir, {"model.d_model": 128}, {}, "fresh") == "auto"
    (previous,) = (run_dir / "previous").iterdir()
    assert {p.name for p in previous.iterdir()} == {"checkpoints", "metrics.jsonl", RUN_FILE}
    assert sorted(p.name for p in run_dir.iterdir()) == sorted([LOCK_FILE, "previous", RUN_FILE])
    assert "--fresh: moved the earlier run" in capsys.readouterr().out


def test_the_same_command_resumes_and_a_changed_identity_is_refused(tmp_path, train_data):
    overrides = [*FAST, f"run.dir={tmp_path}", f"data.dir={train_data}", "eval.every=0", "checkpoint.every=2"]
    pretraining_trainer(load_config(TINY, [*overrides, "train.steps=2"])).train()
    trainer = pretraining_trainer(load_config(TINY, [*overrides, "train.steps=4"]))
    assert trainer.state.step == 2  # resumed by default
    trainer.train()
    files = {p: p.read_bytes() for p in ck.checkpoints_dir(tmp_path).rglob("*") if p.is_file()}
    with pytest.raises(UserError, match=r"model.d_model 64 → 128"):
        pretraining_trainer(load_config(TINY, [*overrides, "train.steps=4", "model.d_model=128"]))
    assert {p: p.read_bytes() for p in ck.checkpoints_dir(tmp_path).rglob("*") if p.is_file()} == files


# --------------------------------------------------------------------------- data


def copy_of(train_data, tmp_path):
    return shutil.copytree(train_data, tmp_path / "data")


def test_a_swapped_tokenizer_and_a_short_validation_split_are_refused_before_anything_starts(
    tmp_path, train_data, cli
):
    data = copy_of(train_data, tmp_path)
    run_dir = tmp_path / "run"
    common = ["--config", TINY, *FAST, f"run.dir={run_dir}", f"data.dir={data}"]
    assert_one_line_error(
        cli("train", *common, "data.seq_len=100000", "model.max_seq_len=100000"), "the validation split of"
    )
    (data / "tokenizer.model").write_bytes((data / "tokenizer.model").read_bytes() + b"x")
    assert_one_line_error(cli("train", *common), "is not the tokenizer the shards in", "restore it")
    assert not run_dir.exists()


def test_out_of_range_ids_stop_the_loader_naming_the_shard_and_offset(tmp_path, train_data, cli):
    from pretrain.data import BatchLoader, WindowStream

    data = copy_of(train_data, tmp_path)
    manifest = json.loads((data / "manifest.json").read_text())
    shard = data / manifest["splits"]["train"]["shards"][0]["file"]
    ids = np.fromfile(shard, dtype=manifest["dtype"])
    ids[1000] = 4095  # same size, an id a 512-piece vocabulary cannot hold
    ids.tofile(shard)
    loader = BatchLoader(WindowStream(data, 512, seed=0), batch_size=64)
    with pytest.raises(
        UserError, match=f"{shard} holds token id 4095 at token offset 1000, but the vocabulary has 512"
    ):
        for _ in range(100):
            next(loader)
    result = cli("data", "verify", str(data))
    assert result.returncode == 2 and "holds id 4095 at token offset 1000" in result.stderr
    assert "GB/s" in result.stdout


def test_data_verify_passes_an_intact_dataset_and_reports_its_throughput(train_data, cli):
    result = cli("data", "verify", str(train_data))
    assert result.returncode == 0, result.stderr
    assert "GB/s" in result.stdout and "every shard matches its sha256" in result.stdout


# --------------------------------------------------------------------------- pins and the supervisor


def test_a_rollback_pin_is_released_once_a_checkpoint_past_the_anomaly_is_complete(tmp_path):
    """The service pins what the policy says retention must keep, on disk, at every judged step."""
    from monitoring.protocol import Outcome
    from monitoring.service import MonitorState
    from pretrain.config import MonitorConfig
    from tests.unit.test_monitor import fake_checkpoint, metrics

    ck.pin(tmp_path, "step_00000003")  # left by an earlier service
    service = MonitorState(tmp_path, MonitorConfig(warmup=4, window=16, rollback_margin=0))
    for step in (5, 10):
        fake_checkpoint(tmp_path, step)
    for step in range(1, 13):
        service.handle_metrics(metrics(step, grad=1.0 + 0.01 * (step % 3)))
    assert ck.pinned(tmp_path) == {"step_00000010"}  # the stale pin is gone
    rollback = service.handle_metrics(metrics(13, grad=80.0))["rollback"]
    assert rollback["target"] == "step_00000010"
    service.handle_outcome(Outcome(rollback["decision"], 13, True, 13, rollback["target"]), None, None)
    fake_checkpoint(tmp_path, 12)  # the trainer went back to 10 and saved again, not yet past 13
    service.handle_metrics(metrics(13))
    assert ck.pinned(tmp_path) == {"step_00000010", "step_00000012"}
    fake_checkpoint(tmp_path, 14)  # past the anomaly: the rollback's target is an ordinary checkpoint again
    service.handle_metrics(metrics(15))
    assert ck.pinned(tmp_path) == {"step_00000014"}
    assert ck.apply_retention(tmp_path, keep=2) == ["step_00000005", "step_00000010"]


def test_a_failing_write_of_the_supervisors_state_is_one_line(tmp_path, monkeypatch):
    from monitoring import supervisor as supervision
    from pretrain.config import MonitorConfig

    lines = []
    sup = supervision.Supervisor(lambda start: ["true"], tmp_path, MonitorConfig(), log=lines.append)
    try:

        def full_disk(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(supervision.atomic, "write_json", full_disk)
        sup._set_state("running", 0)
        sup._set_state("running", 1)
        assert len(lines) == 1 and "No space left on device" in lines[0] and "still supervising" in lines[0]
    finally:
        sup.server.server_close()


def test_the_lifeline_knows_a_live_supervisor_from_a_dead_or_reused_pid():
    from pretrain.lifeline import owner_tag, supervisor_alive

    tag = owner_tag(os.getpid())
    assert supervisor_alive(tag)
    host, pid, started = tag.rsplit(":", 2)
    assert not supervisor_alive(f"{host}:{pid}:{float(started) - 5:.3f}")  # the pid was reused
    assert not supervisor_alive(f"{host}:{2**22 + 7}:{started}")


def test_pretrain_verify_reports_each_checkpoint_and_its_throughput(tmp_path, cli):
    from tests.unit.test_checkpoint import flip_a_byte, make_checkpoint

    make_checkpoint(tmp_path, 10)
    newest = make_checkpoint(tmp_path, 20)
    result = cli("verify", "--checkpoint", str(tmp_path))
    assert result.returncode == 0 and result.stdout.count("intact") == 2 and "GB/s" in result.stdout
    flip_a_byte(newest / "model_states.pt")
    result = cli("verify", "--checkpoint", str(tmp_path))
    assert (
        result.returncode == 2 and "step_00000020: model_states.pt does not match its sha256" in result.stdout
    )
    assert "1 of 2 checkpoint(s) failed verification" in result.stderr
    assert ck.tags_on_disk(tmp_path) == ["step_00000010", "step_00000020"]  # read-only


def test_a_renamed_key_is_no_change(tmp_path, capsys):
    """A run recorded with checkpoint.async (now checkpoint.async_save) resumes without listing
    the rename as a change; a changed value is still listed, under the new name."""
    run_dir = tmp_path / "run"
    identity = {"model.d_model": 64}
    claim(run_dir, identity, {"checkpoint": {"async": True}}, "auto")
    (ck.checkpoints_dir(run_dir) / "step_00000010").mkdir(parents=True)
    capsys.readouterr()
    claim(run_dir, identity, {"checkpoint": {"async_save": True}}, "auto")
    assert "changed since" not in capsys.readouterr().out
    claim(run_dir, identity, {"checkpoint": {"async_save": False}}, "auto")
    assert (
        capsys.readouterr().out.strip() == "changed since the last start: checkpoint.async_save True → False"
    )
