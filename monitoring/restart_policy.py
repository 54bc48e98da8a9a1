"""What the supervisor of `pretrain launch` does once a job has ended: `decide`, a pure function of
how the job ended (its exit status, and what the run's records said then: the summary, the
trainer's request to move a host off, node 0's supervisor), the host set and the restart budget.
No processes, files or clock: `Supervisor.run` (`supervisor.py`) runs the job, gathers these,
and applies the `Decision`; tests/unit/test_restart_policy.py is its table of cases.

    restart   a failure (a crash, a killed rank, a lost node, a hang) within the budget
              (monitor.max_restarts within monitor.restart_window_hours): again from the newest
              checkpoint, on healthy hosts (`HostSet.choose` replaces a lost node by a spare, or
              shrinks down to --min-nodes)
    replace   the trainer asked to move a host off (ExitCode.REPLACE_NODE, RUN_DIR/monitor/
              replace.json): it is left out for the rest of the run and a spare takes its place
    shrink    the same with no spare: fewer nodes, down to --min-nodes
    keep      the same where neither can be: the job starts again with the host, and its later
              starts only warn (the supervisor's answer in replace.json)
    stop      done, bad input, stopped by a check, checkpoints that cannot be saved, a signal to
              the supervisor, the budget spent, or node 0's supervisor gone (a follower)

A move off is asked for, not a failure: its restart is outside the budget.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

from monitoring.hosts import HostSet
from monitoring.protocol import MoveOff
from pretrain.errors import ExitCode

NOT_RESTARTED = {
    ExitCode.DONE: "completed",
    ExitCode.BAD_INPUT: "bad input",
    ExitCode.STOPPED_BY_MONITOR: "stopped by the monitor",
    ExitCode.CHECKPOINT_FAILED: "checkpoints could not be saved",
}
HOW = ("exit", "hang", "interrupted")  # how a job ends, as the supervisor sees it
DECISIONS = ("restart", "replace", "shrink", "keep", "stop")


@dataclass(frozen=True, kw_only=True)
class JobEnd:
    """How a job ended, with what the run's records said as it did."""

    how: str  # HOW
    status: int  # its exit status (a hang: ExitCode.FAILED)
    why: str = ""  # a failure's cause in a few words (the failed node, the killed rank, the hang)
    signum: int | None = None  # interrupted: the signal the supervisor got
    completed: bool = False  # this attempt's summary says the run's last step is trained and saved
    leader_running: bool = True  # node 0's supervisor still runs the job (always, on node 0)
    move_off: MoveOff | None = None  # at ExitCode.REPLACE_NODE: the trainer's request, if readable

    def __post_init__(self) -> None:
        assert self.how in HOW, self.how

    @property
    def asked_to_move_off(self) -> bool:
        return self.how == "exit" and self.status == ExitCode.REPLACE_NODE and self.leader_running

    @property
    def failed(self) -> bool:
        """A failure the restart budget answers (nothing a restart cannot help, nothing asked for)."""
        if self.how != "exit":
            return self.how == "hang"
        return self.leader_running and self.status not in NOT_RESTARTED and not self.asked_to_move_off


@dataclass(frozen=True)
class Budget:
    max_restarts: int  # monitor.max_restarts
    used: int  # restarts counted within the window
    window: str  # the window in words: "in the run", "within monitor.restart_window_hours=1"


@dataclass(frozen=True, kw_only=True)
class Decision:
    action: str  # DECISIONS
    reason: str  # a restart's (its `restart` event's), or why the job stopped
    counted: bool = False  # restart: counted in the budget
    host: str | None = (
        None  # replace, shrink, keep: the host the trainer asked to move off, as the hostfile names it
    )
    asked: str = ""  # replace, shrink, keep: the trainer's reason
    kept: str = ""  # keep: why the host cannot be moved off (the answer written back to replace.json)
    status: int = 0  # stop: the supervisor's exit status
    state: str = ""  # stop: RUN_DIR/monitor/supervisor.json's state
    line: str = ""  # stop: the console line, if any
    resume_hint: bool = False  # stop: say what was saved and how to go on

    def __post_init__(self) -> None:
        assert self.action in DECISIONS, self.action


def decide(end: JobEnd, hosts: HostSet | None, budget: Budget) -> Decision:
    """What to do after the job ended as `end`; `hosts`: the host set over ssh (None: one machine
    or the no-ssh mode). Pure."""
    if end.how == "interrupted":
        signum = end.signum or signal.SIGINT
        return Decision(
            action="stop",
            reason=f"stopped by {signal.Signals(signum).name}; the job exited with status {end.status}",
            status=0 if signum == signal.SIGUSR1 and end.status == 0 else 128 + signum,
            state="stopped",
            resume_hint=True,
        )
    if end.asked_to_move_off:
        return move_off(end.move_off, hosts)
    if not end.failed:
        return ended(end)
    if budget.used >= budget.max_restarts:
        return Decision(
            action="stop",
            reason=end.why,
            status=end.status if end.how == "exit" and end.status > 0 else ExitCode.FAILED,
            state="failed",
            line=f"the job failed ({end.why}) and the restart budget (monitor.max_restarts="
            f"{budget.max_restarts}) is spent {budget.window}; giving up",
        )
    return Decision(action="restart", reason=end.why, counted=True)


def ended(end: JobEnd) -> Decision:
    """A job that is not restarted: done, stopped early on its own (a stop request it saved at),
    or an exit status a restart cannot help (or a follower whose node 0 has gone)."""
    if end.status == ExitCode.DONE and not end.completed:
        reason = "the job saved and stopped before the last step"
        return Decision(action="stop", reason=reason, state="stopped", resume_hint=True)
    state = NOT_RESTARTED.get(end.status, "failed")
    line = (
        "" if end.status == ExitCode.DONE else f"the job exited with status {end.status} ({state}): {end.why}"
    )
    return Decision(action="stop", reason=state, status=end.status, state=state, line=line)


def move_off(request: MoveOff | None, hosts: HostSet | None) -> Decision:
    """The trainer's request to move a host off: leave it out for the rest of the run where a
    spare can take its place or the job may run on fewer nodes; else keep it."""
    host, asked = (request.host, request.reason) if request is not None else ("?", "asked by the trainer")
    if hosts is not None and request is not None:  # the rank's host as the hostfile names it
        host = next((h for h in hosts.in_use if request.rank in hosts.ranks(h)), host)
    if hosts is not None and host in hosts.in_use:
        if hosts.spares():
            return Decision(action="replace", reason=f"replace {host} ({asked})", host=host, asked=asked)
        if len(hosts.in_use) > hosts.min_nodes:
            return Decision(action="shrink", reason=f"move off {host} ({asked})", host=host, asked=asked)
        kept = f"no spare, and --min-nodes {hosts.min_nodes} keeps every node"
    else:
        kept = "no host set to choose from (one machine, or --no-ssh)"
    return Decision(
        action="keep", reason=f"{host} stays ({asked}): {kept}", host=host, asked=asked, kept=kept
    )
