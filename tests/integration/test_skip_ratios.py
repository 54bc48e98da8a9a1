"""The skip guard's two ratios on the real engine (pretrain/stability/skip_step.py): `SkipGuard(ratio,
grad_norm_ratio)` judges the loss against `ratio` × its running level and DeepSpeed's gradient
norm against `grad_norm_ratio` × its own. A 1-process DeepSpeed job (bf16 ZeRO-2, gloo, CPU) trains
the small model of tests/integration/test_skip_step.py with the loss's ratio 2 and the gradient
norm's 5 (a loss spike is the damage itself; the gradient norm's transients reach 4× on clean
runs, docs/monitoring.md): a loss judged at 3× its level is skipped, a gradient norm at 3× its
level lands, one at 8× is skipped. Every tensor a step updates is compared before and after.

Run by pytest, this file launches itself: `python -m torch.distributed.run --nproc_per_node 1 -m
tests.integration.test_skip_ratios OUT_DIR` runs `worker()`, which writes OUT_DIR/rank_0.json.
The unit tier: tests/unit/test_skip_step.py::test_each_signal_is_judged_against_its_own_ratio."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.integration.test_skip_step import CATEGORIES, GRAD_ACCUM, MICRO_BATCH, SEQ

LOSS_RATIO, GRAD_NORM_RATIO = 2.0, 5.0
# (the loss the guard judges ×, the gradients ×) per step; three normal steps first (min_count=3)
PLAN = [
    ("normal", 1.0, 1.0),
    ("normal", 1.0, 1.0),
    ("normal", 1.0, 1.0),
    ("normal", 1.0, 1.0),
    ("loss_3x", 3.0, 1.0),  # between the two ratios: a loss spike, skipped
    ("normal", 1.0, 1.0),
    ("grad_norm_3x", 1.0, 3.0),  # between the two ratios: not a gradient-norm spike, it lands
    ("normal", 1.0, 1.0),
    ("grad_norm_8x", 1.0, 8.0),  # above both: skipped
    ("normal", 1.0, 1.0),
]
SKIPPED = {"loss_3x": ["loss_spike"], "grad_norm_8x": ["grad_norm_spike"]}


def worker() -> None:
    import torch

    from pretrain.parallel.distributed import DistEnv, init_distributed
    from pretrain.parallel.norm_gate import gate_of
    from pretrain.stability.skip_step import SkipGuard, SkipOutcome, global_mean
    from tests.integration.test_skip_step import compare, make_engine, state_tensors

    out = Path(next(a for a in sys.argv[1:] if not a.startswith("--local_rank")))
    env = DistEnv.from_environ()
    init_distributed(env)
    engine, stage = make_engine("zero2", env, out)
    guard = SkipGuard(LOSS_RATIO, window=8, min_count=3, grad_norm_ratio=GRAD_NORM_RATIO)
    gate = gate_of(engine)  # (engine.initialize armed it: pretrain/parallel/norm_gate.py)
    gate.judge = guard
    steps = []
    for index, (kind, loss_factor, grad_factor) in enumerate(PLAN):
        before, skipped_before = state_tensors(engine, stage), engine.skipped_steps
        loss_sum = torch.zeros(())
        for micro in range(GRAD_ACCUM):
            generator = torch.Generator().manual_seed(1000 * index + 10 * micro + env.rank)
            tokens = torch.randint(0, 97, (MICRO_BATCH, SEQ), generator=generator)
            targets = torch.randint(0, 97, (MICRO_BATCH, SEQ), generator=generator)
            loss = engine(tokens=tokens, targets=targets).loss
            engine.backward(loss * grad_factor)
            loss_sum += loss.detach().float()
            if engine.is_gradient_accumulation_boundary():
                guard.set_loss(global_mean(loss_sum / GRAD_ACCUM) * loss_factor)
            engine.step()
        outcome = SkipOutcome.of(gate.outcome)
        steps.append(
            {
                "kind": kind,
                "outcome": outcome._asdict() | {"reasons": list(outcome.reasons)},
                "compare": compare(before, state_tensors(engine, stage)),
                "skipped_steps": engine.skipped_steps - skipped_before,
            }
        )
    gate.judge = None
    engine.destroy()
    (out / f"rank_{env.rank}.json").write_text(json.dumps(steps, indent=1))


@pytest.fixture(scope="module")
def steps(tmp_path_factory) -> list[dict]:
    from tests.integration.runs import worker_results

    return worker_results(1, "tests.integration.test_skip_ratios", tmp_path_factory.mktemp("skip_ratios"))[0]


def test_the_loss_and_the_gradient_norm_are_each_skipped_by_their_own_ratio(steps):
    assert [s["kind"] for s in steps] == [kind for kind, _, _ in PLAN]
    judged = {s["kind"]: s["outcome"] for s in steps}
    # (the plan is what it says: each value at its multiple of its level, between or above the ratios)
    loss_3x, norm_3x, norm_8x = judged["loss_3x"], judged["grad_norm_3x"], judged["grad_norm_8x"]
    assert LOSS_RATIO < loss_3x["loss"] / loss_3x["loss_level"] < GRAD_NORM_RATIO, loss_3x
    assert LOSS_RATIO < norm_3x["grad_norm"] / norm_3x["grad_norm_level"] < GRAD_NORM_RATIO, norm_3x
    assert norm_8x["grad_norm"] / norm_8x["grad_norm_level"] > GRAD_NORM_RATIO, norm_8x
    for number, step in enumerate(steps, start=1):
        kind, outcome, compared = step["kind"], step["outcome"], step["compare"]
        where = f"step {number} ({kind}): {step}"
        assert outcome["reasons"] == SKIPPED.get(kind, []), where
        if kind in SKIPPED:  # nothing landed: weights, fp32 masters, Adam's moments and step
            assert outcome["skipped"] and step["skipped_steps"] == 1, where
            assert all(compared[c]["all_same"] for c in CATEGORIES), where
        else:  # a DeepSpeed step like any other, the 3× gradient norm's too
            assert not outcome["skipped"] and step["skipped_steps"] == 0, where
            assert all(compared[c]["all_changed"] for c in CATEGORIES), where


if __name__ == "__main__":
    worker()
