"""`checkpoint.async_save=true` in real 2-process jobs: a kill during a background save leaves the
previous checkpoint the newest intact one and the resumed run is the golden run, which saves
synchronously (losses, DeepSpeed's files byte for byte, the weight digests); a rollback the
monitor decides while a save is in flight waits for it and loads a complete checkpoint. (The slow
disk is `faults.slow_save_step`.)"""

import json

from pretrain import checkpoint as ck
from pretrain.checkpoint.background import record_file
from tests.integration.golden import OVERRIDES as GOLDEN
from tests.integration.runs import events, metrics, torchrun, train, train_state
from tests.integration.test_monitoring import _start_service

# The golden run's settings, saved every 5 steps instead of 10: the same computation, so the
# resumed run must be the golden run (tests/integration/golden.py), saved in the loop.
RUN = [*GOLDEN, "checkpoint.every=5", "checkpoint.keep=4"]


def _manifest(run_dir, step) -> dict:
    path = ck.checkpoints_dir(run_dir) / ck.tag_for(step) / ck.COMPLETE
    return json.loads(path.read_text())["files"]


def test_a_kill_during_a_background_save_keeps_the_previous_checkpoint_and_resumes_as_sync(
    tmp_path, golden_run, train_data
):
    """Rank 1 is killed (SIGKILL) as step 11 begins, while both ranks are still writing step 10's
    checkpoint in the background: rank 0 finished its part, but with rank 1's missing step 10 gets
    no marker, `latest` stays at step 5, and the next start resumes from step 5. The run is then
    the golden run, saved synchronously: its losses, DeepSpeed's files byte for byte, the weights'
    digests."""
    killed = train(
        torchrun(2),
        tmp_path,
        train_data,
        *RUN,
        "checkpoint.async_save=true",
        "faults.slow_save_step=10",
        "faults.slow_save_seconds=2",
        "faults.kill_step=11",
        "faults.kill_rank=1",
        check=False,
    )
    assert killed.returncode != 0, killed.stdout[-3000:]
    assert "checkpoint step_00000005 saved in the background" in killed.stdout
    assert "checkpoint step_00000010 saved" not in killed.stdout
    half = ck.checkpoints_dir(tmp_path) / "step_00000010"
    assert (half / record_file(0)).is_file()  # rank 0 wrote and hashed all of its part
    assert not (half / record_file(1)).exists()  # rank 1 did not
    assert not (half / ck.COMPLETE).exists()
    assert ck.read_latest(tmp_path) == "step_00000005"
    assert ck.newest_intact(tmp_path, read_only=True, log=lambda line: None) == "step_00000005"

    resumed = train(torchrun(2), tmp_path, train_data, *RUN, "checkpoint.async_save=true")
    assert "resumed from step_00000005" in resumed.stdout
    assert "step_00000010: no completion marker" in resumed.stderr
    ours, theirs = metrics(tmp_path), metrics(golden_run)
    for step in range(1, 21):
        assert ours[step]["train/loss"] == theirs[step]["train/loss"], step
        assert ours[step]["train/grad_norm"] == theirs[step]["train/grad_norm"], step
    for step in (10, 20):
        ours_files, theirs_files = _manifest(tmp_path, step), _manifest(golden_run, step)
        deepspeed_files = sorted(name for name in theirs_files if name.endswith(".pt"))
        assert deepspeed_files and [ours_files[n] for n in deepspeed_files] == [
            theirs_files[n] for n in deepspeed_files
        ], step  # byte for byte what the loop writes
        for key in ("tokens", "data", "params_sha256", "weights_sha256"):
            assert train_state(tmp_path, step)[key] == train_state(golden_run, step)[key], (step, key)
    for step in (10, 15, 20):
        assert ck.verify(ck.checkpoints_dir(tmp_path) / ck.tag_for(step)) is None
        assert not list((ck.checkpoints_dir(tmp_path) / ck.tag_for(step)).glob(".saved_rank_*"))
    assert ck.read_latest(tmp_path) == "step_00000020"


def test_a_rollback_decided_while_a_save_is_in_flight_waits_for_it(tmp_path, train_data):
    """Step 8's save pauses 3 s in the background; the spike at step 9 is rolled back (to step 4,
    the newest complete checkpoint when it was decided) at the boundary after step 10, while step 8
    is still being written: the rollback waits for it, loads step 4, and moves step 8, whole and
    intact, to abandoned/."""
    service, _, _ = _start_service(tmp_path, "monitor.warmup=4", "monitor.window=16")
    try:
        result = train(
            torchrun(2),
            tmp_path,
            train_data,
            "train.steps=12",
            "checkpoint.every=4",
            "eval.every=0",
            "checkpoint.async_save=true",
            "monitor.enabled=true",
            "monitor.timeout=0.5",
            "faults.spike_steps=[9]",
            "faults.slow_save_step=8",
            "faults.slow_save_seconds=3",
        )
    finally:
        service.terminate()
        service.wait(timeout=30)
    out = result.stdout
    rolling = out.index("rolling back to step_00000004")
    after = out[rolling:].splitlines()
    waited = next(i for i, line in enumerate(after) if line.startswith("checkpoint: waited"))
    assert "for step_00000008" in after[waited], out[-3000:]
    assert not any(line.startswith("step ") for line in after[:waited])  # before training went on
    (applied,) = [e for e in events(tmp_path) if e["type"] == "rollback_applied"]
    assert (applied["step"], applied["decided_at"], applied["abandoned"]) == (4, 9, ["step_00000008"])
    assert applied["matches_checkpoint"] is True
    root = ck.checkpoints_dir(tmp_path)
    assert ck.verify(root / "abandoned" / "step_00000008") is None  # finished before it was moved
    assert ck.read_latest(tmp_path) == "step_00000012"
    for tag in ck.tags_on_disk(tmp_path):
        assert ck.verify(root / tag) is None, tag
    assert json.loads((tmp_path / "train_summary.json").read_text())["completed"]
