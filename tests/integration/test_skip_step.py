"""The skip guard (pretrain/stability/skip_step.py) on the real engine: one 2-process DeepSpeed job (gloo, CPU)
trains a small model under bf16 ZeRO-1, ZeRO-2, ZeRO-3, and ZeRO-2 and ZeRO-3 with the optimizer
offloaded to DeepSpeed's CPU Adam, one after another in the same processes, and forces a skip on
chosen steps: a loss spike, a gradient-norm spike, a NaN loss, a NaN gradient. Every tensor that
a step updates — each rank's bf16 weights (its shards under ZeRO-3), fp32 master partitions and
Adam's exp_avg, exp_avg_sq and step — is compared, bit for bit, before and after each step; and
the host's waits for the device during each step are counted (pretrain/bench/host_syncs.py):
the norm gate's one read (pretrain/parallel/norm_gate.py), with DeepSpeed's overflow scan off.

Run by pytest, this file launches itself: `python -m torch.distributed.run --nproc_per_node 2
-m tests.integration.test_skip_step OUT_DIR` runs `worker()` on each rank, which writes
OUT_DIR/rank_N.json for the tests to read.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = {  # name: (shipped DeepSpeed JSON, changes to it)
    "zero1": ("zero1.json", {}),
    "zero2": ("zero2.json", {}),
    # The shipped threshold (1e5) would keep every parameter of a model this small whole on every
    # rank; 0 partitions them all, as a large model's are.
    "zero3": ("zero3.json", {"stage3_param_persistence_threshold": 0}),
    "zero2_offload": ("zero2.json", {"offload_optimizer": {"device": "cpu", "pin_memory": False}}),
    "zero3_offload": ("zero3_offload.json", {"stage3_param_persistence_threshold": 0}),
}
# What each step does; `normal` steps first, so that the levels exist (min_count=3).
PLAN = [
    "normal",
    "normal",
    "normal",
    "normal",
    "loss_spike",  # the loss the guard judges is 10× (the gradients are the step's own)
    "normal",
    "grad_norm_spike",  # backward of 1000× the loss: 1000× the gradient norm (clipping would hide it)
    "nan_loss",  # the judged loss is NaN, the gradients are finite
    "nan_grad",  # backward of NaN × the loss: a non-finite norm, the gate's skip (whatever the guard says)
    "inf_grad",  # backward of 3e38 × the loss: the bf16 gradients overflow to ±Inf, the same skip
    "normal",
]
EXPECTED_REASONS = {
    "normal": [],
    "loss_spike": ["loss_spike"],
    "grad_norm_spike": ["grad_norm_spike"],
    "nan_loss": ["loss_nonfinite"],
    "nan_grad": ["grad_norm_nonfinite"],
    "inf_grad": ["grad_norm_nonfinite"],
}
GRAD_ACCUM, MICRO_BATCH, SEQ = 2, 2, 16
COUNTED = (0, 1, 4, 8)  # PLAN's steps whose host waits are counted: two normal, a spike, a NaN
CATEGORIES = ("bf16", "fp32", "exp_avg", "exp_avg_sq", "step")


# ------------------------------------------------------------------------------------------ worker


def state_tensors(engine, stage: int) -> dict[str, object]:
    """Every tensor this rank holds that an optimizer step writes, by category/name (copies)."""
    import torch

    optimizer = engine.optimizer
    found = {}
    for name, param in engine.module.named_parameters():
        held = param.ds_tensor if stage == 3 else param
        found[f"bf16/{name}"] = held.detach().clone()
    masters = (
        optimizer.fp32_partitioned_groups_flat if stage == 3 else optimizer.single_partition_of_fp32_groups
    )
    for i, master in enumerate(masters):
        found[f"fp32/{i}"] = master.detach().clone()
    for i, state in enumerate(optimizer.optimizer.state.values()):
        for key, value in state.items():
            tensor = value if torch.is_tensor(value) else torch.tensor(float(value))
            found[f"{key}/{i}"] = tensor.detach().clone()
    return found


def compare(before: dict, after: dict) -> dict[str, dict[str, bool]]:
    """Per category: whether every tensor is bit-identical, and whether every tensor changed (Adam's
    state is born at the first step: a tensor new in `after` counts as changed)."""
    import torch

    result = {}
    for category in CATEGORIES:
        names = [n for n in after if n.split("/")[0] == category]
        same = [
            n in before
            and torch.equal(before[n].reshape(-1).view(torch.uint8), after[n].reshape(-1).view(torch.uint8))
            for n in names
        ]
        result[category] = {"count": len(names), "all_same": all(same), "all_changed": not any(same)}
    return result


def make_engine(variant: str, env, out: Path):
    """The variant's engine around the same small model on every call; (engine, ZeRO stage)."""
    import torch

    from pretrain.config import EngineConfig, ModelConfig, OptimConfig
    from pretrain.model.transformer import Transformer
    from pretrain.parallel.engine import BatchPlan, deepspeed_config, initialize, zero_stage

    shipped, changes = VARIANTS[variant]
    ds_json = json.loads((ROOT / "configs" / "deepspeed" / shipped).read_text())
    ds_json["zero_optimization"].update(changes)
    path = out / f"{variant}.json"
    if env.rank == 0:
        path.write_text(json.dumps(ds_json))
    torch.distributed.barrier()
    engine_config = EngineConfig(deepspeed_config=str(path))
    ds = deepspeed_config(engine_config, 1.0, BatchPlan(MICRO_BATCH, GRAD_ACCUM, env.world_size, SEQ))
    torch.manual_seed(0)
    model = Transformer(
        ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=SEQ, d_ff=48)
    )
    engine, _ = initialize(model, engine_config, OptimConfig(lr=1e-2), ds)
    return engine, zero_stage(ds)


