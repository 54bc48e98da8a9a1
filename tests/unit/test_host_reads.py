"""Host reads in the training step, counted: every read of a tensor's value by the host (`item`,
`tolist`, `cpu`, `numpy`, `float()`, `int()`, `bool()`) makes the CPU wait for the accelerator
to finish everything queued before it, so it cannot queue the next step's kernels meanwhile.
The loop makes one per step (docs/performance.md, "Host reads in the step"). On CUDA the GPU
tier counts the synchronizations themselves (`torch.cuda.set_sync_debug_mode`)."""

import json
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest
import torch

import pretrain
from monitoring.protocol import read_events
from monitoring.service import serve
from pretrain.config import MonitorConfig, load_config
from pretrain.train.hooks import StepHook
from tests.helpers import FAST, TINY
from tests.unit.fakes import pretraining_trainer

PACKAGE = str(Path(pretrain.__file__).parent)
READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")


@pytest.fixture
def host_reads(monkeypatch):
    """(file, line) of every host read made by the project's own code (not by torch, DeepSpeed or
    the test's stand-in engine), with the step the trainer was in."""
    seen: list[tuple[str, int]] = []

    def counted(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            caller = sys._getframe(1)
            # (the prefetch thread reads only its own host tensors, before they are copied)
            on_the_loop = threading.current_thread() is threading.main_thread()
            if on_the_loop and caller.f_code.co_filename.startswith(PACKAGE):
                seen.append((Path(caller.f_code.co_filename).name, caller.f_lineno))
            return original(self, *args, **kwargs)

        return read

    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, counted(name))
    return seen


def step_starts(trainer, host_reads: list) -> dict[int, int]:
    """Step → the host reads made before it began, filled by a hook the trainer calls first."""
    began: dict[int, int] = {}

    class Mark(StepHook):  # (first: before any other hook's work of the step)
        priority = -1

        def before_step(self, step):
            began[step] = len(host_reads)

    trainer.hooks.insert(0, Mark())
    return began


def test_a_training_step_reads_the_host_once(tmp_path, train_data, host_reads):
    """Steps 1-5 (no evaluation, no checkpoint), reported to a real monitoring service (on a thread
    here): one read each, also at steps 2 and 4, whose per-layer norms
    (logging.layer_grad_norms_every=2) ride the same read."""
    server, _ = serve(tmp_path, MonitorConfig(warmup=4, window=16))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    cfg = load_config(
        TINY,
        [
            *FAST,
            f"run.dir={tmp_path}",
            f"data.dir={train_data}",
            "train.steps=6",
            "checkpoint.every=6",
            "eval.every=0",
            "monitor.enabled=true",
        ],
    )
    trainer = pretraining_trainer(cfg)
    began = step_starts(trainer, host_reads)
    try:
        trainer.train()
    finally:
        server.shutdown()
        server.server_close()
    per_step = {step: Counter(host_reads[began[step] : began[step + 1]]) for step in range(1, 6)}
    assert all(sum(reads.values()) == 1 for reads in per_step.values()), per_step
    steps = {r["step"]: r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())}
    assert "train/grad_norm/layers.0" in steps[2] and "train/grad_norm/layers.0" not in steps[3]
    assert [e.step for e in read_events(tmp_path) if e.type == "step"] == [1, 2, 3, 4, 5, 6]
