"""Muon through DeepSpeed (pretrain/optim/muon.py) against the reference written from the
algorithm: one 2-process DeepSpeed job (gloo, CPU) trains the same small model under ZeRO-1 and
ZeRO-2 (reduce-scatter on, DeepSpeed's default, and 2 micro-batches per step), in fp32 and in
bf16, one after another in the same processes, 10 steps each, with a learning rate that changes
every step; the test process runs the reference (`ReferenceMuon` + torch.optim.AdamW, one
process, every rank's micro-batches) on the same model and data and compares the fp32 master
weights and Muon's momentum after 10 steps.

Each of DeepSpeed's four Muon bugs has a test that fails if it comes back:
  #7807 ranks that differ       a matrix split between the ranks' partitions: each rank's momentum
                                for it equals the other's and the reference's
  #8441 SGD in place of Muon    each matrix's first update is the reference's Muon step, far from
                                an SGD step
  #8438 a matrix sent to AdamW  every block matrix, and nothing else, is in a Muon group of
                                DeepSpeed's optimizer
  #8443 one update per micro-   the momentum after 10 steps of 2 micro-batches is the reference's
        batch                   after 10 updates, not 20

Run by pytest, this file launches itself: `python -m torch.distributed.run --nproc_per_node 2
-m tests.integration.test_muon OUT_DIR` runs `worker()` on each rank, which writes
OUT_DIR/VARIANT_rank_N.safetensors and OUT_DIR/rank_N.json for the tests to read.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# name: (shipped DeepSpeed JSON, bf16, optim.muon_scale, train.grad_clip)
VARIANTS = {
    "zero1_fp32": ("zero1.json", False, "original", 0.0),
    "zero2_fp32": ("zero2.json", False, "match_rms_adamw", 0.0),
    "zero1_bf16": ("zero1.json", True, "original", 0.0),
    "zero2_bf16": ("zero2.json", True, "original", 0.0),
    # a clip below the AdamW half's gradient norm at every step (0.67-0.70 measured): only it is clipped
    "zero2_fp32_clip": ("zero2.json", False, "original", 0.05),
}
STEPS, GRAD_ACCUM, MICRO_BATCH, SEQ, VOCAB = 10, 2, 2, 16, 97
LR, MUON_LR, WEIGHT_DECAY = 3e-3, 0.005, 0.1
# About twice the largest difference measured (docs/training.md, Muon). Weights: ‖job − reference‖
# over the distance the reference moved in 10 steps; momentum: relative; first: the first step's
# update, relative. fp32 jobs differ only in the order of the sums over ranks and micro-batches
# (measured 9e-6, 1.2e-6, 1.1e-5). bf16 jobs (bf16 weights and activations, ZeRO-2's bf16
# momentum, the fp16 iteration) against the fp32 reference by much more: Newton–Schulz sends
# every direction of the momentum, its smallest too, to a singular value near 1, so a rounding
# difference in a direction the gradient hardly has becomes a whole part of the step
# (measured 0.22, 0.020, 0.23: o_proj, whose first gradient has a singular-value ratio of 0.003).
TOLERANCE = {
    "fp32": {"weight": 2e-5, "momentum": 3e-6, "first": 3e-5},
    "bf16": {"weight": 0.45, "momentum": 0.04, "first": 0.45},
}


def model_config():
    from pretrain.config import ModelConfig

    return ModelConfig(
        vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=SEQ, d_ff=48
    )


def optim_config(scale: str):
    from pretrain.config import OptimConfig

    return OptimConfig(name="muon", lr=LR, muon_lr=MUON_LR, weight_decay=WEIGHT_DECAY, muon_scale=scale)


def lr_at(step: int) -> float:
    """A schedule that moves every step (1-based), so that set_lr's ratios are exercised."""
    return LR * (0.5 + 0.05 * step)


def batch(step: int, micro: int, rank: int):
    import torch

    generator = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=generator)
    return {"tokens": tokens, "targets": torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=generator)}


# ------------------------------------------------------------------------------------------ worker


