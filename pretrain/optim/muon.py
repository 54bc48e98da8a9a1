"""Muon for the blocks' matrices and AdamW for the rest, through DeepSpeed's own Muon.

`optim.name: muon` trains the 2-D weights inside the blocks (attention and MLP projections) with
Muon and everything else (token and position embeddings, the output head, tied or not, norms, any
1-D parameter, a classifier's head) with AdamW, in one DeepSpeed `MuonWithAuxAdam`
(`deepspeed/runtime/zero/muon/`) inside its bf16 ZeRO-1/2 optimizer. This module holds the split,
the parameter groups that optimizer is built on, the checks made before a run starts, and the rule
written down from the algorithm (`muon_direction`), which the check holds DeepSpeed's kernel to
and the tests' reference optimizer (tests/muon_reference.py) is built on.

DeepSpeed 0.19.8's rule, read from its source
---------------------------------------------
Under ZeRO-1/2 (`stage_1_and_2.py`, `get_flat_partition`), once per optimizer step, at the
gradient-accumulation boundary, on each whole matrix W (rows × cols) of the rank's partition — a
matrix split between two ranks' partitions is all-reduced whole to both (#7807) — with g the
gradient averaged over micro-batches and ranks:

    m ← β·m + (1 − β)·g                              momentum (`muon_momentum`, β = 0.95)
    u = (1 − β)·g + β·m                              Nesterov: always on; DeepSpeed has no switch
    O = NS₅(u / (‖u‖_F + 1e-7))                      5 quintic Newton–Schulz steps (3.4445, −4.7750,
                                                     2.0315) on the wide orientation; no step count
                                                     to set. `gram` (default): the Gram form, in fp16
                                                     where the accelerator has it; `standard`: bf16
    O ← O · √max(1, rows/cols)                       the shape rule (Jordan 2024, "original")
    W ← W·(1 − lr·wd) − lr·O                         decoupled weight decay, in `MuonWithAuxAdam.step`

The orthogonalized O replaces the gradient in the ZeRO partition, so DeepSpeed's global gradient
norm covers O together with the AdamW half's gradients, and `gradient_clipping` would clip every
group by it. O's norm is set by the shapes (√min(rows, cols)·√max(1, rows/cols) per matrix), not
by the gradient: a clip on a norm that holds it scales every Muon step by a constant (a change of
learning rate) and the AdamW half by a factor that says nothing about its own gradients. So
`train.grad_clip` clips the AdamW half only, by its own norm (`clip_adamw_half_only`): Muon's
matrices need none, their update being normalized per matrix already (a spike in their gradient
cannot make a larger step). `train/grad_norm` stays DeepSpeed's, over every group. The momentum of a step DeepSpeed discards (a non-finite norm, the skip guard's step) is
never committed. The momentum buffer is one flat tensor per parameter group on each rank, the
full size of every matrix the partition touches (a matrix split between ranks is whole on both),
in the gradients' dtype: fp32 under ZeRO-1, bf16 under bf16 ZeRO-2 (DeepSpeed's choice).

`muon_scale: match_rms_adamw` (Liu et al. 2025, "Muon is Scalable": 0.2·√max(rows, cols), the RMS
of an AdamW update) is the same update with the group's learning rate multiplied by
0.2·√max(rows, cols) / √max(1, rows/cols) and its weight decay divided by it, so W decays by
lr·wd as torch.optim.Muon's `adjust_lr_fn="match_rms_adamw"` does. Each shape is its own group.
"""

from __future__ import annotations

import functools
import inspect
import math
import sys
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from pretrain.config import OptimConfig
from pretrain.errors import ConfigError

MUON_MODULE = "deepspeed.runtime.zero.muon.original_muon"
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5  # DeepSpeed 0.19.8 calls muon_update with its default everywhere
NS_EPS = 1e-7
GRAM_RESTART = 2  # the Gram form starts again from X at this iteration (half-precision drift)
LR_SCALE = "lr_scale"  # each parameter group's learning rate over optim.lr (engine.set_lr)
PROVEN_STAGES = (1, 2)
# Why not ZeRO-3 (docs/training.md, Optimizers): its Muon matches the reference (with reduce_scatter
# off, which it requires), but stage3.py's step() updates the momentum before the gradient-norm
# check, where the skip guard (monitor.skip_step) decides: a skipped step still moves it
ZERO3_MOMENTUM = (
    "under ZeRO-3, DeepSpeed 0.19.8 updates Muon's momentum before the gradient-norm check, so a step "
    "monitor.skip_step skips still changes it"
)


