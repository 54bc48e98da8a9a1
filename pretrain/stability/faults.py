"""Fault injection (`faults.*`), for tests and rehearsals of the monitor and the supervisor.

Scale the loss (and so the gradients), or the gradients alone (the loss reported is the true one),
or make the loss NaN at given steps; kill or hang a rank as a step begins; corrupt the newest
checkpoint's fp32 master weights (same size, other bytes) as a step begins; pause the writing of a
step's checkpoint (`FaultsConfig.save_pause`, which the checkpointer asks: a slow disk, and a window for a kill
during a save); make one rank slow from a step on (`slow_rank`: every forward and backward pass
of it takes `slow_factor` times as long, a rehearsal of a straggler). Each fault but the pause
and the slow rank fires once: the faults fired ("spike:10", "kill:7", ...)
are kept in RUN_DIR/faults_fired.json across rollbacks and restarts, so the same step then runs
clean. Every rank keeps the same set; rank 0 writes it, or the rank about to be killed or hung.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

from pretrain import atomic
from pretrain.config import FaultsConfig
from pretrain.run_dir import FIRED_FILE


class FaultInjector:
    def __init__(self, faults: FaultsConfig, run_dir: str | Path, rank: int):
        self.faults, self.rank = faults, rank
        self.path = Path(run_dir) / FIRED_FILE
        self.fired = set(json.loads(self.path.read_text())) if self.path.exists() else set()
        self._pass_started: float | None = None  # when this slow rank's current pass began
        self.step = 0  # the step in progress
        self.engine = None  # given by `arm` (the flip faults)
        self._handle = None
        self._loss_faults: dict[int, str] = {}  # step -> the loss fault applied in it (for a replay)

    def _pending(self, kind: str, step: int) -> bool:
        return f"{kind}:{step}" not in self.fired

    def _loss_fault(self, step: int) -> str | None:
        if step in self.faults.nan_steps and self._pending("nan", step):
            return "nan"
        if step in self.faults.spike_steps and self._pending("spike", step):
            return "spike"
        if step in self.faults.grad_spike_steps and self._pending("grad_spike", step):
            return "grad_spike"
        return None

    def before_step(self, step: int) -> None:
        """Kill or hang `faults.kill_rank` / `faults.hang_rank`, or corrupt the newest checkpoint,
        as step `step` begins."""
        self.step = step
        if self.faults.corrupt_checkpoint_step == step and self._pending("corrupt", step):
            self.fired.add(f"corrupt:{step}")
            if self.rank == 0:
                atomic.write_json(self.path, sorted(self.fired))
                self._corrupt_newest_checkpoint(step)
        for kind, at, rank in (
            ("kill", self.faults.kill_step, self.faults.kill_rank),
            ("hang", self.faults.hang_step, self.faults.hang_rank),
        ):
            if at != step or not self._pending(kind, step):
                continue
            self.fired.add(f"{kind}:{step}")
            if self.rank == 0:  # (rank 0 speaks: after its console line of the step before)
                print(
                    f"faults: {'killing' if kind == 'kill' else 'hanging'} rank {rank} as step {step} begins "
                    f"(faults.{kind}_step)",
                    file=sys.stderr,
                    flush=True,
                )
            if self.rank != rank:
                continue
            atomic.write_json(self.path, sorted(self.fired))
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            while True:  # hung: alive, but never reaching the next collective
                time.sleep(3600)

    def _corrupt_newest_checkpoint(self, step: int) -> None:
        from pretrain.checkpoint import checkpoints_dir, read_latest

        tag = read_latest(self.path.parent)
        if tag is None:
            return
        (target,) = sorted((checkpoints_dir(self.path.parent) / tag).glob("*rank_0*optim_states.pt"))[:1] or [
            None
        ]
        if target is None:
            print(
                f"faults: {tag} holds no optimizer file of rank 0 to corrupt (faults.corrupt_checkpoint_step)",
                file=sys.stderr,
                flush=True,
            )
            return
        data = bytearray(target.read_bytes())
        middle = len(data) // 2
        data[middle : middle + 256] = bytes(b ^ 0xFF for b in data[middle : middle + 256])
        target.write_bytes(bytes(data))
        print(f"faults: corrupted {target} at step {step}", file=sys.stderr, flush=True)

    def apply(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """The loss of a micro-batch of step `step`, spiked or made NaN when a fault is due."""
        kind = self._loss_fault(step)
        if kind is not None:
            self._loss_faults = {step: kind}
        return self._loss_fault_applied(kind, loss)

    def again(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """A replay of step `step` (pretrain/train/replay_hook.py): the loss fault it had, if any,
        again — a fault of the data, which a replay reproduces."""
        return self._loss_fault_applied(self._loss_faults.get(step), loss)

    def _loss_fault_applied(self, kind: str | None, loss: torch.Tensor) -> torch.Tensor:
        if kind == "nan":
            return loss * float("nan")
        if kind == "grad_spike":  # the same value, its gradient times the factor
            detached = loss.detach()
            return detached + self.faults.grad_spike_factor * (loss - detached)
        return loss * self.faults.spike_factor if kind == "spike" else loss

    def mark_fired(self, step: int) -> None:
        """After step `step`: its loss fault, if any, has fired and will not fire again."""
        kind = self._loss_fault(step)
        if self.faults.flip_step == step and self.faults.flip_target == "grad":
            self.fired.add(f"flip:{step}")  # (every rank: the flipping one did as it flipped)
        if kind is not None or f"flip:{step}" in self.fired:
            if kind is not None:
                self.fired.add(f"{kind}:{step}")
            if self.rank == 0:
                atomic.write_json(self.path, sorted(self.fired))

    # --------------------------------------------------------------------- a slow rank

    def begin_pass(self, step: int) -> None:
        """A forward or backward pass of step `step` begins on this rank: when it is
        `faults.slow_rank` from `faults.slow_from_step` on, it is timed (`end_pass` stretches it)."""
        f = self.faults
        if f.slow_from_step is None or self.rank != f.slow_rank or step < f.slow_from_step:
            return
        self._pass_started = _pass_clock()

    def end_pass(self) -> None:
        """The pass `begin_pass` timed has ended: make it take slow_factor times as long, as the
        straggler hook measures it (pretrain/train/straggler_hook.py). On CPU: the pass's CPU time
        is spent again (slow_factor - 1) times over, computing (a slower CPU, in effect: a sleep
        costs no CPU time). On a GPU: the device is waited for at both ends and the host sleeps
        that long, which delays the device's next work as much (a slower GPU, in effect)."""
        if self._pass_started is None:
            return
        extra = (self.faults.slow_factor - 1) * (_pass_clock() - self._pass_started)
        self._pass_started = None
        if _on_gpu():
            time.sleep(extra)
            return
        until = time.thread_time() + extra
        while time.thread_time() < until:
            pass

    # ----------------------------------------------------------------- flipped bits (issue 46)

    def arm(self, engine) -> None:
        """`faults.flip_target: grad`: a tensor hook on one parameter flips the exponent's top bit
        of one element of `faults.flip_rank`'s local gradient (before DeepSpeed reduces it) in the
        backward passes of `faults.flip_step`: a transient fault (fired as it flips, so a replay of
        the step computes it right)."""
        f = self.faults
        self.engine = engine
        if f.flip_step is None or f.flip_target != "grad" or self.rank != f.flip_rank:
            return
        param = next(p for p in engine.module.parameters() if p.requires_grad)
        self._handle = param.register_hook(self._flip_grad)

    def _flip_grad(self, grad: torch.Tensor) -> torch.Tensor | None:
        if self.step != self.faults.flip_step or not self._pending("flip", self.step):
            return None
        self.fired.add(f"flip:{self.step}")  # (the replay, and every later pass, is clean)
        flipped = grad.clone()
        flat = flipped.view(-1)
        at = int(flat.abs().argmax())  # (a zero's flip is 2.0: the largest element's is huge)
        flip_top_exponent_bit(flat[at : at + 1])
        print(
            f"faults: flipped a gradient bit on rank {self.rank} at step {self.step}",
            file=sys.stderr,
            flush=True,
        )
        return flipped

    def flip_weight(self, step: int) -> None:
        """`faults.flip_target: weight`, after step `flip_step`'s update: the exponent's top bit of
        one element of `faults.flip_rank`'s bf16 copy of a weight (under ZeRO-1/2 one in another
        rank's partition: only that rank's copy goes wrong), which stays wrong until the weights are
        loaded again (a landed update's all-gather would rewrite it, but the huge weight makes every
        later step of that rank non-finite, so none lands)."""
        f = self.faults
        if f.flip_step != step or f.flip_target != "weight" or not self._pending("flip", step):
            return
        self.fired.add(f"flip:{step}")
        if self.rank == 0:
            atomic.write_json(self.path, sorted(self.fired))
        if self.rank != f.flip_rank:
            return
        optimizer = getattr(self.engine, "optimizer", None)
        partitions = getattr(optimizer, "parallel_partitioned_bit16_groups", None)
        if partitions and len(partitions[0]) > 1:
            target = partitions[0][(self.rank + 1) % len(partitions[0])]
        else:  # a block's matrix, which every token passes through; under ZeRO-3 this rank's
            # shard of it, the one copy, which every rank gathers (a persistent parameter's gathered
            # copy is gathered again after a skipped step: a fault there is a transient one)
            param = next(p for name, p in self.engine.module.named_parameters() if name.startswith("layers."))
            target = getattr(param, "ds_tensor", param.data)
        flip_top_exponent_bit(target.view(-1)[:1])
        print(
            f"faults: flipped a weight bit on rank {self.rank} after step {step}", file=sys.stderr, flush=True
        )


def _on_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _pass_clock() -> float:
    """This thread's CPU seconds on CPU; on a GPU, the wall clock once the device has caught up."""
    if not _on_gpu():
        return time.thread_time()
    torch.cuda.synchronize()
    return time.perf_counter()


def flip_top_exponent_bit(values: torch.Tensor) -> None:
    """In place: the top bit of each element's exponent (bf16/fp16 bit 14, fp32 bit 30)."""
    if values.element_size() == 2:
        values.view(torch.int16).bitwise_xor_(0x4000)
    else:
        values.view(torch.int32).bitwise_xor_(0x40000000)
