"""`checkpoint.async_save` in one process, without a process group: the copy taken in the loop,
the completion marker written only once the background writer is done, failures counted at the
next wait, the key in YAML, overrides, `config show` and run.json (and its former name,
`checkpoint.async`), and the slow-save fault. The real 2-process runs (a kill during a save, a rollback while one is in flight)
are tests/integration/test_async_checkpoint.py."""

from __future__ import annotations

import errno
import io
import json
import threading
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from pretrain import checkpoint as ck
from pretrain.checkpoint import background
from pretrain.checkpoint.checkpointer import Checkpointer, CheckpointSaveError, TrainState, weights_digest
from pretrain.config import CheckpointConfig, FaultsConfig, load_config, to_yaml
from pretrain.errors import ConfigError
from pretrain.run_dir import flatten
from tests.helpers import TINY
from tests.unit.fakes import ONE_PROCESS, FakeEngine

# ----------------------------------------------------------------------------------- the copy


def test_the_copy_keeps_views_and_sharing_and_nothing_later_reaches_it():
    flat = torch.arange(12, dtype=torch.float32)
    config = {"lr": [1.0]}
    state = {
        "module": {"a": flat[:4], "b": flat[4:].view(2, 4)},  # views of one buffer, as under ZeRO
        "master": flat,
        "step": torch.tensor(3),
        "config": config,
    }
    before = io.BytesIO()
    torch.save(state, before)
    copied = background.snapshot(state)
    flat.add_(100)  # the next optimizer step, in place
    config["lr"][0] = 0.5
    assert torch.equal(copied["master"], torch.arange(12, dtype=torch.float32))
    assert copied["config"] == {"lr": [1.0]}
    storage = copied["master"].untyped_storage()
    assert copied["module"]["a"].untyped_storage().data_ptr() == storage.data_ptr()  # one copy, shared
    assert copied["module"]["b"].storage_offset() == 4 and copied["module"]["b"].shape == (2, 4)
    assert storage.data_ptr() != flat.untyped_storage().data_ptr()
    after = io.BytesIO()
    torch.save(copied, after)
    assert after.getvalue() == before.getvalue()  # the file a synchronous save would have written


def test_tensors_met_in_two_state_dicts_are_copied_once():
    weight = torch.nn.Parameter(torch.ones(3))
    storages: dict = {}
    one = background.snapshot({"w": weight.detach()}, storages)
    two = background.copy_tensor(weight, storages)
    assert len(storages) == 1 and one["w"].untyped_storage().data_ptr() == two.untyped_storage().data_ptr()
    assert isinstance(two, torch.nn.Parameter) and two.requires_grad


# ------------------------------------------------------------------------------ the marker


def test_the_manifest_takes_the_writers_hashes_only_for_files_of_their_size(tmp_path):
    (tmp_path / "a.pt").write_bytes(b"a" * 10)
    (tmp_path / "b.pt").write_bytes(b"b" * 10)
    (tmp_path / "c.json").write_bytes(b"{}")
    (tmp_path / background.record_file(1)).write_text("{}")  # hidden: never in the manifest
    claimed = {"bytes": 10, "sha256": "from-the-writer"}
    ck.mark_complete(tmp_path, {"step": 1}, {"a.pt": claimed, "b.pt": {"bytes": 9, "sha256": "stale"}})
    files = json.loads((tmp_path / ck.COMPLETE).read_text())["files"]
    assert set(files) == {"a.pt", "b.pt", "c.json"}
    assert files["a.pt"] == claimed
    assert files["b.pt"] == ck.layout.file_entry(tmp_path / "b.pt") and files["c.json"]["bytes"] == 2


# ------------------------------------------------------------------------- the checkpointer


class Writer:
    """What DeepSpeed's TorchCheckpointEngine does, and can be held (`gate`) or made to fail."""

    def __init__(self):
        self.gate = threading.Event()
        self.gate.set()
        self.fail: OSError | None = None

    def save(self, state_dict, path):
        self.gate.wait(30)
        if self.fail is not None:
            raise self.fail
        torch.save(state_dict, path)

    def load(self, path, map_location=None):
        return torch.load(path, map_location=map_location, weights_only=False)

    def makedirs(self, path, exist_ok=False):
        Path(path).mkdir(parents=True, exist_ok=exist_ok)

    def create(self, info):
        pass

    def commit(self, info):
        return True

    def is_decoupled(self):
        return False

    def is_data_parallel_writer(self, dp_rank):
        return dp_rank == 0

    def preserves_storage_sharing(self):
        return True


