"""The machine faults a run has found, per host, and the move off a host that reaches
`monitor.machine_faults_to_exclude` (issue 46; docs/monitoring.md, "Replay and replica checks").
Shared by the two checks that find them: the replay of a rejected step (`replay_hook.py`) and the
replicas' comparison (`replica_hook.py`).

The counts live in RUN_DIR/monitor/machine_faults.json, over the whole run (every restart). A host
that reaches the limit is moved off (`move_off.py`, as a straggler is): every rank saves and stops
with ExitCode.REPLACE_NODE, rank 0 having named the host in RUN_DIR/monitor/replace.json for the
supervisor (`pretrain launch`), which restarts the job without it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from monitoring.protocol import monitor_dir
from pretrain import atomic
from pretrain.parallel.distributed import DistEnv
from pretrain.stability.replay import FaultCounts
from pretrain.train.hooks import CONTINUE, Answer
from pretrain.train.move_off import HostMoves

COUNTS_FILE = "machine_faults.json"  # RUN_DIR/monitor/: machine faults per host over the run


@dataclass(kw_only=True)
class FaultLedger:
    """Every rank: the run's machine faults per host."""

    env: DistEnv
    run_dir: Path
    counts: FaultCounts
    moves: HostMoves  # each rank's host, and the way to move one off

    @property
    def hosts(self) -> list[str]:
        return self.moves.hosts

    def open(self) -> None:
        """Once, on every rank (a collective), by whichever check opens first."""
        if not self.moves.hosts:
            self.moves.open()
            self.counts.counts = read_counts(self.run_dir)

    def count(self, step: int, ranks: list[int], why: str, saving: int | None = None) -> Answer:
        """One machine fault at `step` on the hosts of `ranks` (each host once); a host that
        reaches the limit is moved off, the job saving step `saving` (`step` by default) first."""
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
        # A rank at fault on that host: the supervisor finds the host by its rank (host names may repeat)
        rank = next(r for r in ranks if self.hosts[r] == host)
        return self.moves.ask(rank, step if saving is None else saving, reason, "machine_faults")


def read_counts(run_dir: Path) -> dict[str, int]:
    """RUN_DIR/monitor/machine_faults.json: {host: faults} over the run so far."""
    path = monitor_dir(run_dir) / COUNTS_FILE
    try:
        return {str(k): int(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}
