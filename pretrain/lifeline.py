"""No rank trains without its supervisor.

`pretrain launch` tells the job who supervises it (`PRETRAIN_RUN_OWNER=host:pid:start`). Each rank
on that host watches that process; when it is gone (killed with -9, crashed, out of disk), the rank
sends itself SIGTERM — the same path as a preemption: the ranks agree at the next step boundary,
save a checkpoint and exit — and, if it is still alive `GRACE_SECONDS` later (a hung collective, a
save that cannot finish), SIGKILL. So every rank is gone within `POLL_SECONDS + GRACE_SECONDS` of
its supervisor. Ranks on other hosts of a pdsh launch cannot see the supervisor's process; in the
launcher's no-ssh mode each node has its own supervisor, which its ranks watch.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time

from pretrain.run_dir import OWNER_ENV

POLL_SECONDS = 1.0
GRACE_SECONDS = 25.0


def owner_tag(pid: int) -> str:
    """What the supervisor puts in PRETRAIN_RUN_OWNER for its job (the start time guards against a
    reused pid)."""
    import psutil

    return f"{socket.gethostname()}:{pid}:{psutil.Process(pid).create_time():.3f}"


def supervisor_alive(tag: str) -> bool:
    import psutil

    _, pid, started = tag.rsplit(":", 2)
    try:
        return f"{psutil.Process(int(pid)).create_time():.3f}" == started
    except psutil.Error:
        return False


def watch_supervisor() -> threading.Thread | None:
    """Every rank, at start: a daemon thread that stops this process when its supervisor dies;
    None when there is no supervisor on this host to watch."""
    tag = os.environ.get(OWNER_ENV, "")
    if tag.count(":") < 2 or tag.rsplit(":", 2)[0] != socket.gethostname():
        return None
    thread = threading.Thread(target=_watch, args=(tag,), name="supervisor-lifeline", daemon=True)
    thread.start()
    return thread


def _watch(tag: str) -> None:
    while supervisor_alive(tag):
        time.sleep(POLL_SECONDS)
    print(f"rank {os.environ.get('RANK', '0')}: the supervisor (pid {tag.rsplit(':', 2)[1]}) is gone: "
          f"saving a checkpoint and stopping", file=sys.stderr, flush=True)  # fmt: skip
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE_SECONDS)
    os.kill(os.getpid(), signal.SIGKILL)
