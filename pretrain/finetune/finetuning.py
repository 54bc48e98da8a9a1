"""`finetune(cfg)`: check the starting point and the data, then the run's lifecycle
(`pretrain/run_builder.py`: the run directory, the process group, the checkpoint to resume from,
the engine) with what is fine-tuning's own: the model (with a classification head when the task
needs one) and the loop (`pretrain/train/loop.py`) with a fine-tuning task."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pretrain.checkpoint import resolve_resume
from pretrain.config import FinetuneConfig
from pretrain.errors import UserError
from pretrain.finetune.data import Examples, load_examples, padding_id
from pretrain.finetune.tasks import SFT, Classification, majority_share
from pretrain.initial_model import InitialModel, find_initial
from pretrain.model.classifier import SequenceClassifier
from pretrain.optim.schedules import schedule_for
from pretrain.parallel.distributed import DistEnv
from pretrain.parallel.engine import BatchPlan, deepspeed_config, plan_batches
from pretrain.reporting.wandb_sink import check_available
from pretrain.run_builder import RunParts, RunPlan, run
from pretrain.run_dir import model_identity
from pretrain.tokenizer import sha256_file
from pretrain.train.hooks import DataTrace
from pretrain.train.loop import Cadence
from pretrain.train.moe_hook import expert_balance


@dataclass(kw_only=True)
class FinetuneInputs:
    """What a fine-tuning run starts from, checked before any process group starts."""

    initial: InitialModel
    examples: Examples
    max_length: int
    steps: int
    lr: float  # optim.lr, or the checkpoint's default (InitialModel.learning_rate)
    lr_source: str  # where `lr` comes from, for the first line

    def model(self) -> torch.nn.Module:
        model = self.initial.load_model()
        labels = self.examples.labels
        return model if labels is None else SequenceClassifier(model, len(labels))


def check_inputs(cfg: FinetuneConfig, plan: BatchPlan) -> FinetuneInputs:
    check_available(cfg.logging.wandb)  # every rank, before any process group
    initial = find_initial(cfg.finetune.init)
    max_length = cfg.finetune.max_length or initial.model_cfg.max_seq_len
    if max_length > initial.model_cfg.max_seq_len:
        raise UserError(
            f"finetune.max_length={max_length} exceeds the model's max_seq_len={initial.model_cfg.max_seq_len}"
        )
    examples = load_examples(cfg, initial.tokenizer, max_length)
    steps = cfg.train.steps or max(
        1, math.ceil(cfg.finetune.epochs * len(examples.train.ids) / plan.global_batch_size)
    )
    lr, lr_source = (cfg.optim.lr, "optim.lr") if cfg.optim.lr is not None else initial.learning_rate()
    return FinetuneInputs(
        initial=initial, examples=examples, max_length=max_length, steps=steps, lr=lr, lr_source=lr_source
    )


def as_it_trains(cfg: FinetuneConfig, inputs: FinetuneInputs) -> FinetuneConfig:
    """The config with what the checks settled: the learning rate (optim.lr or the checkpoint's
    default), as the engine, the schedule and the checkpoints' record take it."""
    return dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=inputs.lr))


def identity(cfg: FinetuneConfig, inputs: FinetuneInputs) -> dict:
    """What defines a fine-tuning run (RUN_DIR/run.json): the architecture, the tokenizer, the
    task, its labels and example length, and the training data."""
    data = {}
    for split in ("train", "validation"):
        name = getattr(cfg.data, split)
        data[f"data.{split}"] = sha256_file(name) if name and Path(name).is_file() else name
    return (
        model_identity(inputs.initial.model_cfg)
        | data
        | {
            "tokenizer.sha256": inputs.initial.tokenizer.sha256,
            "finetune.task": cfg.finetune.task,
            "finetune.labels": inputs.examples.labels,
            "finetune.max_length": inputs.max_length,
        }
    )


def finetune(cfg: FinetuneConfig) -> dict:
    """Fine-tune as `cfg` says, on every rank the launcher started; returns the run's summary."""
    return run(cfg.run.dir, functools.partial(run_plan, cfg))


