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
from pretrain.finetune.probe import Probe, probe_head
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
    pooling: str  # classification: finetune.pooling
    lm_loss_weight: float = 0.0  # classification: finetune.lm_loss_weight
    probe: Probe | None = None  # the linear probe's head, once `first_model` has fitted it

    def model(self) -> torch.nn.Module:
        """The model with the checkpoint's weights (and, for classification, a random head)."""
        model = self.initial.load_model()
        labels = self.examples.labels
        if labels is None:
            return model
        return SequenceClassifier(
            model,
            len(labels),
            pooling=self.pooling,
            lm_loss_weight=self.lm_loss_weight,
            blend=self.examples.blend is not None,
        )


def first_model(cfg: FinetuneConfig, inputs: FinetuneInputs, plan: BatchPlan) -> torch.nn.Module:
    """The model a run starts with: classification's head fitted on the frozen model's features
    first, with finetune.linear_probe (`pretrain/finetune/probe.py`), on the device it trains on."""
    model = inputs.model()
    if inputs.examples.labels is None or not cfg.finetune.linear_probe:
        return model
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    model.to(device)
    pad = padding_id(inputs.initial.tokenizer)
    env = DistEnv.from_environ()
    inputs.probe = probe_head(model, inputs.examples.train, pad, plan.micro_batch_size, env, device)
    return model


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
        initial=initial,
        examples=examples,
        max_length=max_length,
        steps=steps,
        lr=lr,
        lr_source=lr_source,
        pooling=cfg.finetune.pooling,
        lm_loss_weight=cfg.finetune.lm_loss_weight,
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
            **({"finetune.pooling": inputs.pooling} if inputs.examples.labels else {}),
            **({"finetune.bag_of_words": True} if inputs.examples.prior_model else {}),
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
            # the bag of words the answers blend in: `pretrain predict` scores new text with it
            **({"bag_of_words": examples.prior_model.state()} if examples.prior_model else {}),
        },
        make_model=functools.partial(first_model, trained, inputs, plan),
        make_resumed_model=inputs.model,  # (the checkpoint's weights replace it: no probe)
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
    return Classification(
        **common,
        num_labels=len(examples.labels),
        bag_of_words=examples.bag_of_words,
        blend=examples.blend,
        group_by_length=cfg.finetune.group_by_length,
    )


def summary(cfg: FinetuneConfig, inputs: FinetuneInputs) -> dict:
    """The run summary's fine-tuning keys: the task, its steps and its examples."""
    train_data, val_data = inputs.examples.train, inputs.examples.validation
    return {
        "task": cfg.finetune.task,
        "steps": inputs.steps,
        "train_examples": len(train_data.ids),
        "train_truncated": inputs.examples.train_truncated(),
        "validation_examples": len(val_data.ids) if val_data else 0,
        "validation_truncated": val_data.truncated if val_data else 0,
        "blend_examples": len(inputs.examples.blend.ids) if inputs.examples.blend else 0,
    }


def first_lines(cfg: FinetuneConfig, inputs: FinetuneInputs, plan: BatchPlan, parts: RunParts) -> list[str]:
    """What the run says before its first step: what trains on what, how many steps and why, the
    learning rate and where it comes from, and (classification) the baselines it must beat."""
    train_data, val_data, labels = inputs.examples.train, inputs.examples.validation, inputs.examples.labels
    blend = inputs.examples.blend
    held = f"; {len(blend.ids):,} held out to fit the blend" if blend else ""
    lines = [
        f"fine-tuning ({cfg.finetune.task}) from {inputs.initial.source} on {parts.env.world_size} process(es), "
        f"ZeRO-{parts.zero} bf16: {len(train_data.ids) + (len(blend.ids) if blend else 0):,} examples "
        f"({inputs.examples.train_truncated():,} truncated to {inputs.max_length} tokens{held})"
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
    if labels:
        lines.append(head_line(inputs, resumed=parts.resume is not None))
    if inputs.examples.blend is not None:
        lines.append(
            "answers blend the network's logits with the bag of words' log-probabilities, weighted as fits "
            f"best the {len(inputs.examples.blend.ids):,} training examples held out from training "
            "(finetune.bag_of_words)"
        )
    return lines


def head_line(inputs: FinetuneInputs, resumed: bool) -> str:
    """What the classification head reads and how it starts: fitted on the frozen features (the
    linear probe), random, or the checkpoint's."""
    pooled = (
        "the mean of the final hidden states"
        if inputs.pooling == "mean"
        else "the last token's final hidden state"
    )
    probe, weight = inputs.probe, inputs.lm_loss_weight
    loss = (
        f"; loss: cross-entropy + {weight:g} x the next-token loss on the example (finetune.lm_loss_weight)"
        if weight
        else ""
    )
    if probe is None:
        start = "the checkpoint's" if resumed else "random (finetune.linear_probe=false)"
        return f"the head reads {pooled}; it starts {start}{loss}"
    return (
        f"the head reads {pooled}; linear probe: fitted on the frozen model's features of the "
        f"{len(inputs.examples.train.ids):,} training examples in {probe.seconds:.1f} s (L2 {probe.l2:g}, "
        f"{probe.held_out_accuracy:.4f} on a held-out fifth), then everything trains{loss}"
    )
