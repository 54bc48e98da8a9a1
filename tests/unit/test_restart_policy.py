"""The supervisor's decision after a job ends (monitoring/restart_policy.py) as a table: how the job
ended and what the run's records said, the host set and the restart budget in; restart, replace,
shrink, keep or stop out. No process, no file, no clock."""

import signal

import pytest

from monitoring.hosts import HostSet
from monitoring.protocol import MoveOff
from monitoring.restart_policy import Budget, JobEnd, decide

LEFT = Budget(max_restarts=3, used=2, window="in the run")
SPENT = Budget(max_restarts=3, used=3, window="within monitor.restart_window_hours=1")
ASKED = MoveOff(host="node7", rank=1, step=30, reason="rank 1 took 2.8x", cause="straggler")


def hosts(spare: bool = True, min_nodes: int = 2) -> HostSet:
    """a and b in use (one rank each, as DeepSpeed numbers them), c a spare."""
    slots = {"a": 1, "b": 1, "c": 1} if spare else {"a": 1, "b": 1}
    return HostSet(slots=slots, nodes=2, min_nodes=min_nodes, micro_batch=1, grad_accum=1, in_use=["a", "b"])


def end(how="exit", status=1, **records) -> JobEnd:
    return JobEnd(how=how, status=status, why=records.pop("why", "rank 1 was killed by SIGKILL"), **records)


CASES = {
    # how the job ended                                  hosts            budget   action, status, state, counted, host
    "done": (end(status=0, completed=True), None, LEFT, ("stop", 0, "completed", False, None)),
    "saved and stopped early": (end(status=0), None, LEFT, ("stop", 0, "stopped", False, None)),
    "bad input": (end(status=2), None, LEFT, ("stop", 2, "bad input", False, None)),
    "stopped by a check": (end(status=3), None, LEFT, ("stop", 3, "stopped by the monitor", False, None)),
    "saves fail": (end(status=4), None, LEFT, ("stop", 4, "checkpoints could not be saved", False, None)),
    "a crash": (end(status=1), None, LEFT, ("restart", 0, "", True, None)),
    "a killed rank": (end(status=247), hosts(), LEFT, ("restart", 0, "", True, None)),
    "a hang": (end("hang", why="hang: no step for 60 s"), None, LEFT, ("restart", 0, "", True, None)),
    "a crash, the budget spent": (end(status=247), None, SPENT, ("stop", 247, "failed", False, None)),
    "a hang, the budget spent": (end("hang"), None, SPENT, ("stop", 1, "failed", False, None)),
    "Ctrl-C": (end("interrupted", 0, signum=signal.SIGINT), None, LEFT, ("stop", 130, "stopped", False, None)),
    "SIGTERM": (end("interrupted", 0, signum=signal.SIGTERM), None, LEFT, ("stop", 143, "stopped", False, None)),
    "SIGUSR1 heeded": (end("interrupted", 0, signum=signal.SIGUSR1), None, LEFT, ("stop", 0, "stopped", False, None)),
    "SIGUSR1, a failure": (end("interrupted", 1, signum=signal.SIGUSR1), None, LEFT, ("stop", 138, "stopped", False, None)),
    "move off, a spare": (end(status=5, move_off=ASKED), hosts(), SPENT, ("replace", 0, "", False, "b")),
    "move off, fewer nodes": (end(status=5, move_off=ASKED), hosts(False, 1), LEFT, ("shrink", 0, "", False, "b")),
    "move off, neither": (end(status=5, move_off=ASKED), hosts(False), LEFT, ("keep", 0, "", False, "b")),
    "move off, one machine": (end(status=5, move_off=ASKED), None, LEFT, ("keep", 0, "", False, "node7")),
    "move off, unreadable": (end(status=5), hosts(), LEFT, ("keep", 0, "", False, "?")),
    "a follower, node 0 gone": (end(status=1, leader_running=False), None, LEFT, ("stop", 1, "failed", False, None)),
    "a follower asked to move off": (end(status=5, leader_running=False), None, LEFT, ("stop", 5, "failed", False, None)),
    "a follower, node 0 running": (end(status=1), None, LEFT, ("restart", 0, "", True, None)),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_the_decision_after_a_job_ends(case):
    job_end, host_set, budget, expected = CASES[case]
    decision = decide(job_end, host_set, budget)
    assert (decision.action, decision.status, decision.state, decision.counted, decision.host) == expected


def test_what_each_decision_says():
    """The reasons a restart event and the console carry, and the answer a kept host gets."""
    assert decide(end(status=247), None, LEFT).reason == "rank 1 was killed by SIGKILL"
    spent = decide(end(status=247), None, SPENT)
    assert spent.line == (
        "the job failed (rank 1 was killed by SIGKILL) and the restart budget (monitor.max_restarts=3) "
        "is spent within monitor.restart_window_hours=1; giving up"
    )
    assert (
        decide(end(status=2, why="bad data"), None, LEFT).line
        == "the job exited with status 2 (bad input): bad data"
    )
    interrupted = decide(end("interrupted", 0, signum=signal.SIGINT), None, LEFT)
    assert interrupted.reason == "stopped by SIGINT; the job exited with status 0" and interrupted.resume_hint
    replaced = decide(end(status=5, move_off=ASKED), hosts(), LEFT)
    assert (replaced.reason, replaced.asked) == ("replace b (rank 1 took 2.8x)", "rank 1 took 2.8x")
    kept = decide(end(status=5, move_off=ASKED), hosts(False), LEFT)
    assert kept.kept == "no spare, and --min-nodes 2 keeps every node"
    assert decide(end(status=5, move_off=ASKED), None, LEFT).kept.startswith("no host set to choose from")