def run_plan(cfg: FinetuneConfig, env: DistEnv) -> RunPlan:
    """Fine-tuning's part of the lifecycle: its checks (all bad input is found here), identity,
    model, schedule, its task (classification or sft), its first lines and its summary."""
    plan = plan_batches(cfg.train, 0, env.world_size)
    ds_config = deepspeed_config(cfg.engine, cfg.train.grad_clip, plan, cfg.optim)
    inputs = check_inputs(cfg, plan)  # everything that can be wrong with the input is found here
    resolve_resume(cfg.run.dir, cfg.checkpoint.resume)
    trained, initial, examples = as_it_trains(cfg, inputs), inputs.initial, inputs.examples
    return RunPlan(
        config=trained,
        steps=inputs.steps,
        identity=identity(trained, inputs),
        ds_config=ds_config,
        batches=plan,
        cadence=Cadence.of(trained, inputs.steps),
        lr_at=schedule_for(trained.optim.lr, inputs.steps, trained.schedule, initial.model_cfg.d_model),
        tokenizer=initial.tokenizer.path,
        saved_config={
            "model": asdict(initial.model_cfg),
            "labels": examples.labels,
            "init_source": initial.source,
        },
        make_model=inputs.model,
        make_task=functools.partial(make_task, trained, inputs, plan),
        make_hooks=lambda parts: (  # (no faults, no monitor; with experts, their balance)
            ([DataTrace(Path(cfg.run.dir), parts.env.rank)] if cfg.logging.data_trace else [])
            + expert_balance(parts, Cadence.of(trained, inputs.steps))
        ),
        first_lines=functools.partial(first_lines, trained, inputs, plan),
        summary=summary(trained, inputs),
        # (a checkpoint written before the data position was recorded: the examples of its steps)
        position_at=lambda step: {"examples": step * plan.global_batch_size},
    )


def make_task(cfg: FinetuneConfig, inputs: FinetuneInputs, plan: BatchPlan, env: DistEnv, engine):
    """The fine-tuning task: sft, or classification when the examples have labels."""
    examples = inputs.examples
    common = dict(
        train=examples.train,
        validation=examples.validation,
        micro_batch_size=plan.micro_batch_size,
        pad_id=padding_id(inputs.initial.tokenizer),
        seed=cfg.run.seed,
        env=env,
        device=engine.device,
        run_dir=Path(cfg.run.dir),
    )
    if examples.labels is None:
        return SFT(**common)
    return Classification(**common, num_labels=len(examples.labels), bag_of_words=examples.bag_of_words)


def summary(cfg: FinetuneConfig, inputs: FinetuneInputs) -> dict:
    """The run summary's fine-tuning keys: the task, its steps and its examples."""
    train_data, val_data = inputs.examples.train, inputs.examples.validation
    return {
        "task": cfg.finetune.task,
        "steps": inputs.steps,
        "train_examples": len(train_data.ids),
        "train_truncated": train_data.truncated,
        "validation_examples": len(val_data.ids) if val_data else 0,
        "validation_truncated": val_data.truncated if val_data else 0,
    }


def first_lines(cfg: FinetuneConfig, inputs: FinetuneInputs, plan: BatchPlan, parts: RunParts) -> list[str]:
    """What the run says before its first step: what trains on what, how many steps and why, the
    learning rate and where it comes from, and (classification) the baselines it must beat."""
    train_data, val_data, labels = inputs.examples.train, inputs.examples.validation, inputs.examples.labels
    lines = [
        f"fine-tuning ({cfg.finetune.task}) from {inputs.initial.source} on {parts.env.world_size} process(es), "
        f"ZeRO-{parts.zero} bf16: {len(train_data.ids):,} examples "
        f"({train_data.truncated:,} truncated to {inputs.max_length} tokens)"
        + (f", {len(labels)} labels" if labels else "")
        + f", global batch {plan.global_batch_size}, steps {parts.state.step + 1}..{inputs.steps}"
        + (f" (resumed from {parts.resume.tag})" if parts.resume else ""),
        f"{inputs.steps:,} steps "
        + (
            "(train.steps)"
            if cfg.train.steps
            else f"({cfg.finetune.epochs:g} epochs of {len(train_data.ids):,} examples, {plan.global_batch_size} per step)"
        )
        + f"; learning rate {cfg.optim.lr:.1e} ({inputs.lr_source})",
    ]
    if val_data is not None and labels:
        lines.append(
            f"to beat on the {len(val_data.ids):,} validation examples: the majority label "
            f"{majority_share(val_data.labels, len(labels)):.4f}, a bag of words "
            f"{inputs.examples.bag_of_words:.4f} (accuracy)"
        )
    return lines
