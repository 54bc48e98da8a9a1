"""A run directory left alone for a week, with real processes: one job per directory, the same
command resumes, another run's identity is refused, a corrupt rollback target is skipped, no rank
outlives its supervisor, a full disk ends in one line, and bad data is refused, not restarted."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from pretrain import checkpoint as ck
from pretrain import lifeline
from pretrain.reporting.metrics import tensorboard_dir
from tests.helpers import assert_one_line_error
from tests.integration.runs import FAST, TINY, events


def launch_command(run_dir, data_dir, *overrides, nproc=2):
    return [
        sys.executable,
        "-m",
        "pretrain",
        "launch",
        "--nproc",
        str(nproc),
        "--config",
        TINY,
        f"run.dir={run_dir}",
        f"data.dir={data_dir}",
        *FAST,
        "eval.every=0",
        "monitor.warmup=4",
        "monitor.window=16",
        *overrides,
    ]


# Tests of ownership, not of detection: a monitor that judges every step but never false-alarms
# on a resumed run's short history (false alarms are the detectors' business, tested elsewhere).
CALM = ["monitor.grad_norm_sigma=1000", "monitor.loss_sigma=1000"]


# What DeepSpeed and torch print by default that a `pretrain launch` must not show (see --verbose).
NOISE = (
    "[INFO]",
    "CUDA_VISIBLE_DEVICES",
    "built successfully",
    "FutureWarning",
    "DeprecationWarning",
    "Setting accelerator",
    "Unable to find hostfile",
    "Reconstructed",
    "Processing zero checkpoint",
)


def run(command, timeout=600):
    """(`timeout`: a safety net against a hang, as every job's in the suite, never what decides.)"""
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def step_events(run_dir) -> list[int]:
    path = Path(run_dir) / "events.jsonl"
    return [e["step"] for e in events(run_dir) if e["type"] == "step"] if path.exists() else []


def wait_for(condition, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return False


def processes_of(run_dir) -> list[psutil.Process]:
    """Every process whose command line names this run directory (launchers, ranks)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if any(f"run.dir={run_dir}" == part for part in process.info["cmdline"] or []):
            found.append(process)
    return found


def files_under(directory) -> dict:
    return {p: p.read_bytes() for p in Path(directory).rglob("*") if p.is_file()}


def test_one_job_per_directory_no_rank_outlives_its_supervisor_and_the_same_command_resumes(
    tmp_path, train_data
):
    """One run directory through a week's accidents: a second job is refused while one runs;
    Ctrl-C saves and stops; the same command resumes; a supervisor killed with -9 takes every
    rank with it (they save as they go); the same command finishes the run on one timeline; a
    different model there is refused, its checkpoints untouched. The console stays quiet."""
    command = launch_command(tmp_path, train_data, "train.steps=40", "checkpoint.every=1000", *CALM)
    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert wait_for(
        lambda: (
            f'"pid": {first.pid}' in (tmp_path / "run.lock").read_text(errors="replace")
            if (tmp_path / "run.lock").exists()
            else False
        )
    )
    second = run(command)
    assert_one_line_error(second, f"is in use by pid {first.pid} on", "wait for that job to end")
    assert wait_for(lambda: len(step_events(tmp_path)) >= 3)
    first.send_signal(signal.SIGINT)  # Ctrl-C: the job saves and stops
    output = first.communicate(timeout=300)[0]
    assert first.returncode == 130, output[-3000:]
    assert "asking the job to save a checkpoint and stop" in output
    # The ranks got SIGTERM from the supervisor and say what it was asked (issue 43).
    assert "SIGINT to pretrain launch, passed on as SIGTERM: saved" in output, output[-3000:]
    assert json.loads((tmp_path / "monitor" / "supervisor.json").read_text())["state"] == "stopped"
    stopped = ck.step_of(ck.newest_complete(tmp_path))
    assert stopped < 40 and step_events(tmp_path) == list(range(1, stopped + 1))  # every step monitored, once

    supervisor = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert wait_for(lambda: len(step_events(tmp_path)) >= stopped + 3)
    assert len(processes_of(tmp_path)) >= 3  # the launcher and two ranks, besides the supervisor
    supervisor.kill()  # kill -9: no chance to stop its job
    supervisor.wait()
    killed = time.time()
    gone_within = lifeline.POLL_SECONDS + lifeline.GRACE_SECONDS + 5  # the lifeline's promise, and a margin
    assert wait_for(lambda: not processes_of(tmp_path), timeout=gone_within), [
        p.info for p in processes_of(tmp_path)
    ]
    print(f"every process of the job was gone {time.time() - killed:.1f} s after the supervisor")
    saved = ck.newest_complete(tmp_path)
    assert ck.step_of(saved) > stopped  # the ranks saved as they stopped

    again = run(command)  # the same command, again
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"steps {ck.step_of(saved) + 1}..40 (resumed from {saved})" in again.stdout
    for noise in NOISE:  # a quiet console: our lines only
        assert noise not in again.stdout + again.stderr, noise
    assert "changed since the last start" not in again.stdout  # nothing the user changed (issue 29)
    assert (
        f"next: tensorboard --logdir {tmp_path / 'tensorboard'}\n      pretrain generate --checkpoint {tmp_path}"
        in (again.stdout)
    )  # where to look next (issue 29)
    steps = step_events(tmp_path)  # the killed supervisor's service may have missed its last steps
    assert steps[: stopped + 1] == [*range(1, stopped + 1), stopped + 1]  # the resume went on from there
    assert steps[-(40 - ck.step_of(saved)) :] == list(range(ck.step_of(saved) + 1, 41))  # ... and this one
    assert len(list(tensorboard_dir(tmp_path).glob("events.out.tfevents.*"))) == 3  # one per start
    complete = run(command)  # once more: the run is complete (issue 29: it trained "steps 41..40")
    assert complete.returncode == 0, complete.stdout[-3000:] + complete.stderr[-3000:]
    assert f"is already complete: step 40 of 40 is saved ({ck.newest_complete(tmp_path)})" in complete.stdout
    assert "training " not in complete.stdout and "launch: the job" not in complete.stdout
    assert step_events(tmp_path) == steps and len(list(tensorboard_dir(tmp_path).glob("events.out.*"))) == 3
    assert json.loads((tmp_path / "monitor" / "supervisor.json").read_text())["state"] == "completed"
    before = files_under(tmp_path / "checkpoints")
    changed = run([*command, "model.d_model=128", "model.n_heads=8"])
    assert_one_line_error(changed, "holds another run", "model.d_model 64 → 128", "--fresh")
    assert files_under(tmp_path / "checkpoints") == before  # byte-identical


def test_a_corrupt_rollback_target_is_set_aside_and_an_older_intact_one_used(tmp_path, train_data):
    # Checkpoints at 5 and 10; at step 12 the fp32 master weights of step_00000010 are changed (same
    # size); the spike at 13 rolls back: step_00000010 fails verification, step_00000005 is used.
    result = run(
        launch_command(
            tmp_path,
            train_data,
            "train.steps=20",
            "checkpoint.every=5",
            "faults.corrupt_checkpoint_step=12",
            "faults.spike_steps=[13]",
            "monitor.grad_norm_sigma=20",
            "monitor.loss_sigma=20",
        )
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    log = events(tmp_path)
    (corrupt,) = [e for e in log if e["type"] == "checkpoint_corrupt"]
    assert (
        corrupt["tag"] == "step_00000010" and "optim_states.pt does not match its sha256" in corrupt["reason"]
    )
    (applied,) = [e for e in log if e["type"] == "rollback_applied"]
    assert applied["requested"] == "step_00000010" and applied["tag"] == "step_00000005"
    assert applied["matches_checkpoint"] is True  # fp32 master weights included
    assert not [e for e in log if e["type"] == "circuit_breaker"]
    assert (tmp_path / "checkpoints" / "corrupt" / "step_00000010").is_dir()  # set aside, not deleted
    summary = json.loads((tmp_path / "train_summary.json").read_text())
    assert summary["completed"] and summary["step"] == 20 and summary["rollbacks"] == 1


def test_a_full_disk_ends_in_one_line_and_no_orphan(tmp_path, train_data):
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1200k", "tmpfs", str(mount)], capture_output=True
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {made.stderr.decode().strip()}")
    try:
        run_dir = mount / "run"
        result = run(
            launch_command(
                run_dir, train_data, "train.steps=12", "checkpoint.every=3", "logging.tensorboard=false"
            )
        )
        assert result.returncode == 4, result.stdout[-3000:] + result.stderr[-3000:]
        errors = [line for line in result.stderr.splitlines() if "error" in line]
        assert len(errors) == 1 and "could not be saved in" in errors[0] and "free)" in errors[0], (
            result.stderr
        )
        assert "Traceback" not in result.stderr + result.stdout
        assert "restart" not in result.stdout  # a full disk is not a crash to retry
        assert ck.tags_on_disk(run_dir) == []  # nothing that looks like a checkpoint
        assert not processes_of(run_dir)
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_out_of_range_ids_are_bad_input_and_not_restarted(tmp_path, train_data):
    data = shutil.copytree(train_data, tmp_path / "data")
    manifest = json.loads((data / "manifest.json").read_text())
    shard = data / manifest["splits"]["train"]["shards"][0]["file"]
    ids = np.fromfile(shard, dtype=manifest["dtype"])
    ids[len(ids) // 2 :] = 4095  # same size; half the windows hold ids a 512-piece vocabulary cannot
    ids.tofile(shard)
    result = run(launch_command(tmp_path / "run", data, "train.steps=6"))
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert "holds token id 4095 at token offset" in result.stderr and "pretrain data verify" in result.stderr
    assert "restart" not in result.stdout and "Traceback" not in result.stderr
    assert not os.path.exists(tmp_path / "run" / "checkpoints")
    # One line per rank: a rank that found it says what (here both do), a rank that lost such a
    # rank repeats its reason; the supervisor's line names the rank and what it found.
    said = [line for line in result.stderr.splitlines() if line.strip()]
    pattern = (
        r"pretrain: (?:error on rank (\d): .*holds token id 4095|rank (\d): stopped during step \d+: "
        r"rank \d stopped: .*holds token id 4095)"
    )
    ranks = sorted(next(g for g in re.match(pattern, line).groups() if g) for line in said)
    assert len(said) == 2 and ranks == ["0", "1"], result.stderr
    assert re.search(
        r"exited with status 2 \(bad input\): rank \d stopped during step \d+: .*holds token id 4095",
        result.stdout,
    ), result.stdout