# ------------------------------------------------------------------------------------ the split


def muon_parameters(model: nn.Module) -> set[int]:
    """ids of the parameters Muon trains: the 2-D weights inside the blocks (`pretrain.model.transformer.Block`)."""
    from pretrain.model.transformer import Block

    return {
        id(p)
        for module in model.modules()
        if isinstance(module, Block)
        for p in module.parameters()
        if p.ndim == 2 and p.requires_grad
    }


def shape_factor(rule: str, shape: tuple[int, ...]) -> float:
    """What the learning rate of a Muon matrix of this shape is multiplied by, on top of
    DeepSpeed's own √max(1, rows/cols) (1 for `original`)."""
    rows, cols = shape[0], math.prod(shape[1:])
    if rule == "original":
        return 1.0
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols)) / math.sqrt(max(1.0, rows / cols))
    raise ValueError(f"unknown Muon scale rule {rule!r}")


def muon_groups(model: nn.Module, optim: OptimConfig, adamw_groups: list[dict]) -> list[dict]:
    """`MuonWithAuxAdam`'s parameter groups: the Muon matrices (one group per shape factor), then
    `adamw_groups` (weight decay as `engine.param_groups` decides) less those matrices. Every
    parameter is tagged `use_muon`, which DeepSpeed's ZeRO optimizer reads. Each group carries its
    learning rate over `optim.lr` (`LR_SCALE`: Muon's muon_lr / lr times its shape factor, AdamW's 1),
    which `engine.set_lr` multiplies the schedule by."""
    chosen = muon_parameters(model)
    if not chosen:
        raise ConfigError("optim.name=muon: the model has no block matrices for Muon; use optim.name=adamw")
    by_factor: dict[float, list[nn.Parameter]] = {}
    for param in model.parameters():
        param.use_muon = id(param) in chosen
        if param.use_muon:
            by_factor.setdefault(shape_factor(optim.muon_scale, tuple(param.shape)), []).append(param)
    groups = [
        {
            "params": params,
            "use_muon": True,
            "lr": optim.muon_lr * factor,
            LR_SCALE: optim.muon_lr * factor / optim.lr,
            "momentum": optim.muon_momentum,
            "weight_decay": optim.weight_decay / factor,
            "ns_method": optim.muon_ns_method,
        }
        for factor, params in sorted(by_factor.items())
    ]
    for group in adamw_groups:
        rest = [p for p in group["params"] if id(p) not in chosen]
        if rest:
            groups.append(
                group
                | {"params": rest, "use_muon": False, "lr": optim.lr, LR_SCALE: 1.0}
                | {"betas": (optim.beta1, optim.beta2)}
                | {"eps": optim.eps}
            )
    return groups


# --------------------------------------------------------------------------- DeepSpeed's module


_compile_kernels = True  # False: DeepSpeed's Muon kernels run eagerly (set per device by the engine)


def compile_muon_kernels(on: bool) -> None:
    """Whether DeepSpeed's Muon kernels go through `torch.compile` at their first call (on a GPU,
    as DeepSpeed does) or run eagerly (on a CPU: inductor took 40 s per rank at the first step
    here, 10 s with its cache warm, for a model of 2 layers)."""
    global _compile_kernels
    _compile_kernels = on


KERNELS = ("zeropower_via_newtonschulz5", "zeropower_via_gram_newtonschulz", "muon_update")
# every module-level name DeepSpeed calls its kernels by (muon_optimizer imports muon_update)
KERNEL_NAMES = ((MUON_MODULE, KERNELS), ("deepspeed.runtime.zero.muon.muon_optimizer", ("muon_update",)))


