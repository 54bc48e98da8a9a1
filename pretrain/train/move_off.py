"""Moving a host off: the one way the trainer asks the supervisor for it, whatever the cause — a
straggler (`straggler_hook.py`, monitor.on_straggler=replace) or machine faults
(`machine_faults.py`, monitor.machine_faults_to_exclude). docs/monitoring.md, "Stragglers" and
"Replay and replica checks".

`HostMoves.ask` answers the loop with `SaveAndStop(..., ExitCode.REPLACE_NODE)` on every rank,
rank 0 having written the request, a `monitoring.protocol.MoveOff`, to RUN_DIR/monitor/replace.json;
the supervisor (`pretrain launch`) restarts the job without that host. Where the supervisor
answered an earlier request that it cannot move a host off (the record's `kept`: no spare, no
fewer nodes allowed), this start only warns: asking again would restart the job forever.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from monitoring.protocol import REPLACE_FILE, MoveOff, monitor_dir
from pretrain import atomic
from pretrain.errors import ExitCode
from pretrain.parallel.distributed import DistEnv, all_gather_objects
from pretrain.reporting.metrics import MetricsWriter
from pretrain.run_dir import OWNER_ENV
from pretrain.train.hooks import CONTINUE, Answer, SaveAndStop


@dataclass(kw_only=True)
class HostMoves:
    """Every rank: each rank's host, gathered once for every hook that names hosts, and the
    request to move one off."""

    env: DistEnv
    run_dir: Path
    writer: MetricsWriter
    hosts: list[str] = field(default_factory=list)  # every rank's host, by rank
    kept: str | None = None  # the supervisor's answer to an earlier request: why it cannot move hosts off
    warned: set[str] = field(default_factory=set)  # hosts said to stay (once each)

    def open(self) -> None:
        """Once, on every rank (a collective), by whichever hook opens first: the hosts, and
        rank 0's reading of the supervisor's answer (so every rank answers alike)."""
        if self.hosts:
            return
        earlier = MoveOff.read(self.run_dir) if self.env.is_main else None
        gathered = all_gather_objects((socket.gethostname(), earlier.kept if earlier is not None else None))
        self.hosts, self.kept = [host for host, _ in gathered], gathered[0][1]

    def ask(self, rank: int, step: int, reason: str, cause: str) -> Answer:
        """Every rank: move off the host of `rank` (`cause`: "straggler" or "machine_faults") —
        save and stop with ExitCode.REPLACE_NODE; only a warning when the supervisor said it cannot."""
        host = self.hosts[rank]
        if self.kept is not None:
            if host not in self.warned:
                self.warned.add(host)
                self.writer.message(
                    f"{host} stays ({reason}): the supervisor cannot move it off ({self.kept})"
                )
            return CONTINUE
        if self.env.is_main:
            asked = MoveOff(host=host, rank=rank, step=step, reason=reason, cause=cause)
            monitor_dir(self.run_dir).mkdir(parents=True, exist_ok=True)
            atomic.write_json(monitor_dir(self.run_dir) / REPLACE_FILE, asked.to_json())
            if not os.environ.get(OWNER_ENV):  # no `pretrain launch` to restart it
                self.writer.message(
                    f"no supervisor runs this job to restart it without {host}: start it again without "
                    f"{host} and it resumes from the checkpoint it saves now"
                )
        return SaveAndStop(f"moving off {host} ({reason})", ExitCode.REPLACE_NODE)
