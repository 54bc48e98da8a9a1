"""A straggler named in a real 2-process job (gloo, DeepSpeed's launcher): rank 1 made three times
slower from step 2 (`faults.slow_*`) is named after three windows of ten steps, and with
`monitor.on_straggler=replace` every rank saves a checkpoint there, rank 0 writes
RUN_DIR/monitor/replace.json, and the job exits with status 5 (the supervisor's restart on a
spare is tested with the supervisor). The suite's clean runs name no one: see docs/monitoring.md,
"Stragglers"."""

import json
import socket

from monitoring.protocol import REPLACE_FILE, monitor_dir
from pretrain.errors import ExitCode
from pretrain.train.straggler_hook import MIN_WINDOW_STEPS
from tests.integration.runs import events, launcher, train, train_state


def test_a_rank_three_times_slower_is_named_and_replace_saves_and_exits_5(tmp_path, train_data):
    run_dir = tmp_path / "run"
    slow_from, windows = 2, 3
    result = train(
        launcher(2),
        run_dir,
        train_data,
        "train.steps=60",
        "eval.every=0",
        "checkpoint.every=1000",
        "faults.slow_rank=1",
        "faults.slow_factor=3",
        f"faults.slow_from_step={slow_from}",
        f"monitor.straggler_windows={windows}",
        "monitor.on_straggler=replace",
        check=False,
    )
    assert result.returncode == ExitCode.REPLACE_NODE == 5, result.stdout[-3000:] + result.stderr[-3000:]
    # The first step is not counted, so windows end at steps 11, 21, 31: all three slow.
    named_at = 1 + windows * MIN_WINDOW_STEPS
    stragglers = [e for e in events(run_dir) if e["type"] == "straggler"]
    assert [(e["step"], e["rank"], e["host"]) for e in stragglers] == [(named_at, 1, socket.gethostname())]
    assert stragglers[0]["factor"] > 2  # (3 less the noise of two ranks sharing two cores)
    assert f"straggler: rank 1 on {socket.gethostname()} took" in result.stdout
    assert f"moving off {socket.gethostname()} (rank 1 took" in result.stdout
    assert f"saved step_{named_at:08d} and exiting" in result.stdout
    assert train_state(run_dir, named_at)["step"] == named_at  # the checkpoint every rank saved
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{named_at:08d}"
    asked = json.loads((monitor_dir(run_dir) / REPLACE_FILE).read_text())
    assert asked["host"] == socket.gethostname() and asked["rank"] == 1 and asked["step"] == named_at
    assert "rank 1 took" in asked["reason"]
    summary = json.loads((run_dir / "train_summary.json").read_text())
    assert not summary["completed"] and summary["step"] == named_at and summary["exit_code"] == 5
