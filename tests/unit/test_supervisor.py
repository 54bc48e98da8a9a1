"""The supervisor's pure parts, its diagnosis of a failed job (around a fake job: nothing is
started), and `pretrain launch` refusing bad input before it starts anything (in this process)."""

from __future__ import annotations

import json
import os
import re
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from monitoring import supervisor as sv
from monitoring.protocol import SUMMARY_FILE, MoveOff, read_events
from monitoring.supervisor import HangWatch, Supervisor
from pretrain import lifeline
from pretrain.config import MonitorConfig
from tests.helpers import FAST, TINY, assert_one_line_error


def test_hang_watch():
    watch = HangWatch(factor=3, min_seconds=5, startup_seconds=100)
    watch.start(now=0)
    assert watch.overdue(99) is None and "no first step for 101 s" in watch.overdue(101)
    watch.step(10)
    assert watch.limit() == 5  # one step seen: no interval yet, the floor
    watch.step(14)  # a 4 s interval: limit 3 × 4 = 12 s
    assert watch.limit() == 12 and watch.overdue(26) is None and "no step for 13 s" in watch.overdue(27)
    watch.step(15)  # a shorter interval does not lower the limit
    assert watch.limit() == 12
    watch.start(now=100)  # a restart: the startup limit again, the step intervals remembered
    assert watch.overdue(150) is None
    watch.step(160)
    assert watch.limit() == 12 and watch.overdue(173)


def test_the_ranks_are_told_what_the_supervisor_got_only_where_they_get_another_signal():
    """Slurm's time-limit warning reaches every process of the step, the ranks as well as the
    supervisor, which passes it on as itself: a note would make a rank that hears the supervisor's
    copy first say something else than one that hears Slurm's first (the CI failure of
    test_slurm_launch), so none is written and both say `SIGUSR1 received`."""
    import signal

    assert sv.stop_note(signal.SIGUSR1, signal.SIGUSR1, over_ssh=False) is None
    assert sv.stop_note(signal.SIGTERM, signal.SIGTERM, over_ssh=False) is None  # (scancel, likewise)
    note = sv.stop_note(signal.SIGINT, signal.SIGTERM, over_ssh=False)  # a Ctrl-C: the ranks get SIGTERM
    assert note == "SIGINT to pretrain launch, passed on as SIGTERM"
    # over ssh the launcher passes SIGTERM to every host, whatever the supervisor got
    assert sv.stop_note(signal.SIGUSR1, signal.SIGUSR1, over_ssh=True) == (
        "SIGUSR1 to pretrain launch, passed on as SIGTERM"
    )


def test_launch_refuses_bad_input_before_starting_anything(tmp_path, train_data, cli):
    run_dir = tmp_path / "run"
    common = ["--config", TINY, f"run.dir={run_dir}", f"data.dir={train_data}", *FAST]
    for args in (["--nproc", "0"], ["--hostfile", str(tmp_path / "missing")], ["--node-rank", "1"]):
        assert_one_line_error(cli("launch", *args, *common))
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("a slots=1\nb slots=1\n")
    for args, message in (
        (["--nodes", "2"], "--nodes and --min-nodes need --hostfile over ssh"),
        (["--hostfile", str(hostfile), "--nodes", "3"], "--nodes 3: the hostfile lists 2 host(s)"),
        (["--hostfile", str(hostfile), "--nodes", "2", "--min-nodes", "3"], "--min-nodes 3 must be from 1"),
        (
            ["--hostfile", str(hostfile), "--no-ssh", "--nodes", "1"],
            "need --hostfile over ssh (not --no-ssh)",
        ),
    ):
        assert_one_line_error(cli("launch", *args, *common), message)
    result = cli("launch", "--nproc", "2", *common, "faults.kill_step=3", "faults.kill_rank=2")
    assert_one_line_error(result, "faults.kill_rank=2 but the job has 2 rank(s)")
    assert_one_line_error(
        cli("launch", "--nproc", "2", *common, "train.global_batch_size=6"), "global_batch_size"
    )
    assert not run_dir.exists()  # no run directory, token or endpoint that looks like a run


DEAD_PID = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # never a process's
KILLED = (
    f"rank 1 ({socket.gethostname()}, pid {DEAD_PID}) was killed by SIGKILL during step 5 (exit status 247)"
)