@contextmanager
def eager_muon_kernels():
    """DeepSpeed's Muon kernels run eagerly inside this block (the check's probe, unit tests),
    however they were decorated: `torch.compile`'s wrapper and ours both keep the kernel as
    `__wrapped__`."""
    global _compile_kernels
    compiled = [
        (module, name, getattr(module, name))
        for module_name, names in KERNEL_NAMES
        if (module := sys.modules.get(module_name)) is not None
        for name in names
        if hasattr(getattr(module, name, None), "__wrapped__")
    ]
    before, _compile_kernels = _compile_kernels, False
    for module, name, kernel in compiled:
        setattr(module, name, kernel.__wrapped__)
    try:
        yield
    finally:
        _compile_kernels = before
        for module, name, kernel in compiled:
            setattr(module, name, kernel)


def import_deepspeed_muon_compiling_lazily() -> None:
    """Import DeepSpeed's Muon kernels with their `torch.compile` put off to their first call.

    DeepSpeed imports its Muon optimizer at `deepspeed.initialize` (to list it among ZeRO's
    optimizers) and in ZeRO-1/2's gradient reduction, whichever optimizer trains; that module
    decorates three kernels with `torch.compile` (`deepspeed.runtime.compiler.compile()`) as it is
    imported, and building those wrappers imports inductor's compiler: about 0.8 s of CPU in every
    rank's start-up, for an optimizer an AdamW run never builds. Here the decorator builds the
    same `torch.compile` wrapper when a kernel is first called instead (or none: see
    `compile_muon_kernels`). The decorator is DeepSpeed's again once the module is imported."""
    if MUON_MODULE in sys.modules:
        return
    try:
        from deepspeed.runtime import compiler
    except ImportError:  # another DeepSpeed layout: its own import, at its own cost
        return
    eager = getattr(compiler, "compile", None)
    if eager is None:
        return
    compiler.compile = lambda: _compiled_at_first_call
    try:
        __import__(MUON_MODULE)
    except ImportError:  # a DeepSpeed without Muon: nothing to put off
        pass
    finally:
        compiler.compile = eager


def _compiled_at_first_call(fn: Callable) -> Callable:
    compiled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal compiled
        if not _compile_kernels or (compiled is None and torch.compiler.is_compiling()):
            return fn(*args, **kwargs)  # eager, or traced inside an outer graph as a compiled kernel would be
        if compiled is None:
            compiled = torch.compile(fn)
        return compiled(*args, **kwargs)

    return call


def deepspeed_muon_optimizer():
    """DeepSpeed's `MuonWithAuxAdam` class (its kernels imported lazily first)."""
    import_deepspeed_muon_compiling_lazily()
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    return MuonWithAuxAdam


# --------------------------------------------------------------------- the rule, from the algorithm


