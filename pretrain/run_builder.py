"""One lifecycle for every run, pretraining and fine-tuning alike (docs/architecture.md):

    1. check the inputs: every bad input is found here, before any process group exists
    2. own the run directory (one job at a time; the run's identity in run.json)
    3. determinism settings, then the process group
    4. choose where to resume from, or say the run is already complete (its last step saved and
       its summary written) and stop there
    5. build the model in its engine, then the trainer around it
    6. train

A task supplies step 1 as a function of the job's `DistEnv` that returns a `RunPlan`: its
identity, what `run.json` records, the DeepSpeed JSON, its model factory and how to build its
trainer (the task, its hooks, the summary). `pretrain.pretraining.pretrain` and
`pretrain.finetune.finetune` are each that function and one call of `run`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from monitoring.protocol import SUMMARY_FILE
from pretrain import atomic
from pretrain.checkpoint.checkpointer import Resume, choose_resume
from pretrain.config import CheckpointConfig, EngineConfig, OptimConfig, RunSection
from pretrain.distributed import DistEnv, barrier
from pretrain.engine import build, set_determinism_and_connect, zero_stage
from pretrain.lifeline import watch_supervisor
from pretrain.run_dir import owning_run_dir
from pretrain.train.loop import Trainer

# (env, engine, optimizer, resume or None, ZeRO stage) → the trainer around the engine
MakeTrainer = Callable[[DistEnv, Any, Any, "Resume | None", int], Trainer]


@dataclass(frozen=True)
class RunPlan:
    """What a task's checks found and what the lifecycle needs from the task."""

    run: RunSection
    checkpoint: CheckpointConfig
    engine: EngineConfig
    optim: OptimConfig
    steps: int  # the run's last step
    identity: dict  # what defines the run: another one in the same directory is refused
    run_config: dict  # the whole config, as run.json records it
    ds_config: dict  # the completed DeepSpeed JSON
    make_model: Callable[[], nn.Module]
    make_trainer: MakeTrainer


def run(run_dir: str | Path, check: Callable[[DistEnv], RunPlan]) -> dict:
    """Every rank: the lifecycle above; returns the run's summary."""
    watch_supervisor(run_dir)
    env = DistEnv.from_environ()
    plan = check(env)
    with owning_run_dir(
        plan.run.dir, env.is_main, plan.identity, plan.run_config, plan.checkpoint.resume
    ) as setting:
        set_determinism_and_connect(plan.run, env)
        resume = choose_resume(plan.run.dir, setting, env)
        if resume is not None and resume.state.step >= plan.steps and summary_complete(Path(plan.run.dir)):
            return already_complete(Path(plan.run.dir), plan.steps, env, resume)
        # (the last step saved but the run not finished, e.g. killed before its last evaluation or
        # results were written: the trainer does what is left, training nothing)
        ds_config = resume.deepspeed_config(plan.ds_config) if resume else plan.ds_config
        engine, optimizer = build(plan.run, plan.engine, plan.optim, plan.make_model, ds_config)
        return plan.make_trainer(env, engine, optimizer, resume, zero_stage(ds_config)).train()


def summary_complete(run_dir: Path) -> bool:
    """Whether the run's summary says it finished: its last step trained and saved, its last
    evaluation and its results written (the loop's last act)."""
    try:
        return json.loads((run_dir / SUMMARY_FILE).read_text()).get("completed") is True
    except (OSError, ValueError, AttributeError):
        return False


def already_complete(run_dir: Path, steps: int, env: DistEnv, resume: Resume) -> dict:
    """The run's last step is trained and saved: say so, train and evaluate nothing, and exit 0.
    Rank 0 writes the summary again (the same, marked complete) for the supervisor to see."""
    summary_path = run_dir / SUMMARY_FILE
    try:
        summary = json.loads(summary_path.read_text())
    except (OSError, ValueError):
        summary = {}
    state = resume.state
    summary |= {"step": state.step, "tokens": summary.get("tokens", state.tokens), "completed": True}
    if env.is_main:
        atomic.write_json(summary_path, summary)
        print(
            f"the run in {run_dir} is already complete: step {state.step} of {steps} is saved "
            f"({resume.tag}); nothing to train (raise train.steps to train further)",
            flush=True,
        )
    barrier()
    return summary