@dataclass
class FakeJob:
    """What the supervisor sees of a job: the launcher's exit status from the `exits_after`-th poll
    on (None: never, until stopped), and what `stop` gets from it."""

    exits_after: int | None
    status: int
    stopped_with: int = 247  # DeepSpeed's launcher, SIGTERMed after a rank died: that rank's status
    attempt: int = 0
    started_at: float = field(default_factory=time.time)
    over_ssh: bool = False
    node_exits: list = field(default_factory=list)
    polls: int = 0
    stopped: bool = False

    def poll(self) -> int | None:
        self.polls += 1
        if self.stopped:
            return self.stopped_with
        return self.status if self.exits_after is not None and self.polls >= self.exits_after else None

    def stop(self, grace: float) -> int:
        self.stopped = True
        return self.stopped_with


def write_record(run_dir, rank, **fields):
    path = run_dir / lifeline.RANK_RECORDS / f"rank-{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rank": rank, "node": 0, "host": socket.gethostname()} | fields))


def first_restart(tmp_path, monkeypatch, first: FakeJob, ranks) -> tuple[str, list[str]]:
    """The supervisor over a first job whose hang watch is already overdue (its last step 10 s
    ago, hang_min_seconds=1) when it is first looked at, with `ranks(run_dir)` written as the job's
    rank records; the second job completes the run. The first restart's reason, and the log."""

    def start(command, attempt, **kwargs):
        if attempt == 0:
            supervisor.state.watch.step(time.monotonic() - 10)
            ranks(tmp_path)
            return first
        (tmp_path / SUMMARY_FILE).write_text(json.dumps({"completed": True, "step": 10}))
        return FakeJob(exits_after=1, status=0, attempt=attempt)

    monkeypatch.setattr(sv.Job, "start", start)
    log: list[str] = []
    config = MonitorConfig(hang_min_seconds=1, stop_grace_seconds=1)
    supervisor = Supervisor(lambda start: ["train"], tmp_path, config, poll_seconds=0.01, log=log.append)
    assert supervisor.run() == 0
    restarts = [e for e in read_events(tmp_path) if e.type == "restart"]
    assert len(restarts) == 1, log
    return restarts[0].reason, log


def killed_rank_1(run_dir):
    """Rank 1 killed by SIGKILL as step 5 began (its record unmarked, its process gone); rank 0
    lost it in a collective and is leaving, saying so."""
    write_record(run_dir, 0, pid=os.getpid(), step=5, why="lost another rank during step 5", exited=True)
    write_record(run_dir, 1, pid=DEAD_PID)


def test_a_dead_rank_seen_when_the_hang_watch_fires_is_the_reason_not_a_hang(tmp_path, monkeypatch):
    """At the same check the hang watch is overdue and a rank is dead: the supervisor waits for the
    launcher's exit (here the third poll) and names the death, whichever it noticed first."""
    job = FakeJob(exits_after=3, status=247)
    reason, log = first_restart(tmp_path, monkeypatch, job, killed_rank_1)
    assert reason == KILLED and not job.stopped and job.polls == 3, log
    # (10 s or more: the supervisor's first look may come later on a busy machine)
    assert re.fullmatch(
        r"launch: hang: no step for 1\d s \(limit 1 s\), but rank 1 has left the job; "
        r"waiting for its launcher to exit",
        log[1],
    ), log