def make_engine(variant: str, env, out: Path):
    import torch

    from pretrain.config import EngineConfig
    from pretrain.model.transformer import Transformer
    from pretrain.parallel.engine import BatchPlan, check_optimizer, deepspeed_config, initialize

    shipped, bf16, scale, clip = VARIANTS[variant]
    engine_config = EngineConfig(deepspeed_config=f"configs/deepspeed/{shipped}")
    ds = deepspeed_config(engine_config, clip, BatchPlan(MICRO_BATCH, GRAD_ACCUM, env.world_size, SEQ))
    check_optimizer(optim_config(scale), ds)
    ds["bf16"]["enabled"] = bf16
    torch.manual_seed(0)
    return initialize(Transformer(model_config()), engine_config, optim_config(scale), ds)


def momentum_by_name(engine) -> dict:
    """This rank's Muon momentum, per matrix: DeepSpeed's flat buffer per group holds every matrix
    its partition touches, whole, in partition order."""
    optimizer, names = engine.optimizer, {id(p): n for n, p in engine.module.named_parameters()}
    found = {}
    for i, params in enumerate(optimizer.params_in_partition):
        flat = optimizer.optimizer.param_groups[i]["params"][0]
        buffer = optimizer.optimizer.state[flat].get("momentum_buffer")
        if buffer is None:
            continue
        offset = 0
        for param in params:
            found[names[id(param)]] = (
                buffer[offset : offset + param.numel()].view(param.shape).float().clone()
            )
            offset += param.numel()
        assert offset == buffer.numel(), (offset, buffer.numel())
    return found


def masters(engine) -> dict:
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}


def run_variant(variant: str, env, out: Path) -> dict:
    from deepspeed.accelerator import get_accelerator
    from safetensors.torch import save_file

    # fp32 jobs: told the accelerator has no fp16, DeepSpeed's own fallback runs the Gram iteration
    # in fp32 (`ns_compute_dtype`), which takes fp16's rounding out of the tight comparison
    accelerator = get_accelerator()
    accelerator.__dict__.pop("is_fp16_supported", None)
    if not VARIANTS[variant][1]:
        accelerator.is_fp16_supported = lambda: False
    engine, optimizer = make_engine(variant, env, out)
    names = {id(p): n for n, p in engine.module.named_parameters()}
    groups = [
        {"use_muon": bool(g["use_muon"]), "params": [names[id(p)] for p in params]}
        for g, params in zip(optimizer.optimizer.param_groups, optimizer.bit16_groups, strict=True)
    ]
    first = None
    losses = []
    for step in range(1, STEPS + 1):
        losses.append(train_step(engine, optimizer, env, step))
        if step == 1:
            first = masters(engine)
    tensors = {f"weight/{n}": t for n, t in masters(engine).items()}
    tensors |= {f"first/{n}": t for n, t in first.items()}
    tensors |= {f"momentum/{n}": t for n, t in momentum_by_name(engine).items()}
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(out / f"{variant}_rank_{env.rank}.safetensors")
    )
    skipped = rolled_back = None
    if VARIANTS[variant][1]:  # (a bf16 guard; the loop's rollback with DeepSpeed's bf16 optimizer)
        skipped = skip_then_step(engine, optimizer, env)
        rolled_back = rollback_then_step(engine, optimizer, env, out / variant)
    engine.destroy()
    return {"groups": groups, "losses": losses, "skip": skipped, "rollback": rolled_back}


def train_step(engine, optimizer, env, step: int) -> float:
    """One optimizer step (1-based) of GRAD_ACCUM micro-batches; the last micro-batch's loss."""
    from pretrain.parallel.engine import set_lr

    set_lr(optimizer, lr_at(step))
    for micro in range(GRAD_ACCUM):
        loss = engine(**batch(step, micro, env.rank)).loss
        engine.backward(loss)
        engine.step()
    return float(loss.detach())


def held_state(engine, optimizer) -> dict:
    """Every tensor of this rank an optimizer step writes: bf16 weights, fp32 masters, and each
    group's optimizer state (Muon's momentum, AdamW's moments and step), copied."""
    import torch

    found = {f"bf16/{n}": p.detach().clone() for n, p in engine.module.named_parameters()}
    found |= {
        f"fp32/{i}": t.detach().clone() for i, t in enumerate(optimizer.single_partition_of_fp32_groups)
    }
    for i, group in enumerate(optimizer.optimizer.param_groups):
        for key, value in optimizer.optimizer.state.get(group["params"][0], {}).items():
            found[f"{key}/{i}"] = (value if torch.is_tensor(value) else torch.tensor(float(value))).clone()
    return found


