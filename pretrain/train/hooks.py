"""The loop's step hooks: what happens at the boundaries of every optimizer step besides the step
itself, each a small object that owns its state (docs/architecture.md). `Trainer` calls every hook,
in the order of its declared `priority` (lowest first; hooks of equal priority in the order they
were given), at these points:

    open(stack)                 once, as training starts (what it opens, it closes on `stack`)
    before_step(step)           before the step's first micro-batch
    lr_factor(step) -> float    the step's learning rate is the schedule's times every hook's factor
    before_forward(step, batch) before each micro-batch's forward pass, with that micro-batch
    loss(step, loss) -> loss    each micro-batch's loss, after its forward pass, before its backward
    vote() -> float | tensor    its value in the step's one all-reduce (summed over ranks): a
                                number, or a 1-D float32 tensor on the engine's device (one slot
                                per rank, each rank filling its own, is how a value of every rank
                                reaches every rank)
    agreed(step, vote)          right after the step's one all-reduce: its own vote summed over
                                the ranks, as a device tensor (no host read)
    before_update(step, mean_loss, batch)
                                after the step's last backward pass, before its update lands:
                                the step's mean loss over every rank (a device scalar) and this
                                rank's last micro-batch
    readings(step) -> {name: tensor}
                                device scalars read with the step's one host read; they join the
                                step's metrics (replacing any of the same name)
    after_step(step, metrics, batch_ids, vote) -> Answer
                                the step is logged; `batch_ids`: this rank's windows or examples in
                                the step; `vote`: the sum of every rank's vote (a list of numbers
                                for a tensor vote)
    before_eval(step) -> Answer
                                an evaluation of the state after `step` is due
    before_checkpoint(step, stopping, last) -> Answer
                                a checkpoint is due (`stopping`: the ranks agreed to stop after it)
    close()                     as training ends, also on an error

The priorities, and why each hook comes where it does:

    0   InjectedFaults           first: its record of what fired must never be skipped by another
                                 hook's Rewind or Stop (or a loss fault fires again after every
                                 rollback of its step), and a slow rank's stretched forward pass
                                 is inside what the straggler hook times
    10  DataTrace                the windows of every step, whatever the later hooks answer
    20  InstabilityPrecursors    before the monitor's: its report carries them
    25  ExpertBalance            before the monitor's: its report carries the experts' loads; it
                                 moves the bias after the update, whatever the skip guard decided
                                 (it reads whether the update landed)
    30  SkipBadUpdates           before the monitor's: its report says whether the update landed
    40  StragglerWatch           before the monitor's: its report carries the ranks' times
    50  (a hook that declares none)
    60  ReplicaCheck             before the replay: a wrong copy of the weights replays alike
    70  ReplayCheck              after the skip guard (it replays a rejected step), before the
                                 monitor (it amends the report: a machine fault, not the data)
    100 Monitored                last: it reports what every hook before it measured

A hook with a `name` keeps `state_dict()` in every checkpoint (train_state.json's `hooks`); the
loop gives it back with `load_state_dict` when it resumes or rewinds to one.

A hook answers `CONTINUE`, `Rewind(state)` (it put the weights and the data back at an earlier
step: the loop goes on from there; with `leaving`, a `SaveAndStop`, the loop stops there instead:
that state is a checkpoint already) or `Stop(reason, by)` (the run must not go on: nothing after
this state is saved; `by` names who refused, the monitor or another check). The first answer other
than `CONTINUE` ends that boundary; the hooks after the one that gave it are not called there. At `after_step` a hook may also answer
`SaveAndStop(reason, exit_code)`: save a checkpoint at this boundary and stop, as a stop request
does, and exit with that status; the hooks after it are still called (a `Rewind` or `Stop` from
one of them comes first). Every rank must give the same answer at the same boundary.
`StepHook`'s methods do nothing: a hook overrides those it needs.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch

from pretrain.checkpoint.checkpointer import TrainState
from pretrain.stability.faults import FaultInjector


class Answer:
    """What a hook says at a step boundary: go on (`CONTINUE`), `Rewind` or `Stop`."""


CONTINUE = Answer()


@dataclass(frozen=True)
class SaveAndStop(Answer):
    reason: str  # rank 0's line after the save: "REASON: saved step_N and exiting"
    exit_code: int  # the job's exit status (pretrain.errors.ExitCode)


@dataclass(frozen=True)
class Rewind(Answer):
    state: TrainState  # where the loop goes on from (the step, tokens and lr scale of a checkpoint)
    leaving: SaveAndStop | None = None  # stop at `state` instead, with this reason and status


BY_THE_MONITOR = "the monitor"


@dataclass(frozen=True)
class Stop(Answer):
    reason: str
    by: str  # who refused to go on: BY_THE_MONITOR (the summary's `stopped_by_monitor`), or another check


class StepHook:
    """A component the loop calls at its step boundaries; every method here does nothing."""

    name = ""  # its key in a checkpoint's `hooks`, when it has state to keep
    priority = 50  # where the loop calls it among the hooks, lowest first (the table above)

    def open(self, stack: contextlib.ExitStack) -> None:
        pass

    def before_step(self, step: int) -> None:
        pass

    def lr_factor(self, step: int) -> float:
        return 1.0

    def before_forward(self, step: int, batch: dict[str, torch.Tensor]) -> None:
        pass

    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def vote(self) -> float | torch.Tensor:
        return 0.0

    def agreed(self, step: int, vote: torch.Tensor) -> None:
        pass

    def before_update(self, step: int, mean_loss: torch.Tensor, batch: dict[str, torch.Tensor]) -> None:
        pass

    def readings(self, step: int) -> dict[str, torch.Tensor]:
        return {}

    def after_step(self, step: int, metrics: dict, batch_ids: list, vote: float | list[float]) -> Answer:
        return CONTINUE

    def before_eval(self, step: int) -> Answer:
        return CONTINUE

    def before_checkpoint(self, step: int, stopping: bool, last: bool) -> Answer:
        return CONTINUE

    def close(self) -> None:
        pass

    def state_dict(self) -> dict | None:
        return None

    def load_state_dict(self, state: dict) -> None:
        pass


@dataclass
class InjectedFaults(StepHook):
    """`faults.*`: spikes and NaNs in the loss, killed and hung ranks, a corrupted checkpoint, each
    fired once, and a slow rank (`pretrain/stability/faults.py` holds what fires when). The first hook
    (`priority` 0, the table above)."""

    priority = 0
    faults: FaultInjector
    engine: Any = None  # a DeepSpeed engine: where a flip fault flips (None: no flip faults)

    def open(self, stack: contextlib.ExitStack) -> None:
        if self.engine is not None:
            self.faults.arm(self.engine)

    def before_step(self, step: int) -> None:
        self.faults.before_step(step)

    def before_forward(self, step: int, batch: dict[str, torch.Tensor]) -> None:
        self.faults.end_pass()  # (the last micro-batch's backward)
        self.faults.begin_pass(step)

    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        loss = self.faults.apply(step, loss)
        self.faults.end_pass()  # (the forward)
        self.faults.begin_pass(step)  # (the backward)
        return loss

    def vote(self) -> float:
        self.faults.end_pass()  # (the step's last backward)
        return 0.0

    def after_step(self, step: int, metrics: dict, batch_ids: list, vote: float) -> Answer:
        if self.engine is not None:
            self.faults.flip_weight(step)
        self.faults.mark_fired(step)
        return CONTINUE


@dataclass
class DataTrace(StepHook):
    """`logging.data_trace`: RUN_DIR/data_trace/rank_NNNNN.jsonl, the windows (or examples) this
    rank trained on at each step, one line per step; a step trained again after a rollback or a
    restart appends another line."""

    priority = 10

    run_dir: Path
    rank: int
    file: TextIO | None = None

    def open(self, stack: contextlib.ExitStack) -> None:
        directory = Path(self.run_dir) / "data_trace"
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"rank_{self.rank:05d}.jsonl"
        self.file = stack.enter_context(open(path, "a", buffering=1))  # noqa: SIM115 (closed by the stack)

    def after_step(self, step: int, metrics: dict, batch_ids: list, vote: float) -> Answer:
        self.file.write(json.dumps({"step": step, "windows": batch_ids}) + "\n")
        return CONTINUE