def test_a_launcher_that_never_exits_after_a_death_is_stopped_and_the_death_is_the_reason(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(Supervisor, "_launcher_exit_seconds", 0.05)
    job = FakeJob(exits_after=None, status=247)
    reason, log = first_restart(tmp_path, monkeypatch, job, killed_rank_1)
    assert reason == KILLED and job.stopped, log
    assert "launch: a rank has left the job and its launcher has not exited in 0 s; stopping the job" in log


@pytest.mark.parametrize("exited", [False, True])
def test_a_hang_with_every_rank_alive_or_cleanly_exited_is_a_hang(tmp_path, monkeypatch, exited):
    def ranks(run_dir):  # alive (this process), or one marked exited with no reason: done, not dead
        write_record(run_dir, 0, pid=os.getpid())
        write_record(run_dir, 1, pid=DEAD_PID if exited else os.getpid(), exited=exited or None)

    job = FakeJob(exits_after=None, status=1, stopped_with=143)
    reason, log = first_restart(tmp_path, monkeypatch, job, ranks)
    assert re.match(r"hang: no step for 1\d s \(limit 1 s\)", reason) and job.stopped, log


@pytest.mark.parametrize(
    "minutes_apart, window_hours, starts, code",
    [
        (1, 1.0, 4, 1),  # a crash loop: the 4th failure within the hour finds the budget (3) spent
        (30, 1.0, 11, 0),  # a failure every half hour: never more than 2 restarts in an hour
        (30, None, 4, 1),  # null: the whole run counts, the rule before the window
    ],
)
def test_the_restart_budget_counts_restarts_within_a_window_of_time(
    tmp_path, monkeypatch, minutes_apart, window_hours, starts, code
):
    """monitor.max_restarts (3) restarts within monitor.restart_window_hours: a job that fails
    every `minutes_apart` minutes (a fake clock) is restarted until it completes at its 11th start,
    or given up on when the budget is spent."""
    now = [0.0]

    def start(command, attempt, **kwargs):
        now[0] += minutes_apart * 60
        if attempt == 10:
            (tmp_path / SUMMARY_FILE).write_text(json.dumps({"completed": True, "step": 10}))
            return FakeJob(exits_after=1, status=0, attempt=attempt)
        return FakeJob(exits_after=1, status=1, attempt=attempt)

    monkeypatch.setattr(sv.Job, "start", start)
    log: list[str] = []
    config = MonitorConfig(max_restarts=3, restart_window_hours=window_hours)
    supervisor = Supervisor(lambda start: ["train"], tmp_path, config, poll_seconds=0.01, log=log.append)
    supervisor.clock = lambda: now[0]
    assert supervisor.run() == code
    assert sum(line.startswith("launch: restart") for line in log) == starts - 1, log
    if code:
        assert "restart budget (monitor.max_restarts=3) is spent" in log[-1], log


@pytest.mark.parametrize("spare", [True, False])
def test_a_host_the_trainer_moves_off_is_left_out_for_a_spare_or_with_none_kept_and_told(
    tmp_path, monkeypatch, spare
):
    """Exit status 5 with RUN_DIR/monitor/replace.json naming rank 1: the host that holds rank 1
    in this start (as the hostfile names it, whatever name the rank gave) is left out for the rest
    of the run and the spare takes its place, outside the restart budget. With no spare (and
    --min-nodes at N) it stays, and the supervisor's answer in replace.json tells the job's later
    starts to only warn: no override is added to the command."""
    from monitoring.hosts import HostSet

    starts = []

    def start(command, attempt, **kwargs):
        starts.append(command)
        if attempt == 0:
            asked = MoveOff(host="its-own-name", rank=1, step=31, reason="straggler: 2.8x", cause="straggler")
            (tmp_path / "monitor").mkdir(exist_ok=True)
            (tmp_path / "monitor" / "replace.json").write_text(json.dumps(asked.to_json()))
            return FakeJob(exits_after=1, status=5, attempt=attempt)
        (tmp_path / SUMMARY_FILE).write_text(json.dumps({"completed": True, "step": 40}))
        return FakeJob(exits_after=1, status=0, attempt=attempt)

    monkeypatch.setattr(sv.Job, "start", start)
    monkeypatch.setattr(sv, "check_hosts", lambda slots, run_dir, **_: dict.fromkeys(slots))  # all healthy
    slots = {"a": 1, "b": 1, "c": 1} if spare else {"a": 1, "b": 1}
    hosts = HostSet(slots=slots, nodes=2, min_nodes=2, micro_batch=1, grad_accum=1)
    log: list[str] = []
    config = MonitorConfig(max_restarts=0)  # a counted restart would give up
    supervisor = Supervisor(
        lambda start: list(start.hosts.hosts), tmp_path, config, hosts=hosts, log=log.append
    )
    assert supervisor.run() == 0, log
    kinds = [(e.type, getattr(e, "host", None) or getattr(e, "new", None)) for e in read_events(tmp_path)]
    if spare:
        assert starts == [["a", "b"], ["a", "c"]], starts
        assert hosts.banned == {"b": "straggler: 2.8x"} and "launch: moving off b: straggler: 2.8x" in log, (
            log
        )
        assert ("node_excluded", "b") in kinds and ("node_replaced", "c") in kinds, kinds
        assert MoveOff.read(tmp_path).kept is None
        return
    assert starts == [["a", "b"], ["a", "b"]] and not hosts.banned, starts
    assert MoveOff.read(tmp_path).kept == "no spare, and --min-nodes 2 keeps every node"
    assert any(line.startswith("launch: b stays (straggler: 2.8x)") for line in log), log
