"""The training step's one host read.

Every read of a tensor's value by the host (`.item()`, `.tolist()`, `float(t)`, `bool(t)`) makes
the CPU wait until the accelerator has finished everything queued before it, so it cannot queue
the next kernels meanwhile: the device idles for the host's time. A step needs a few numbers on
the host — the loop's (the agreed loss, stop and votes; per-layer norms on some steps), the
optimizer's (is the gradient norm finite, and the skip guard's verdict: apply the update or
not) — so they are gathered here and read together, once.

Who joins what, in order: the loop joins its device numbers before the update
(`Trainer.optimizer_step`); the norm gate (`pretrain/parallel/norm_gate.py`), inside DeepSpeed's
optimizer step, joins the gradient norm and the decision and reads everything joined so far,
because the decision must be on the host before the update is applied or dropped; the loop then
takes its numbers back. Without a gate (a stand-in engine, `engine.one_host_read: false`) the
loop's own `read()` after the step is the one read. A value joined after the read (the
instability precursors, measured on the weights after the update) makes one more read.

Values are widened to float64 on the device, which is exact: the host sees the bits a read of
each tensor would have given.
"""

from __future__ import annotations

import torch


class StepRead:
    """Device values joined during a step, read to the host together (`read`)."""

    def __init__(self) -> None:
        self.begin()

    def begin(self) -> None:
        """A new step: nothing joined, nothing read."""
        self._pending: list[torch.Tensor] = []
        self._numbers: list[float] = []
        self._joined = 0  # values joined so far, read or not
        self.grad_norm: float | None = None  # the gate's gradient norm as DeepSpeed reports it (inf: skipped)

    def join(self, tensor: torch.Tensor) -> slice:
        """`tensor`'s values in the next read; where they will be in `values`."""
        flat = tensor.detach().double().reshape(-1)
        if self._pending:
            flat = flat.to(self._pending[0].device)
        self._pending.append(flat)
        start = self._joined
        self._joined += flat.numel()
        return slice(start, self._joined)

    def read(self) -> None:
        """Everything joined since the last read, to the host in one copy (nothing joined: no read)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        self._numbers += torch.cat(pending).tolist()

    def values(self, where: slice) -> list[float]:
        """The host numbers of a join (read first if they are still on the device)."""
        if where.stop > len(self._numbers):
            self.read()
        return self._numbers[where]
