"""The training loop, one for pretraining and fine-tuning.

`Trainer.train` reads top to bottom: each optimizer step runs its micro-batches, then comes each
step-boundary call in the order it happens — metrics, the monitor's verdict, evaluation, checkpoint,
stop. What differs between pretraining and fine-tuning (the batches, what is evaluated, the data
position a checkpoint records) is the `Task`; building everything the loop needs is the job of
`pretrain/pretraining.py` and `pretrain/finetune/`. Every rank runs the same code; rank 0 alone
writes logs, TensorBoard and the small JSON files. SIGTERM/SIGINT: the ranks agree at the next
step boundary, save a checkpoint and exit cleanly.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol, TextIO

import numpy as np
import torch

from monitoring.protocol import SUMMARY_FILE, Action, append_event, read_events
from pretrain import atomic
from pretrain.checkpoint import tag_for
from pretrain.checkpoint.checkpointer import Checkpointer, TrainState
from pretrain.distributed import DistEnv, StopRequest, all_gather_objects, all_reduce_sum, barrier
from pretrain.engine import set_lr
from pretrain.faults import FaultInjector
from pretrain.flops import mfu
from pretrain.lifeline import note_step
from pretrain.metrics import MetricsWriter, literal_markdown
from pretrain.monitor_link import MonitorLink, apply_rollback

QUARANTINE_FILE = "quarantine.jsonl"  # monitor.quarantine: the windows set aside, one line per rollback
DATA_POSITIONS_KEPT = 1024  # steps back a verdict can be about and still name its windows


class Task(Protocol):
    """What the loop asks of pretraining or a fine-tuning task."""

    evaluates: (
        bool  # whether to evaluate at all (pretraining: eval.every > 0; fine-tuning: a validation split)
    )

    def next_batch(self) -> dict[str, torch.Tensor]:
        """One micro-batch for this rank: keyword arguments of the model's forward; `tokens` is
        the input tokens (B, T)."""

    def served(self) -> list:
        """Ids of the windows or examples of the last micro-batch (for the data trace)."""

    def scalars(self) -> dict[str, float]:
        """The task's own training scalars (pretraining on a mixture: tokens per corpus)."""

    def evaluate(self, engine) -> dict[str, float]:
        """Held-out metrics, without the `eval/` prefix (a collective)."""

    def probe(self, engine, step: int) -> np.ndarray | None:
        """An image for TensorBoard's `attention/probe` at each evaluation, or None (a collective)."""

    def samples(self, engine, step: int) -> list[tuple[str, str]]:
        """(prompt, what the model writes after it) at each evaluation (a collective)."""

    def state_dict(self) -> dict:
        """The data position, saved in every checkpoint (a rollback also needs `pause` and
        `reshuffle`: see `monitor_link.Rewindable`)."""

    def load_state_dict(self, state: dict) -> None: ...
    def close(self) -> None: ...

    def windows_of(self, state: dict) -> list[tuple[int, int]]:
        """The (window id, epoch) of every rank's windows in the step that starts at data position
        `state` (recomputed: the order is deterministic); [] for tasks without windows."""

    def evidence(self, windows: list[int]) -> dict:
        """What a rollback event says about these windows: {"documents": [...]}, or why not."""

    def quarantine(self, entries: list[tuple[int, int]]) -> None:
        """Never serve these (window id, epoch) again in that epoch."""

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

    @classmethod
    def of(cls, cfg, steps: int, stop_at_step: int | None = None) -> Cadence:
        """From a run's (or fine-tuning run's) logging, eval and checkpoint sections."""
        return cls(steps, cfg.logging.every, cfg.eval.every, cfg.checkpoint.every,
                   cfg.logging.layer_grad_norms_every, stop_at_step)  # fmt: skip


