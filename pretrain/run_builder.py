"""One lifecycle for every run, pretraining and fine-tuning alike (docs/architecture.md):

    1. check the inputs: every bad input is found here, before any process group exists
    2. own the run directory (one job at a time; the run's identity in run.json)
    3. determinism settings, then the process group
    4. choose where to resume from, or say the run is already complete (its last step saved and
       its summary written) and stop there
    5. build the model in its engine, then the trainer around it: the task, the checkpointer,
       the restore (weights, optimizer, RNG and the task's data position), the metrics writer,
       the step hooks
    6. train

A task supplies step 1 as a function of the job's `DistEnv` that returns a `RunPlan`: its config,
identity, DeepSpeed JSON and schedule, its model factory, and its own parts of the trainer (the
task, its hooks, its first lines, its summary). `pretrain.pretraining.pretrain` and
`pretrain.finetune.finetune` are each that function and one call of `run`; the unit tier runs
steps 4-5 (`start`) with a stand-in engine.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from monitoring.protocol import SUMMARY_FILE
from pretrain import atomic
from pretrain.checkpoint.checkpointer import Checkpointer, Resume, TrainState, choose_resume
from pretrain.config import FaultsConfig, FinetuneConfig, RunConfig, config_hash, to_yaml
from pretrain.lifeline import watch_supervisor
from pretrain.parallel.distributed import DistEnv, barrier
from pretrain.parallel.engine import BatchPlan, build, set_determinism_and_connect
from pretrain.parallel.norm_gate import step_read
from pretrain.planning.flops import current_device_peak_flops
from pretrain.reporting.metrics import MetricsWriter
from pretrain.run_dir import owning_run_dir
from pretrain.train.hooks import StepHook
from pretrain.train.loop import Cadence, Task, Trainer

# (run, engine, optim sections, model factory, DeepSpeed JSON) → (engine, optimizer): engine.build
MakeEngine = Callable[..., tuple[Any, Any]]


@dataclass(frozen=True, kw_only=True)
class RunParts:
    """What the builder made around the engine, for a task's hooks and first lines."""

    env: DistEnv
    engine: Any  # a DeepSpeed engine (or anything with its interface)
    task: Task
    checkpointer: Checkpointer
    writer: MetricsWriter
    state: TrainState  # where the run starts: restored when resuming
    resume: Resume | None
    zero: int  # the engine's ZeRO stage


@dataclass(frozen=True, kw_only=True)
class RunPlan:
    """What a task's checks found and what the lifecycle needs from the task."""

    # the run
    config: RunConfig | FinetuneConfig  # as the run trains: run.json, run_config.json, the config text
    steps: int  # the run's last step
    identity: dict  # what defines the run: another one in the same directory is refused
    ds_config: dict  # the completed DeepSpeed JSON
    batches: BatchPlan
    cadence: Cadence
    lr_at: Callable[[int], float]  # the schedule
    flops_per_token: float | None = None  # for MFU
    # its checkpoints
    tokenizer: Path  # copied into every checkpoint
    special_tokens: dict | None = None  # a Hugging Face tokenizer's, as the run uses it
    saved_config: dict = field(default_factory=dict)  # run_config.json's keys besides the config's
    faults: FaultsConfig | None = None  # the checkpointer's (faults.slow_save_step)
    # a checkpoint that did not record the task's data position: the position at its step
    position_at: Callable[[int], dict] | None = None
    # the task's own parts
    make_model: Callable[[], nn.Module]
    # the model when the run resumes from a checkpoint of its own, whose weights replace whatever it
    # starts with: pretraining's skips reading checkpoint.init (None: make_model)
    make_resumed_model: Callable[[], nn.Module] | None = None
    make_task: Callable[[DistEnv, Any], Task]  # (env, engine) → the task
    make_hooks: Callable[[RunParts], list[StepHook]] = lambda parts: []
    first_lines: Callable[[RunParts], list[str]]  # what the run says before its first step
    summary: dict = field(default_factory=dict)  # its keys of the run's summary


def run(run_dir: str | Path, check: Callable[[DistEnv], RunPlan]) -> dict:
    """Every rank: the lifecycle above; returns the run's summary."""
    watch_supervisor(run_dir)
    env = DistEnv.from_environ()
    plan = check(env)
    cfg = plan.config
    with owning_run_dir(
        cfg.run.dir, env.is_main, plan.identity, asdict(cfg), cfg.checkpoint.resume
    ) as setting:
        set_determinism_and_connect(cfg.run, env)
        made = start(plan, env, setting, build)
        return made.train() if isinstance(made, Trainer) else made


