"""The supervisor's host set over ssh (`pretrain launch --hostfile H --nodes N --min-nodes M`):
which hosts the job runs on, which wait as spares, which are left out and why, and the check a
host passes before each start.

Before every start each host is checked (`check_hosts`: ssh answers within a timeout, the
project's Python imports there and finds torch and DeepSpeed installed, the run directory is
writable and has room, the GPUs its slots
need are visible where there are GPUs, each with the memory the run's memory plan needs per GPU,
`pretrain/planning/memory.py`). `HostSet.choose` then takes N healthy hosts — those of the
last attempt first, then the spares in hostfile order, then hosts lost earlier in the run — or,
with fewer than N healthy, fewer nodes down to M where the global batch still divides (more
gradient accumulation keeps it exactly). A host the trainer asked to move off (a straggler,
machine faults: `monitoring.protocol.MoveOff`) is left out for the rest of the run; any other
host is checked again at each start.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

CHECK_SECONDS = 60.0  # a host's whole check (ssh, then importing the project: a cold cache is slow)
CONNECT_SECONDS = 10  # ssh's own connection timeout
MIN_FREE_BYTES = 1 << 30  # the run directory's file system needs at least this much room (1 GiB)

# What a host runs to check itself, as the DeepSpeed launcher will run the job there: the same
# Python, in the same directory. It prints one JSON line: the problem, or none.
CHECK_SCRIPT = """
import json, os, shutil, sys, tempfile
run_dir, slots, min_free, need = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def say(problem):
    print(json.dumps({"problem": problem})); sys.exit(0)
try:
    import importlib.util, monitoring, pretrain  # noqa: F401  (the project; its engine only found:
    missing = [m for m in ("torch", "deepspeed") if importlib.util.find_spec(m) is None]  # ~2 s each)
except Exception as exc:
    say(f"the project does not import: {type(exc).__name__}: {exc}")
if missing:
    say(f"{' and '.join(missing)} not installed for {sys.executable}")
try:
    os.makedirs(run_dir, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=run_dir, prefix=".host_check_"):
        pass
except OSError as exc:
    say(f"the run directory {run_dir} is not writable: {exc.strerror}")
free = shutil.disk_usage(run_dir).free
if free < min_free:
    say(f"the run directory's file system has {free >> 20} MiB free (needs {min_free >> 20} MiB)")
if os.path.exists("/dev/nvidia0") or os.path.exists("/dev/nvidiactl"):
    import torch
    if torch.cuda.device_count() < slots:
        say(f"{torch.cuda.device_count()} GPU(s) visible, {slots} expected")
    have = min(torch.cuda.get_device_properties(i).total_memory for i in range(slots)) / 2**30
    if have < need / 2**30:
        say(f"its GPUs have {have:.1f} GiB but the memory plan needs {need / 2**30:.1f} GiB per GPU "
            f"(`pretrain plan CFG --gpus N --gpu-memory-gib {have:.0f}` shows what fits)")
say(None)
"""


def check_host(host: str, run_dir: Path, slots: int, env: dict | None = None, need: float = 0) -> str | None:
    """Why `host` cannot take part in the next start, or None when it can. `need`: the bytes per GPU
    of the run's memory plan (`pretrain/planning/memory.py`; 0: not checked)."""
    arguments = [str(run_dir), str(slots), str(MIN_FREE_BYTES), str(int(need))]
    remote = shlex.join([sys.executable, "-c", CHECK_SCRIPT, *arguments])
    command = ["ssh", "-o", f"ConnectTimeout={CONNECT_SECONDS}", "-o", "BatchMode=yes", host]
    command.append(f"cd {shlex.quote(os.getcwd())} && {remote}")
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=CHECK_SECONDS, env=env)
    except subprocess.TimeoutExpired:
        return f"no answer over ssh within {CHECK_SECONDS:.0f} s"
    for line in reversed(done.stdout.splitlines()):
        try:
            return json.loads(line)["problem"]
        except (ValueError, KeyError, TypeError):
            continue
    said = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
    return said if said.startswith("ssh:") else f"ssh: {said}"


