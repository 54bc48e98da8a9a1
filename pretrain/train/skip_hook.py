"""The step hook that skips a bad update in place (`monitor.skip_step`; pretrain/stability/skip_step.py says
how, inside DeepSpeed's ZeRO optimizer, and why it is bit-exact).

Each step the loop hands it the step's mean loss over every rank before the update lands
(`before_update`); DeepSpeed's own gradient norm is judged inside the optimizer step, against the
running medians of both. A step whose loss or gradient norm is non-finite, or above
`monitor.skip_ratio` × its median (the gradient norm: `monitor.skip_grad_norm_ratio`, when set),
does not change the weights or the optimizer's state on any rank, and training goes on. What it
decided is read with the gradient norm, in the step's one host read (`readings`): the step's
metrics get `train/update_skipped` (1 for a skipped step), the real gradient norm (DeepSpeed
reports inf for a skipped step) and the two levels; rank 0 appends an `update_skipped` event, and
the monitor is told in the step's report. The levels are kept in every checkpoint (train_state.json
`hooks.skip_step`), so a resumed or rolled-back run judges as the run did at that step.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch

from monitoring.protocol import UpdateSkipped, append_event
from pretrain.parallel.distributed import DistEnv
from pretrain.parallel.norm_gate import gate_of
from pretrain.stability.skip_step import SkipGuard, SkipUnsupported
from pretrain.train.hooks import CONTINUE, Answer, StepHook

LEVEL_TAGS = {"loss": "train/skip_level/loss", "grad_norm": "train/skip_level/grad_norm"}


class SkipBadUpdates(StepHook):
    """`monitor.skip_step`: a bad update skipped in place (`pretrain/stability/skip_step.py`)."""

    name = "skip_step"
    priority = 30  # (the order of the hooks: pretrain/train/hooks.py)

    def __init__(self, guard: SkipGuard, engine, env: DistEnv, run_dir: Path, writer) -> None:
        self.guard, self.engine, self.env, self.run_dir, self.writer = guard, engine, env, run_dir, writer
        self.gate = None  # the engine's norm gate, once open

    def open(self, stack: contextlib.ExitStack) -> None:
        gate = gate_of(self.engine)
        if gate is None:
            raise SkipUnsupported(
                "monitor.skip_step decides inside the engine's norm gate, and this engine has none: "
                "use bf16 with ZeRO stage 1, 2 or 3 and engine.one_host_read=true"
            )
        gate.judge = self.guard
        stack.callback(setattr, gate, "judge", None)
        self.gate = gate

    def before_update(self, step: int, mean_loss: torch.Tensor, batch: dict[str, torch.Tensor]) -> None:
        self.guard.set_loss(mean_loss)

    def readings(self, step: int) -> dict[str, float]:
        """What the gate read with this step's decision (host numbers: no read of their own)."""
        outcome, self.gate.outcome = self.gate.outcome, None
        if outcome is None:  # (no decision this step)
            return {}
        skipped, _, _, _, grad_norm, loss_level, grad_norm_level = outcome
        return {
            "train/update_skipped": skipped,
            "train/grad_norm": grad_norm,
            LEVEL_TAGS["loss"]: loss_level,
            LEVEL_TAGS["grad_norm"]: grad_norm_level,
        }

    def after_step(self, step: int, metrics: dict, batch_ids: list, vote: float) -> Answer:
        if not metrics.get("train/update_skipped"):
            return CONTINUE
        loss, norm = metrics["train/loss"], metrics["train/grad_norm"]
        levels = {k: metrics[tag] for k, tag in LEVEL_TAGS.items()}
        reasons = why_skipped(loss, norm, levels, self.guard.ratio, self.guard.grad_norm_ratio)
        if self.env.is_main:
            known = {k: v if math.isfinite(v) else None for k, v in levels.items()}
            append_event(
                self.run_dir,
                UpdateSkipped(
                    step=step,
                    loss=loss,
                    grad_norm=norm,
                    reasons=reasons,
                    loss_level=known["loss"],
                    grad_norm_level=known["grad_norm"],
                ),
            )
        self.writer.message(
            f"step {step}: update skipped ({', '.join(reasons) or 'DeepSpeed overflow'}: loss {loss:.4g} "
            f"against {levels['loss']:.4g}, gradient norm {norm:.4g} against {levels['grad_norm']:.4g}); "
            "the weights are those of the step before"
        )
        return CONTINUE

    def state_dict(self) -> dict:
        return self.guard.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.guard.load_state_dict(state)


def why_skipped(
    loss: float, grad_norm: float, levels: dict[str, float], ratio: float, grad_norm_ratio: float
) -> list[str]:
    """The reasons, from the values and the levels the step was judged against (a NaN level: not
    judged by ratio yet)."""
    reasons = []
    for name, value, limit in (("loss", loss, ratio), ("grad_norm", grad_norm, grad_norm_ratio)):
        if not math.isfinite(value):
            reasons.append(f"{name}_nonfinite")
        elif math.isfinite(levels[name]) and value > limit * levels[name]:
            reasons.append(f"{name}_spike")
    return reasons