def rollback_then_step(engine, optimizer, env, run_dir: Path) -> dict:
    """The loop's rollback with Muon (`pretrain.train.rollback.go_back` loads the target through
    `Checkpointer.load`): a checkpoint saved after step 12, step 13 trained, the checkpoint loaded
    back. Which held tensors then differ from the saved ones (by value: a legacy load gives
    ZeRO-2's bf16 momentum back as fp32, which the next step turns back to bf16), what
    rollback_applied.matches_checkpoint would say, and which differ after step 13 again from
    after step 13 the first time (bit for bit)."""
    import torch

    from pretrain.checkpoint.checkpointer import Checkpointer, TrainState
    from pretrain.config import CheckpointConfig

    tokenizer = run_dir / "tokenizer.model"  # what a checkpoint copies; nothing reads it here
    tokenizer.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.write_bytes(b"")
    checkpointer = Checkpointer(
        run_dir / "run", env, CheckpointConfig(), run_config={}, tokenizer=tokenizer, config_hash=""
    )
    tag = checkpointer.save(engine, TrainState(step=STEPS + 2), None)
    saved = held_state(engine, optimizer)
    train_step(engine, optimizer, env, STEPS + 3)
    first = held_state(engine, optimizer)
    _, matches = checkpointer.load(engine, tag)
    loaded = held_state(engine, optimizer)
    train_step(engine, optimizer, env, STEPS + 3)
    again = held_state(engine, optimizer)
    return {
        "held": sorted(saved),
        "matches_checkpoint": matches,
        "loaded_differ": [n for n in saved if not torch.equal(saved[n].double(), loaded[n].double())],
        "moved": [n for n in saved if not torch.equal(saved[n], first[n])],
        "again_differ": [
            n
            for n in first
            if not torch.equal(first[n].view(-1).view(torch.uint8), again[n].view(-1).view(torch.uint8))
        ],
    }


def skip_then_step(engine, optimizer, env) -> dict:
    """One step the skip guard skips (a NaN loss), then a normal one: which state each changed."""

    import torch

    from pretrain.parallel.engine import set_lr
    from pretrain.parallel.norm_gate import gate_of
    from pretrain.stability.skip_step import SkipGuard, global_mean

    guard = SkipGuard(ratio=3.0, window=8, min_count=3)
    gate = gate_of(engine)  # (engine.initialize armed it: pretrain/parallel/norm_gate.py)
    gate.judge = guard
    changed = {}
    for step, judged in ((STEPS + 1, math.nan), (STEPS + 2, None)):
        before = held_state(engine, optimizer)
        set_lr(optimizer, lr_at(step))
        total = torch.zeros(())
        for micro in range(GRAD_ACCUM):
            loss = engine(**batch(step, micro, env.rank)).loss
            engine.backward(loss)
            total += loss.detach().float()
            if engine.is_gradient_accumulation_boundary():
                guard.set_loss(global_mean(total / GRAD_ACCUM) if judged is None else torch.tensor(judged))
            engine.step()
        after = held_state(engine, optimizer)
        changed["skipped" if judged is not None else "next"] = {
            name: not torch.equal(
                before[name].view(-1).view(torch.uint8), after[name].view(-1).view(torch.uint8)
            )
            for name in after
        }
    gate.judge = None
    return changed


def worker() -> None:
    import torch

    from pretrain.parallel.distributed import DistEnv, init_distributed

    out = Path(sys.argv[1])
    env = DistEnv.from_environ()
    init_distributed(env)
    results = {}
    for variant in VARIANTS:
        results[variant] = run_variant(variant, env, out)
        torch.distributed.barrier()
    (out / f"rank_{env.rank}.json").write_text(json.dumps(results, indent=1))


# --------------------------------------------------------------------------------------- reference


def start_weights(bf16: bool) -> dict:
    """The model's weights as the job's fp32 masters start: bf16's rounding of them in bf16 jobs
    (DeepSpeed makes the masters from the bf16 model)."""
    import torch

    from pretrain.model.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(model_config())
    if bf16:
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(param.bfloat16().float())
    return model