class WriterEngine(FakeEngine):
    """FakeEngine saving as DeepSpeed's engine does: each state dict through its checkpoint engine."""

    def __init__(self, module, optimizer):
        super().__init__(module, optimizer)
        self.checkpoint_engine = Writer()

    def save_checkpoint(self, save_dir, tag, client_state=None, save_latest=True):
        directory = Path(save_dir) / tag
        self.checkpoint_engine.makedirs(directory, exist_ok=True)
        state = {"module": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}
        self.checkpoint_engine.save(state, str(directory / "model_states.pt"))

    def load_checkpoint(self, load_dir, tag, load_module_strict=True, load_lr_scheduler_states=True):
        state = self.checkpoint_engine.load(str(Path(load_dir) / tag / "model_states.pt"))
        self.module.load_state_dict(state["module"], strict=load_module_strict)
        self.optimizer.load_state_dict(state["optimizer"])
        return str(Path(load_dir) / tag), {}


def background_checkpointer(tmp_path, **config):
    from tests.conftest import random_weights_model

    model = random_weights_model()
    engine = WriterEngine(model, torch.optim.AdamW(model.parameters()))
    tokenizer = tmp_path / "tokenizer.model"
    tokenizer.write_bytes(b"a tokenizer")
    saver = Checkpointer(
        tmp_path / "run",
        ONE_PROCESS,
        CheckpointConfig(keep=2, async_save=True),
        run_config={"checkpoint": {"async_save": True}},
        tokenizer=tokenizer,
        config_hash="0123456789abcdef",
        faults=FaultsConfig(**config),
    )
    return engine, saver, tmp_path / "run"


def test_the_marker_comes_only_once_the_background_writer_is_done(tmp_path):
    engine, saver, run_dir = background_checkpointer(tmp_path)
    assert saver.in_background
    assert saver.save(engine, TrainState(1), {"consumed": 1}) is None  # in flight
    assert saver.wait() == "step_00000001" and ck.read_latest(run_dir) == "step_00000001"
    digest, weights = weights_digest(engine), {k: v.clone() for k, v in engine.module.state_dict().items()}
    engine.checkpoint_engine.gate.clear()  # a slow disk
    assert saver.save(engine, TrainState(2), {"consumed": 2}) is None
    with torch.no_grad():
        for p in engine.module.parameters():
            p.add_(1.0)  # the next steps, while the save is written
    in_flight = ck.checkpoints_dir(run_dir) / "step_00000002"
    assert not (in_flight / ck.COMPLETE).exists() and ck.read_latest(run_dir) == "step_00000001"
    assert ck.newest_intact(run_dir) == "step_00000001"  # what a rollback or a restart would take
    engine.checkpoint_engine.gate.set()
    assert saver.wait() == "step_00000002" and saver.pending is None
    assert ck.verify(in_flight) is None and ck.read_latest(run_dir) == "step_00000002"
    saved = json.loads((in_flight / ck.TRAIN_STATE).read_text())
    assert saved["weights_sha256"] == [digest] and saved["step"] == 2 and saved["data"] == {"consumed": 2}
    assert not list(in_flight.glob(".saved_rank_*"))
    _loaded, matches = saver.load(engine, "step_00000002")
    assert matches and all(torch.equal(engine.module.state_dict()[k], v) for k, v in weights.items())


def test_a_load_and_the_last_save_wait_for_the_save_in_flight(tmp_path):
    engine, saver, run_dir = background_checkpointer(tmp_path)
    saver.save(engine, TrainState(1), {"consumed": 1})
    engine.checkpoint_engine.gate.clear()
    saver.save(engine, TrainState(2), {"consumed": 2})
    threading.Timer(0.3, engine.checkpoint_engine.gate.set).start()
    saved, _ = saver.load(engine, "step_00000001")  # (a rollback): waits, then loads
    assert saved["step"] == 1 and ck.check_complete(ck.checkpoints_dir(run_dir) / "step_00000002") is None
    assert saver.save(engine, TrainState(3), {"consumed": 3}, last=True) == "step_00000003"  # complete
    assert saver.pending is None and ck.read_latest(run_dir) == "step_00000003"


