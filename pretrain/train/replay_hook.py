"""The step hook that tells a machine fault from bad data (`monitor.replay`; issue 46,
docs/monitoring.md, "Replay and replica checks").

A rejected step — its update did not land: DeepSpeed's own skip on a non-finite gradient, or the
skip guard's (`monitor.skip_step`) — left the weights as they were, so it can be computed again
exactly. On such a step every rank runs the step's micro-batches forward and backward once more,
without updating (`torch.autograd.grad`: no gradient is accumulated, DeepSpeed's reduction hooks
do not fire), and the ranks compare, in one small all-gather, each rank's local loss and local
(pre-reduction) gradient norm with the first pass's (`pretrain/stability/replay.py`). The same values: the
data, and the step goes the way it goes today (the skip, the monitor's verdict, a rollback,
quarantine). Different values: a machine computed one of the passes wrong — a `machine_fault`
event names the ranks and hosts, the console says it in one line, the update stays skipped, and
the monitor is told the step was skipped in place (`train/update_skipped`), so it neither rolls
back nor quarantines the step's documents. The fault counts toward its host's exclusion
(`machine_faults.py`).

On a normal step it adds no host read and no collective: the first pass's values are device
tensors (the losses the step computed, and `GradientTally`'s per-parameter norms), read only on a
rejected step.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from monitoring.protocol import MachineFault, append_event
from pretrain.parallel.distributed import DistEnv, all_gather_objects
from pretrain.reporting.metrics import MetricsWriter
from pretrain.stability.faults import FaultInjector
from pretrain.stability.replay import GPU_RTOL, GradientTally, changed_ranks
from pretrain.train.hooks import CONTINUE, Answer, StepHook
from pretrain.train.machine_faults import FaultLedger


@dataclass(kw_only=True)
class ReplayCheck(StepHook):
    """Every rank replays a rejected step and compares; rank 0 writes the event. After the skip
    guard (its `update_skipped` is read) and before the monitor (whose report it amends)."""

    priority = 70  # (the order of the hooks: pretrain/train/hooks.py)

    env: DistEnv
    run_dir: Path
    writer: MetricsWriter
    engine: Any  # a DeepSpeed engine (or anything with its interface)
    faults: FaultInjector  # a loss fault of the data is applied again on the replay
    grad_accum: int
    ledger: FaultLedger
    tally: GradientTally | None = None
    batches: list = field(default_factory=list)  # this step's micro-batches (references)
    losses: list = field(default_factory=list)  # this step's local losses (device scalars)
    skipped_before: int = 0

    def open(self, stack: contextlib.ExitStack) -> None:
        self.tally = GradientTally(self.engine.module)
        stack.callback(self.tally.remove)
        self.ledger.open()

    def before_step(self, step: int) -> None:
        self.batches, self.losses = [], []
        self.tally.clear()
        self.skipped_before = self.engine.skipped_steps

    def before_forward(self, step: int, batch: dict[str, torch.Tensor]) -> None:
        self.batches.append(batch)

    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        self.losses.append(loss.detach())
        return loss

    def after_step(self, step: int, metrics: dict, batch_ids: list, vote: float) -> Answer:
        if self.engine.skipped_steps == self.skipped_before:  # (the update landed: every rank knows)
            return CONTINUE
        first = self.local_values(self.tally.take())
        second = self.local_values(self.replay(step))
        passes = all_gather_objects((first, second))
        rtol = GPU_RTOL if self.engine.device.type == "cuda" else 0.0
        changed = changed_ranks([p[0] for p in passes], [p[1] for p in passes], rtol)
        if not changed:
            return CONTINUE
        metrics["train/update_skipped"] = 1.0  # (the monitor's report: a skip, not the data's fault)
        metrics["train/machine_fault"] = 1.0
        hosts = [self.ledger.hosts[r] for r in changed]
        if self.env.is_main:
            append_event(
                self.run_dir,
                MachineFault(
                    step=step,
                    ranks=changed,
                    hosts=hosts,
                    first=[list(passes[r][0]) for r in changed],
                    replay=[list(passes[r][1]) for r in changed],
                ),
            )
        shown = "; ".join(
            f"rank {r} on {self.ledger.hosts[r]}: loss {passes[r][0][0]:.6g} then {passes[r][1][0]:.6g}, "
            f"gradient norm {passes[r][0][1]:.6g} then {passes[r][1][1]:.6g}"
            for r in changed
        )
        self.writer.message(
            f"step {step}: machine fault: the replayed step changed ({shown}); update skipped, "
            "its documents kept"
        )
        return self.ledger.count(step, changed, "its replayed step changed")

    def local_values(self, norm: torch.Tensor) -> tuple[float, float]:
        """(this rank's mean loss over the step's micro-batches, its gradient norm): one host read."""
        loss = (
            torch.stack(self.losses).double().mean() if self.losses else torch.zeros((), dtype=torch.float64)
        )
        loss_value, norm_value = torch.stack([loss, norm.to(loss.device)]).tolist()
        return loss_value, norm_value

    def replay(self, step: int) -> torch.Tensor:
        """The step's micro-batches forward and backward again, nothing updated; its gradient norm
        (`self.losses` then holds the replay's losses)."""
        params = [p for p in self.engine.module.parameters() if p.requires_grad]
        batches, self.losses = self.batches, []
        for batch in batches:
            loss = self.faults.again(step, self.engine.module(**batch).loss)  # (not the engine: its
            # forward arms DeepSpeed's backward epilogue, which would reduce the replay's gradients)
            self.losses.append(loss.detach())
            # as DeepSpeed's backward scales it (engine._scale_loss_by_gas; bf16's loss scale is 1)
            torch.autograd.grad(loss.float() / self.grad_accum, params, allow_unused=True)
        return self.tally.take()
