"""What the benchmarks that train share: one real `pretrain train` (or `pretrain launch`) process
per run, its output in RUN_DIR.log beside the run directory, and a run that already finished not
repeated, so that an interrupted sweep continues where it stopped."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from monitoring.protocol import SUMMARY_FILE
from pretrain.errors import ExitCode


def finished(run_dir: Path) -> dict | None:
    """The run's train_summary.json once it completed, else None."""
    path = run_dir / SUMMARY_FILE
    if path.is_file():
        summary = json.loads(path.read_text())
        if summary.get("completed"):
            return summary
    return None


def ended(run_dir: Path) -> dict | None:
    """The run's train_summary.json once it completed or a check stopped it (the monitor, the
    replica check), else None."""
    path = run_dir / SUMMARY_FILE
    if path.is_file():
        summary = json.loads(path.read_text())
        if summary.get("completed") or summary.get("stopped_by_monitor") or summary.get("stopped_by"):
            return summary
    return None


def run_once(command: str, config: Path | str, run_dir: Path, overrides: list[str], label: str) -> int:
    """`pretrain COMMAND --config CONFIG run.dir=RUN_DIR OVERRIDES...` unless the run already
    completed or was stopped by the monitor; returns its exit status (0 for a run found complete,
    3 for one found stopped)."""
    summary = ended(run_dir)
    if summary is not None:
        return ExitCode.DONE if summary.get("completed") else ExitCode.STOPPED_BY_MONITOR
    print(f"  {label} -> {run_dir}", file=sys.stderr, flush=True)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = run_dir.parent / f"{run_dir.name}.log"
    with open(log, "w") as out:
        code = subprocess.call(
            [
                sys.executable,
                "-m",
                "pretrain",
                command,
                "--config",
                str(config),
                f"run.dir={run_dir}",
                *overrides,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    if code != 0:
        print(f"    exited with status {code} (see {log})", file=sys.stderr, flush=True)
    return code