def test_a_failed_background_save_counts_at_the_next_wait(tmp_path, capsys):
    engine, saver, run_dir = background_checkpointer(tmp_path)
    saver.save_retries = 1
    saver.save(engine, TrainState(1), {"consumed": 1}, last=True)
    engine.checkpoint_engine.fail = OSError(errno.ENOSPC, "No space left on device")
    assert saver.save(engine, TrainState(2), {"consumed": 2}) is None  # its failure is not known yet
    assert saver.wait() is None and saver.failures == 1
    assert ck.tags_on_disk(run_dir) == ["step_00000001"] and ck.read_latest(run_dir) == "step_00000001"
    assert "checkpoint step_00000002 could not be saved" in capsys.readouterr().err
    saver.save(engine, TrainState(3), {"consumed": 3})
    with pytest.raises(CheckpointSaveError, match="2 failed save\\(s\\) in a row"):
        saver.save(engine, TrainState(4), {"consumed": 4})  # waits for 3 first: its failure stops the job


def test_an_engine_it_cannot_copy_through_is_saved_in_the_loop(tmp_path, capsys):
    engine, saver, _run_dir = background_checkpointer(tmp_path)
    del engine.checkpoint_engine
    engine.save_checkpoint = FakeEngine.save_checkpoint.__get__(engine)
    assert saver.save(engine, TrainState(1), {"consumed": 1}) == "step_00000001"  # done, in the loop
    assert not saver.in_background and "saving in the loop" in capsys.readouterr().err


def test_the_slow_save_fault_pauses_that_steps_save(tmp_path, capsys):
    assert FaultsConfig(slow_save_step=4, slow_save_seconds=0.2).save_pause(4) == 0.2
    assert FaultsConfig(slow_save_step=4, slow_save_seconds=0.2).save_pause(3) == 0.0
    assert FaultsConfig().save_pause(4) == 0.0
    with pytest.raises(ConfigError, match="faults.slow_save_seconds"):
        FaultsConfig(slow_save_seconds=-1)
    engine, saver, _ = background_checkpointer(tmp_path, slow_save_step=2, slow_save_seconds=0.2)
    saver.save(engine, TrainState(2), {"consumed": 2}, last=True)
    assert "pausing the save of step_00000002 for 0.2 s" in capsys.readouterr().out


# ---------------------------------------------------------------------------------- the key


def test_checkpoint_async_save_is_a_key_in_yaml_overrides_config_show_and_run_json(tmp_path):
    assert CheckpointConfig().async_save is False and load_config(TINY).checkpoint.async_save is False
    cfg = load_config(TINY, ["checkpoint.async_save=true"])
    assert cfg.checkpoint.async_save is True
    assert "  async_save: true" in to_yaml(cfg).splitlines()  # pretrain config show
    assert flatten(asdict(cfg))["checkpoint.async_save"] is True  # run.json, run_config.json
    text = Path(TINY).read_text().replace("checkpoint:\n", "checkpoint:\n  async_save: true\n")
    (tmp_path / "run.yaml").write_text(text)
    assert load_config(tmp_path / "run.yaml").checkpoint.async_save is True
    with pytest.raises(ConfigError, match="checkpoint.async_save"):
        load_config(TINY, ["checkpoint.async_save=sometimes"])


def test_the_former_name_checkpoint_async_still_reads_with_one_note(tmp_path, capsys):
    """`checkpoint.async` (its name until the rename) in a YAML file or an override is read as
    `checkpoint.async_save`, with one line on stderr, once; a fine-tuned checkpoint's saved
    run_config.json that holds it loads without a note (its user did not write it)."""
    from pretrain.config import finetune_config_from_dict, loading

    loading._note_renamed.cache_clear()
    assert load_config(TINY, ["checkpoint.async=true"]).checkpoint.async_save is True
    text = Path(TINY).read_text().replace("checkpoint:\n", "checkpoint:\n  async: true\n")
    (tmp_path / "run.yaml").write_text(text)
    assert load_config(tmp_path / "run.yaml").checkpoint.async_save is True
    assert load_config(tmp_path / "run.yaml", ["checkpoint.async=false"]).checkpoint.async_save is False
    err = capsys.readouterr().err
    assert err == "note: checkpoint.async is deprecated, read as checkpoint.async_save: rename it\n"
    with pytest.raises(ConfigError, match="checkpoint.async and checkpoint.async_save are both set"):
        load_config(TINY, ["checkpoint.async=true", "checkpoint.async_save=true"])
    with pytest.raises(ConfigError, match="checkpoint.async_save"):
        load_config(TINY, ["checkpoint.async=sometimes"])
    loading._note_renamed.cache_clear()
    saved = {"finetune": {"init": "a run"}, "data": {"train": "a.csv"}, "checkpoint": {"async": True}}
    assert finetune_config_from_dict(saved).checkpoint.async_save is True
    assert capsys.readouterr().err == ""
