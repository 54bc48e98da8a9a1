"""Helpers for the integration tier: real DeepSpeed jobs of 1-2 processes on CPU (gloo)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from pretrain.parallel.distributed import free_port
from tests.helpers import FAST, TINY, metrics_by_step

__all__ = [
    "FAST",
    "TINY",
    "events",
    "launcher",
    "metrics",
    "torchrun",
    "train",
    "train_state",
    "worker_results",
]


def launcher(nproc: int, module: str = "pretrain.train") -> list[str]:
    """DeepSpeed's launcher starting `nproc` processes of `module` (arguments follow)."""
    return [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        str(nproc),
        "--master_port",
        str(free_port()),
        "--module",
        module,
    ]


def torchrun(nproc: int, module: str = "pretrain.train") -> list[str]:
    """torch's launcher starting `nproc` processes of `module`: the same ranks as `launcher()`'s (the
    same environment contract, DeepSpeed's engine in each) without DeepSpeed's two launcher
    processes, about 4 s less per job here. Tests whose subject is not the launcher use it; the
    golden run, the launch, SIGTERM and exit-status tests keep DeepSpeed's."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(free_port()),
        "-m",
        module,
    ]


def train(command, run_dir, data_dir, *overrides, check=True) -> subprocess.CompletedProcess:
    args = [*command, "--config", TINY, f"run.dir={run_dir}", f"data.dir={data_dir}", *FAST, *overrides]
    result = subprocess.run(args, capture_output=True, text=True, timeout=600)
    if check:
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


def copy_checkpoint(source_run, run_dir, step: int) -> None:
    """Checkpoint `step` of another run into `run_dir`, as its newest: a resume starts there."""
    tag = f"step_{step:08d}"
    shutil.copytree(source_run / "checkpoints" / tag, run_dir / "checkpoints" / tag)
    (run_dir / "checkpoints" / "latest").write_text(tag + "\n")


def worker_results(nproc: int, module: str, out: Path) -> list[dict]:
    """`module` run as a job of `nproc` processes with `out` as its argument (a test file's own
    worker, which writes out/rank_N.json); each rank's JSON, in rank order."""
    command = [*torchrun(nproc, module), str(out)]
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return [json.loads((Path(out) / f"rank_{rank}.json").read_text()) for rank in range(nproc)]


metrics = metrics_by_step  # per step, the last record written (a resumed run appends)


def train_state(run_dir, step) -> dict:
    return json.loads((Path(run_dir) / "checkpoints" / f"step_{step:08d}" / "train_state.json").read_text())


def events(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "events.jsonl").read_text().splitlines()]