def reference(variant: str, clipped: bool = True) -> dict:
    """The same 10 steps in one process: every rank's micro-batches, each loss over all of them;
    with the variant's train.grad_clip (`clipped`), the AdamW half's gradients clipped by their
    own norm and Muon's never."""
    import torch

    from pretrain.optim.muon import LR_SCALE, muon_groups
    from pretrain.parallel.engine import param_groups
    from tests.muon_reference import reference_optimizers

    _, bf16, scale, clip = VARIANTS[variant]
    model = start_weights(bf16)
    optim = optim_config(scale)
    groups = muon_groups(model, optim, param_groups(model, optim.weight_decay))
    ratios = [group[LR_SCALE] for group in groups]
    optimizers = reference_optimizers(groups, None if bf16 else torch.float32)
    by_group = [g for o in optimizers for g in o.param_groups]  # muon groups first, as muon_groups orders
    first = None
    for step in range(1, STEPS + 1):
        for group, ratio in zip(by_group, ratios, strict=True):
            group["lr"] = lr_at(step) * ratio
        for rank in range(2):
            for micro in range(GRAD_ACCUM):
                (model(**batch(step, micro, rank)).loss / (2 * GRAD_ACCUM)).backward()
        if clip and clipped:
            torch.nn.utils.clip_grad_norm_([p for g in optimizers[1].param_groups for p in g["params"]], clip)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        if step == 1:
            first = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = optimizers[0].state
    return {
        "weight": {n: p.detach() for n, p in model.named_parameters()},
        "first": first,
        "momentum": {n: state[p]["momentum_buffer"] for n, p in model.named_parameters() if p in state},
    }


# ------------------------------------------------------------------------------------------ tests


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    """One 2-process job for every variant, once per test session (shared by the xdist workers)."""
    from tests.conftest import built_once
    from tests.integration.runs import torchrun

    def run(out: Path) -> None:
        command = [*torchrun(2, "tests.integration.test_muon"), str(out)]
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]

    return built_once(tmp_path_factory, "muon", run)


def ranks(job: Path, variant: str) -> list[dict]:
    from safetensors.torch import load_file

    return [load_file(str(job / f"{variant}_rank_{rank}.safetensors")) for rank in (0, 1)]


def held(found: dict, kind: str) -> dict:
    return {k.split("/", 1)[1]: v for k, v in found.items() if k.startswith(f"{kind}/")}


@pytest.fixture(scope="module")
def references() -> dict:
    return {variant: reference(variant) for variant in VARIANTS}


def distance(ours, theirs, start) -> float:
    """‖ours − theirs‖ over the distance the reference moved from `start`."""
    return float((ours - theirs).norm() / (theirs - start).norm())


