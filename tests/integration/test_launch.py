"""`pretrain launch`: the service with the DeepSpeed job under it, restarted after a killed rank
or a hung one, the restart budget, the circuit breaker and NaN rollbacks, all with real processes."""

import json
import os
import re
import subprocess
import sys

import torch

from pretrain.config import REPO_CONFIG_DIR
from pretrain.parallel.distributed import free_port
from tests.integration.runs import FAST, TINY, events, metrics


def launch(run_dir, data, *overrides, nproc=2, timeout=600, script=False):
    """`data`: a prepared corpus, or {name: corpus} for a mixture of equal weights. `script`: through
    launch/single_node.sh (NPROC, MASTER_PORT), as a user of the launch scripts starts it."""
    if isinstance(data, dict):
        sources = ",".join(f"{{name: {name}, dir: '{d}', weight: 1}}" for name, d in data.items())
        data_setting = f"data.mixture=[{sources}]"
    else:
        data_setting = f"data.dir={data}"
    port = free_port()
    start = (
        ["bash", str(REPO_CONFIG_DIR.parent / "launch" / "single_node.sh")]
        if script
        else [sys.executable, "-m", "pretrain", "launch", "--nproc", str(nproc), "--master-port", str(port)]
    )
    command = [
        *start,
        "--config",
        TINY,
        f"run.dir={run_dir}",
        data_setting,
        *FAST,
        "eval.every=0",
        "monitor.warmup=4",
        "monitor.window=16",
        *overrides,
    ]
    env = os.environ | {"NPROC": str(nproc), "MASTER_PORT": str(port)}
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    result.master_port = port
    return result


