"""The machine faults a run has found, per host, and the move off a host that reaches
`monitor.machine_faults_to_exclude` (issue 46; docs/monitoring.md, "Replay and replica checks").
Shared by the two checks that find them: the replay of a rejected step (`replay_hook.py`) and the
replicas' comparison (`replica_hook.py`).

The counts live in RUN_DIR/monitor/machine_faults.json, over the whole run (every restart). A host
that reaches the limit is moved off: every rank saves and stops with ExitCode.REPLACE_NODE, rank 0
having named the host in RUN_DIR/monitor/replace.json for the supervisor (`pretrain launch`), which
restarts the job without it.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass, field
from pathlib import Path

from monitoring.protocol import REPLACE_FILE, monitor_dir
from pretrain import atomic
from pretrain.errors import ExitCode
from pretrain.parallel.distributed import DistEnv, all_gather_objects
from pretrain.stability.replay import FaultCounts
from pretrain.train.hooks import CONTINUE, Answer, SaveAndStop

COUNTS_FILE = "machine_faults.json"  # RUN_DIR/monitor/: machine faults per host over the run


@dataclass(kw_only=True)
class FaultLedger:
    """Every rank: each rank's host, and the run's machine faults per host."""

    env: DistEnv
    run_dir: Path
    counts: FaultCounts
    hosts: list[str] = field(default_factory=list)  # every rank's host, by rank

    def open(self) -> None:
        """Once, on every rank (a collective), by whichever check opens first."""
        if not self.hosts:
            self.hosts = all_gather_objects(socket.gethostname())
            self.counts.counts = read_counts(self.run_dir)

    def count(self, step: int, ranks: list[int], why: str) -> Answer:
        """One machine fault on the hosts of `ranks` (each host once); a host that reaches the
        limit is moved off."""
        reached = self.counts.add([self.hosts[r] for r in ranks])
        if self.env.is_main:
            monitor_dir(self.run_dir).mkdir(parents=True, exist_ok=True)
            atomic.write_json(monitor_dir(self.run_dir) / COUNTS_FILE, self.counts.counts)
        if not reached:
            return CONTINUE
        host = reached[0]
        reason = (
            f"{self.counts.counts[host]} machine faults on {host} (monitor.machine_faults_to_exclude="
            f"{self.counts.limit}; the last at step {step}: {why})"
        )
        if self.env.is_main:
            atomic.write_json(
                monitor_dir(self.run_dir) / REPLACE_FILE,
                {"host": host, "rank": self.hosts.index(host), "step": step, "reason": reason},
            )
        return SaveAndStop(f"moving off {host} ({reason})", ExitCode.REPLACE_NODE)


def read_counts(run_dir: Path) -> dict[str, int]:
    """RUN_DIR/monitor/machine_faults.json: {host: faults} over the run so far."""
    path = monitor_dir(run_dir) / COUNTS_FILE
    try:
        return {str(k): int(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}
