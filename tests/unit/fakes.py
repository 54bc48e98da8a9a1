"""A stand-in for DeepSpeed's engine in one plain process (the unit tier has no process group), after
torchtitan's unit tests of its checkpointer: the part of the engine's interface the loop, the
checkpointer and the rollback use, around a real model and the project's own optimizer. The
real engine is exercised by the integration tier; these tests are about everything around it."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model

from pretrain import pretraining, run_builder
from pretrain.config import FinetuneConfig, RunConfig
from pretrain.finetune import finetuning
from pretrain.parallel.distributed import DistEnv
from pretrain.parallel.engine import make_optimizer
from pretrain.run_builder import RunPlan
from pretrain.run_dir import claim
from pretrain.train.loop import Trainer

ONE_PROCESS = DistEnv(rank=0, local_rank=0, world_size=1)


# Named as DeepSpeed's ZeRO optimizer file of rank 0 is, which faults.corrupt_checkpoint_step changes.
OPTIMIZER_FILE = "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"


class FakeEngine:
    """Forward, backward scaled by the accumulation steps, a step that clips and skips a step
    with non-finite gradients (as DeepSpeed's bf16 overflow check does), and save/load of the
    weights and the optimizer in a directory per tag."""

    def __init__(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        grad_accum: int = 1,
        clip: float = 1.0,
    ):
        self.module, self.optimizer = module, optimizer
        self.grad_accum, self.clip = grad_accum, clip
        self.device = next(module.parameters()).device
        self.micro_steps = self.global_steps = self.skipped_steps = 0
        self.grad_norm: torch.Tensor | float | None = None
        self.saved: list[str] = []

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.grad_accum).backward()

    def gradient_accumulation_steps(self) -> int:
        return self.grad_accum

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.grad_accum == 0

    def step(self) -> None:
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return
        params = [p for p in self.module.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.clip if self.clip > 0 else math.inf)
        # As DeepSpeed's: the norm stays a tensor on the device; an overflow is float("inf").
        self.grad_norm = norm
        if math.isfinite(norm):
            self.optimizer.step()
        else:
            self.grad_norm = float("inf")
            self.skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.global_steps += 1

    def get_global_grad_norm(self) -> torch.Tensor | float | None:
        return self.grad_norm

    def train(self) -> None:
        self.module.train()

    def eval(self) -> None:
        self.module.eval()

    def zero_optimization_stage(self) -> int:
        return 0

    def save_checkpoint(
        self, save_dir: str, tag: str, client_state: dict | None = None, save_latest: bool = True
    ) -> None:
        directory = Path(save_dir) / tag
        directory.mkdir(parents=True, exist_ok=True)
        save_model(self.module, str(directory / "model.safetensors"))
        torch.save(self.optimizer.state_dict(), directory / OPTIMIZER_FILE)
        counters = {
            "micro_steps": self.micro_steps,
            "global_steps": self.global_steps,
            "skipped_steps": self.skipped_steps,
        }
        (directory / "engine.json").write_text(json.dumps(counters))
        self.saved.append(tag)

    def load_checkpoint(
        self, load_dir: str, tag: str, load_module_strict: bool = True, load_lr_scheduler_states: bool = True
    ):
        directory = Path(load_dir) / tag
        load_model(self.module, str(directory / "model.safetensors"), strict=load_module_strict)
        self.optimizer.load_state_dict(torch.load(directory / OPTIMIZER_FILE, weights_only=True))
        counters = json.loads((directory / "engine.json").read_text())
        self.micro_steps, self.global_steps = counters["micro_steps"], counters["global_steps"]
        return str(directory), {}


def pretraining_trainer(cfg: RunConfig, device: str = "cpu") -> Trainer | dict:
    """`pretrain.pretraining.pretrain` up to the loop, in this process, with a FakeEngine where
    DeepSpeed's would be: the same checks, task, checkpointer, resume, writer, faults and monitor link.
    The optimizer is torch's AdamW on any device (also on CUDA, in the GPU tier): these tests are
    about the loop, not DeepSpeed's fused Adam."""
    return one_process(pretraining.run_plan(cfg, ONE_PROCESS), device)


def finetuning_trainer(cfg: FinetuneConfig) -> Trainer | dict:
    """`pretrain.finetune.finetune` up to the loop, in this process, with a FakeEngine."""
    return one_process(finetuning.run_plan(cfg, ONE_PROCESS))


def one_process(plan: RunPlan, device: str = "cpu") -> Trainer | dict:
    """`run_builder.run` but the run directory's lock, the process group and the loop: the run
    claimed, then `run_builder.start` with FakeEngines; the trainer (or, for a run already
    complete, its summary)."""
    config = plan.config
    setting = claim(config.run.dir, plan.identity, asdict(config), config.checkpoint.resume)
    return run_builder.start(plan, ONE_PROCESS, setting, functools.partial(fake_engine, device=device))


def fake_engine(
    run, engine, optim, make_model, ds_config: dict, device: str = "cpu", expert_parallel: int = 1
):
    """`pretrain.parallel.engine.build` with a FakeEngine: (engine, optimizer)."""
    torch.manual_seed(run.seed)
    model = make_model().to(device)
    optimizer = make_optimizer(model, optim, {}, on_gpu=False)
    fake = FakeEngine(
        model, optimizer, ds_config["gradient_accumulation_steps"], ds_config["gradient_clipping"]
    )
    return fake, fake.optimizer