def check_hosts(
    slots: dict[str, int], run_dir: Path, env: dict | None = None, need: float = 0
) -> dict[str, str | None]:
    """Every host's check, at once: host → None (healthy) or why not."""
    with ThreadPoolExecutor(max_workers=min(len(slots), 32) or 1) as pool:
        found = {host: pool.submit(check_host, host, run_dir, n, env, need) for host, n in slots.items()}
        return {host: future.result() for host, future in found.items()}


@dataclass(frozen=True)
class Choice:
    """The hosts of the next start and its gradient accumulation; `refused`: smaller sizes (node
    counts) left out because the global batch does not divide by them, with why."""

    hosts: list[str]
    grad_accum: int
    refused: list[str] = field(default_factory=list)


@dataclass
class HostSet:
    slots: dict[str, int]  # every host of the hostfile, in its order, with its processes
    nodes: int  # N: the job's hosts when enough are healthy
    min_nodes: int  # M: the fewest it may shrink to
    micro_batch: int  # train.micro_batch_size
    grad_accum: int  # train.grad_accum at N nodes (the global batch is kept at any size)
    in_use: list[str] = field(default_factory=list)  # the hosts of the current (or last) start
    excluded: dict[str, str] = field(default_factory=dict)  # left out of the last start: host → why
    lost: list[str] = field(default_factory=list)  # lost during the run (least preferred)
    banned: dict[str, str] = field(default_factory=dict)  # left out for the rest of the run (moved off)
    gpu_memory_needed: float = 0.0  # bytes per GPU of the run's memory plan, checked on every host

    def __post_init__(self) -> None:
        hosts = list(self.slots)
        base = hosts[: self.nodes]
        self.global_batch = self.micro_batch * self.grad_accum * sum(self.slots[h] for h in base)

    def spares(self) -> list[str]:
        """Hosts neither in use nor left out: ready to take a lost one's place."""
        return [
            h for h in self.slots if h not in self.in_use and h not in self.excluded and h not in self.banned
        ]

    def ranks(self, host: str, hosts: list[str] | None = None) -> list[int]:
        """The ranks `host` holds among `hosts` (the current start's by default): DeepSpeed numbers
        them in the order of its hostfile."""
        hosts = self.in_use if hosts is None else hosts
        if host not in hosts:
            return []
        first = sum(self.slots[h] for h in hosts[: hosts.index(host)])
        return list(range(first, first + self.slots[host]))

    def choose(self, problems: dict[str, str | None]) -> Choice | None:
        """The next start's hosts from the checks' `problems` (host → why it cannot take part, or
        None); None when fewer than M hosts can take part at a size the global batch divides."""
        self.excluded = {h: why for h, why in problems.items() if why is not None and h not in self.banned}
        healthy = [h for h in self.preference() if problems.get(h) is None and h not in self.banned]
        refused = []
        for count in range(min(self.nodes, len(healthy)), self.min_nodes - 1, -1):
            hosts = healthy[:count]
            per_step = self.micro_batch * sum(self.slots[h] for h in hosts)
            if self.global_batch % per_step == 0:
                return Choice(hosts, self.global_batch // per_step, refused)
            refused.append(
                f"{count} node(s): the global batch {self.global_batch} is not a multiple of "
                f"train.micro_batch_size {self.micro_batch} x {per_step // self.micro_batch} processes"
            )
        return None

    def preference(self) -> list[str]:
        """The order hosts are taken in: the last start's (that were not lost), then the rest of
        the hostfile's, then the hosts lost earlier in the run."""
        fresh = [h for h in self.slots if h not in self.lost]
        kept = [h for h in self.in_use if h in fresh]
        return kept + [h for h in fresh if h not in kept] + [h for h in self.slots if h in self.lost]

    def view(self) -> dict:
        """/status's `job.hosts` and RUN_DIR/monitor/hosts.json."""
        return {
            "in_use": list(self.in_use),
            "spares": self.spares(),
            "excluded": self.excluded | self.banned,
            "lost": list(self.lost),
        }