@dataclass
class Trainer:
    env: DistEnv
    run_dir: Path
    engine: Any  # a DeepSpeed engine (or anything with its interface)
    optimizer: torch.optim.Optimizer
    task: Task
    cadence: Cadence
    lr_at: Callable[[int], float]  # the schedule: step → learning rate, before the monitor's lr scale
    grad_accum: int
    writer: MetricsWriter
    checkpointer: Checkpointer
    faults: FaultInjector
    monitor: MonitorLink | None = None
    flops_per_token: float | None = None  # for MFU, with peak_flops
    peak_flops: float | None = None
    data_trace: bool = False  # RUN_DIR/data_trace/rank_NNNNN.jsonl: the windows of every step
    state: TrainState = field(default_factory=TrainState)
    summary: dict = field(default_factory=dict)
    last_saved: int = 0  # the step of the newest checkpoint of this timeline
    charted_to: int = 0  # the newest step whose verdict is on TensorBoard
    quarantine: bool = False  # monitor.quarantine: a rollback also sets the anomalous step's windows aside
    quarantined: list = field(default_factory=list)  # (window, epoch) set aside by this process's rollbacks
    data_at: dict = field(default_factory=dict)  # step → the data position it started at (recent steps)

    def train(self) -> dict:
        """Optimizer steps until the last one, a stop request, or the monitor's stop."""
        self.summary |= {"eval": [], "rollbacks": 0, "restarts": 0}
        with contextlib.ExitStack() as stack:
            stop = stack.enter_context(StopRequest())
            stack.callback(self.task.close)
            stack.callback(self.writer.close)
            if self.monitor is not None:
                stack.callback(self.monitor.close)
            trace = self._open_data_trace(stack)
            if self.task.evaluates and self.state.step == 0:
                self.evaluate(0)  # the baseline every curve starts from
            self.last_saved = self.state.step
            ending = self.steps(stop, trace)
            if ending != "stopped_by_monitor":  # (that state is the one the monitor refused)
                if (
                    self.state.step >= self.cadence.steps
                    and self.task.evaluates
                    and not self._evaluated(self.state.step)
                ):
                    self.evaluate(self.state.step)  # resumed at the last step: its results all the same
                if self.last_saved != self.state.step:
                    self.save(last=True)
        return self.finish()

    def steps(self, stop: StopRequest, trace: TextIO | None) -> str:
        """Steps until the last one ("completed"), a stop request ("stop_requested") or the
        monitor's stop ("stopped_by_monitor")."""
        c = self.cadence
        while self.state.step < c.steps:
            step = self.state.step + 1
            note_step(step)  # (what this rank says, and the supervisor reads, if another rank is lost)
            self.faults.before_step(step)
            self.remember_data_position(step)
            metrics, served, stop_requested, action_waits = self.optimizer_step(step, stop)
            self.log(step, metrics, served, trace)
            if self.monitor is not None:
                self.monitor.report(step, metrics, self.state.tokens)  # judged while the next step runs
                acted = self.act(step, self.monitor.take() if action_waits else None)  # about an earlier step
                if acted == "rollback":
                    continue
                if acted == "stop":
                    return "stopped_by_monitor"
            if self.task.evaluates and (step == c.steps or (c.eval_every and step % c.eval_every == 0)):
                self.evaluate(step)
            if step % c.checkpoint_every == 0 or step == c.steps or stop_requested:
                if self.monitor is not None:  # a checkpoint holds only steps the monitor has judged
                    acted = self.act(
                        step, self.monitor.verdict(wait=not stop_requested, last=step == c.steps)
                    )
                    if acted == "rollback":
                        continue
                    if acted == "stop":
                        return "stopped_by_monitor"
                self.save(last=step == c.steps or stop_requested)
                self.last_saved = step
            if stop_requested:
                self.record_stop(step, stop)
                return "stop_requested"
        return "completed"

    def record_stop(self, step: int, stop: StopRequest) -> None:
        """Every rank, after the save at a stop: which ranks asked to stop and why (a node that
        lost its supervisor, a scheduler's SIGTERM), on rank 0's console and in events.jsonl."""
        requesters = [r for r in all_gather_objects(stop.requester()) if r is not None]
        if not requesters:
            self.writer.message(f"reached train.stop_at_step: saved {tag_for(step)} and exiting")
            return
        self.writer.message(
            f"stop requested by {describe_requesters(requesters)}: saved {tag_for(step)} and exiting"
        )
        if self.env.is_main:
            append_event(self.run_dir, {"type": "stop_requested", "step": step, "saved": tag_for(step),
                                        "requested_by": requesters})  # fmt: skip

    def act(self, step: int, action: Action | None) -> str | None:
        """The monitor's action at the boundary after `step`: "rollback" (applied), "stop", or None.
        Also charts the verdicts that arrived."""
        self.chart_verdicts()
        if action is not None and action.kind == "stop":
            self.stop_by_monitor(action)
            return "stop"
        if action is not None and action.kind == "rollback" and self.rollback(step, action):
            return "rollback"
        return None

    # --------------------------------------------------------------------------- step boundary

    def optimizer_step(
        self, step: int, stop: StopRequest
    ) -> tuple[dict[str, float | None], list, bool, bool]:
        """Micro-batches → backward → optimizer step; the ranks agree on the loss and on stopping.
        The host reads the step's numbers once, at the end (`read_step_values`)."""
        started = time.perf_counter()
        lr = self.lr_at(step) * self.state.lr_scale
        set_lr(self.optimizer, lr)
        every = self.cadence.layer_norms_every
        device = self.engine.device
        loss_sum, layer_squares, served, tokens = torch.zeros((), device=device), {}, [], 0
        for _ in range(self.grad_accum):
            batch = self.task.next_batch()
            served += self.task.served()
            tokens += batch["tokens"].numel()
            loss = self.faults.apply(step, self.engine(**batch).loss)
            self.engine.backward(loss)
            if every and step % every == 0 and self.engine.is_gradient_accumulation_boundary():
                layer_squares = layer_grad_squares(self.engine.module)
            self.engine.step()
            loss_sum += loss.detach().float()
        # One collective per step: the mean loss over ranks, whether any rank was asked to stop, and
        # whether rank 0 holds an action of the monitor (about an earlier step) for every rank.
        # (torch.full fills on the device; torch.tensor(x, device=...) would copy from the host and wait)
        stopping = torch.full((), float(stop.requested), device=device)
        action_waits = torch.full((), self.monitor.pending() if self.monitor else 0.0, device=device)
        agreed = all_reduce_sum(torch.stack([loss_sum / self.grad_accum, stopping, action_waits]))
        values = read_step_values(agreed, self.engine.get_global_grad_norm(), layer_squares)
        stop_requested = values.stopping > 0 or step == self.cadence.stop_at_step
        # Pretraining's micro-batches have one shape on every rank; fine-tuning pads each rank's to
        # its own longest example, so there this counts rank 0's padded shape for every rank.
        tokens *= self.env.world_size
        self.state = TrainState(step, self.state.tokens + tokens, self.state.lr_scale)
        self.faults.mark_fired(step)
        step_time = time.perf_counter() - started  # (the read above waited for the step's kernels)
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
        metrics |= {f"train/grad_norm/{k}": v for k, v in values.layer_norms.items()} | self.task.scalars()
        return metrics, served, stop_requested, values.action_waits > 0

    def log(self, step: int, metrics: dict, served: list, trace: TextIO | None) -> None:
        if trace is not None:
            trace.write(json.dumps({"step": step, "windows": served}) + "\n")
        self.writer.record(step, metrics)
        if step % self.cadence.log_every == 0 or step == self.cadence.steps:
            self.writer.scalars(step, metrics)
            self.writer.console(step, metrics)

    def rollback(self, step: int, action: Action) -> bool:
        """At the boundary after `step`: the monitor's rollback (decided at step `action.step`).
        Whether it was applied (else it is cancelled: no intact checkpoint to go back to)."""
        self.writer.text("monitor/rollbacks", f"step {action.step}: {action.reason} -> {action.tag}, "
                         f"seed {action.seed} (applied after step {step})", action.step or step)  # fmt: skip
        self.writer.message(f"monitor: {action.reason} at step {action.step}: rolling back to {action.tag} "
                            f"with data seed {action.seed}, lr scale {action.lr_scale:g}")  # fmt: skip
        windows = self.task.windows_of(self.data_at[action.step]) if action.step in self.data_at else []
        evidence = self.task.evidence([w for w, _ in windows]) if self.env.is_main else {}
        state = apply_rollback(action, step, self.engine, self.task, self.checkpointer, evidence)
        if state is not None and self.quarantine and windows:
            self.set_aside(action, windows, evidence)
        if state is None:
            reason = f"no intact checkpoint at or before {action.tag}"
            self.writer.message(f"monitor: {reason}: rollback cancelled")
            self.monitor.resolved(action, step, None, reason)
            return False
        self.monitor.resolved(action, step, tag_for(state.step))
        self.state = state
        self.last_saved = state.step
        return True

    def remember_data_position(self, step: int) -> None:
        """Where the data stood as `step` began, for the steps a verdict may still be about."""
        self.data_at[step] = self.task.state_dict()
        for old in [s for s in self.data_at if s <= step - DATA_POSITIONS_KEPT]:
            del self.data_at[old]

    def set_aside(self, action: Action, windows: list[tuple[int, int]], evidence: dict) -> None:
        """Quarantine the anomalous step's windows (and those of earlier rollbacks, which an older
        checkpoint's position does not hold yet); rank 0 lists them in RUN_DIR/quarantine.jsonl."""
        self.quarantined += [w for w in windows if w not in self.quarantined]
        self.task.quarantine(self.quarantined)
        if self.env.is_main:
            record = {"step": action.step, "decision": action.decision, "windows": [list(w) for w in windows]}
            with open(self.run_dir / QUARANTINE_FILE, "a") as f:
                f.write(json.dumps(evidence | record) + "\n")  # (windows with their epochs)
            self.writer.message(
                f"monitor: {len(windows)} windows of step {action.step} set aside for their epoch"
            )

    def chart_verdicts(self) -> None:
        """Rank 0: what the monitor judged (every step, at the step it judged): the series with
        its band, and warnings and rollbacks as marks (1 at their step, 0 elsewhere)."""
        for answer in self.monitor.judged():
            step, scalars = answer["judged"]["step"], monitor_scalars(answer)
            if step <= self.charted_to:  # a step run again after a rollback: keep the marks it had
                scalars = {k: v for k, v in scalars.items() if k not in MARKS or v}
            self.charted_to = max(self.charted_to, step)
            self.writer.scalars(step, scalars)

    def stop_by_monitor(self, action: Action) -> None:
        self.summary["stopped_by_monitor"] = action.reason
        self.writer.message(f"monitor: {action.reason}; stopping the job")

    def evaluate(self, step: int) -> None:
        results = self.task.evaluate(self.engine)
        self.summary["eval"].append({"step": step} | results)
        shown = {k: v for k, v in results.items() if k != "examples"}
        self.writer.scalars(step, {f"eval/{k}": v for k, v in shown.items()})
        self.writer.message(f"eval at step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in shown.items()))
        image = self.task.probe(self.engine, step)
        if image is not None:
            self.writer.image("attention/probe", image, step)
        for index, (prompt, text) in enumerate(self.task.samples(self.engine, step)):
            self.writer.message(f"sample at step {step}: {prompt!r} -> {text!r}")
            self.writer.text(
                f"samples/{index}", f"**{literal_markdown(prompt)}**{literal_markdown(text)}", step
            )

    def _evaluated(self, step: int) -> bool:
        return bool(self.summary["eval"]) and self.summary["eval"][-1]["step"] == step

    def save(self, last: bool = False) -> None:
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

    def _open_data_trace(self, stack: contextlib.ExitStack) -> TextIO | None:
        if not self.data_trace:
            return None
        directory = self.run_dir / "data_trace"
        directory.mkdir(parents=True, exist_ok=True)
        return stack.enter_context(open(directory / f"rank_{self.env.rank:05d}.jsonl", "a", buffering=1))


MARKS = ("monitor/warning", "monitor/rollback")


def run_history(run_dir: Path) -> dict[str, int]:
    """The summary's counts over the whole run, every attempt (a restart or a resume starts a new
    process whose own count would begin at 0), from RUN_DIR/events.jsonl: rollbacks applied and
    the supervisor's restarts. `--fresh` moves an earlier run's events aside with the rest of it."""
    types = [e.get("type") for e in read_events(run_dir)]
    return {"rollbacks": types.count("rollback_applied"), "restarts": types.count("restart")}


def monitor_scalars(answer: dict) -> dict[str, float]:
    """TensorBoard's `monitor/*` scalars for one judged step, from the service's answer."""
    judged, bands, verdict = answer["judged"], answer.get("bands") or {}, answer.get("verdict") or {}
    level = verdict.get("level")
    out = _finite({
        "monitor/loss": judged.get("loss"),
        "monitor/grad_norm": judged.get("grad_norm"),
        "monitor/warning": float(level == "warn"),
        "monitor/rollback": float(level == "rollback"),
    })  # fmt: skip
    for series in ("loss", "grad_norm"):
        out |= in_band(series, judged.get(series), bands.get(series) or {})
    return out


def in_band(series: str, value, band: dict) -> dict[str, float]:
    """The Margin chart's three tags of `series` (metrics.py), all or none: TensorBoard draws a
    Margin chart only when its value, lower and upper tags have the same steps, and there is no
    band in the warm-up (nor a value to draw when the judged one is not finite)."""
    three = _finite({f"monitor/{series}_in_band": value, f"monitor/{series}_level": band.get("level"),
                     f"monitor/{series}_threshold": band.get("threshold")})  # fmt: skip
    return three if len(three) == 3 else {}


def _finite(values: dict) -> dict[str, float]:
    numbers = {k: _number(v) for k, v in values.items()}
    return {k: v for k, v in numbers.items() if v is not None and math.isfinite(v)}


def _number(value) -> float | None:
    try:
        return float(value)  # (a non-finite value arrives as the string "nan" or "inf")
    except (TypeError, ValueError):
        return None


class StepValues(NamedTuple):
    loss_sum: float  # the micro-batches' mean loss, summed over ranks
    stopping: float  # > 0: some rank was asked to stop
    action_waits: float  # > 0: rank 0 holds a monitor action for every rank
    grad_norm: float | None
    layer_norms: dict[str, float]  # per layer group, on the steps that take them


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
    agreed: torch.Tensor, grad_norm: torch.Tensor | float | None, layer_squares: dict[str, torch.Tensor]
) -> StepValues:
    """The step's one host read: the agreed numbers, the engine's gradient norm and the per-layer
    squared norms come back to the host together. Every read makes the host wait for the
    accelerator (it cannot queue the next kernels meanwhile), so the loop makes only this one
    (docs/performance.md, "Host reads in the step"). Values are widened to float64 on the device,
    which is exact: the host sees the bits a read of each tensor would have given."""
    norm_on_device = isinstance(grad_norm, torch.Tensor)
    on_device = [agreed.double()]
    if norm_on_device:
        on_device.append(grad_norm.detach().double().reshape(1).to(agreed.device))
    groups = list(layer_squares)
    on_device += [layer_squares[g].reshape(1).to(agreed.device) for g in groups]
    numbers = torch.cat(on_device).tolist()
    loss_sum, stopping, action_waits = numbers[:3]
    if norm_on_device:
        grad_norm = numbers[3]
    elif grad_norm is not None:
        grad_norm = float(grad_norm)  # DeepSpeed's overflow: float("inf")
    squares = numbers[3 + norm_on_device :]
    layer_norms = {g: math.sqrt(v) for g, v in zip(groups, squares, strict=True)}
    return StepValues(loss_sum, stopping, action_waits, grad_norm, layer_norms)


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
