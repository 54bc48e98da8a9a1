"""No rank trains without its supervisor, and the supervisor knows when its ranks are gone.

`pretrain launch` tells the job who supervises it (`PRETRAIN_RUN_OWNER=host:pid:start`), on every
host: in the job's environment, and over ssh in the file DeepSpeed's launcher reads its exported
variables from (`DS_ENV_FILE`, see `pretrain/cli/launch.py`).

- Each rank on the supervisor's host watches that process; when it is gone (killed with -9,
  crashed, out of disk), the rank sends itself SIGTERM — the same path as a preemption: the ranks
  agree at the next step boundary, save a checkpoint and exit — and, if it is still alive
  `GRACE_SECONDS` later (a hung collective, a save that cannot finish), SIGKILL. So every rank is
  gone within `POLL_SECONDS + GRACE_SECONDS` of its supervisor.
- Ranks on other hosts of an ssh (pdsh) launch cannot see the supervisor's process, but the
  DeepSpeed launcher can: it runs beside the supervisor (`pretrain/cli/deepspeed_runner.py`) and,
  when the supervisor is gone, signals this job's launcher on every host over pdsh, and each
  passes SIGTERM to its ranks, which save and exit while pdsh still relays their output. In the
  launcher's no-ssh mode (and under Slurm) each node has its own supervisor, which its ranks watch.
- Every rank of a supervised job holds a shared lock on RUN_DIR/monitor/ranks.lock for its life
  (the run directory is on a file system every node shares, as checkpoints need), so the
  supervisor can tell when the last rank of a job, on any host, has exited (`ranks_running`).
- Every rank of a supervised job also keeps a record, RUN_DIR/monitor/ranks/rank-R.json (its host
  and pid), marked as exited when the process leaves through Python's exit, with the step it was
  in and why it stopped where that is known (`note_exit`). A rank the kernel killed (SIGKILL, the
  OOM killer) or that crashed below Python leaves its record unmarked: the supervisor names it
  when the job fails (`vanished_ranks`) instead of quoting the launcher's exit status.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from pretrain import atomic
from pretrain.parallel.distributed import STOP_CAUSE
from pretrain.run_dir import OWNER_ENV

POLL_SECONDS = 1.0
GRACE_SECONDS = 25.0
RANKS_LOCK = "monitor/ranks.lock"
RANK_RECORDS = "monitor/ranks"
STOP_REASON = "monitor/stop_reason.json"  # why the supervisor asks its ranks to stop, as it asks

_held: list[int] = []  # this process's shared lock on ranks.lock, kept open for its life
_record: dict = {}  # this rank's record: its path, and what it says once the rank exits


def owner_tag(pid: int | None = None) -> str:
    """What the supervisor (this process, by default) puts in PRETRAIN_RUN_OWNER for its job (the
    start time guards against a reused pid)."""
    import psutil

    pid = os.getpid() if pid is None else pid
    return f"{socket.gethostname()}:{pid}:{psutil.Process(pid).create_time():.3f}"


def supervisor_alive(tag: str) -> bool:
    import psutil

    _, pid, started = tag.rsplit(":", 2)
    try:
        return f"{psutil.Process(int(pid)).create_time():.3f}" == started
    except psutil.Error:
        return False


def watch_supervisor(
    run_dir: str | Path | None = None,
    *,
    who: str | None = None,
    then: str = "saving a checkpoint and stopping",
) -> threading.Thread | None:
    """Every rank, at start (and the launcher beside the supervisor): hold the job's shared lock
    on RUN_DIR/monitor/ranks.lock (given `run_dir`), and a daemon thread that stops this process
    when its supervisor dies; None when there is no supervisor on this host to watch."""
    tag = os.environ.get(OWNER_ENV, "")
    if tag.count(":") < 2:
        return None
    if run_dir is not None:
        _hold_ranks_lock(Path(run_dir))
        _keep_record(Path(run_dir))
    if tag.rsplit(":", 2)[0] != socket.gethostname():
        return None
    who = who or f"rank {os.environ.get('RANK', '0')}"
    thread = threading.Thread(target=_watch, args=(tag, who, then), name="supervisor-lifeline", daemon=True)
    thread.start()
    return thread


def _watch(tag: str, who: str, then: str) -> None:
    while supervisor_alive(tag):
        time.sleep(POLL_SECONDS)
    host, pid, _ = tag.rsplit(":", 2)
    with contextlib.suppress(OSError):  # (a stderr that went away with the supervisor)
        print(f"{who}: the supervisor (pid {pid}) is gone: {then}", file=sys.stderr, flush=True)
    STOP_CAUSE.append(f"its supervisor (pid {pid} on {host}) is gone")
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE_SECONDS)
    os.kill(os.getpid(), signal.SIGKILL)


def _hold_ranks_lock(run_dir: Path) -> None:
    path = run_dir / RANKS_LOCK
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return  # a full disk: the supervisor then cannot wait for us
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # never waits long: only a supervisor's brief probe is exclusive
    except OSError:
        os.close(fd)  # a file system without locks: as above
        return
    _held.append(fd)


def _keep_record(run_dir: Path) -> None:
    rank = int(os.environ.get("RANK", "0"))
    record = {
        "rank": rank,
        "node": int(os.environ.get("CROSS_RANK", "0")),
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }
    path = run_dir / RANK_RECORDS / f"rank-{rank}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_json(path, record)
    except OSError:
        return  # a full disk: the supervisor then cannot name a vanished rank
    _record.update(path=path, record=record)
    atexit.register(_mark_exited)


def note_step(step: int) -> None:
    """The step this rank is in (the loop, as each step begins; a dict write)."""
    _record["step"] = step


def current_step() -> int | None:
    return _record.get("step")


def note_exit(*, why: str, status: int | None = None, now: bool = False) -> None:
    """Why this rank stops early (and its exit status), for its record; `now`: written at once, for
    the other ranks, which learn of it when this one is gone."""
    _record["why"] = why
    if status is not None:
        _record["status"] = status
    if now and "path" in _record:
        _mark_exited()


def _mark_exited() -> None:
    extra = {k: _record[k] for k in ("step", "why", "status") if k in _record}
    with contextlib.suppress(OSError):
        atomic.write_json(_record["path"], _record["record"] | extra | {"exited": True})


def peer_reason(wait: float, poll: float = 0.2) -> dict | None:
    """Another rank's record that says why it stopped (bad input it found), waiting up to `wait`
    seconds for one to appear; None when none does (it was killed, or there are no records)."""
    if "path" not in _record:
        return None
    run_dir = Path(_record["path"]).parents[2]
    deadline = time.monotonic() + wait
    while True:
        told = [
            r for r in rank_records(run_dir) if r.get("status") and r.get("rank") != _record["record"]["rank"]
        ]
        if told or time.monotonic() >= deadline:
            return told[0] if told else None
        time.sleep(poll)


def clear_rank_records(run_dir: str | Path) -> None:
    """Before a job starts: the records of an earlier attempt's ranks, and why it was stopped, are gone."""
    for path in [*(Path(run_dir) / RANK_RECORDS).glob("rank-*.json"), Path(run_dir) / STOP_REASON]:
        with contextlib.suppress(OSError):
            path.unlink()


