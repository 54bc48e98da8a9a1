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
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from pretrain.distributed import STOP_CAUSE
from pretrain.run_dir import OWNER_ENV

POLL_SECONDS = 1.0
GRACE_SECONDS = 25.0
RANKS_LOCK = "monitor/ranks.lock"

_held: list[int] = []  # this process's shared lock on ranks.lock, kept open for its life


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