def start(plan: RunPlan, env: DistEnv, setting: str, make_engine: MakeEngine) -> Trainer | dict:
    """Every rank, with the run directory owned and the process group up: the trainer, built on
    the checkpoint the resume `setting` leads to (or none), or the summary of a run already complete."""
    cfg, run_dir = plan.config, Path(plan.config.run.dir)
    experts = expert_parallel(cfg)
    resume = choose_resume(run_dir, setting, env, mirror=cfg.checkpoint.mirror, expert_parallel=experts)
    if resume is not None and resume.state.step >= plan.steps and summary_complete(run_dir):
        return already_complete(run_dir, plan.steps, env, resume)
    # (the last step saved but the run not finished, e.g. killed before its last evaluation or
    # results were written: the trainer does what is left, training nothing)
    ds_config = resume.deepspeed_config(plan.ds_config) if resume else plan.ds_config
    # resuming, the checkpoint's weights replace the model's: a task may skip reading its first ones
    make_model = plan.make_resumed_model if resume and plan.make_resumed_model else plan.make_model
    engine, optimizer = make_engine(
        cfg.run, cfg.engine, cfg.optim, make_model, ds_config, expert_parallel=experts
    )
    return build_trainer(plan, env, engine, optimizer, resume)


def expert_parallel(cfg: RunConfig | FinetuneConfig) -> int:
    """`parallel.expert` (pretraining's; fine-tuning keeps every expert on every rank)."""
    parallel = getattr(cfg, "parallel", None)
    return parallel.expert if parallel is not None else 1


def build_trainer(plan: RunPlan, env: DistEnv, engine, optimizer, resume: Resume | None) -> Trainer:
    """Everything the loop needs around an engine: the task, checkpoints (restored when resuming),
    metrics, the task's hooks and first lines."""
    cfg, run_dir = plan.config, Path(plan.config.run.dir)
    task = plan.make_task(env, engine)
    checkpointer = Checkpointer(
        run_dir,
        env,
        cfg.checkpoint,
        run_config=asdict(cfg) | plan.saved_config,
        tokenizer=plan.tokenizer,
        config_hash=config_hash(cfg),
        faults=plan.faults,
        special_tokens=plan.special_tokens,
        expert_parallel=expert_parallel(cfg),
    )
    state = restore(checkpointer, engine, task, resume, plan.position_at)
    writer = MetricsWriter(
        run_dir,
        plan.steps,
        enabled=env.is_main,
        tensorboard=cfg.logging.tensorboard,
        wandb=cfg.logging.wandb,
        run_config=asdict(cfg),
    )
    zero = engine.zero_optimization_stage()
    parts = RunParts(
        env=env,
        engine=engine,
        task=task,
        checkpointer=checkpointer,
        writer=writer,
        state=state,
        resume=resume,
        zero=zero,
    )
    hooks = plan.make_hooks(parts)
    writer.text("config", "```\n" + to_yaml(cfg) + "\n```", state.step)
    for line in plan.first_lines(parts):
        writer.message(line)
    return Trainer(
        env=env,
        run_dir=run_dir,
        engine=engine,
        optimizer=optimizer,
        task=task,
        cadence=plan.cadence,
        lr_at=plan.lr_at,
        grad_accum=plan.batches.grad_accum,
        writer=writer,
        checkpointer=checkpointer,
        hooks=hooks,
        flops_per_token=plan.flops_per_token,
        peak_flops=cfg.engine.peak_flops or current_device_peak_flops(),
        state=state,
        summary={"world_size": env.world_size, "zero_stage": zero} | plan.summary,
        read=step_read(engine),
    )


def restore(
    checkpointer: Checkpointer,
    engine,
    task: Task,
    resume: Resume | None,
    position_at: Callable[[int], dict] | None = None,
) -> TrainState:
    """Every rank: where the run starts. Resuming, the checkpoint's weights, optimizer and RNG
    states go into the engine (`Checkpointer.restore`) and its data position into the task
    (`position_at` its step where it recorded none); else step 0."""
    if resume is None:
        return TrainState()
    state = checkpointer.restore(engine, resume)
    data = resume.data
    if data is None and position_at is not None:
        data = position_at(state.step)
    task.load_state_dict(data)
    return state


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
