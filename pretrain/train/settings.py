"""The loop's own monitor settings, declared beside the parts that read them: its link to the
service and what a rollback does to the data (`rollback.py`, `pretrain/monitor_link.py`), and the
straggler watch (`straggler_hook.py`). Keys of the run config's `monitor:` section (a contract),
composed into `MonitorConfig` by `pretrain/config/schema.py`. Importable without torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from monitoring.config import SettingError, check_choice, check_positive

STRAGGLER_RESPONSES = ("warn", "replace")  # monitor.on_straggler


@dataclass(kw_only=True)
class LinkSettings:
    """The trainer's requests to the service, and what a rollback does to the data."""

    timeout: float = 2.0  # seconds per request; the trainer goes on (and warns) when it gets no answer
    # on a rollback, the anomalous step's windows are not served again in their epoch (RUN_DIR/quarantine.jsonl)
    quarantine: bool = False

    def check_link(self) -> None:
        check_positive("monitor.timeout", self.timeout)


@dataclass(kw_only=True)
class StragglerSettings:
    """A rank whose compute time per step is above straggler_factor × the median rank's for
    straggler_windows logging intervals in a row is a straggler: an event and a warning (warn), or
    also a checkpoint and a restart with a spare node in its host's place (replace)."""

    straggler_factor: float = 1.5
    straggler_windows: int = 3
    on_straggler: str = "warn"

    def check_stragglers(self) -> None:
        if not (math.isfinite(self.straggler_factor) and self.straggler_factor > 1):
            raise SettingError(
                f"monitor.straggler_factor={self.straggler_factor} must be a finite number > 1"
            )
        check_positive("monitor.straggler_windows", self.straggler_windows)
        check_choice("monitor.on_straggler", self.on_straggler, STRAGGLER_RESPONSES)
