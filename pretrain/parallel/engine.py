"""DeepSpeed setup: batch sizes derived and checked once, the DeepSpeed JSON completed with them,
the optimizer with its parameter groups, activation checkpointing and torch.compile switches.

The model arrives as a plain `Transformer` and leaves wrapped in a DeepSpeed engine; nothing in
`pretrain/model/transformer.py` knows. Everything that can be checked without processes (batch arithmetic,
the DeepSpeed JSON) is checked in `plan_batches` / `deepspeed_config`, which the trainer calls
before any process group starts.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pretrain.config import EngineConfig, OptimConfig, RunSection, TrainConfig, config_dir
from pretrain.errors import ConfigError
from pretrain.model.transformer import Transformer, prefer_attention
from pretrain.optim import muon as optimizers
from pretrain.optim.muon import LR_SCALE
from pretrain.parallel.deepspeed_ops import announced_builds
from pretrain.parallel.distributed import DistEnv, configure_determinism, init_distributed, say_once_per_node
from pretrain.parallel.experts import expert_param_groups, split_experts
from pretrain.parallel.norm_gate import NormGate, gated
from pretrain.parallel.sequence import split_attention


@dataclass(frozen=True)
class BatchPlan:
    micro_batch_size: int  # windows per rank per forward/backward (per sequence-parallel group)
    grad_accum: int  # micro-batches per optimizer step
    world_size: int  # data-parallel ranks: the processes / sequence_parallel
    seq_len: int
    sequence_parallel: int = 1  # S: ranks sharing each window (parallel.sequence)
    expert_parallel: int = 1  # E: ranks splitting each MoE block's experts (parallel.expert)

    @property
    def global_batch_size(self) -> int:  # windows per optimizer step, all ranks
        return self.micro_batch_size * self.grad_accum * self.world_size

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len


def plan_batches(
    train: TrainConfig, seq_len: int, world_size: int, sequence_parallel: int = 1, expert_parallel: int = 1
) -> BatchPlan:
    """The batch sizes of `world_size` processes, S = `sequence_parallel` of them sharing each
    window: world_size / S data-parallel ranks (`pretrain.pretraining.preflight` checks that S
    divides the processes); E = `expert_parallel` of them splitting the experts (all of them
    data-parallel ranks)."""
    if world_size % expert_parallel:
        raise ConfigError(
            f"parallel.expert={expert_parallel} but the job has {world_size} process(es): each group of "
            f"{expert_parallel} ranks splits the experts, so run a multiple of {expert_parallel} processes"
        )
    data_parallel = world_size // sequence_parallel
    plan = BatchPlan(
        train.micro_batch_size, train.grad_accum, data_parallel, seq_len, sequence_parallel, expert_parallel
    )
    wanted = train.global_batch_size
    ranks = (
        f"{world_size} processes"
        if sequence_parallel == 1
        else f"{data_parallel} data-parallel ranks ({world_size} processes / parallel.sequence={sequence_parallel})"
    )
    if wanted is not None and wanted != plan.global_batch_size:
        hint = ""
        if wanted % (train.micro_batch_size * data_parallel) == 0:
            hint = f"; with {ranks} set train.grad_accum={wanted // (train.micro_batch_size * data_parallel)}"
        raise ConfigError(
            f"train.global_batch_size={wanted} but train.micro_batch_size={train.micro_batch_size} × "
            f"train.grad_accum={train.grad_accum} × {ranks} = {plan.global_batch_size}{hint}"
        )
    return plan


def resolve_deepspeed_path(path: str) -> Path:
    candidate = Path(path)
    if candidate.is_file():
        return candidate
    if not candidate.is_absolute():
        packaged = config_dir().parent / candidate
        if packaged.is_file():
            return packaged
    raise ConfigError(f"engine.deepspeed_config={path}: no such file; use one of configs/deepspeed/*.json")


def deepspeed_config(
    engine: EngineConfig, grad_clip: float, plan: BatchPlan, optim: OptimConfig | None = None
) -> dict[str, Any]:
    """The run's DeepSpeed JSON (`engine.deepspeed_config`) with the derived batch sizes and
    clipping (`train.grad_clip`) written in; explicit values that disagree with the run config are
    an error, not silently overridden. With `optim`, the optimizer is checked against it too
    (`check_optimizer`; `build` checks it again, once the process group is up)."""
    path = resolve_deepspeed_path(engine.deepspeed_config)
    try:
        ds = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON (line {exc.lineno}): fix it") from None
    if not isinstance(ds, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    derived = {
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.grad_accum,
        "train_batch_size": plan.global_batch_size,
        "gradient_clipping": grad_clip,
    }
    if plan.sequence_parallel > 1 or "sequence_parallel_size" in ds:  # (DeepSpeed's own key)
        derived["sequence_parallel_size"] = plan.sequence_parallel
    for key, value in derived.items():
        given = ds.get(key, "auto")
        if given != "auto" and given != value:
            raise ConfigError(
                f"{path}: {key}={given} disagrees with the run config, which gives {value} "
                f'at world size {plan.world_size}: set it to "auto" and size batches in the run config'
            )
        ds[key] = value
    for key in ("optimizer", "scheduler"):
        if key in ds:
            raise ConfigError(f"{path}: remove {key!r}: the optimizer and schedule come from the run config")
    if ds.get("fp16", {}).get("enabled"):
        raise ConfigError(f"{path}: fp16 is enabled; this project trains in bf16: remove the fp16 section")
    # A step whose gradients hold NaN/Inf is skipped, never applied: by the norm gate where it
    # applies (`norm_gate.gated`, with engine.one_host_read: the step's one host read), by
    # DeepSpeed's own overflow scan (check_grad_overflow, its host reads) elsewhere.
    ds["bf16"] = {**ds.get("bf16", {}), "enabled": True}
    ds["bf16"]["check_grad_overflow"] = not (engine.one_host_read and gated(ds))
    ds.setdefault("steps_per_print", 10**9)  # the trainer does its own logging
    if plan.sequence_parallel > 1 and zero_stage(ds) == 3:
        ds["zero_optimization"] = zero3_sequence_parallel(path, ds["zero_optimization"])
    if plan.expert_parallel > 1:
        check_expert_parallel_zero(path, ds, plan.expert_parallel)
    if optim is not None:
        check_optimizer(optim, ds)
    return ds


def zero3_sequence_parallel(path: Path, zero: dict[str, Any]) -> dict[str, Any]:
    """ZeRO-3's settings under sequence parallelism. DeepSpeed 0.19.8's ZeRO-3 averages a bucket's
    gradients over its data-parallel ranks (processes / S: the sequence-parallel ranks' gradients
    are parts of one window's, to be summed) only on its contiguous path; its reduce-scatter path
    (`reduce_scatter_coalesced`, the default) divides by every process, which makes each gradient
    S times too small (measured: half the gradient norm of one process at S = 2; stages 1 and 2
    are right). So reduce_scatter is off and contiguous_gradients on; a file that sets them
    otherwise is refused."""
    for key, wanted in (("reduce_scatter", False), ("contiguous_gradients", True)):
        if zero.get(key, wanted) != wanted:
            raise ConfigError(
                f"{path}: zero_optimization.{key}={zero[key]} with parallel.sequence > 1: DeepSpeed's "
                f"ZeRO-3 then averages gradients over every process, not the data-parallel ones; set it to "
                f"{str(wanted).lower()} or remove it"
            )
    return zero | {"reduce_scatter": False, "contiguous_gradients": True}


def check_expert_parallel_zero(path: Path, ds: dict[str, Any], size: int) -> None:
    """What experts split across ranks need of the DeepSpeed JSON (pretrain/parallel/experts.py):
    ZeRO-1 or 2, the path proven against one rank (DeepSpeed's engine refuses its MoE groups under
    ZeRO-3; ZeRO-0 reduces them on another path), with the settings its MoE groups assert on, and
    a load that restores each rank's own experts from its fp32 partition."""
    stage = zero_stage(ds)
    if stage not in (1, 2):
        raise ConfigError(
            f"{path}: ZeRO stage {stage} with parallel.expert={size}: experts split across ranks train "
            "under ZeRO-1 or ZeRO-2 (DeepSpeed refuses its expert groups under ZeRO-3); use zero1.json or "
            "zero2.json, or parallel.expert=1"
        )
    zero = ds.get("zero_optimization", {})
    for key in ("reduce_scatter", "contiguous_gradients", "load_from_fp32_weights"):
        if zero.get(key, True) is False:
            raise ConfigError(
                f"{path}: zero_optimization.{key}=false with parallel.expert={size}: DeepSpeed's expert groups "
                "need it true; set it to true or remove it"
            )


def check_zero3_buckets(ds: dict[str, Any], largest_parameter: int) -> None:
    """Under sequence parallelism, ZeRO-3 reduces a parameter larger than reduce_bucket_size on the
    path that divides by every process (`zero3_sequence_parallel`): refused."""
    size = float(ds.get("zero_optimization", {}).get("reduce_bucket_size", 5e8))
    if zero_stage(ds) == 3 and ds.get("sequence_parallel_size", 1) > 1 and largest_parameter > size:
        raise ConfigError(
            f"zero_optimization.reduce_bucket_size={size:.0f} is below the model's largest parameter "
            f"({largest_parameter:,} elements): with parallel.sequence > 1 DeepSpeed's ZeRO-3 would average "
            f"its gradient over every process; set reduce_bucket_size to at least {largest_parameter}"
        )


def zero_stage(ds: dict[str, Any]) -> int:
    return int(ds.get("zero_optimization", {}).get("stage", 0))


def _offloads_optimizer(ds: dict[str, Any]) -> bool:
    return ds.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none") not in (
        "none",
        None,
    )


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only: not on norms, biases, or embeddings (token or position)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay, seen = [], [], set()
    for param in model.parameters():
        if id(param) in seen or not param.requires_grad:
            continue
        seen.add(id(param))
        (decay if param.ndim >= 2 and id(param) not in embeddings else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def _adamw_class(ds: dict[str, Any], on_gpu: bool | None) -> tuple[type, dict[str, Any]]:
    """DeepSpeed's CPU Adam when ZeRO offloads the optimizer, its fused Adam on GPUs, torch's AdamW
    on CPU; with the keyword that makes each one AdamW."""
    if _offloads_optimizer(ds):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam, {"adamw_mode": True}
    if on_gpu is None:
        on_gpu = torch.cuda.is_available()
    if on_gpu:
        from deepspeed.ops.adam import FusedAdam

        return FusedAdam, {"adam_w_mode": True}
    return torch.optim.AdamW, {}


def make_optimizer(
    model: nn.Module, optim: OptimConfig, ds: dict[str, Any], on_gpu: bool | None = None
) -> torch.optim.Optimizer:
    """`optim.name`'s optimizer. AdamW: `_adamw_class`'s. Muon: DeepSpeed's `MuonWithAuxAdam` on
    `pretrain.optim.muon.muon_groups`, its AdamW half `_adamw_class`'s, each group carrying its
    learning rate over optim.lr for `set_lr`. `on_gpu`: where the parameters will train (default: on a GPU when
    there is one)."""
    groups = expert_param_groups(param_groups(model, optim.weight_decay))
    adamw, adamw_kwargs = _adamw_class(ds, on_gpu)
    if optim.name == "adamw":
        return adamw(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps, **adamw_kwargs)
    groups = optimizers.muon_groups(model, optim, groups)
    optimizers.compile_muon_kernels(torch.cuda.is_available() if on_gpu is None else on_gpu)
    return optimizers.deepspeed_muon_optimizer()(
        groups, adam_optimizer=adamw, adam_optimizer_kwargs=adamw_kwargs, adam_w_mode=True
    )


def check_optimizer(optim: OptimConfig, ds: dict[str, Any]) -> None:
    """The optimizer against the completed DeepSpeed JSON: Muon only where it is proven
    (`pretrain.optim.muon.check`)."""
    optimizers.check(optim, ds, offloads=_offloads_optimizer(ds))


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each block's activations in the backward pass. The block's own forward is
    wrapped in place, so parameter names (and checkpoints) are unchanged."""
    from torch.utils.checkpoint import checkpoint

    for block in model.layers:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def compile_blocks(model: nn.Module, fullgraph: bool = False) -> None:
    """torch.compile each block in place (same parameter names; one graph reused by all blocks);
    `fullgraph`: as one graph, or an error (tests/unit/test_compiled_path.py holds ours to 0
    graph breaks)."""
    for block in model.layers:
        block.compile(fullgraph=fullgraph)


def compile_model(model: nn.Module, engine: EngineConfig, ds: dict[str, Any]) -> None:
    """`engine.compile`: each block, and with `engine.compile_head` the final norm, the LM head and
    the loss (`Transformer.head_loss`), each one graph. Where DeepSpeed itself runs inside a block
    — ZeRO-3's parameter gathers, sequence parallelism's all-to-all: graph breaks — and for a
    mixture of experts (its routing and dispatch, not held to one graph), the blocks are compiled
    around them as before and the head stays eager; so are other models' blocks (the benchmark's
    Transformers model)."""
    whole = (
        isinstance(model, Transformer)
        and model.cfg.moe is None
        and zero_stage(ds) < 3
        and ds.get("sequence_parallel_size", 1) == 1
    )
    compile_blocks(model, fullgraph=whole)
    if whole and engine.compile_head:
        model.head_loss = torch.compile(model.head_loss, fullgraph=True)


def set_determinism_and_connect(run: RunSection, env: DistEnv) -> None:
    """Every rank, once the input is checked: determinism settings (`run.deterministic`), then the
    process group."""
    configure_determinism(run.deterministic)
    init_distributed(env)


def build(
    run: RunSection,
    engine: EngineConfig,
    optim: OptimConfig,
    make_model: Callable[[], nn.Module],
    ds: dict[str, Any],
    expert_parallel: int = 1,
):
    """Every rank: the model (built after seeding with `run.seed`, so every rank builds the same
    one) in its engine; returns (engine, optimizer). The optimizer is checked against the DeepSpeed
    JSON first (`check_optimizer`: bad input, before the model is built). `expert_parallel`:
    `parallel.expert`."""
    check_optimizer(optim, ds)
    torch.manual_seed(run.seed)
    return initialize(make_model(), engine, optim, ds, expert_parallel)


def initialize(
    model: nn.Module, engine: EngineConfig, optim: OptimConfig, ds: dict[str, Any], expert_parallel: int = 1
):
    """Wrap the model in a DeepSpeed engine, as `engine` says; returns (engine, optimizer)."""
    import deepspeed

    if engine.activation_checkpointing:
        apply_activation_checkpointing(model)
    # parallel.sequence: attention across each window's ranks; DeepSpeed's groups as its mpu
    sequence_parallel = ds.get("sequence_parallel_size", 1)
    mpu = split_attention(model, sequence_parallel) if sequence_parallel > 1 else None
    if isinstance(model, Transformer):  # (not the benchmark's Transformers model: no experts)
        split_experts(model, expert_parallel)  # (the experts' dispatch; with E > 1, each rank's share)
    if engine.compile:
        compile_model(model, engine, ds)
    prefer_attention(engine.attention)
    with announced_builds(say_once_per_node(DistEnv.from_environ())):  # fused / CPU Adam: a JIT build
        optimizers.import_deepspeed_muon_compiling_lazily()
        optimizer = make_optimizer(model, optim, ds)
        wrapped, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds, mpu=mpu)
    if ds.get("bf16", {}).get("check_grad_overflow") is False:  # (deepspeed_config: gated)
        NormGate.arm(wrapped)  # the scan is off: the gate decides, or nothing would
    # DeepSpeed's MoE checkpoint files name experts after its own layer's modules and leave ours out
    # of the model file: ours are saved as a dense model's are (pretrain/checkpoint/universal.py)
    wrapped.has_moe_layers = False
    if optim.name == "muon" and ds.get("gradient_clipping"):
        optimizers.clip_adamw_half_only(optimizer)  # (Muon's matrices are never clipped)
    return wrapped, optimizer


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The step's learning rate: `lr` (optim.lr's schedule, times the hooks' factors) times each
    parameter group's own scale (`LR_SCALE`: Muon's muon_lr / lr and its shape factor; 1 for
    AdamW and for groups without one)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get(LR_SCALE, 1.0)