def test_killed_and_hung_ranks_are_restarted_and_the_run_completes(tmp_path, train_data, code_data):
    """On a two-corpus mixture with document masking: the mixture's position survives both
    restarts, and the held-out loss falls on each corpus."""
    import glob

    result = launch(
        tmp_path,
        {"prose": train_data, "code": code_data},
        "train.steps=10",
        "checkpoint.every=3",
        "faults.kill_step=5",
        "faults.kill_rank=1",
        "faults.hang_step=8",
        "faults.hang_rank=0",
        # The hang limit: 10 x the longest interval between steps seen, at least 4 s (intervals here:
        # at most 0.3 s alone, 0.5 s with a busy loop per core). The kill does not race it: a rank
        # already gone when the hang watch fires makes the supervisor wait for the launcher and name
        # the death (the launcher exits only after the rank that lost it waited 3 s for a reason).
        "monitor.hang_min_seconds=4",
        "monitor.stop_grace_seconds=1",
        "data.document_masking=true",
        "eval.every=10",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    restarts = [e for e in events(tmp_path) if e["type"] == "restart"]
    assert not [e for e in events(tmp_path) if e["type"] == "rollback"]  # restarts are not anomalies
    assert [(e["restart"], e["resume_from"], e["step"]) for e in restarts] == [
        (1, "step_00000003", 4),  # rank 1 killed as step 5 began: the last reported step was 4
        (2, "step_00000006", 7),  # rank 0 hung as step 8 began
    ]
    # The killed rank, its signal and the step, in one line from the supervisor; one line (no
    # traceback) from the rank that lost it; DeepSpeed's launcher's [ERROR] line only with --verbose.
    assert re.fullmatch(
        r"rank 1 \(\S+, pid \d+\) was killed by SIGKILL during step 5 \(exit status 247\)",
        restarts[0]["reason"],
    ), restarts[0]
    assert restarts[1]["reason"].startswith("hang: no step")
    assert "pretrain: rank 0: stopped during step 5: another rank left the job (" in result.stderr
    assert "Traceback" not in result.stderr and "[ERROR]" not in result.stderr, result.stderr[-3000:]
    summary = json.loads((tmp_path / "train_summary.json").read_text())
    assert summary["completed"] and summary["step"] == 10
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from pretrain.reporting.metrics import tensorboard_dir

    board = EventAccumulator(str(tensorboard_dir(tmp_path)), size_guidance={"scalars": 0})
    board.Reload()
    for name in ("prose", "code"):  # evaluated at step 0 (first attempt) and 10 (the last)
        losses = {e.step: e.value for e in board.Scalars(f"eval/loss/{name}")}
        assert sorted(losses) == [0, 10] and losses[10] < losses[0] - 0.3, (name, losses)
    with open(tmp_path / "checkpoints" / "step_00000010" / "train_state.json") as f:
        data = json.load(f)["data"]
    served = {name: source["served"] for name, source in data["sources"].items()}
    assert served == {"prose": 20, "code": 20}  # 10 steps × 2 ranks × 2 windows, half each
    assert "faults: killing rank 1 as step 5 begins (faults.kill_step)" in result.stderr
    assert (
        f"restart 1/3 after {restarts[0]['reason']}" in result.stdout
        and "restart 2/3 after hang" in result.stdout
    )
    assert all(s in metrics(tmp_path) for s in range(1, 11))
    status = json.loads((tmp_path / "monitor" / "supervisor.json").read_text())
    assert status["state"] == "completed" and status["attempt"] == 2
    # The service's own view, as the last /status would have shown it, is in the events: steps
    # 4, 5 and 6 (killed at 5, resumed from 3), then 7 (hung at 8, resumed from 6), ran twice.
    step_events = [e["step"] for e in events(tmp_path) if e["type"] == "step"]
    assert step_events == [1, 2, 3, 4, 4, 5, 6, 7, 7, 8, 9, 10]
    # The mixture's window order survives the restarts: each step trained again after a restart
    # (4 after the kill, 7 after the hang: their attempts' data traces) got the very windows, on
    # every rank, that its first attempt got.
    for rank in (0, 1):
        lines = (tmp_path / "data_trace" / f"rank_{rank:05d}.jsonl").read_text().splitlines()
        attempts: dict[int, list] = {}
        for record in map(json.loads, lines):
            attempts.setdefault(record["step"], []).append(record["windows"])
        again = {step: tries for step, tries in attempts.items() if len(tries) > 1}
        assert sorted(again) == [4, 7] and sorted(attempts) == list(range(1, 11)), (rank, sorted(attempts))
        assert all(tries[0] == tries[1] for tries in again.values()), (rank, again)
    # DeepSpeed's CPU shared-memory buffers (66 MB per rank, named after the job's rendezvous port)
    # are not left behind, not even by the killed attempts: every rank unlinks its name once the
    # group has started.
    leaked = glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*_{result.master_port}_*")
    assert leaked == []


def test_the_restart_budget_is_finite(tmp_path, train_data):
    result = launch(
        tmp_path,
        train_data,
        "train.steps=4",
        "checkpoint.every=2",
        "faults.kill_step=3",
        "monitor.max_restarts=0",
        nproc=1,
    )
    assert result.returncode != 0
    assert "restart budget (monitor.max_restarts=0) is spent" in result.stdout
    assert json.loads((tmp_path / "monitor" / "supervisor.json").read_text())["state"] == "failed"
    assert not [e for e in events(tmp_path) if e["type"] == "restart"]


def test_nan_rolls_back_and_the_circuit_breaker_stops_a_run_that_keeps_failing(tmp_path, train_data):
    """Step 6 fails twice (each fault fires once, so two faults at one step): a NaN, rolled back,
    then a spike at the same step, which with max_rollbacks=1 trips the breaker; the job stops with
    status 3 and the supervisor does not restart it. ZeRO-1, started by launch/single_node.sh: the
    run learns before the NaN, and the rollback loads a ZeRO-1 checkpoint."""
    result = launch(
        tmp_path,
        train_data,
        "train.steps=10",
        "checkpoint.every=4",
        "faults.nan_steps=[6]",
        "faults.spike_steps=[6]",
        "monitor.max_rollbacks=1",
        "engine.deepspeed_config=configs/deepspeed/zero1.json",
        script=True,
    )
    assert result.returncode == 3, result.stdout[-3000:] + result.stderr[-3000:]
    assert "ZeRO-1 bf16" in result.stdout
    losses = metrics(tmp_path)
    assert losses[5]["train/loss"] < losses[1]["train/loss"] - 0.1  # it learns
    assert "circuit breaker" in result.stderr
    log = events(tmp_path)
    rollbacks = [e for e in log if e["type"] == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0]["step"] == 6 and rollbacks[0]["target"] == "step_00000004"
    assert rollbacks[0]["finding"] == "nonfinite"
    applied = [e for e in log if e["type"] == "rollback_applied"]
    assert len(applied) == 1 and applied[0]["matches_checkpoint"]
    breaker = [e for e in log if e["type"] == "circuit_breaker"]
    assert len(breaker) == 1 and breaker[0]["step"] == 6
    assert not [e for e in log if e["type"] == "restart"]
    # Each verdict acted on at a step boundary after it arrived, and before any checkpoint.
    steps, at = [e["step"] for e in log if e["type"] == "step"], applied[0]["applied_at"]
    assert 6 <= at <= 8 and steps[:at] == list(range(1, at + 1)) and steps[at : at + 2] == [5, 6]
    assert max(steps[at:]) <= 8
    summary = json.loads((tmp_path / "train_summary.json").read_text())
    assert not summary["completed"] and "circuit breaker" in summary["stopped_by_monitor"]
    assert (
        json.loads((tmp_path / "monitor" / "supervisor.json").read_text())["state"]
        == "stopped by the monitor"
    )
    # Nothing after the refused state was saved: the newest checkpoint is the healthy step 4,
    # and no NaN ever reached the weights.
    from pretrain import checkpoint as ck
    from pretrain.evaluation.inference import load_trained

    assert ck.newest_complete(tmp_path) == "step_00000004"
    assert all(torch.isfinite(p).all() for p in load_trained(tmp_path).model.parameters())
