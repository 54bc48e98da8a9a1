"""The step hook that names a straggler: a rank whose compute is slower than the others'
(docs/monitoring.md, "Stragglers").

What it measures: each rank's forward passes in a step (every micro-batch's, summed): on CPU the
CPU time of the thread that runs them, on a GPU the device's time between CUDA events
(`ForwardClock`). The forward, not forward + backward: DeepSpeed reduces the gradients inside the
backward pass (ZeRO-2 and -3 at every micro-batch, ZeRO-1 at the step's last), so on a GPU a fast
rank's backward includes waiting for the slowest rank (measured on CPU with the wall clock, ZeRO-1
and -2: the fast rank's last backward took 138 ms against the slow rank's 30); its forward passes do
not wait for anyone (ZeRO-3's gathers of partitioned parameters aside). Each rank puts its time in
its own slot of a vector that rides the step's one all-reduce (its vote): every rank gets every
rank's time with no other collective and no host read.

The rule (`StragglerRule`, a pure function of the times) is judged over windows: the steps since
the last window, ending at a logging step once they are at least `MIN_WINDOW_STEPS` (so with
`logging.every` ≥ 10 a window is a logging interval). Each rank's median time per step over the
window is compared with the median of the *other* ranks' times; a rank above
`monitor.straggler_factor` × that for `monitor.straggler_windows` windows in a row is a straggler.
(Against the others' median, not everyone's: with two ranks the median of both is their mean, and
a rank 3× slower than the other is only 1.5× that.) One step's time has outliers (a job's first
steps: allocation, first calls; once 5.6× the other rank's at step 2 of a clean run): a window
holds at least ten steps, its time is their median, and the first step after the hook opens is
not counted. Every rank holds the same times and so comes to the same verdict at the same step.
Rank 0 appends a `straggler` event, says so on the console, charts `train/straggler_factor` (the
largest rank's factor) and hands the window's times to the monitor's report. With
`monitor.on_straggler: replace`, the slow host is moved off (`move_off.py`): every rank answers
`SaveAndStop`, a checkpoint, then exit status 5 (ExitCode.REPLACE_NODE), rank 0 having written
RUN_DIR/monitor/replace.json for the supervisor, which restarts the job with a spare in its place.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from monitoring.protocol import MAX_RANKS_REPORTED, Straggler, append_event
from pretrain.monitor_link import MonitorLink
from pretrain.parallel.distributed import DistEnv
from pretrain.reporting.metrics import MetricsWriter
from pretrain.train.hooks import CONTINUE, Answer, StepHook
from pretrain.train.move_off import HostMoves

FACTOR_TAG = "train/straggler_factor"  # TensorBoard: the largest rank's time over the others' median
MIN_WINDOW_STEPS = 10  # a window of the rule holds at least this many steps (one step is noise)


class ForwardClock:
    """This rank's forward seconds in a step, read without making the host wait. On CPU: the CPU
    time of this thread, which runs the forward, not the wall clock: ranks that share cores with
    other work (the suite's two jobs on two cores) lose wall time to each other for many steps on
    end, and time spent descheduled or waiting in a collective is not compute. On a GPU: a CUDA
    event before and after each forward, read one step late: by then the step's one host read has
    waited for them, so reading them waits for nothing (events not yet complete are not read: 0,
    unmeasured)."""

    def __init__(self, device: torch.device):
        self.on_gpu = torch.device(device).type == "cuda"
        self.seconds = 0.0  # (CPU) this step's so far
        self.started = 0.0
        self.events: list = []  # (GPU) this step's (start, end) pairs
        self.previous: list = []  # (GPU) the last step's

    def start(self) -> None:
        if self.on_gpu:
            self.events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
            self.events[-1][0].record()
        else:
            self.started = time.thread_time()

    def stop(self) -> None:
        if self.on_gpu:
            self.events[-1][1].record()
        else:
            self.seconds += time.thread_time() - self.started

    def take(self) -> float:
        """The step's forward seconds (on a GPU the step before's), and start the next step's."""
        if not self.on_gpu:
            seconds, self.seconds = self.seconds, 0.0
            return seconds
        done, self.previous, self.events = self.previous, self.events, []
        if not done or not all(end.query() for _, end in done):
            return 0.0
        return sum(start.elapsed_time(end) for start, end in done) / 1000


