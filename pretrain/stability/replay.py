"""Was it the data or the machine? The parts of the answer that need no loop (issue 46;
docs/monitoring.md, "Replay and replica checks").

* `GradientTally`: each rank's own (pre-reduction) gradient norm, measured by a tensor hook on
  every parameter, which sees a micro-batch's gradient before DeepSpeed's accumulation hooks
  reduce it. One `vector_norm` kernel per parameter and micro-batch, kept on the device: no host
  read and no collective on a normal step; `take()` is read only on a rejected step.
* `changed_ranks`: the ranks whose loss or gradient norm differ between a step's two passes (bit
  for bit on CPU; within `GPU_RTOL` on a GPU, where reductions may be non-deterministic).
* `FaultCounts`: the machine faults found per host, and the hosts that reached the limit.

Pure where they can be: `changed_ranks` and `FaultCounts` take values and return
values, and are tested without a process group (tests/unit/test_replay.py).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

# On a GPU the two passes of the same micro-batches may differ in the last bits (atomics in the
# embedding's backward, split-K matmuls): relative differences below this are the same value. A
# flipped exponent bit moves a value by a factor of 2^64 or more (or its element to ~0, which
# moves the norm by that element's share: a fault that small is below this and read as data).
GPU_RTOL = 1e-3


class GradientTally:
    """This rank's gradient norm over a step's micro-batches: the root of the sum, over every
    micro-batch and parameter, of the squared norm of the gradient that parameter got in that
    micro-batch's backward pass, before any reduction. Device tensors throughout."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.norms: list[torch.Tensor] = []
        self.handles = [p.register_hook(self._seen) for p in module.parameters() if p.requires_grad]

    def _seen(self, grad: torch.Tensor) -> None:
        # On a CPU, in the gradient's own dtype (the kernel accumulates in fp32 and rounds the
        # result): the two passes are equal bit for bit, so the rounding hides no fault a GPU's
        # GPU_RTOL would show, and a bf16 gradient's norm with dtype=float32 converts it through a
        # slow path first (60x the time on an AVX2 CPU). On a GPU in fp32: two passes may differ
        # in the last bits, and a bf16 rounding could move one norm by 2^-8, past GPU_RTOL.
        dtype = torch.float32 if grad.is_cuda else None
        self.norms.append(torch.linalg.vector_norm(grad, dtype=dtype))

    def take(self) -> torch.Tensor:
        """The norm so far (a float64 device scalar), and start over."""
        norms, self.norms = self.norms, []
        if not norms:
            return torch.zeros((), dtype=torch.float64)
        return torch.stack(norms).double().square().sum().sqrt()

    def clear(self) -> None:
        self.norms = []

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def same(a: float, b: float, rtol: float = 0.0) -> bool:
    """Bit for bit (rtol 0: NaN equals NaN, as its bits do), or within `rtol` of each other."""
    if rtol == 0.0 or not (math.isfinite(a) and math.isfinite(b)):
        return struct.pack("<d", a) == struct.pack("<d", b) or (math.isnan(a) and math.isnan(b))
    return abs(a - b) <= rtol * max(abs(a), abs(b))


def changed_ranks(
    first: Sequence[tuple[float, float]], second: Sequence[tuple[float, float]], rtol: float = 0.0
) -> list[int]:
    """Per rank (loss, gradient norm) of the first pass and of the replay → the ranks whose values
    changed: a machine computed one of the two passes wrong. An empty list: the same values (the
    data)."""
    return [
        rank
        for rank, (a, b) in enumerate(zip(first, second, strict=True))
        if not (same(a[0], b[0], rtol) and same(a[1], b[1], rtol))
    ]


# ---------------------------------------------------------------------------------- the hosts


@dataclass
class FaultCounts:
    """Machine faults (a replayed step that changed, a replica that differs) per host, over the
    whole run (RUN_DIR/monitor/machine_faults.json), and the limit that excludes a host."""

    limit: int  # monitor.machine_faults_to_exclude
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, hosts: Sequence[str]) -> list[str]:
        """One fault on each of `hosts` (each once) → the hosts that reach the limit now."""
        reached = []
        for host in dict.fromkeys(hosts):
            self.counts[host] = self.counts.get(host, 0) + 1
            if self.counts[host] == self.limit:
                reached.append(host)
        return reached
