"""The supervisor of `pretrain launch`: the monitoring service and, under it, the DeepSpeed job,
restarted when it crashes or hangs. (`pretrain/cli/launch.py` checks the run and builds the
launcher's command line; this module runs it, watches it, and applies what the restart policy
decides once it has ended: `restart_policy.py`, a pure function.)

One process holds the HTTP service (its threads) and the supervisor (the main thread). The job is
the DeepSpeed launcher with every rank it starts, in a session of its own, so it is stopped as a
whole. The supervisor restarts it from the newest complete checkpoint (`checkpoint.resume=auto`)
when it

- exits with a failure (a crash, a killed rank): any status but 0 (done), 2 (bad input: a restart
  would fail the same way), 3 (a check stopped it) and 4 (checkpoints could not be saved:
  `pretrain.errors.ExitCode`);
- hangs: no step reported for `monitor.hang_factor` times the longest interval between two steps
  seen so far (never less than `monitor.hang_min_seconds`), or no first step within
  `monitor.startup_seconds` of a start;

at most `monitor.max_restarts` times; and, outside that budget, after it saved and exited with 5
to move a host off (RUN_DIR/monitor/replace.json). Each restart is an event `restart` in RUN_DIR/events.jsonl, is
listed by GET /status and counted by `pretrain_restarts` in GET /metrics.

A rank that died is a death, not a hang, whichever the supervisor notices first: when the hang
watch fires while a rank has left the job (its process gone, or its record saying why it stopped:
`departed_ranks`), the job is failing, not hung, and the supervisor waits for the launcher's exit
(DeepSpeed's launcher stops the other ranks, up to its own 30 s for them) and names the death from
it. A launcher that does not exit within that is stopped, and the death is still the reason.

Several nodes: with a hostfile the DeepSpeed launcher reaches every host over ssh (pdsh), and
this one supervisor stops and restarts all of them. Its ranks are then not its descendants: it
asks them to stop through the launcher (SIGTERM: it signals this job's launcher on every host
over pdsh, which passes SIGTERM on to its ranks; `pretrain/cli/deepspeed_runner.py`), follows the
job's stderr through a file (RUN_DIR/monitor/launcher.stderr: a pipe would break the job's output
if this process died), learns from pdsh's own report when one host's
launcher has exited ("pdsh@H: HOST: ssh exited with exit code N": the whole job is stopped at
once, naming the host), and waits for the last rank on any host to exit (the ranks' shared lock,
`pretrain/lifeline.py`) before it restarts the job or exits. In the launcher's no-ssh mode each
node runs `pretrain launch --no-ssh --node-rank K`: node 0 holds the service and watches for
hangs; the others only restart their own ranks after a failure, for as long as node 0's
supervisor, whose state is in RUN_DIR/monitor/supervisor.json (a shared file system, as for
checkpoints), is running.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from monitoring.config import SupervisorConfig
from monitoring.hosts import Choice, HostSet, check_hosts
from monitoring.protocol import (
    HOSTS_FILE,
    REPLACE_FILE,
    SUMMARY_FILE,
    SUPERVISOR_FILE,
    Event,
    JobStopped,
    MoveOff,
    NodeExcluded,
    NodeLost,
    NodeReplaced,
    Restart,
    WorldResized,
    append_event,
    monitor_dir,
)
from monitoring.restart_policy import Budget, Decision, JobEnd, decide
from monitoring.service import serve
from pretrain import atomic, checkpoint
from pretrain.config import MonitorConfig
from pretrain.errors import ExitCode
from pretrain.lifeline import (
    clear_rank_records,
    describe_failure,
    owner_tag,
    rank_records,
    tell_ranks_why,
    wait_for_ranks,
)
from pretrain.run_dir import OWNER_ENV, RunLock


@dataclass
class HangWatch:
    """When a job counts as hung, from the times its steps were reported (pure; times in seconds)."""

    factor: float
    min_seconds: float
    startup_seconds: float
    started_at: float = 0.0
    last_step_at: float | None = None
    longest_gap: float = 0.0  # kept across restarts: a restart does not change how long a step takes

    @classmethod
    def from_config(cls, config: SupervisorConfig) -> HangWatch:
        return cls(config.hang_factor, config.hang_min_seconds, config.startup_seconds)

    def start(self, now: float) -> None:
        self.started_at, self.last_step_at = now, None

    def step(self, now: float) -> None:
        if self.last_step_at is not None:
            self.longest_gap = max(self.longest_gap, now - self.last_step_at)
        self.last_step_at = now

    def limit(self) -> float:
        if self.last_step_at is None:
            return self.startup_seconds
        return max(self.factor * self.longest_gap, self.min_seconds)

    def overdue(self, now: float) -> str | None:
        """Why the job counts as hung at `now`, or None."""
        since = now - (self.last_step_at if self.last_step_at is not None else self.started_at)
        if since <= self.limit():
            return None
        what = "no step" if self.last_step_at is not None else "no first step"
        return f"hang: {what} for {since:.0f} s (limit {self.limit():.0f} s)"


LAUNCHER_RANKS_SECONDS = 30.0  # DeepSpeed's launcher: how long it waits for its ranks after SIGTERM


def departed_ranks(run_dir: str | Path) -> list[dict]:
    """The records of the job's ranks that have left it early (RUN_DIR/monitor/ranks,
    `pretrain/lifeline.py`): marked exited with a reason (bad input it found, another rank it
    lost), or, on this host, unmarked with the process gone (killed by a signal, crashed; a zombie
    its launcher has not yet reaped counts as gone). A rank that exited cleanly is not one; ranks
    on other hosts are seen only through their marks."""
    import psutil

    here = socket.gethostname()
    departed = []
    for record in rank_records(run_dir):
        if record.get("exited"):
            gone = bool(record.get("why"))
        elif record.get("host") == here and isinstance(record.get("pid"), int):
            try:
                gone = psutil.Process(record["pid"]).status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                gone = True
            except psutil.Error:
                gone = False
        else:
            gone = False
        if gone:
            departed.append(record)
    return departed


JOB_STDERR = "launcher.stderr"  # over ssh: the job's stderr, this attempt's (in RUN_DIR/monitor/)

# pdsh's own line when one host's command ends with a failure (pdsh 2.x, ssh rcmd module)
NODE_EXIT = re.compile(
    r"^pdsh@[^:]*: (?P<host>[^:\s]+): ssh (?:exited with exit code (?P<code>\d+)|killed by signal (?P<signal>\d+))"
)
HOST_LINE = re.compile(r"^(?P<host>[^:\s]+): (?P<text>.*)$")  # a remote line, as pdsh labels it


def node_exit(line: str) -> tuple[str, int] | None:
    """(host, status) from pdsh's report of a host whose command failed (a signal as 128 + its
    number, as a shell reports it); None for any other line."""
    found = NODE_EXIT.match(line)
    if found is None:
        return None
    status = int(found["code"]) if found["code"] is not None else 128 + int(found["signal"])
    return (found["host"], status) if status != 0 else None


def run_completed(run_dir: str | Path, since: float = 0.0) -> bool:
    """Whether RUN_DIR's summary, written at or after `since` (wall clock), says the run's last step
    is trained and saved."""
    path = Path(run_dir) / SUMMARY_FILE
    try:
        return path.stat().st_mtime >= since and json.loads(path.read_text()).get("completed") is True
    except (OSError, ValueError, AttributeError):
        return False


@dataclass
class NodeExit:
    host: str
    code: int
    last_line: str = ""  # what that host's ranks said last on stderr: usually why


@dataclass
class Job:
    """The DeepSpeed launcher and its ranks, in a process group of their own (over ssh, the ranks
    run under each host's sshd instead, and `node_exits` collects pdsh's reports of hosts whose
    launcher has ended with a failure)."""

    process: subprocess.Popen
    attempt: int
    started_at: float = 0.0  # wall clock (time.time()), to tell this attempt's files from older ones
    over_ssh: bool = False
    node_exits: list[NodeExit] = field(default_factory=list)
    last_lines: dict[str, str] = field(default_factory=dict)

    @classmethod
    def start(
        cls,
        command: list[str],
        attempt: int,
        env: dict | None = None,
        pass_fds: tuple = (),
        over_ssh: bool = False,
        stderr_file: Path | None = None,
    ) -> Job:
        """`stderr_file` (over ssh): the job's stderr goes there, and is followed onto this
        process's stderr — a file, not a pipe, so that the job's writers (pdsh, which relays every
        host's stderr) never break on a pipe when this process is gone."""
        started_at = time.time()
        try:
            stderr = open(stderr_file, "wb") if stderr_file is not None else None  # noqa: SIM115 (the child's)
        except OSError:  # a full disk: the job's stderr is this process's, and failed hosts go unnoticed
            stderr = stderr_file = None
        try:
            process = subprocess.Popen(
                command, start_new_session=True, env=env, pass_fds=pass_fds, stderr=stderr
            )
        finally:
            if stderr is not None:
                stderr.close()
        job = cls(process, attempt, started_at, over_ssh)
        if stderr_file is not None:
            threading.Thread(
                target=job._follow_stderr, args=(stderr_file,), name="job-stderr", daemon=True
            ).start()
        return job

    def _follow_stderr(self, path: Path) -> None:
        """Pass the job's stderr through unchanged as it is written, noting pdsh's reports of
        failed hosts, until the job has exited and everything it wrote is read."""
        with open(path, "rb") as f:
            pending = b""
            while True:
                chunk = f.readline()
                if not chunk:
                    if self.process.poll() is not None:
                        chunk = f.read()
                        if not chunk:
                            break
                    else:
                        time.sleep(0.05)
                        continue
                pending += chunk
                if not pending.endswith(b"\n") and self.process.poll() is None:
                    continue  # a line still being written
                self._said(pending)
                pending = b""

    def _said(self, raw: bytes) -> None:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.buffer.write(raw)
            sys.stderr.flush()
        for line in raw.decode(errors="replace").splitlines():
            exited = node_exit(line)
            if exited is not None:
                self.node_exits.append(NodeExit(exited[0], exited[1], self.last_lines.get(exited[0], "")))
                continue
            said = HOST_LINE.match(line.rstrip())
            if said and said["text"].strip():
                self.last_lines[said["host"]] = said["text"].strip()

    def poll(self) -> int | None:
        return self.process.poll()

    def signal_launcher(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signum)

    def signal_group(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signum)

    def stop(self, grace: float) -> int:
        """SIGTERM to every process of the job (over ssh, to the launcher, which stops every host's
        part), SIGKILL to what is left after `grace` seconds."""
        if self.over_ssh:
            self.signal_launcher(signal.SIGTERM)
        else:
            self.signal_group(signal.SIGTERM)
        try:
            return self.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.signal_group(signal.SIGKILL)
            return self.process.wait()
        finally:
            self.signal_group(signal.SIGKILL)  # ranks the launcher left behind

    def ask_ranks_to_stop(self, signum: int = signal.SIGTERM) -> None:
        """`signum` (SIGTERM, or SIGUSR1 to pass on a scheduler's warning, which the ranks also
        ignore once they are done) to the ranks only (the launcher's grandchildren, or its children
        under torchrun-like launchers): they agree on a step, save a checkpoint and exit 0, and the
        launcher follows. Over ssh, SIGTERM to the launcher, which passes it on to every host."""
        import psutil

        if self.over_ssh:
            self.signal_launcher(signal.SIGTERM)
            return

        try:
            launcher = psutil.Process(self.process.pid)
            ranks = [p for child in launcher.children() for p in child.children()] or launcher.children()
        except psutil.Error:
            ranks = []
        for rank in ranks:
            with contextlib.suppress(psutil.Error):
                rank.send_signal(signum)
        if not ranks:
            self.signal_group(signal.SIGTERM)


def stop_note(received: signal.Signals, passed_on: signal.Signals, over_ssh: bool) -> str | None:
    """What the ranks read as why they stop (`tell_ranks_why`) when the supervisor got `received`
    and passes it on as `passed_on` (over ssh every host's ranks get SIGTERM); None where they get
    `received` itself: the signal says it all, and where a scheduler sends it to every process
    (Slurm's time-limit warning, scancel) a rank that hears the scheduler's copy before the
    supervisor's then names the same signal as one that hears the supervisor's first."""
    reaches_ranks_as = signal.SIGTERM if over_ssh else passed_on
    if reaches_ranks_as == received:
        return None
    return f"{received.name} to pretrain launch, passed on as {reaches_ranks_as.name}"


@dataclass(frozen=True)
class JobStart:
    """What a start of the job is: the attempt (0: the first; later ones resume from the newest
    checkpoint) and, over ssh, the hosts chosen for it with their gradient accumulation."""

    attempt: int
    hosts: Choice | None = None


class Interrupt:
    """SIGINT/SIGTERM to the supervisor: the first asks the job to save and stop, a second kills it.
    SIGUSR1 (a scheduler's warning before its time limit) asks the same, and only asks."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.count = 0
        self.signum: int | None = None
        self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGUSR1 and self.count:
            return  # already stopping: a repeated warning is not a second Ctrl-C
        self.count += 1
        self.signum = self.signum or signum

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


class Supervisor:
    """Runs the job `make_command(start)` gives (asked again at each start, for a fresh rendezvous
    port) and restarts it; the `leader` (node 0) also holds the monitoring service."""

    def __init__(
        self,
        make_command: Callable[[JobStart], list[str]],
        run_dir: str | Path,
        config: MonitorConfig,
        *,
        leader: bool = True,
        base_seed: int = 0,
        poll_seconds: float = 0.2,  # how soon an exit or a hang is noticed
        log=print,
        lock: RunLock | None = None,
        hosts: HostSet | None = None,  # over ssh (pdsh): the host set it chooses each start's hosts from
        job_env: dict[str, str] | None = None,
        resume: Callable[[int | None], str] | None = None,  # how to go on after a stop by a signal (or none)
    ):
        self.make_command, self.run_dir, self.config = make_command, Path(run_dir), config
        self.leader, self.poll_seconds, self.log, self.lock = leader, poll_seconds, log, lock
        self.hosts, self.job_env, self.resume = hosts, job_env or {}, resume
        self.ssh_nodes: list[str] = []  # the current start's hosts, in node-rank order, over ssh
        self.restart_times: list[float] = []  # when the restarts the budget counts were made
        self.clock: Callable[[], float] = time.monotonic  # (what the restart budget's window is read on)
        self._state_write_failed = False
        self.server = self.state = None
        if leader:
            self.server, self.state = serve(run_dir, config, base_seed)
            self.state.supervise(HangWatch.from_config(config))

    # --------------------------------------------------------------------------- the loop

    def run(self) -> int:
        """Start the job, watch it, and after it ends apply what the restart policy decides
        (`restart_policy.decide`), until that is to stop: the supervisor's exit status."""
        self._serve()
        interrupt = Interrupt()
        job = None
        try:
            if self.leader:  # (an earlier launch's request and answer: this one decides afresh)
                (monitor_dir(self.run_dir) / REPLACE_FILE).unlink(missing_ok=True)
            restarts = 0
            while True:
                job = self._start(restarts)
                if job is None:  # too few healthy hosts to start on
                    self._set_state("failed", restarts)
                    return ExitCode.FAILED
                end = self._ended(job, interrupt)
                if end.failed:
                    self._note_lost_nodes(job)
                decision = decide(end, self.hosts, self._budget())
                if decision.action == "stop":
                    return self._stop(decision, end, job)
                self._apply(decision, end)
                restarts += 1
                self._record_restart(restarts, decision.reason)
        finally:
            self._leave(job, interrupt)

    def _serve(self) -> None:
        if self.server is None:
            return
        # poll_interval: how long shutdown() waits for the serving loop when the run ends
        threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, name="monitor-http", daemon=True
        ).start()
        host, port = self.server.server_address[:2]
        self.log(f"launch: monitor on http://{host}:{port} (status: /status, Prometheus: /metrics)")

    def _leave(self, job: Job | None, interrupt: Interrupt) -> None:
        """However the supervisor leaves (an exception included), no job runs on without it."""
        if job is not None and job.poll() is None:
            self.log("launch: stopping the job (the supervisor is exiting)")
            tell_ranks_why(self.run_dir, "pretrain launch is exiting")
            job.ask_ranks_to_stop()
            with contextlib.suppress(subprocess.TimeoutExpired):
                job.process.wait(timeout=self.config.stop_grace_seconds)
            job.stop(grace=0)
            if job.over_ssh:
                wait_for_ranks(self.run_dir, self._ranks_exit_seconds)
        interrupt.restore()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    def _ended(self, job: Job, interrupt: Interrupt) -> JobEnd:
        """Watch the job until it ends; how it ended, with what the run's records say then."""
        outcome, detail = self._watch(job, interrupt)
        if outcome == "interrupted":
            return JobEnd(how="interrupted", status=detail, signum=interrupt.signum)
        if outcome == "hang":
            return JobEnd(how="hang", status=ExitCode.FAILED, why=detail)
        return JobEnd(
            how="exit",
            status=detail,
            why=self._why_failed(job, detail) if detail != ExitCode.DONE else "",
            completed=detail == ExitCode.DONE and self._completed_since(job.started_at),
            leader_running=self._leader_running(),
            move_off=MoveOff.read(self.run_dir) if detail == ExitCode.REPLACE_NODE else None,
        )

    def _budget(self) -> Budget:
        return Budget(self.config.max_restarts, len(self._recent_restarts()), self._window_words())

    def _stop(self, decision: Decision, end: JobEnd, job: Job) -> int:
        self._set_state(decision.state, job.attempt)
        if decision.resume_hint:
            self._tell_how_to_resume(decision.reason, end.signum)
        if decision.line:
            self.log(f"launch: {decision.line}")
        return decision.status

    def _apply(self, decision: Decision, end: JobEnd) -> None:
        """A restart's side: the budget counts a failure's; a host moved off is left out for the
        rest of the run (`HostSet.banned`), or, kept, told to the job's later starts."""
        if decision.counted:
            self.restart_times.append(self.clock())
        if decision.action in ("replace", "shrink"):
            host = decision.host
            self.hosts.banned[host] = decision.asked
            self.log(f"launch: moving off {host}: {decision.asked}")
            self._append(
                NodeExcluded(
                    step=self._step(), host=host, ranks=self.hosts.ranks(host), reason=decision.asked
                )
            )
        elif decision.action == "keep":
            self.log(
                f"launch: {decision.reason}; going on with it, stragglers and machine faults only warned"
            )
            if self.leader and end.move_off is not None:  # (the job's later starts read the answer)
                answer = dataclasses.replace(end.move_off, kept=decision.kept)
                with contextlib.suppress(OSError):
                    atomic.write_json(monitor_dir(self.run_dir) / REPLACE_FILE, answer.to_json())

    def _start(self, restarts: int) -> Job | None:
        """Start the job (attempt `restarts`); over ssh, on hosts that pass their checks (None when
        too few do)."""
        choice = None
        if self.hosts is not None:
            choice = self._choose_hosts()
            if choice is None:
                return None
        command = self.make_command(JobStart(restarts, choice))
        if self.state is not None:
            self.state.job_started(restarts, self.hosts.view() if self.hosts is not None else None)
        # The job inherits the run directory's lock (held until its last process is gone) and is
        # told who supervises it: its ranks stop if this process dies (pretrain/lifeline.py).
        env = os.environ | self.job_env | {OWNER_ENV: owner_tag(os.getpid())}
        fds = (self.lock.fd,) if self.lock is not None and self.lock.fd is not None else ()
        if self.leader:
            clear_rank_records(self.run_dir)  # (what the ranks of an earlier attempt left)
        stderr_file = monitor_dir(self.run_dir) / JOB_STDERR if self.ssh_nodes else None
        job = Job.start(
            command, restarts, env=env, pass_fds=fds, over_ssh=bool(self.ssh_nodes), stderr_file=stderr_file
        )
        self._set_state("running", restarts)
        return job

    def _watch(self, job: Job, interrupt: Interrupt) -> tuple[str, int | str]:
        outcome = self._watch_until_done(job, interrupt)
        if job.over_ssh and not wait_for_ranks(self.run_dir, self._ranks_exit_seconds):
            self.log(
                f"launch: ranks of the job are still running on {', '.join(self.ssh_nodes)} "
                f"{self._ranks_exit_seconds:.0f} s after it ended; going on without them"
            )
        return outcome

    def _watch_until_done(self, job: Job, interrupt: Interrupt) -> tuple[str, int | str]:
        asked_to_stop = False
        failing_since = None  # when the hang watch fired with a rank already gone: a death, not a hang
        while True:
            code = job.poll()
            if code is not None:
                return ("interrupted" if interrupt.count else "exit"), code
            if job.node_exits and not interrupt.count:
                return "exit", self._stop_for_a_failed_node(job)
            if interrupt.count and not asked_to_stop:
                self._pass_on(interrupt, job)
                asked_to_stop = True
            elif interrupt.count > 1:
                return "interrupted", job.stop(grace=0)
            if self.state is not None and not interrupt.count:
                ended, failing_since = self._overdue(job, failing_since)
                if ended is not None:
                    return ended
            time.sleep(self.poll_seconds)

    def _stop_for_a_failed_node(self, job: Job) -> int:
        """pdsh reported a host whose launcher failed: the whole job stops at once; its status."""
        failed = job.node_exits[0]
        node = self.ssh_nodes.index(failed.host) if failed.host in self.ssh_nodes else "?"
        why = f": {failed.last_line}" if failed.last_line else ""
        self.log(
            f"launch: node {node} ({failed.host}) failed: its launcher exited with status "
            f"{failed.code}{why}; stopping the job on every node"
        )
        job.stop(self.config.stop_grace_seconds)
        return failed.code

    def _pass_on(self, interrupt: Interrupt, job: Job) -> None:
        """A signal to the supervisor: the ranks are asked to save and stop (SIGUSR1 passed on as
        itself, anything else as SIGTERM), told first what the supervisor got where they get
        another signal (`stop_note`)."""
        self.log("launch: asking the job to save a checkpoint and stop (again to kill it)")
        received = signal.Signals(interrupt.signum or signal.SIGINT)
        passed_on = signal.SIGUSR1 if received == signal.SIGUSR1 else signal.SIGTERM
        note = stop_note(received, passed_on, job.over_ssh)
        if note is not None:
            tell_ranks_why(self.run_dir, note)
        job.ask_ranks_to_stop(passed_on)

    def _overdue(
        self, job: Job, failing_since: float | None
    ) -> tuple[tuple[str, int | str] | None, float | None]:
        """The hang watch (node 0): how the job ended when it is overdue (None: not ended), and
        since when a rank that left the job is waited for."""
        hung = self.state.overdue()
        if hung and self._completed_since(job.started_at):
            # The last step is trained and saved; only the processes' exit is slow (a final
            # evaluation's teardown, a slow process-group shutdown): done, not hung.
            self.log(f"launch: the run is complete but its processes have not exited ({hung}); stopping them")
            job.stop(self.config.stop_grace_seconds)
            return ("exit", ExitCode.DONE), failing_since
        departed = departed_ranks(self.run_dir) if hung else []
        if departed:
            # A rank has left the job: it is failing, not hung, and its launcher's exit (soon: it
            # stops the other ranks) says how; the death is the reason either way.
            if failing_since is None:
                failing_since = time.monotonic()
                gone = [r for r in departed if not r.get("exited")] or departed  # (the dead first)
                ranks = ", ".join(str(r.get("rank", "?")) for r in gone)
                self.log(
                    f"launch: {hung}, but rank{'s' if len(gone) > 1 else ''} {ranks} "
                    f"{'have' if len(gone) > 1 else 'has'} left the job; waiting for its launcher to exit"
                )
            if time.monotonic() - failing_since > self._launcher_exit_seconds:
                self.log(
                    f"launch: a rank has left the job and its launcher has not exited in "
                    f"{self._launcher_exit_seconds:.0f} s; stopping the job"
                )
                return ("exit", job.stop(self.config.stop_grace_seconds) or ExitCode.FAILED), failing_since
        elif hung:
            self.log(f"launch: {hung}; stopping the job")
            job.stop(self.config.stop_grace_seconds)
            return ("hang", hung), failing_since
        return None, failing_since

    def _tell_how_to_resume(self, why: str, signum: int | None = None) -> None:
        """A job that ended before the run's last step (stopped by `signum`, or by itself): what
        was saved and how to go on, on the console and (node 0) in events.jsonl."""
        saved = checkpoint.newest_complete(self.run_dir, verify_hashes=False)
        resume = self.resume(signum) if self.resume else "the same command again"
        self.log(f"launch: {why}; newest checkpoint: {saved or 'none yet'}; to resume: {resume}")
        if self.leader:
            event = JobStopped(
                step=checkpoint.step_of(saved) if saved else None, saved=saved, why=why, resume=resume
            )
            with contextlib.suppress(OSError):
                append_event(self.run_dir, event)

    def _why_failed(self, job: Job, status: int) -> str:
        """A failed job's cause in a few words: the node whose launcher failed, the rank that was
        killed (and the signal) or that stopped on bad input, with the step; else the status."""
        if job.node_exits:
            failed = job.node_exits[0]
            return f"{failed.host}'s launcher exited with status {failed.code}"
        return describe_failure(self.run_dir, status)

    def _completed_since(self, started_at: float) -> bool:
        """Whether this attempt wrote a summary of a completed run (the loop's last act)."""
        return run_completed(self.run_dir, since=started_at)

    @property
    def _ranks_exit_seconds(self) -> float:
        """Over ssh, how long the ranks on every host may take to exit once the job has ended:
        the stop's grace, then DeepSpeed's per-node launcher's own 30 s for its ranks, and a margin."""
        return self.config.stop_grace_seconds + LAUNCHER_RANKS_SECONDS + 5

    @property
    def _launcher_exit_seconds(self) -> float:
        """How long a launcher whose rank has left may take to exit: its own wait for the other
        ranks (they stop at once, or within PEER_REASON_WAIT_S, 3 s, when they lose a collective),
        and a margin: a safety net for a launcher that is stuck, not a race with a slow one."""
        return LAUNCHER_RANKS_SECONDS + 5

    # --------------------------------------------------------------------------- the hosts

    def _choose_hosts(self):
        """Check every host, choose the next start's, and say (console, events) what changed: a
        host left out and why, a spare in a lost one's place, a smaller world. None, with the
        reason, when fewer than --min-nodes hosts can take part."""
        hosts, before = self.hosts, list(self.hosts.in_use)
        excluded_before = dict(hosts.excluded)
        choice = hosts.choose(check_hosts(hosts.slots, self.run_dir, need=hosts.gpu_memory_needed))
        for host, why in hosts.excluded.items():
            if excluded_before.get(host) != why:
                self.log(f"launch: {host} left out: {why}")
                self._append(
                    NodeExcluded(step=self._step(), host=host, ranks=hosts.ranks(host, before), reason=why)
                )
        for refused in choice.refused if choice is not None else []:
            self.log(f"launch: not on {refused}")
        if choice is None:
            self.log(
                f"launch: fewer than --min-nodes {hosts.min_nodes} host(s) can take part "
                f"({', '.join(f'{h}: {w}' for h, w in (hosts.excluded | hosts.banned).items()) or 'none healthy'}); "
                "giving up: bring hosts back and run the same command again"
            )
            return None
        gone = [h for h in before if h not in choice.hosts]
        for old, new in zip(gone, [h for h in choice.hosts if h not in before], strict=False):
            self.log(f"launch: {new} replaces {old}")
            self._append(NodeReplaced(step=self._step(), old=old, new=new))
        world = sum(hosts.slots[h] for h in choice.hosts)
        previous = sum(hosts.slots[h] for h in before) if before else None
        if previous is not None and world != previous:
            self.log(
                f"launch: {previous} -> {world} process(es) on {len(choice.hosts)} node(s), "
                f"{choice.grad_accum} micro-batches per step (the global batch kept)"
            )
            self._append(
                WorldResized(step=self._step(), previous=previous, size=world, accumulation=choice.grad_accum)
            )
        hosts.in_use, self.ssh_nodes = list(choice.hosts), list(choice.hosts)
        if self.leader:
            with contextlib.suppress(OSError):
                atomic.write_json(monitor_dir(self.run_dir) / HOSTS_FILE, hosts.view())
        return choice

    def _note_lost_nodes(self, job: Job) -> None:
        """A failed job's lost nodes, events and the last place in the host set's preference: of
        the hosts pdsh reported, those whose ranks vanished (killed with their node, not exited
        with a reason as the survivors that lost them do); the first reported when no record says."""
        if self.hosts is None or not job.node_exits:
            return
        vanished = {r.get("node") for r in rank_records(self.run_dir) if not r.get("exited")}
        nodes = self.ssh_nodes
        dead = [nodes[n] for n in sorted(n for n in vanished if isinstance(n, int) and 0 <= n < len(nodes))]
        reported = {failed.host: failed for failed in job.node_exits}
        for host in dead or [job.node_exits[0].host]:
            if host in self.hosts.lost:
                continue
            self.hosts.lost.append(host)
            failed = reported.get(host)
            why = "its ranks vanished" if failed is None else f"its launcher exited with status {failed.code}"
            if failed is not None and failed.last_line:
                why += f": {failed.last_line}"
            self.log(f"launch: {host} lost ({why})")
            self._append(NodeLost(step=self._step(), host=host, ranks=self.hosts.ranks(host), reason=why))

    def _recent_restarts(self) -> list[float]:
        """The counted restarts within monitor.restart_window_hours (all of them when it is null)."""
        hours, now = self.config.restart_window_hours, self.clock()
        return [t for t in self.restart_times if hours is None or now - t < hours * 3600]

    def _window_words(self) -> str:
        hours = self.config.restart_window_hours
        return "in the run" if hours is None else f"within monitor.restart_window_hours={hours:g}"

    def _step(self) -> int | None:
        return self.state.last_step() if self.state is not None else None

    def _append(self, event: Event) -> None:
        """Node 0: an event of the host set; a full disk loses the line, not the supervisor."""
        if self.leader:
            with contextlib.suppress(OSError):
                append_event(self.run_dir, event)

    # --------------------------------------------------------------------------- records

    def _record_restart(self, restarts: int, reason: str) -> None:
        resume = checkpoint.newest_complete(self.run_dir, verify_hashes=False)
        step = None
        if self.state is not None:
            step = self.state.last_step()
        event = Restart(
            step=step,
            reason=reason,
            restart=restarts,
            max_restarts=self.config.max_restarts,
            resume_from=resume,
        )
        self.log(
            f"launch: restart {len(self._recent_restarts())}/{self.config.max_restarts} after {reason}, "
            f"from {resume or 'the beginning (no complete checkpoint yet)'}"
        )
        if self.state is not None:  # node 0: the service records it (events, /status, Prometheus)
            self.state.record_restart(event)

    def _set_state(self, state: str, attempt: int) -> None:
        """RUN_DIR/monitor/supervisor.json; a failing write (a full disk) is one line, once, and the
        supervisor carries on supervising."""
        if not self.leader:
            return
        try:
            atomic.write_json(
                monitor_dir(self.run_dir) / SUPERVISOR_FILE,
                {"state": state, "attempt": attempt, "pid": os.getpid(), "time": time.time()},
            )
            self._state_write_failed = False
        except OSError as exc:
            if not self._state_write_failed:
                free = shutil.disk_usage(self.run_dir).free if self.run_dir.exists() else 0
                self.log(
                    f"launch: cannot write {monitor_dir(self.run_dir) / SUPERVISOR_FILE}: {exc.strerror} "
                    f"({free // 2**20} MB free); still supervising the job"
                )
            self._state_write_failed = True

    def _leader_running(self) -> bool:
        """A follower restarts its ranks only while node 0's supervisor is still running the job."""
        if self.leader:
            return True
        path = monitor_dir(self.run_dir) / SUPERVISOR_FILE
        try:
            return json.loads(path.read_text())["state"] == "running"
        except (OSError, ValueError, KeyError):
            return False