def train_step(engine, guard, index: int, kind: str, rank: int) -> None:
    """One optimizer step of PLAN[index] (its batches depend only on the index and the rank), as
    the loop runs it: the guard gets the global mean loss before the last engine.step()."""
    import torch

    from pretrain.stability.skip_step import global_mean

    loss_sum = torch.zeros(())
    for micro in range(GRAD_ACCUM):
        generator = torch.Generator().manual_seed(1000 * index + 10 * micro + rank)
        tokens = torch.randint(0, 97, (MICRO_BATCH, SEQ), generator=generator)
        targets = torch.randint(0, 97, (MICRO_BATCH, SEQ), generator=generator)
        loss = engine(tokens=tokens, targets=targets).loss
        engine.backward(
            loss * {"grad_norm_spike": 1000.0, "nan_grad": math.nan, "inf_grad": 3e38}.get(kind, 1.0)
        )
        loss_sum += loss.detach().float()
        if guard is not None and engine.is_gradient_accumulation_boundary():
            judged = global_mean(loss_sum / GRAD_ACCUM)
            guard.set_loss(judged * {"loss_spike": 10.0, "nan_loss": math.nan}.get(kind, 1.0))
        engine.step()


def digest(tensors: dict) -> str:
    import torch

    sha = hashlib.sha256()
    for name in sorted(tensors):
        sha.update(name.encode() + tensors[name].reshape(-1).view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def run_variant(variant: str, env, out: Path) -> dict:
    """PLAN with the guard armed, every step compared; then, for reference, PLAN's normal steps
    alone (the same batches) on a fresh engine without a guard."""
    from pretrain.bench.host_syncs import HostSyncs
    from pretrain.parallel.norm_gate import gate_of
    from pretrain.stability.skip_step import SkipGuard, SkipOutcome

    engine, stage = make_engine(variant, env, out)
    guard = SkipGuard(ratio=3.0, window=8, min_count=3)
    gate = gate_of(engine)  # (engine.initialize armed it: DeepSpeed's scan is off)
    gate.judge = guard
    steps = []
    started = time.perf_counter()
    for index, kind in enumerate(PLAN):
        before = state_tensors(engine, stage)
        skipped_before = engine.skipped_steps
        # the host's waits, counted on the first steps (the first makes AdamW's state) and on a
        # step skipped by the guard and by a NaN: the counter slows every operation it sees
        with HostSyncs(engine.device) if index in COUNTED else contextlib.nullcontext() as syncs:
            if syncs is not None:
                syncs.new_step()
            train_step(engine, guard, index, kind, env.rank)
        outcome = SkipOutcome.of(gate.outcome)
        after = state_tensors(engine, stage)
        steps.append(
            {
                "kind": kind,
                "outcome": outcome._asdict() | {"reasons": list(outcome.reasons)},
                "compare": compare(before, after),
                "skipped_steps": engine.skipped_steps - skipped_before,
                "engine_grad_norm": float(engine.get_global_grad_norm()),
                "adam_steps": sorted({float(t) for n, t in after.items() if n.startswith("step/")}),
                "host_syncs": syncs.steps[-1] if syncs is not None else None,
            }
        )
    seconds = time.perf_counter() - started
    guarded = digest(state_tensors(engine, stage))
    gate.judge = None
    engine.destroy()

    engine, stage = make_engine(variant, env, out)
    gate_own = {}
    for index, kind in enumerate(PLAN):
        if kind == "normal":
            train_step(engine, None, index, kind, env.rank)
        elif kind in ("nan_grad", "inf_grad"):  # without a guard: the gate's own skip
            before, skipped_before = state_tensors(engine, stage), engine.skipped_steps
            train_step(engine, None, index, kind, env.rank)
            gate_own[kind] = {
                "compare": compare(before, state_tensors(engine, stage)),
                "skipped_steps": engine.skipped_steps - skipped_before,
            }
    unguarded = digest(state_tensors(engine, stage))
    scan = engine._config.bfloat16_config.check_grad_overflow  # DeepSpeed's own: off (the gate decides)
    engine.destroy()
    return {
        "stage": stage,
        "steps": steps,
        "seconds": seconds,
        "levels": guard.state_dict(),
        "gate_nonfinite_grad": gate_own,
        "deepspeed_scan": scan,
        "final_sha256": {"guarded": guarded, "unguarded": unguarded},
    }


def worker() -> None:
    import torch

    from pretrain.parallel.distributed import DistEnv, init_distributed

    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # (DeepSpeed's launcher adds it)
    out = Path(args[0])
    variants = args[1].split(",") if len(args) > 1 else list(VARIANTS)
    env = DistEnv.from_environ()
    init_distributed(env)
    results = {}
    for variant in variants:
        results[variant] = run_variant(variant, env, out)
        torch.distributed.barrier()
    (out / f"rank_{env.rank}.json").write_text(json.dumps(results, indent=1))


# ------------------------------------------------------------------------------------------ tests


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """One 2-process job for every variant, once per test session (shared by the xdist
    workers); each rank's results."""
    from tests.conftest import built_once
    from tests.integration.runs import torchrun

    def run(out: Path) -> None:
        command = [*torchrun(2, "tests.integration.test_skip_step"), str(out)]
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]

    out = built_once(tmp_path_factory, "skip_step", run)
    return [json.loads((out / f"rank_{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_skipped_step_changes_nothing_and_the_next_step_trains(ranks, variant):
    for rank in ranks:
        steps = rank[variant]["steps"]
        assert [s["kind"] for s in steps] == PLAN
        adam_step = 0
        for number, step in enumerate(steps, start=1):
            kind, outcome, compared = step["kind"], step["outcome"], step["compare"]
            where = f"{variant} step {number} ({kind}): {step}"
            assert all(compared[c]["count"] > 0 for c in CATEGORIES), where
            assert outcome["reasons"] == EXPECTED_REASONS[kind], where
            if kind == "normal":
                adam_step += 1
                assert not outcome["skipped"] and step["skipped_steps"] == 0, where
                assert (
                    math.isfinite(outcome["grad_norm"]) and outcome["grad_norm"] == step["engine_grad_norm"]
                )
                assert all(compared[c]["all_changed"] for c in CATEGORIES), where
            else:
                # Bit for bit: weights (bf16 and fp32 masters), Adam's moments and its step count.
                assert all(compared[c]["all_same"] for c in CATEGORIES), where
                assert outcome["skipped"] and outcome["outlier"], where
                assert step["skipped_steps"] == 1 and step["engine_grad_norm"] == math.inf, where
            assert step["adam_steps"] == [float(adam_step)], where
        spikes = {s["kind"]: s["outcome"] for s in steps}
        # The guard reports the real norm of a skipped spike (DeepSpeed reports inf).
        assert spikes["grad_norm_spike"]["grad_norm"] > 100 * spikes["grad_norm_spike"]["grad_norm_level"]
        assert math.isfinite(spikes["loss_spike"]["grad_norm"])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_skipped_steps_are_as_if_never_run(ranks, variant):
    """With the guard, PLAN ends where its normal steps alone end without one, bit for bit: a step
    the guard lets through is DeepSpeed's own step, and a skipped one leaves no trace. Without the
    guard (the default: the norm gate alone, DeepSpeed's overflow scan off), a NaN gradient is the
    gate's skip through DeepSpeed's overflow path, on every variant: it too leaves
    every weight, master weight and Adam state as it was (test_nonfinite_engine.py follows one
    through the loop's checkpoints)."""
    for rank in ranks:
        final = rank[variant]["final_sha256"]
        assert final["guarded"] == final["unguarded"]
        assert rank[variant]["deepspeed_scan"] is False
        for kind, own in rank[variant]["gate_nonfinite_grad"].items():
            assert own["skipped_steps"] == 1 and all(own["compare"][c]["all_same"] for c in CATEGORIES), (
                kind,
                own,
            )
        assert set(rank[variant]["gate_nonfinite_grad"]) == {"nan_grad", "inf_grad"}


@pytest.mark.parametrize("variant", [v for v in VARIANTS if "offload" not in v])
def test_a_step_waits_for_the_device_once(ranks, variant):
    """Every read of a device value during a step, DeepSpeed's and torch's included, counted from
    outside: the gate's one read (DeepSpeed 0.19.8 makes four more under ZeRO-1/2 and one under
    ZeRO-3 with its scan on: docs/performance.md). With the optimizer offloaded, DeepSpeed computes
    the norm on the host, parameter by parameter: not counted here."""
    for rank in ranks:
        for number, step in enumerate(rank[variant]["steps"], start=1):
            if step["host_syncs"] is not None:
                assert len(step["host_syncs"]) == 1 and "step_read.py" in step["host_syncs"][0], (
                    number,
                    step,
                )


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_rank_decides_the_same(ranks, variant):
    outcomes = [[s["outcome"] for s in rank[variant]["steps"]] for rank in ranks]
    assert json.dumps(outcomes[0]) == json.dumps(outcomes[1])
    assert ranks[0][variant]["levels"] == ranks[1][variant]["levels"]


if __name__ == "__main__":
    worker()
