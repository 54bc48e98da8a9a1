"""The training loop, one for pretraining and fine-tuning.

`Trainer.train` reads top to bottom: each optimizer step runs its micro-batches, then comes each
step-boundary call in the order it happens — metrics, the step hooks (`hooks.py`: injected faults,
the data trace, the monitor in `monitor_hook.py`), evaluation, checkpoint, stop. What differs
between pretraining and fine-tuning (the batches, what is evaluated, the data position a checkpoint
records) is the `Task`, and which hooks run; building everything the loop needs is the job of
`pretrain/pretraining.py` and `pretrain/finetune/`. Every rank runs the same code; rank 0 alone
writes logs, TensorBoard and the small JSON files. SIGTERM/SIGINT: the ranks agree at the next
step boundary, save a checkpoint and exit cleanly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch

from monitoring.protocol import (
    SUMMARY_FILE,
    Restart,
    RollbackApplied,
    StopRequested,
    append_event,
    read_events,
)
from pretrain import atomic
from pretrain.checkpoint import tag_for
from pretrain.checkpoint.checkpointer import Checkpointer, TrainState
from pretrain.lifeline import note_step, why_the_supervisor_stops
from pretrain.parallel.distributed import DistEnv, StopRequest, all_gather_objects, all_reduce_sum, barrier
from pretrain.parallel.engine import set_lr
from pretrain.parallel.step_read import StepRead
from pretrain.planning.flops import mfu
from pretrain.reporting.metrics import MetricsWriter, literal_markdown
from pretrain.train.hooks import BY_THE_MONITOR, CONTINUE, Answer, Rewind, SaveAndStop, StepHook, Stop

STOP_REQUESTED = Answer()  # how `Trainer.steps` ends when the ranks agreed to stop (a signal, stop_at_step)


class Task(Protocol):
    """What the loop asks of pretraining or a fine-tuning task. Optional members, called only where
    a task has them: `scalars()` (its own training scalars, e.g. tokens per corpus), `probe(engine,
    step)` (an image for TensorBoard's `attention/probe` at each evaluation), `samples(engine,
    step)` ((prompt, continuation) pairs at each evaluation) and `close()`."""

    evaluates: (
        bool  # whether to evaluate at all (pretraining: eval.every > 0; fine-tuning: a validation split)
    )

    def next_batch(self) -> dict[str, torch.Tensor]:
        """One micro-batch for this rank: keyword arguments of the model's forward; `tokens` is
        the input tokens (B, T)."""

    def last_batch_ids(self) -> list:
        """Ids of the windows or examples of the last micro-batch (for the data trace)."""

    def evaluate(self, engine) -> dict[str, float]:
        """Held-out metrics, without the `eval/` prefix (a collective)."""

    def state_dict(self) -> dict:
        """The data position, saved in every checkpoint."""

    def load_state_dict(self, state: dict) -> None: ...

    def finish(self, summary: dict) -> str | None:
        """Rank 0, after the last step: write the task's own results; the closing line to print."""


@dataclass(frozen=True)
class Cadence:
    """When each step-boundary call happens."""

    steps: int  # the last step
    log_every: int
    eval_every: int  # 0: only after the last step (when the task evaluates at all)
    checkpoint_every: int
    layer_norms_every: int  # 0: never
    stop_at_step: int | None = None  # save and exit here (e.g. to fit a job time limit)

    def logged(self, step: int) -> bool:
        """Whether the console and TensorBoard get this step's scalars."""
        return step % self.log_every == 0 or step == self.steps

    @classmethod
    def of(cls, cfg, steps: int, stop_at_step: int | None = None) -> Cadence:
        """From a run's (or fine-tuning run's) logging, eval and checkpoint sections."""
        return cls(
            steps,
            cfg.logging.every,
            cfg.eval.every,
            cfg.checkpoint.every,
            cfg.logging.layer_grad_norms_every,
            stop_at_step,
        )


@dataclass
class Trainer:
    env: DistEnv
    run_dir: Path
    engine: Any  # a DeepSpeed engine (or anything with its interface)
    optimizer: torch.optim.Optimizer
    task: Task
    cadence: Cadence
    lr_at: Callable[[int], float]  # the schedule: step → learning rate, before the hooks' factors
    grad_accum: int
    writer: MetricsWriter
    checkpointer: Checkpointer
    hooks: list[StepHook] = field(default_factory=list)  # called by their `priority` at each boundary
    flops_per_token: float | None = None  # for MFU, with peak_flops
    peak_flops: float | None = None
    state: TrainState = field(default_factory=TrainState)
    summary: dict = field(default_factory=dict)
    last_saved: int = 0  # the step of the newest checkpoint of this timeline
    read: StepRead = field(default_factory=StepRead)  # the step's one host read (the engine's gate's)

    def train(self) -> dict:
        """Optimizer steps until the last one, a stop request, or the monitor's stop."""
        self.summary |= {"eval": [], "rollbacks": 0, "restarts": 0}
        self.hooks.sort(key=lambda hook: hook.priority)  # (stable: equal priorities keep their order)
        with contextlib.ExitStack() as stack:
            stop = stack.enter_context(StopRequest(cause=lambda: why_the_supervisor_stops(self.run_dir)))
            if hasattr(self.task, "close"):
                stack.callback(self.task.close)
            stack.callback(self.writer.close)
            for hook in self.hooks:
                stack.callback(hook.close)
                hook.open(stack)
            self.give_hooks_their_state()
            if self.task.evaluates and self.state.step == 0:
                self.evaluate(0)  # the baseline every curve starts from
            self.last_saved = self.state.step
            ending = self.steps(stop)
            if not isinstance(ending, Stop):  # (the state a hook stopped at is the one it refused)
                if (
                    self.state.step >= self.cadence.steps
                    and self.task.evaluates
                    and not self._evaluated(self.state.step)
                ):
                    self.evaluate(self.state.step)  # resumed at the last step: its results all the same
                if self.last_saved != self.state.step:
                    self.save(last=True)
        return self.finish()

    def steps(self, stop: StopRequest) -> Answer:
        """Steps until the last one (`CONTINUE`), a stop request or a hook's leaving
        (`STOP_REQUESTED`), or a hook's `Stop`."""
        c = self.cadence
        while self.state.step < c.steps:
            step = self.state.step + 1
            note_step(step)  # (what this rank says, and the supervisor reads, if another rank is lost)
            for hook in self.hooks:
                hook.before_step(step)
            metrics, batch_ids, stop_requested, votes = self.optimizer_step(step, stop)
            self.log(step, metrics)
            answer = self.ask("after_step", step, metrics, batch_ids, votes=votes)
            if isinstance(answer, Rewind | Stop):
                if (ending := self.ending(answer, stop)) is None:
                    continue
                return ending
            # (at the last step there is nothing left to stop for: the run completes as it would)
            leaving = answer if isinstance(answer, SaveAndStop) and step < c.steps else None
            stop_requested = stop_requested or leaving is not None
            if self.task.evaluates and (step == c.steps or (c.eval_every and step % c.eval_every == 0)):
                answer = self.ask("before_eval", step)  # (a step rolled back here is not evaluated)
                if isinstance(answer, Rewind | Stop):
                    if (ending := self.ending(answer, stop)) is None:
                        continue
                    return ending
                self.evaluate(step)
            if step % c.checkpoint_every == 0 or step == c.steps or stop_requested:
                last = step == c.steps
                answer = self.ask("before_checkpoint", step, stop_requested, last)
                if isinstance(answer, Rewind | Stop):
                    if (ending := self.ending(answer, stop)) is None:
                        continue
                    return ending
                self.save(last=last or stop_requested)
                self.last_saved = step
            if stop_requested:
                self.record_stop(step, stop, leaving)
                return STOP_REQUESTED
        return CONTINUE

    def ask(self, boundary: str, *args, votes: list[float | list[float]] | None = None) -> Answer:
        """Each hook's `boundary` method in turn (with its agreed vote last, given `votes`), until
        one answers other than `CONTINUE`; a `Rewind` moves the loop back to its state, a `Stop` is
        recorded in the summary. A `SaveAndStop` (the first one given) is the answer once every
        hook has been asked."""
        leaving = None
        for index, hook in enumerate(self.hooks):
            answer = getattr(hook, boundary)(*args, *([votes[index]] if votes is not None else []))
            if isinstance(answer, Rewind):
                self.state = answer.state
                self.last_saved = answer.state.step
                self.give_hooks_their_state()
                return answer
            if isinstance(answer, Stop):
                by_monitor = answer.by == BY_THE_MONITOR  # (else another check: `stopped_by`, `stopped_for`)
                self.summary |= (
                    {"stopped_by_monitor": answer.reason}
                    if by_monitor
                    else {"stopped_by": answer.by, "stopped_for": answer.reason}
                )
                return answer
            if isinstance(answer, SaveAndStop) and leaving is None:
                leaving = answer
        return leaving or CONTINUE

    def ending(self, answer: Rewind | Stop, stop: StopRequest) -> Answer | None:
        """How `steps` ends after a boundary's `Rewind` or `Stop`: the `Stop`; for a `Rewind` that
        leaves, `STOP_REQUESTED` at its state (a checkpoint already); None: the loop goes on."""
        if isinstance(answer, Stop):
            return answer
        if answer.leaving is None:
            return None
        self.record_stop(self.state.step, stop, answer.leaving)
        return STOP_REQUESTED

    def give_hooks_their_state(self) -> None:
        """Each named hook's state as of the checkpoint the loop resumed or rewound to."""
        for hook in self.hooks:
            if hook.name and hook.name in self.state.hooks:
                hook.load_state_dict(self.state.hooks[hook.name])

    def record_stop(self, step: int, stop: StopRequest, leaving: SaveAndStop | None = None) -> None:
        """Every rank, after the save at a stop: which ranks asked to stop and why (a node that
        lost its supervisor, a scheduler's SIGTERM), on rank 0's console and in events.jsonl; a
        hook's `SaveAndStop`: its reason, and the exit status in the summary."""
        requesters = [r for r in all_gather_objects(stop.requester()) if r is not None]
        if leaving is not None:
            self.summary |= {"stopped_for": leaving.reason, "exit_code": int(leaving.exit_code)}
            self.writer.message(f"{leaving.reason}: saved {tag_for(step)} and exiting")
        if not requesters:
            if leaving is None:
                self.writer.message(f"reached train.stop_at_step: saved {tag_for(step)} and exiting")
            return
        self.writer.message(
            f"stop requested by {describe_requesters(requesters)}: saved {tag_for(step)} and exiting"
        )
        if self.env.is_main:
            append_event(
                self.run_dir,
                StopRequested(step=step, saved=tag_for(step), requested_by=requesters),
            )

    # --------------------------------------------------------------------------- step boundary

    def step_metrics(self, values: StepValues, lr: float, tokens: int, step_time: float) -> dict:
        """The step's train/* metrics (and the task's and the hooks' readings) from what was read."""
        per_device = tokens / step_time / self.env.world_size
        metrics = {
            "train/loss": values.loss_sum / self.env.world_size,
            "train/lr": lr,
            "train/grad_norm": values.grad_norm,
            "train/tokens_per_sec": tokens / step_time,
            "train/tokens_per_sec_per_device": per_device,
            "train/mfu": mfu(per_device, self.flops_per_token, self.peak_flops)
            if self.peak_flops and self.flops_per_token
            else None,
            "train/step_time": step_time,
            "train/memory_gb": _memory_gb(),
            "train/skipped_steps": float(self.engine.skipped_steps),
            "train/tokens": float(self.state.tokens),
        }
        metrics |= {f"train/grad_norm/{k}": v for k, v in values.layer_norms.items()}
        metrics |= self.task.scalars() if hasattr(self.task, "scalars") else {}
        metrics |= values.readings
        return metrics

    def optimizer_step(
        self, step: int, stop: StopRequest
    ) -> tuple[dict[str, float | None], list, bool, list[float | list[float]]]:
        """Micro-batches → backward → optimizer step; the ranks agree on the loss and on stopping.
        The host reads the step's numbers once (`pretrain/parallel/step_read.py`): inside the
        optimizer step, with the norm gate's decision, or after it (`read_step_values`)."""
        started = time.perf_counter()
        lr = self.lr_at(step)
        for hook in self.hooks:
            lr *= hook.lr_factor(step)  # (1.0 but for the monitor's, after a rollback that scales it)
        set_lr(self.optimizer, lr)
        every = self.cadence.layer_norms_every
        device, read = self.engine.device, self.read
        loss_sum, layer_squares, batch_ids, tokens = torch.zeros((), device=device), {}, [], 0
        read.begin()
        for micro_batch in range(self.grad_accum):
            batch = self.task.next_batch()
            batch_ids += self.task.last_batch_ids()
            tokens += batch["tokens"].numel()
            for hook in self.hooks:
                hook.before_forward(step, batch)
            loss = self.engine(**batch).loss
            for hook in self.hooks:
                loss = hook.loss(step, loss)
            self.engine.backward(loss)
            loss_sum += loss.detach().float()
            if micro_batch == self.grad_accum - 1:  # this micro-batch's engine.step() is the update
                if every and step % every == 0:
                    layer_squares = layer_grad_squares(self.engine.module)
                agreed, vote_sizes = self.agree(loss_sum, stop)
                for hook, vote in zip(self.hooks, votes_on_device(agreed, vote_sizes), strict=True):
                    hook.agreed(step, vote)
                for hook in self.hooks:
                    hook.before_update(step, agreed[0] / self.env.world_size, batch)
                joined = read.join(agreed), {g: read.join(v) for g, v in layer_squares.items()}
            self.engine.step()  # (an engine's norm gate reads what was joined, with its decision)
        readings = {name: value for hook in self.hooks for name, value in hook.readings(step).items()}
        values = read_step_values(read, joined, self.engine.get_global_grad_norm(), readings)
        stop_requested = values.stopping > 0 or step == self.cadence.stop_at_step
        # Pretraining's micro-batches have one shape on every rank; fine-tuning pads each rank's to
        # its own longest example, so there this counts rank 0's padded shape for every rank.
        tokens *= self.env.world_size
        self.state = TrainState(step, self.state.tokens + tokens)
        step_time = time.perf_counter() - started  # (the read above waited for the step's kernels)
        metrics = self.step_metrics(values, lr, tokens, step_time)
        return metrics, batch_ids, stop_requested, votes_of_hooks(values.votes, vote_sizes)

    def agree(self, loss_sum: torch.Tensor, stop: StopRequest) -> tuple[torch.Tensor, list[int | None]]:
        """The step's one collective, before its update lands: the mean loss summed over ranks,
        whether any rank was asked to stop, and each hook's vote (the monitor's: whether rank 0
        holds an action for every rank; the straggler hook's: a slot per rank, its compute time);
        and the size of each hook's vote (None: a number). Every value is float32, the loss's
        type, so that the loss is summed as it always was. (torch.full fills on the device;
        torch.tensor(x, device=...) would copy from the host and wait.)"""
        device, dtype = loss_sum.device, loss_sum.dtype
        parts = [
            (loss_sum / self.grad_accum).reshape(1),
            torch.full((1,), float(stop.requested), device=device),
        ]
        sizes: list[int | None] = []
        for hook in self.hooks:
            vote = hook.vote()
            if isinstance(vote, torch.Tensor):
                parts.append(vote.to(device=device, dtype=dtype).reshape(-1))
                sizes.append(parts[-1].numel())
            else:
                parts.append(torch.full((1,), float(vote), device=device, dtype=dtype))
                sizes.append(None)
        return all_reduce_sum(torch.cat(parts)), sizes

    def log(self, step: int, metrics: dict) -> None:
        self.writer.record(step, metrics)
        if self.cadence.logged(step):
            self.writer.scalars(step, metrics)
            self.writer.console(step, metrics)

    def evaluate(self, step: int) -> None:
        results = self.task.evaluate(self.engine)
        self.summary["eval"].append({"step": step} | results)
        shown = {k: v for k, v in results.items() if k != "examples"}
        self.writer.scalars(step, {f"eval/{k}": v for k, v in shown.items()})
        self.writer.message(f"eval at step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in shown.items()))
        image = self.task.probe(self.engine, step) if hasattr(self.task, "probe") else None
        if image is not None:
            self.writer.image("attention/probe", image, step)
        samples = self.task.samples(self.engine, step) if hasattr(self.task, "samples") else []
        for index, (prompt, text) in enumerate(samples):
            self.writer.message(f"sample at step {step}: {prompt!r} -> {text!r}")
            self.writer.text(
                f"samples/{index}", f"**{literal_markdown(prompt)}**{literal_markdown(text)}", step
            )

    def _evaluated(self, step: int) -> bool:
        return bool(self.summary["eval"]) and self.summary["eval"][-1]["step"] == step

    def save(self, last: bool = False) -> None:
        states = {hook.name: hook.state_dict() for hook in self.hooks if hook.name}
        self.state = dataclasses.replace(self.state, hooks={k: v for k, v in states.items() if v is not None})
        started = time.perf_counter()
        tag = self.checkpointer.save(self.engine, self.state, self.task.state_dict(), last)
        if tag is not None:
            self.writer.message(f"checkpoint {tag} saved ({time.perf_counter() - started:.1f} s)")
        self.writer.flush()

    def finish(self) -> dict:
        s = self.state
        self.summary |= {"step": s.step, "tokens": s.tokens, "completed": s.step >= self.cadence.steps}
        if self.env.is_main:
            self.summary |= run_history(self.run_dir)
            atomic.write_json(self.run_dir / SUMMARY_FILE, self.summary)
            closing = self.task.finish(self.summary)
            if closing:
                print(closing, flush=True)
        barrier()
        return self.summary


def run_history(run_dir: Path) -> dict[str, int]:
    """The summary's counts over the whole run, every attempt (a restart or a resume starts a new
    process whose own count would begin at 0), from RUN_DIR/events.jsonl: rollbacks applied and
    the supervisor's restarts. `--fresh` moves an earlier run's events aside with the rest of it."""
    types = [e.type for e in read_events(run_dir)]
    return {"rollbacks": types.count(RollbackApplied.type), "restarts": types.count(Restart.type)}


class StepValues(NamedTuple):
    loss_sum: float  # the micro-batches' mean loss, summed over ranks
    stopping: float  # > 0: some rank was asked to stop
    votes: list[float]  # the hooks' votes, summed over ranks, one after another (`votes_of_hooks`)
    grad_norm: float | None
    layer_norms: dict[str, float]  # per layer group, on the steps that take them
    readings: dict[str, float]  # the hooks' (`StepHook.readings`)


def votes_of_hooks(numbers: list[float], sizes: list[int | None]) -> list[float | list[float]]:
    """The agreed votes, one per hook: a number, or a list for a hook that voted a tensor."""
    votes, at = [], 0
    for size in sizes:
        votes.append(numbers[at] if size is None else numbers[at : at + size])
        at += 1 if size is None else size
    return votes


def votes_on_device(agreed: torch.Tensor, sizes: list[int | None]) -> list[torch.Tensor]:
    """Each hook's slice of the agreed tensor (after the loss and the stop flag): a 0-d tensor for
    a number, a 1-D one for a tensor vote."""
    votes, at = [], 2
    for size in sizes:
        votes.append(agreed[at] if size is None else agreed[at : at + size])
        at += 1 if size is None else size
    return votes


def describe_requesters(requesters: list[dict]) -> str:
    """ "node 1 (vm-2, ranks 2-3): its supervisor (pid 4242 on vm-2) is gone; …", one part per
    node and reason."""
    groups: dict[tuple, list[int]] = {}
    for r in requesters:
        groups.setdefault((r["node"], r["host"], r["why"]), []).append(r["rank"])
    parts = []
    for (node, host, why), ranks in sorted(groups.items()):
        ranks = sorted(ranks)
        if len(ranks) == 1:
            which = f"rank {ranks[0]}"
        elif ranks == list(range(ranks[0], ranks[-1] + 1)):
            which = f"ranks {ranks[0]}-{ranks[-1]}"
        else:
            which = "ranks " + ",".join(map(str, ranks))
        parts.append(f"node {node} ({host}, {which}): {why}")
    return "; ".join(parts)


def read_step_values(
    read: StepRead,
    joined: tuple[slice, dict[str, slice]],
    grad_norm: torch.Tensor | float | None,
    readings: dict[str, torch.Tensor | float] | None = None,
) -> StepValues:
    """The step's numbers on the host: the agreed vector and the per-layer squared norms the loop
    joined to `read` before the update, the gradient norm, and the hooks' readings. Every read
    makes the host wait for the accelerator (it cannot queue the next kernels meanwhile), so they
    share one (docs/performance.md, "Host reads in the step"): the norm gate's, inside the
    optimizer step, which also gives the norm (`read.grad_norm`), or else the one here, which
    the engine's norm joins. A hook's tensor reading joins whichever comes next (after the gate's
    read, one more: the precursors, measured after the update); a number is taken as it is."""
    agreed_at, layers_at = joined
    norm_at = None
    if read.grad_norm is not None:
        grad_norm = read.grad_norm
    elif isinstance(grad_norm, torch.Tensor):
        norm_at = read.join(grad_norm)
    elif grad_norm is not None:
        grad_norm = float(grad_norm)  # DeepSpeed's overflow: float("inf")
    readings = readings or {}
    reading_at = {k: read.join(v) for k, v in readings.items() if isinstance(v, torch.Tensor)}
    read.read()
    loss_sum, stopping, *votes = read.values(agreed_at)
    if norm_at is not None:
        (grad_norm,) = read.values(norm_at)
    layer_norms = {g: math.sqrt(read.values(at)[0]) for g, at in layers_at.items()}
    read_values = {
        k: read.values(reading_at[k])[0] if k in reading_at else float(v) for k, v in readings.items()
    }
    return StepValues(loss_sum, stopping, votes, grad_norm, layer_norms, read_values)


def layer_grad_squares(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Squared gradient norm per layer group (embeddings, layers.N, head: the rest), as float64
    tensors on the device (no host read); works under every ZeRO stage (a collective under ZeRO-3,
    so every rank calls it). Each parameter's square is summed in fp32, the groups in fp64."""
    from deepspeed.utils import safe_get_full_grad

    squares: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters():
        grad = safe_get_full_grad(param)
        if grad is None:
            continue
        parts = name.split(".")
        if "layers" in parts[:-1]:
            group = "layers." + parts[parts.index("layers") + 1]
        elif "embeddings" in name:
            group = "embeddings"
        else:
            group = "head"
        square = grad.float().pow(2).sum().double()
        squares[group] = squares[group] + square if group in squares else square
    return squares


def _memory_gb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import psutil

    return psutil.Process().memory_info().rss / 2**30