def median_of_others(times: Sequence[float]) -> list[float]:
    """For each value, the median of all the others (at least two values): one sort, then each
    rank's median read around its own place in the sorted order."""
    order = sorted(range(len(times)), key=lambda i: times[i])
    ranked = [times[i] for i in order]
    n = len(ranked) - 1  # the others' count

    def nth_without(k: int, place: int) -> float:
        return ranked[k] if k < place else ranked[k + 1]

    medians = [0.0] * len(times)
    for place, i in enumerate(order):
        if n % 2:
            medians[i] = nth_without(n // 2, place)
        else:
            medians[i] = (nth_without(n // 2 - 1, place) + nth_without(n // 2, place)) / 2
    return medians


def straggler_factors(times: Sequence[float | None]) -> list[float | None]:
    """Each rank's time over the median of the other ranks' times; None for a rank not measured,
    or when fewer than two ranks are."""
    measured = [(r, t) for r, t in enumerate(times) if t is not None and t > 0]
    factors: list[float | None] = [None] * len(times)
    if len(measured) < 2:
        return factors
    medians = median_of_others([t for _, t in measured])
    for (rank, t), median in zip(measured, medians, strict=True):
        factors[rank] = t / median
    return factors


@dataclass(frozen=True)
class Straggling:
    rank: int
    factor: float  # its time over the median of the other ranks', this window
    windows: int  # windows in a row above the factor (at least the rule's)


@dataclass
class StragglerRule:
    """monitor.straggler_factor and straggler_windows over successive windows."""

    factor: float
    windows: int
    streaks: dict[int, int] = field(default_factory=dict)  # rank → windows in a row above

    def judge(self, times: Sequence[float | None]) -> list[Straggling]:
        """One window's time per rank (None: not measured) → the ranks above `factor` × the
        median of the others for `windows` windows in a row or more, slowest first. An unmeasured
        window neither extends nor breaks a rank's streak."""
        factors = straggler_factors(times)
        for rank, factor in enumerate(factors):
            if factor is not None:
                self.streaks[rank] = self.streaks.get(rank, 0) + 1 if factor > self.factor else 0
        straggling = [
            Straggling(rank, factors[rank], streak)
            for rank, streak in self.streaks.items()
            if streak >= self.windows and factors[rank] is not None
        ]
        return sorted(straggling, key=lambda s: -s.factor)


@dataclass
class WindowTimes:
    """Every rank's forward seconds at each step of one window (a step × rank table of float32,
    the all-reduce's own type: 4 MB for a window of 1,000 steps of 1,024 ranks)."""

    rows: list[torch.Tensor] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return len(self.rows)

    def add(self, seconds: Sequence[float]) -> None:
        self.rows.append(torch.tensor(seconds, dtype=torch.float32))

    def medians(self) -> list[float | None]:
        """Each rank's median over the window's steps it was measured at (0: not measured, as a
        GPU's first step); None for a rank never measured. The median, not the mean: one step in
        which a rank was descheduled for 300 ms (measured in the suite's clean runs: 24x the other
        rank's forward) would make the mean of a window of ten look 3x slow."""
        table = torch.stack(self.rows).double()
        table[table <= 0] = float("nan")
        medians = table.nanmedian(dim=0).values.tolist()
        return [None if m != m else m for m in medians]  # (NaN: never measured)


@dataclass(kw_only=True)
class StragglerWatch(StepHook):
    """Every rank measures and judges; rank 0 reports. No `name`: nothing of it is kept in a
    checkpoint, so a restart starts its streaks over (on the hosts it now runs on)."""

    priority = 40  # (the order of the hooks: pretrain/train/hooks.py)

    env: DistEnv
    run_dir: Path
    writer: MetricsWriter
    logged: Callable[[int], bool]  # the logging steps, where a window may end
    rule: StragglerRule
    replace: bool  # monitor.on_straggler == "replace"
    engine: Any  # a DeepSpeed engine (or anything with its interface): its device
    moves: HostMoves  # each rank's host, and the way to move one off
    link: MonitorLink | None = None  # rank 0's report carries each window's times
    clock: ForwardClock | None = None
    window: WindowTimes = field(default_factory=WindowTimes)
    warming_up: bool = True  # the first step after opening is not counted

    def open(self, stack: contextlib.ExitStack) -> None:
        self.clock = ForwardClock(self.engine.device)
        self.moves.open()

    @property
    def hosts(self) -> list[str]:
        return self.moves.hosts

    def before_forward(self, step: int, batch: dict) -> None:
        self.clock.start()

    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        self.clock.stop()  # (after the faults' hook: a slow rank's stretch is inside)
        return loss

    def vote(self) -> torch.Tensor:
        slots = torch.zeros(self.env.world_size, dtype=torch.float32, device=self.engine.device)
        # fill_, not `slots[rank] = x`: on a GPU that assignment copies x from the host and waits
        # for the device (measured on an H200: 0.5 s behind a queued kernel; fill_, 0.2 ms)
        slots[self.env.rank].fill_(self.clock.take())
        return slots

    def after_step(self, step: int, metrics: dict, batch_ids: list, vote: list[float]) -> Answer:
        if self.warming_up:
            self.warming_up = False
            return CONTINUE
        self.window.add(vote)
        if not self.logged(step) or self.window.steps < MIN_WINDOW_STEPS:
            return CONTINUE
        times, self.window = self.window.medians(), WindowTimes()
        straggling = self.rule.judge(times)
        named = [s for s in straggling if s.windows == self.rule.windows]
        if self.env.is_main:
            self.show(step, times, named)
        if not (self.replace and straggling):
            return CONTINUE
        return self.leave(step, straggling[0])

    def show(self, step: int, times: list[float | None], named: list[Straggling]) -> None:
        """Rank 0: the window's times to the monitor's report and TensorBoard; each rank named
        now, as an event and a console line."""
        factors = straggler_factors(times)
        known = [f for f in factors if f is not None]
        if known:
            self.writer.scalars(step, {FACTOR_TAG: max(known)})
        if self.link is not None:
            self.link.note_ranks(step, self.report(times, factors, {s.rank for s in named}))
        for s in named:
            host = self.hosts[s.rank]
            append_event(
                self.run_dir, Straggler(step=step, rank=s.rank, host=host, factor=round(s.factor, 3))
            )
            self.writer.message(
                f"straggler: rank {s.rank} on {host} took {s.factor:.2f}x the median rank's forward time "
                f"over {s.windows} windows of at least {MIN_WINDOW_STEPS} steps in a row, up to step {step} "
                f"(monitor.straggler_factor={self.rule.factor:g}, monitor.on_straggler="
                f"{'replace' if self.replace else 'warn'})"
            )

    def report(self, times: list[float | None], factors: list[float | None], named: set[int]) -> list[dict]:
        """StepMetrics.ranks: each measured rank's host, seconds per step and factor (the slowest
        MAX_RANKS_REPORTED of a larger job), in rank order; `straggler` on those named now."""
        ranks = [r for r, seconds in enumerate(times) if seconds is not None]
        if len(ranks) > MAX_RANKS_REPORTED:
            ranks = sorted(sorted(ranks, key=lambda r: -(factors[r] or 0))[:MAX_RANKS_REPORTED])
        return [
            {"rank": r, "host": self.hosts[r], "step_seconds": times[r]}
            | ({"factor": factors[r]} if factors[r] is not None else {})
            | ({"straggler": True} if r in named else {})
            for r in ranks
        ]

    def leave(self, step: int, slowest: Straggling) -> Answer:
        """monitor.on_straggler=replace: the slowest rank's host is moved off (every rank saves
        and stops)."""
        why = (
            f"rank {slowest.rank} took {slowest.factor:.2f}x the median rank's forward time for "
            f"{slowest.windows} windows in a row"
        )
        return self.moves.ask(slowest.rank, step, why, "straggler")
