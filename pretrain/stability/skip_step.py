"""Skip a bad optimizer update in place, inside DeepSpeed's bf16 ZeRO-1/2/3 optimizers (issue 31).

A step whose global mean loss or global gradient norm is non-finite, or above `ratio` × its
running level, does not update anything on any rank: not the bf16 weights, not the fp32 master
weights, not Adam's `exp_avg`, `exp_avg_sq` or `step`. Training goes on with the next step.

Where it decides
----------------
Inside DeepSpeed's bf16 ZeRO-1/2/3 optimizer step, through the norm gate
(`pretrain/parallel/norm_gate.py`): the gate lets DeepSpeed compute the global gradient norm,
asks the guard (`judge`, given the real, unscaled norm and the loss given by `set_loss`, against
the running levels) and reads its verdict with the norm in the step's one host read; a skip takes
DeepSpeed's own overflow path (no basic-optimizer `step()`: the gradients are dropped, the engine
counts `skipped_steps`, reports the norm as inf and does not step its lr scheduler).

Why the skip is bit-exact: on that path nothing writes the master weights, the moments, the step
count or the bf16 weights — the basic optimizer's `step()` (torch AdamW, FusedAdam, CPU Adam: any
of them) is never called. So it does not depend on the optimizer's arithmetic (unlike masking the
update with a 0/1 step factor, as OLMo-core's SkipStepAdamW does in its own AdamW).
tests/integration/test_skip_step.py compares every one of those tensors before and after a
skipped step on 2-process jobs for ZeRO-1, ZeRO-2, ZeRO-3 and ZeRO-2/3 with CPU offload (torch
AdamW, DeepSpeed's CPU Adam), and checks that a run with skips ends bit for bit where its other
steps alone end without the guard. FusedAdam (GPU) is not tested here: no GPU.

What it costs
-------------
* No host read of its own: the gate reads the verdict and `outcome()` (a device vector) with the
  gradient norm, in the step's one read. `state_dict()` reads the levels (2 × window numbers) —
  call it when saving a checkpoint only.
* No collective of its own, given the global mean loss. The norm is DeepSpeed's, already reduced
  over the ranks. The loss must be the same on every rank (every rank must decide the same, or
  one rank would step while another skips); the loop gets it from its one all-reduce if that runs
  before the last micro-batch's `engine.step()`; if it runs after, `global_mean` is one extra
  all-reduce of one number per step.
* About 50 small ops per step on tensors of at most 2 × window numbers (a median among them):
  0.15 ms per step on this machine's CPU (1 thread, window 64), queued without waiting on a GPU.

The running level
-----------------
`RunningLevel`: per signal (loss, gradient norm), the median of the last `window` finite values,
kept in a NaN-padded device buffer (`torch.nanmedian`: empty slots do not count). A value is
judged against the level before it joins. Skipped values join too: the median ignores a lone
spike, and a real, lasting change of level (more than `ratio` ×) stops being skipped after about
window / 2 steps instead of never. Non-finite values never join. The ratio test starts once a
signal has `min_count` values; until then only non-finite values skip. `state_dict()` is a
JSON-able dict for the checkpoint; every rank must load the same one.

Use (the loop)
--------------
    guard = SkipGuard(ratio=3.0)                 # once; guard.load_state_dict(saved) on resume
    gate = gate_of(engine)                       # the engine's norm gate (engine.initialize arms it)
    gate.judge = guard                           # from now on every optimizer step is judged
    ... per step, after the last micro-batch's backward, before its engine.step():
    guard.set_loss(mean_loss_over_ranks)         # a device scalar, identical on every rank
    engine.step()                                # the gate reads the verdict with the norm
    result = SkipOutcome.of(gate.outcome)        # on the host already

`act=False` decides and reports (`outlier`) but never skips (calibration). A skipped step's data
is consumed and the loop's step and the lr schedule move on as usual; Adam's own step count does
not, so its bias correction is that of the last applied step.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

SIGNALS = ("loss", "grad_norm")
# Why a step was skipped (or, with act=False, would have been): bits of `SkipOutcome.reasons`.
LOSS_NONFINITE, NORM_NONFINITE, LOSS_SPIKE, NORM_SPIKE = 1, 2, 4, 8
REASONS = {
    LOSS_NONFINITE: "loss_nonfinite",
    NORM_NONFINITE: "grad_norm_nonfinite",
    LOSS_SPIKE: "loss_spike",
    NORM_SPIKE: "grad_norm_spike",
}


MIN_COUNT = 16  # values a signal needs before `monitor.skip_step` judges it against its level


class SkipUnsupported(RuntimeError):
    """The engine has no norm gate to decide inside (`pretrain/parallel/norm_gate.py`)."""


class RunningLevel:
    """Per signal, the median of its last `window` finite values (device tensors throughout)."""

    def __init__(self, window: int = 64, signals: int = len(SIGNALS), device=None) -> None:
        if window < 1:
            raise ValueError(f"window={window} must be >= 1")
        self.window = window
        self.buffer = torch.full((signals, window), math.nan, dtype=torch.float64, device=device)

    def to(self, device) -> RunningLevel:
        self.buffer = self.buffer.to(device)
        return self

    def level(self) -> torch.Tensor:
        """(signals,) float64: each signal's median (the lower middle value for an even count);
        NaN for a signal with no values yet."""
        return self.buffer.nanmedian(dim=1).values

    def count(self) -> torch.Tensor:
        """(signals,) int64: values held."""
        return (~self.buffer.isnan()).sum(dim=1)

    def push(self, values: torch.Tensor, keep: torch.Tensor) -> None:
        """Append values[i] to signal i's window where keep[i] (the oldest value drops out)."""
        shifted = torch.cat([self.buffer[:, 1:], values.to(self.buffer)[:, None]], dim=1)
        self.buffer = torch.where(keep[:, None], shifted, self.buffer)

    def state_dict(self) -> dict[str, Any]:
        """JSON-able: per signal its values, oldest first (a host read)."""
        rows = self.buffer.cpu().tolist()
        return {"window": self.window} | {
            name: [v for v in row if not math.isnan(v)] for name, row in zip(SIGNALS, rows, strict=True)
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The newest `window` values of each signal (a saved window may have been larger)."""
        rows = torch.full((len(SIGNALS), self.window), math.nan, dtype=torch.float64)
        for i, name in enumerate(SIGNALS):
            values = [float(v) for v in state.get(name, [])][-self.window :]
            if values:
                rows[i, self.window - len(values) :] = torch.tensor(values, dtype=torch.float64)
        self.buffer = rows.to(self.buffer.device)


class Decision(NamedTuple):
    skip: torch.Tensor  # bool scalar: an outlier or a non-finite value
    reasons: torch.Tensor  # float64 scalar: the sum of the REASONS bits that hold
    keep: torch.Tensor  # (signals,) bool: which values join the running level


def decide(
    values: torch.Tensor,
    given: torch.Tensor,
    level: torch.Tensor,
    count: torch.Tensor,
    ratios: torch.Tensor,
    min_count: int,
) -> Decision:
    """The step's verdict, on the device. values: (loss, grad_norm) float64; given: which of them
    this step has; level/count: the running level before this step; ratios: per signal."""
    finite = torch.isfinite(values)
    nonfinite = (given & ~finite).double()
    spike = (given & finite & (count >= min_count) & (values > ratios * level)).double()
    # (Python-number factors: no tensor is copied from the host)
    reasons = (
        nonfinite[0] * LOSS_NONFINITE
        + nonfinite[1] * NORM_NONFINITE
        + spike[0] * LOSS_SPIKE
        + spike[1] * NORM_SPIKE
    )
    return Decision(reasons > 0, reasons, given & finite)


class SkipOutcome(NamedTuple):
    """One step's result, on the host (`SkipOutcome.of(guard.outcome().tolist())`)."""

    skipped: bool  # the update did not land (DeepSpeed counted it in engine.skipped_steps)
    outlier: bool  # the guard's verdict (with act=False: would have skipped)
    reasons: tuple[str, ...]  # REASONS names
    loss: float  # as judged (NaN when no loss was given)
    grad_norm: float  # the real norm, also on a skipped step (DeepSpeed then reports inf)
    loss_level: float  # the levels the step was judged against (NaN: none yet)
    grad_norm_level: float

    @classmethod
    def of(cls, numbers: list[float]) -> SkipOutcome:
        skipped, outlier, reasons, loss, norm, loss_level, norm_level = numbers
        names = tuple(name for bit, name in REASONS.items() if int(reasons) & bit)
        return cls(skipped > 0, outlier > 0, names, loss, norm, loss_level, norm_level)


OUTCOME_SIZE = len(SkipOutcome._fields)


class SkipGuard:
    """The running levels, the per-step decision and the hook into the engine's ZeRO optimizer."""

    def __init__(
        self,
        ratio: float = 3.0,
        window: int = 64,
        min_count: int = 16,
        act: bool = True,
        grad_norm_ratio: float | None = None,  # default: `ratio`
        device=None,
    ) -> None:
        if ratio <= 1.0 or (grad_norm_ratio is not None and grad_norm_ratio <= 1.0):
            raise ValueError("a skip ratio must be > 1")
        if not 1 <= min_count <= window:
            raise ValueError(f"min_count={min_count} must be in [1, window={window}]")
        self.ratio = ratio
        self.grad_norm_ratio = ratio if grad_norm_ratio is None else grad_norm_ratio
        self.min_count = min_count
        self.act = act
        self.levels = RunningLevel(window, device=device)
        # Device constants, made once (torch.tensor(..., device=) copies from the host).
        self._ratios = torch.tensor([self.ratio, self.grad_norm_ratio], dtype=torch.float64, device=device)
        self._given = {
            True: torch.tensor([True, True], device=device),
            False: torch.tensor([False, True], device=device),
        }
        self._loss: torch.Tensor | None = None
        self._decided = False  # a decision since the last outcome()
        self._outcome = torch.full((OUTCOME_SIZE,), math.nan, dtype=torch.float64, device=device)

    @classmethod
    def for_run(
        cls, ratio: float, window: int, act: bool = True, grad_norm_ratio: float | None = None
    ) -> SkipGuard:
        """The guard `monitor.skip_step` runs with (monitor.skip_ratio, skip_grad_norm_ratio,
        skip_window): the ratio test starts once a signal has MIN_COUNT values (or a whole,
        smaller window)."""
        return cls(
            ratio, window=window, min_count=min(MIN_COUNT, window), act=act, grad_norm_ratio=grad_norm_ratio
        )

    # ------------------------------------------------------------------ per step

    def set_loss(self, loss: torch.Tensor) -> None:
        """This step's global mean loss (a device scalar, identical on every rank), before the
        engine.step() that ends the step. Without it the step is judged on its gradient norm."""
        self._loss = loss.detach()

    def judge(self, norm: torch.Tensor) -> torch.Tensor:
        """Decide on this step given DeepSpeed's global gradient norm (the real, unscaled one);
        update the levels; return the bool skip tensor (False whatever the verdict if not act)."""
        device = norm.device
        if self.levels.buffer.device != device:  # (once, when made without the engine's device)
            self.levels.to(device)
            self._ratios = self._ratios.to(device)
            self._given = {k: v.to(device) for k, v in self._given.items()}
        norm = norm.detach().reshape(()).double()
        loss = self._loss
        given = self._given[loss is not None]
        loss = torch.full((), math.nan, dtype=torch.float64, device=device) if loss is None else loss
        values = torch.stack([loss.to(device).reshape(()).double(), norm])
        level, count = self.levels.level(), self.levels.count()
        decision = decide(values, given, level, count, self._ratios, self.min_count)
        self.levels.push(values, decision.keep)
        skip = decision.skip if self.act else torch.zeros_like(decision.skip)
        # skipped: the guard's skip, or the gate's for a non-finite norm (act or not).
        skipped = skip | ~torch.isfinite(norm)
        self._outcome = torch.cat(
            [torch.stack([skipped.double(), decision.skip.double(), decision.reasons]), values, level]
        )
        self._loss, self._decided = None, True
        return skip

    def outcome(self) -> torch.Tensor:
        """After `judge`: the device float64 vector `SkipOutcome.of` reads (the gate reads it with
        the norm). A step never judged (no norm computed) is judged here with an infinite norm, so
        its loss still counts and its reason is recorded."""
        if not self._decided:
            self.judge(torch.full((), math.inf, device=self.levels.buffer.device))
        self._decided = False
        return self._outcome

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict[str, Any]:
        return self.levels.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.levels.load_state_dict(state)


def global_mean(local: torch.Tensor) -> torch.Tensor:
    """The mean of a scalar over the ranks: one all-reduce of one number (for a loop whose own
    all-reduce comes after engine.step())."""
    from pretrain.parallel.distributed import all_reduce_sum

    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    return all_reduce_sum(local.detach().float().reshape(1).clone())[0] / world
