"""The stability parts' settings, each declared by the part that reads it: skipping a bad update
in place (`skip_step.py`), replaying a rejected step (`replay.py`) and comparing the replicas
(`replicas.py`). They are keys of the run config's `monitor:` section (a contract:
`monitor.skip_step`, `monitor.replay`, ...), which `pretrain/config/schema.py`'s `MonitorConfig`
composes from them, the trainer's link and stragglers (`pretrain/train/settings.py`) and the
service's and supervisor's (`monitoring/config.py`). Importable without torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from monitoring.config import SettingError, check_positive


@dataclass(kw_only=True)
class SkipSettings:
    """Skip a bad update in place (pretrain/stability/skip_step.py): a step whose loss or gradient
    norm is non-finite or above skip_ratio × its running median (of the last skip_window) never
    lands (the gradient norm against skip_grad_norm_ratio instead, when that is set). The trainer
    does it, with or without the service; the service then rolls back only when more than
    monitor.skip_max_consecutive steps in a row were skipped, or for what a skip cannot fix."""

    skip_step: bool = False
    skip_ratio: float = 3.0
    skip_grad_norm_ratio: float | None = None  # the gradient norm's own ratio; None: skip_ratio
    skip_window: int = 64

    def check_skip(self) -> None:
        if not (math.isfinite(self.skip_ratio) and self.skip_ratio > 1):
            raise SettingError(f"monitor.skip_ratio={self.skip_ratio} must be a finite number > 1")
        ratio = self.skip_grad_norm_ratio
        if ratio is not None and not (math.isfinite(ratio) and ratio > 1):
            raise SettingError(
                f"monitor.skip_grad_norm_ratio={ratio} must be a finite number > 1 (or null: skip_ratio)"
            )
        if self.skip_window < 2:
            raise SettingError(f"monitor.skip_window={self.skip_window} must be >= 2")


@dataclass(kw_only=True)
class ReplaySettings:
    """Was it the data or the machine (docs/monitoring.md, "Replay and replica checks")? replay: a
    step whose update did not land is run again on every rank, and a rank whose loss or gradient
    norm changes is a machine fault (on by default: on a clean step its gradient tally is one norm
    per gradient on the device, no host read, no collective; measured in docs/performance.md). A
    host with machine_faults_to_exclude of them (from the replay or the replica check) is moved off
    at a restart."""

    replay: bool = True
    machine_faults_to_exclude: int = 2

    def check_replay(self) -> None:
        check_positive("monitor.machine_faults_to_exclude", self.machine_faults_to_exclude)


@dataclass(kw_only=True)
class ReplicaSettings:
    """The replicas compared (docs/monitoring.md, "Replay and replica checks"): every
    consistency_every steps, before every checkpoint and after every rejected step, the weights
    every rank holds alike are digested and compared; a rank whose copy differs is a machine fault
    (replica_mismatch, a rollback to the newest consistent checkpoint). 0: never."""

    consistency_every: int = 100

    def check_replicas(self) -> None:
        if self.consistency_every < 0:
            raise SettingError(
                f"monitor.consistency_every={self.consistency_every} must be >= 0 (0: no replica check)"
            )
