"""The norm gate: inside DeepSpeed's bf16 ZeRO-1/2/3 optimizer step, the one place where the step
reads the host — the gradient norm, whether the update may land, and the loop's own numbers,
together (`pretrain/parallel/step_read.py`).

What DeepSpeed 0.19.8 reads without it (a real 1-process ZeRO-2 step, counted from outside;
docs/performance.md, "Host reads in the step"): its bf16 overflow scan (`has_overflow`, an
`.item()`), the norm's validity in `step()` (`is_invalid_grad_norm`, a `bool()`), and the same test
again before clipping, once per parameter group — four waits for the device per step under
ZeRO-1/2, one under ZeRO-3, besides the loop's own read. DeepSpeed's scan repeats what a finite
gradient norm already says (a NaN or Inf gradient makes the norm non-finite: DeepSpeed masks such
group norms to −1 and `combine_grad_norm_groups` turns that into inf), so the completed DeepSpeed
JSON turns it off (`bf16.check_grad_overflow: false`, `gated`) and every engine built with it gets
a gate (`engine.initialize`): one decides both, so the scan is never off without a gate.

How: the gate wraps the method that computes the global norm on the optimizer instance (stage 1/2
`scaled_global_norm`, stage 3 `_get_norm_groups`; the same one the skip guard judged before it
moved here). It lets DeepSpeed compute the norm, decides on the device — a non-finite norm skips,
and with `monitor.skip_step` the skip guard's verdict (`judge`) too — then reads the norm, the
decision, the judge's outcome and whatever the loop joined, in one read. On the host:

* a skip sets `optimizer.overflow` (stage 1/2) or hands DeepSpeed an infinite norm (stage 3,
  whose `step()` tests it): DeepSpeed's own overflow path follows — the gradients are dropped,
  the basic optimizer's `step()` is never called (no weight, master weight, moment or step count
  changes: tests/integration/test_skip_step.py compares every one, bit for bit), the engine counts
  `skipped_steps` and reports the norm as inf;
* the norm goes back to DeepSpeed as a host (CPU) fp32 tensor of the same bits, so its remaining
  tests (`is_invalid_grad_norm` before clipping, stage 3's in `step()`) and the clip coefficient
  are host arithmetic (IEEE operations: the same bits the device computed), and the gradients are
  scaled by a host scalar — no further wait. Stage 3: the gate combines the group norms on the
  device with DeepSpeed's own `combine_grad_norm_groups` and hands back that one norm as a single
  group (the L2 norm of one value is the value: a unit test holds it).

With the optimizer offloaded to the CPU, DeepSpeed computes the norm on the host parameter by
parameter (its own reads, not the GPU fast path); the gate works there the same way.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch

from pretrain.parallel.step_read import StepRead

_ARMED = "_pretrain_norm_gate"  # the optimizer's attribute holding its gate


class GateUnsupported(RuntimeError):
    """The engine's optimizer is not one the gate knows how to decide inside."""


class Judge(Protocol):
    """What the gate asks besides finiteness (the skip guard, `pretrain/stability/skip_step.py`)."""

    def judge(self, norm: torch.Tensor) -> torch.Tensor:
        """Given the real (unscaled) global norm on the device: the bool skip tensor."""

    def outcome(self) -> torch.Tensor:
        """The float64 vector read with the decision (what the judge reports)."""


def gated(ds: dict[str, Any]) -> bool:
    """Whether an engine of this completed DeepSpeed JSON gets a gate (and DeepSpeed's bf16 scan
    turns off): bf16 ZeRO-1/2/3 computing its gradient norm, but ZeRO-1 with fp32 gradient
    accumulation (DeepSpeed's BF16_Optimizer, which the gate does not know)."""
    zero = ds.get("zero_optimization", {})
    stage = int(zero.get("stage", 0))
    fp32_accumulation = stage == 1 and ds.get("data_types", {}).get("grad_accum_dtype") == "fp32"
    norm = zero.get("compute_grad_norm", True) is not False
    bf16 = ds.get("bf16", {}).get("enabled", False) is True
    return bf16 and stage in (1, 2, 3) and norm and not fp32_accumulation