def newton_schulz(g: torch.Tensor, method: str = "gram", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """NS₅(g / (‖g‖_F + 1e-7)) in `dtype`, on the wide orientation (rows ≤ cols), returned in it.

    `standard`: X ← aX + (bA + cA²)X with A = XXᵀ, five times. `gram` (Dao 2026): the same
    polynomial carried on the small Gram matrix R = XXᵀ, X ← QX only at the restart and the end:
    the same result in exact arithmetic, fewer products for a wide matrix. The normalization is
    in g's own dtype (fp32 for an fp16 g), then the iteration in `dtype`."""
    a, b, c = NS_COEFFICIENTS
    tall = g.size(-2) > g.size(-1)
    if method == "standard":
        x = g.to(dtype)
        x = x.mT if tall else x
        x = x / (x.norm(dim=(-2, -1), keepdim=True) + NS_EPS)
    else:
        x = g.to(torch.float32 if g.dtype == torch.float16 else g.dtype)
        x = x.mT if tall else x
        x = (x / (x.norm(dim=(-2, -1), keepdim=True) + NS_EPS)).to(dtype)
    if method == "standard" or x.size(-1) <= x.size(-2):  # square: no saving, the standard form
        for _ in range(NS_STEPS):
            gram = x @ x.mT
            x = a * x + (b * gram + c * gram @ gram) @ x
    else:
        r, q = x @ x.mT, None
        for i in range(NS_STEPS):
            if i == GRAM_RESTART:
                x, q = q @ x, None
                r = x @ x.mT
            z = b * r + c * r @ r
            if q is None:
                q = z.clone()
                q.diagonal(dim1=-2, dim2=-1).add_(a)
            else:
                q = a * q + z @ q
            if i < NS_STEPS - 1 and i + 1 != GRAM_RESTART:
                rz = a * r + z @ r
                r = a * rz + z @ rz
        return x.mT @ q.mT if tall else q @ x
    return x.mT if tall else x


def ns_dtype(method: str) -> torch.dtype:
    """Where DeepSpeed runs the iteration (`ns_compute_dtype`): `gram` in fp16 and `standard` in
    bf16 where the accelerator has them, fp32 where it does not (DeepSpeed's CPU accelerator has
    no fp16 on a CPU without AVX512-FP16 or AMX-FP16, an AMD EPYC among them). Without DeepSpeed's
    Muon module, the accelerator's choice on a GPU."""
    try:
        from deepspeed.runtime.zero.muon.original_muon import ns_compute_dtype
    except ImportError:
        return torch.float16 if method == "gram" else torch.bfloat16
    return ns_compute_dtype(method)


def muon_direction(
    grad: torch.Tensor,
    momentum: torch.Tensor,
    beta: float,
    method: str = "gram",
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The step's update for one matrix (momentum updated in place): Nesterov momentum,
    orthogonalized, times √max(1, rows/cols); in grad's dtype."""
    momentum.lerp_(grad, 1 - beta)
    update = grad.lerp(momentum, beta)
    orthogonal = newton_schulz(update, method, ns_dtype(method) if dtype is None else dtype)
    rows, cols = grad.shape
    orthogonal *= math.sqrt(rows / cols) if rows > cols else 1.0  # in the iteration's dtype, as DeepSpeed
    return orthogonal.to(grad.dtype)


# ------------------------------------------------------------------------ clipping the AdamW half

# What `clip_adamw_half_only` wraps on DeepSpeed 0.19.8's ZeRO-1/2 optimizer: `scaled_global_norm`
# computes each group's norm with `get_grad_norm_direct`, in group order, and `step` then calls
# `unscale_and_clip_grads` on each group's flat fp32 gradient (`single_partition_of_fp32_groups`).
CLIPPING_METHODS = ("scaled_global_norm", "get_grad_norm_direct", "unscale_and_clip_grads")


def clip_adamw_half_only(zero) -> None:
    """`train.grad_clip` on DeepSpeed's ZeRO optimizer `zero` (Muon's, `clip` > 0): the AdamW
    groups are clipped by their own norm, the Muon groups not at all (module docstring). DeepSpeed
    still computes and reports its norm over every group."""
    from deepspeed.runtime.utils import combine_grad_norm_groups

    muon = {i for i, group in enumerate(zero.optimizer.param_groups) if group.get("use_muon")}
    norms: list[torch.Tensor] = []  # this step's norm of each group, in group order
    adamw: list[torch.Tensor] = []
    global_norm, group_norm, clip = (getattr(zero, name) for name in CLIPPING_METHODS)

    def recorded_group_norm(gradients, params, norm_type=2):
        norms.append(group_norm(gradients, params, norm_type))
        return norms[-1]

    def scaled_global_norm(norm_type=2):
        norms.clear()
        total = global_norm(norm_type)
        adamw[:] = [combine_grad_norm_groups([n for i, n in enumerate(norms) if i not in muon], norm_type)]
        return total

    def unscale_and_clip_grads(grad_groups_flat, total_norm):
        flat = grad_groups_flat[0]
        group = next(i for i, p in enumerate(zero.single_partition_of_fp32_groups) if p.grad is flat)
        if group not in muon:
            return clip(grad_groups_flat, adamw[0])
        bound, zero.clip_grad = zero.clip_grad, 0.0  # (the loss scale still applies; 1 in bf16)
        try:
            return clip(grad_groups_flat, total_norm)
        finally:
            zero.clip_grad = bound

    zero.get_grad_norm_direct = recorded_group_norm
    zero.scaled_global_norm = scaled_global_norm
    zero.unscale_and_clip_grads = unscale_and_clip_grads


# ----------------------------------------------------------------------- the checks before a run


@functools.cache
def deepspeed_muon_differences() -> tuple[str, ...]:
    """What differs between the installed DeepSpeed's Muon and the rule above, which the
    integration tests proved on DeepSpeed 0.19.8: [] when nothing does. Reads signatures and
    runs DeepSpeed's `muon_update` (eagerly) on a fixed 12×5 and 5×12 gradient against
    `muon_direction`."""
    try:
        muon_class = deepspeed_muon_optimizer()
        from deepspeed.runtime.zero import stage_1_and_2
        from deepspeed.runtime.zero.muon import original_muon
    except ImportError as exc:
        return (f"no Muon in this DeepSpeed ({exc})",)
    found = []
    wanted = {"adam_optimizer", "adam_optimizer_kwargs", "adam_w_mode"}
    missing = wanted - set(inspect.signature(muon_class.__init__).parameters)
    if missing:
        found.append(f"MuonWithAuxAdam takes no {', '.join(sorted(missing))}")
    if not all(hasattr(original_muon, name) for name in KERNELS):
        return (*found, f"original_muon lacks one of {', '.join(KERNELS)}")
    update = original_muon.muon_update
    params = inspect.signature(getattr(update, "__wrapped__", update)).parameters
    for name, default in (("ns_steps", NS_STEPS), ("nesterov", True), ("ns_method", "gram")):
        if name not in params or params[name].default != default:
            found.append(f"muon_update's {name} default is no longer {default!r}")
    zero = getattr(stage_1_and_2, "DeepSpeedZeroOptimizer", None)
    for method in (
        "get_flat_partition",
        "_muon_staging_momentum",
        "_commit_muon_momentum",
        *CLIPPING_METHODS,
    ):
        if not hasattr(zero, method):
            found.append(f"ZeRO-1/2 has no {method}")
    generator = torch.Generator().manual_seed(0)
    for shape in ((12, 5), (5, 12)):
        for method in ("gram", "standard"):
            grad = torch.randn(shape, generator=generator)
            with eager_muon_kernels():
                theirs = original_muon.muon_update(grad.clone(), torch.zeros(shape), 0.9, ns_method=method)
            ours = muon_direction(grad.clone(), torch.zeros(shape), 0.9, method)
            error = float((theirs - ours).norm() / ours.norm())
            if not error < 2e-2:  # fp16/bf16 iterations of one rule agree to ~1e-3
                found.append(
                    f"muon_update({method}) on a {shape[0]}×{shape[1]} matrix differs by {error:.2g}"
                )
    return tuple(found)


def check(optim: OptimConfig, ds: dict[str, Any], offloads: bool) -> None:
    """Before any process group: Muon only where it is proven (bf16 ZeRO-1/2 of the DeepSpeed the
    tests ran, no offload). One line naming the setting and what to use."""
    if optim.name != "muon":
        return
    stage = int(ds.get("zero_optimization", {}).get("stage", 0))
    if stage not in PROVEN_STAGES:
        why = f": {ZERO3_MOMENTUM}" if stage == 3 else ""
        raise ConfigError(
            f"optim.name=muon with ZeRO stage {stage}: DeepSpeed's Muon is proven here under ZeRO-1 and "
            f"ZeRO-2 only (tests/integration/test_muon.py){why}; use configs/deepspeed/zero1.json or "
            "zero2.json, or optim.name=adamw"
        )
    if offloads:
        raise ConfigError(
            "optim.name=muon with the optimizer offloaded to the CPU: not proven here; "
            "remove offload_optimizer from the DeepSpeed JSON, or use optim.name=adamw"
        )
    differences = deepspeed_muon_differences()
    if differences:
        import deepspeed

        raise ConfigError(
            f"optim.name=muon: DeepSpeed {deepspeed.__version__}'s Muon is not the one proven here "
            f"(0.19.8): {'; '.join(differences)}; use optim.name=adamw, or prove it with "
            "tests/integration/test_muon.py and update pretrain/optim/muon.py"
        )