def tolerance(variant: str) -> dict[str, float]:
    return TOLERANCE["bf16" if VARIANTS[variant][1] else "fp32"]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_weights_after_10_steps_are_the_references(job, references, variant):
    start = dict(start_weights(VARIANTS[variant][1]).named_parameters())
    ref = references[variant]["weight"]
    for found in ranks(job, variant):
        errors = {n: distance(w, ref[n], start[n].detach()) for n, w in held(found, "weight").items()}
        assert set(errors) == set(start)
        worst = max(errors, key=errors.get)
        assert errors[worst] < tolerance(variant)["weight"], (variant, worst, errors)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_one_momentum_update_per_step_the_same_on_every_rank(job, references, variant):
    """#8443: 10 steps of 2 micro-batches are 10 momentum updates (20 would leave the momentum
    far from the reference's); #7807: a matrix split between the partitions has the same momentum
    on both ranks, the reference's."""
    import torch

    ref = references[variant]["momentum"]
    by_rank = [held(found, "momentum") for found in ranks(job, variant)]
    assert set(by_rank[0]) | set(by_rank[1]) == set(ref)
    for found in by_rank:
        for name, momentum in found.items():
            error = float((momentum - ref[name]).norm() / ref[name].norm())
            assert error < tolerance(variant)["momentum"], (variant, name, error)
    split = set(by_rank[0]) & set(by_rank[1])
    assert split, "no matrix is split between the two partitions: the test no longer covers #7807"
    for name in split:
        assert torch.equal(by_rank[0][name], by_rank[1][name]), name


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_matrix_steps_by_muon_not_sgd(job, references, variant):
    """#8441: the first update of every block matrix is the reference's Muon step: orthogonalized,
    its singular values near the largest (a gradient's, SGD's step, spread over decades)."""
    import torch

    start = dict(start_weights(VARIANTS[variant][1]).named_parameters())
    ref = references[variant]["first"]
    found = held(ranks(job, variant)[0], "first")
    for name in references[variant]["momentum"]:
        ours, theirs = found[name] - start[name].detach(), ref[name] - start[name].detach()
        assert float((ours - theirs).norm() / theirs.norm()) < tolerance(variant)["first"], name
        values = torch.linalg.svdvals(ours.double())
        assert float(values[min(ours.shape) // 2] / values[0]) > 0.5, (name, values)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_block_matrices_and_nothing_else_are_muons(job, variant):
    """#8438: in DeepSpeed's own optimizer, every 2-D weight inside a block is in a Muon group, and
    the embeddings, the output head and the norms are in AdamW groups."""
    names = {n: p.ndim for n, p in start_weights(False).named_parameters()}
    expected = {n for n, ndim in names.items() if n.startswith("layers.") and ndim == 2}
    for rank in (0, 1):
        groups = json.loads((job / f"rank_{rank}.json").read_text())[variant]["groups"]
        muon = {n for g in groups if g["use_muon"] for n in g["params"]}
        adamw = {n for g in groups if not g["use_muon"] for n in g["params"]}
        assert muon == expected and adamw == set(names) - expected
        assert {"tok_embeddings.weight", "lm_head.weight", "norm.weight"} <= adamw


def test_with_muon_train_grad_clip_clips_the_adamw_half_only(job, references):
    """`zero2_fp32_clip` is its reference with the AdamW half clipped by its own norm and Muon's
    matrices not at all (test_weights_after_10_steps_are_the_references: DeepSpeed's own clip, of
    every group by the norm of all, Muon's update included, fails it); here, that the clip acted:
    the reference without it is far from the job."""
    import torch

    start = dict(start_weights(False).named_parameters())
    found = held(ranks(job, "zero2_fp32_clip")[0], "weight")
    unclipped = reference("zero2_fp32_clip", clipped=False)["weight"]
    ours = torch.cat([(found[n] - start[n].detach()).flatten() for n in found])
    theirs = torch.cat([(unclipped[n] - start[n].detach()).flatten() for n in found])
    assert float((ours - theirs).norm() / theirs.norm()) > 100 * TOLERANCE["fp32"]["weight"]


@pytest.mark.parametrize("variant", [v for v, (_, bf16, _, _) in VARIANTS.items() if bf16])
def test_a_skipped_step_leaves_muons_state_and_the_next_one_trains(job, variant):
    """The skip guard (monitor.skip_step) with Muon: a skipped step changes no weight, master
    weight, momentum or AdamW moment, bit for bit (DeepSpeed stages the step's momentum and
    commits it only once the step is applied); the next step changes every one."""
    for rank in (0, 1):
        skip = json.loads((job / f"rank_{rank}.json").read_text())[variant]["skip"]
        assert any(name.startswith("momentum_buffer/") for name in skip["skipped"])
        assert not any(skip["skipped"].values()), [n for n, changed in skip["skipped"].items() if changed]
        assert all(skip["next"].values()), [n for n, changed in skip["next"].items() if not changed]


@pytest.mark.parametrize("variant", [v for v, (_, bf16, _, _) in VARIANTS.items() if bf16])
def test_a_rollback_brings_muons_state_back_exactly(job, variant):
    """The loop's rollback load (`Checkpointer.load`) with Muon under ZeRO-1 and ZeRO-2: after a
    step past the checkpoint, every weight, master, momentum and AdamW moment is the checkpoint's
    again, the weights' digests say so (rollback_applied.matches_checkpoint), and the step trained
    again from it is, bit for bit, the step trained from it the first time."""
    for rank in (0, 1):
        rollback = json.loads((job / f"rank_{rank}.json").read_text())[variant]["rollback"]
        assert any(name.startswith("momentum_buffer/") for name in rollback["held"])
        assert sorted(rollback["moved"]) == rollback["held"]  # the step after the save changed all
        assert rollback["matches_checkpoint"] is True
        assert rollback["loaded_differ"] == [] and rollback["again_differ"] == []


if __name__ == "__main__":
    worker()