class NormGate:
    """The decision and the step's one read, around one ZeRO optimizer's norm method."""

    def __init__(self, optimizer) -> None:
        self.optimizer = optimizer
        self.read = StepRead()  # the loop joins its numbers here (`step_read`)
        self.judge: Judge | None = None  # the skip guard, while its hook is open
        self.outcome: list[float] | None = None  # the judge's, read with the last decision

    def decide(self, norm: torch.Tensor) -> tuple[bool, float]:
        """Judge DeepSpeed's (scaled) global norm on the device, then read: (skip, the norm's value)."""
        scale = self.optimizer.loss_scale
        unscaled = norm / scale
        skip = ~torch.isfinite(unscaled)
        if self.judge is not None:  # (the guard's verdict; a non-finite norm skips whatever it says)
            skip = skip | self.judge.judge(unscaled)
        decided = self.read.join(torch.stack([norm.reshape(()).double(), skip.double()]))
        reported = self.read.join(self.judge.outcome()) if self.judge is not None else None
        self.read.read()
        value, skipped = self.read.values(decided)
        self.outcome = self.read.values(reported) if reported is not None else None
        self.read.grad_norm = math.inf if skipped else value / scale
        return bool(skipped), value

    # ------------------------------------------------------------------ the hook

    @classmethod
    def arm(cls, engine) -> NormGate:
        """Wrap the norm method of `engine`'s ZeRO optimizer (or of `engine`, an optimizer)."""
        from deepspeed.runtime.engine import DeepSpeedEngine
        from deepspeed.runtime.utils import combine_grad_norm_groups
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        optimizer = engine.optimizer if isinstance(engine, DeepSpeedEngine) else engine
        if getattr(optimizer, _ARMED, None) is not None:
            raise GateUnsupported("this optimizer already has a norm gate")
        gate = cls(optimizer)
        if isinstance(optimizer, DeepSpeedZeroOptimizer):
            if not optimizer.compute_grad_norm:
                raise GateUnsupported(
                    "ZeRO-1/2 decides on the gradient norm: keep zero_optimization.compute_grad_norm"
                )
            original = optimizer.scaled_global_norm

            def scaled_global_norm(*args, **kwargs):
                norm = original(*args, **kwargs)
                skip, value = gate.decide(norm)
                if skip:
                    optimizer.overflow = True  # (DeepSpeed's own overflow path follows)
                return torch.tensor(math.inf if skip else value, dtype=norm.dtype)

            optimizer.scaled_global_norm = scaled_global_norm
        elif isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
            original = optimizer._get_norm_groups

            def get_norm_groups():
                norm = combine_grad_norm_groups(original())
                skip, value = gate.decide(norm)
                return [torch.tensor(math.inf if skip else value, dtype=norm.dtype)]

            optimizer._get_norm_groups = get_norm_groups
        else:
            raise GateUnsupported(
                f"deciding a step inside {type(optimizer).__name__} is not supported: "
                "use bf16 with ZeRO stage 1, 2 or 3 (and bf16 gradient accumulation for stage 1)"
            )
        setattr(optimizer, _ARMED, gate)
        return gate


def gate_of(engine) -> NormGate | None:
    """The gate of an engine (or of its optimizer), if it has one."""
    optimizer = getattr(engine, "optimizer", None)
    return getattr(optimizer, _ARMED, None) or getattr(engine, _ARMED, None)


def step_read(engine) -> StepRead:
    """Where the loop joins its numbers: the gate's (read inside the optimizer step), or a read of
    its own after the step for an engine without a gate."""
    gate = gate_of(engine)
    return gate.read if gate is not None else StepRead()