def tell_ranks_why(run_dir: str | Path, why: str) -> None:
    """The supervisor, before it signals its ranks to stop: what it was asked and how it passes it on
    (a Ctrl-C reaches the ranks as SIGTERM, which they could not tell from a scheduler's own)."""
    path = Path(run_dir) / STOP_REASON
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_json(path, {"why": why})


def why_the_supervisor_stops(run_dir: str | Path) -> str | None:
    """What the supervisor said as it asked the ranks to stop (`tell_ranks_why`), or None."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return str(json.loads((Path(run_dir) / STOP_REASON).read_text())["why"])
    return None


def rank_records(run_dir: str | Path) -> list[dict]:
    """The records of the job's ranks, by rank (unreadable ones left out)."""
    records = []
    for path in (Path(run_dir) / RANK_RECORDS).glob("rank-*.json"):
        with contextlib.suppress(OSError, ValueError):
            records.append(json.loads(path.read_text()))
    return sorted(records, key=lambda r: r.get("rank", 0))


def describe_failure(run_dir: str | Path, status: int) -> str:
    """Why a job failed, for the supervisor's line: the ranks that vanished (killed by a signal
    or crashed without Python's exit), the signal where the status says it, and the step the
    surviving ranks were in; else what a rank said when it stopped; else the exit status."""
    records = rank_records(run_dir)
    steps = [r["step"] for r in records if r.get("step") is not None]
    at = f" during step {max(steps)}" if steps else ""
    vanished = [r for r in records if not r.get("exited")]
    if vanished:
        signum = signal_of_status(status)
        how = (
            f"killed by {signal.Signals(signum).name}"
            if signum
            else "gone without exiting (killed or crashed)"
        )
        who = ", ".join(f"rank {r['rank']} ({r['host']}, pid {r['pid']})" for r in vanished)
        return f"{who} {'were' if len(vanished) > 1 else 'was'} {how}{at} (exit status {status})"
    told = sorted(
        (r for r in records if r.get("why")), key=lambda r: "status" not in r
    )  # (its own reason first)
    if told:
        return f"rank {told[0]['rank']} stopped{at}: {told[0]['why']} (exit status {status})"
    return f"exit status {status}"


def signal_of_status(status: int) -> int | None:
    """The signal that ended a rank, from a launcher's exit status: DeepSpeed's launcher exits with
    the rank's negative return code (256 - N), a shell with 128 + N."""
    for signum in (256 - status, status - 128):
        if signum in (
            signal.SIGKILL,
            signal.SIGSEGV,
            signal.SIGABRT,
            signal.SIGBUS,
            signal.SIGTERM,
            signal.SIGINT,
        ):
            return signum
    return None


def ranks_running(run_dir: str | Path) -> bool:
    """Whether any rank of a supervised job, on any host sharing the run directory, still runs."""
    path = Path(run_dir) / RANKS_LOCK
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # also drops the probe's lock at once
    return False


def wait_for_ranks(run_dir: str | Path, timeout: float, poll: float = 0.2) -> bool:
    """Wait up to `timeout` seconds for every rank of the job to exit; whether they all have."""
    deadline = time.monotonic() + timeout
    while ranks_running(run_dir):
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll)
    return True
