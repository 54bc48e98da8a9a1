"""The norm gate (pretrain/parallel/norm_gate.py) on stand-ins for DeepSpeed's ZeRO optimizers (no
process group): one host read per decision, the loop's numbers in it, DeepSpeed's overflow path
taken exactly when the step is skipped, the norm handed back on the host with the same bits. The
real engine, every stage, every tensor bit for bit: tests/integration/test_skip_step.py."""

import math
from types import SimpleNamespace

import pytest
import torch

from pretrain.bench.host_syncs import HostSyncs
from pretrain.parallel.norm_gate import GateUnsupported, NormGate, gate_of, gated, step_read
from pretrain.parallel.step_read import StepRead
from pretrain.stability.skip_step import SkipGuard, SkipOutcome

INF = math.inf


def stand_in(cls, **attributes):
    """An instance of DeepSpeed's optimizer class with only what the gate touches."""
    optimizer = object.__new__(cls)
    optimizer.custom_loss_scaler = False
    optimizer.loss_scaler = SimpleNamespace(cur_scale=1.0)
    for key, value in attributes.items():
        setattr(optimizer, key, value)
    return optimizer


def zero_1_and_2(norm: dict):
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    optimizer = stand_in(DeepSpeedZeroOptimizer, compute_grad_norm=True, overflow=False)
    optimizer.scaled_global_norm = lambda norm_type=2: norm["value"]
    return optimizer


def test_zero_1_and_2_read_once_and_take_deepspeeds_overflow_path_exactly_when_skipping():
    norm = {"value": torch.tensor(1.0)}
    optimizer = zero_1_and_2(norm)
    gate = NormGate.arm(optimizer)
    assert gate_of(SimpleNamespace(optimizer=optimizer)) is gate and step_read(optimizer) is gate.read
    with pytest.raises(GateUnsupported, match="already"):
        NormGate.arm(optimizer)
    guard = SkipGuard(ratio=3.0, window=8, min_count=2)
    gate.judge = guard
    seen = []
    with HostSyncs(torch.device("cpu")) as syncs:
        for loss, value in [
            (5.0, 1.0),
            (5.0, 1.0),
            (5.0, 1.0 + 2**-23),
            (50.0, 1.0),
            (5.0, 9.0),
            (5.0, math.nan),
        ]:
            norm["value"] = torch.full((), value)  # (made as a device value: not from Python numbers)
            gate.read.begin()
            loop = gate.read.join(torch.full((2,), loss) * torch.arange(1, -1, -1))  # (the loop's vector)
            optimizer.overflow = False  # (DeepSpeed's step() does this first)
            guard.set_loss(torch.tensor(loss))
            syncs.new_step()
            handed = optimizer.scaled_global_norm()
            gate.read.read()  # (the loop's own read after the step: nothing left)
            syncs.end_step()
            assert handed.device.type == "cpu" and handed.dtype == torch.float32  # on the host
            outcome = SkipOutcome.of(gate.outcome)
            seen.append((handed.item(), optimizer.overflow, outcome.skipped, gate.read.grad_norm))
            assert gate.read.values(loop) == [loss, 0.0]
    assert [[site.split(" ")[-1] for site in step] for step in syncs.steps] == [["(read)"]] * 6
    # unchanged bits, or inf and DeepSpeed's overflow flag; a NaN gradient norm skips too
    assert seen == [
        (1.0, False, False, 1.0),
        (1.0, False, False, 1.0),
        (1.0 + 2**-23, False, False, 1.0 + 2**-23),
        (INF, True, True, INF),
        (INF, True, True, INF),
        (INF, True, True, INF),
    ]


def test_without_a_judge_only_a_non_finite_norm_skips():
    norm = {"value": torch.tensor(1e30)}
    optimizer = zero_1_and_2(norm)
    gate = NormGate.arm(optimizer)
    assert torch.equal(optimizer.scaled_global_norm(), norm["value"]) and not optimizer.overflow
    assert gate.outcome is None and gate.read.grad_norm == norm["value"].item()
    for bad in (INF, -INF, math.nan):
        norm["value"] = torch.tensor(bad)
        optimizer.overflow = False
        assert optimizer.scaled_global_norm().item() == INF and optimizer.overflow


def test_zero_3_gets_the_combined_norm_as_one_host_group():
    from deepspeed.runtime.utils import combine_grad_norm_groups
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    groups = {"value": [torch.tensor(3.0), torch.tensor(4.0)]}
    optimizer = stand_in(DeepSpeedZeroOptimizer_Stage3)
    optimizer._get_norm_groups = lambda: groups["value"]
    gate = NormGate.arm(optimizer)
    gate.judge = SkipGuard(ratio=3.0, window=8, min_count=1)
    gate.judge.set_loss(torch.tensor(5.0))
    (handed,) = optimizer._get_norm_groups()
    assert handed.device.type == "cpu" and combine_grad_norm_groups([handed]).item() == 5.0
    assert SkipOutcome.of(gate.outcome).grad_norm == 5.0
    groups["value"] = [torch.tensor(30.0), torch.tensor(40.0)]
    gate.judge.set_loss(torch.tensor(5.0))
    assert [g.item() for g in optimizer._get_norm_groups()] == [INF]
    assert SkipOutcome.of(gate.outcome).reasons == ("grad_norm_spike",)


def test_the_norm_of_one_group_is_its_value_bit_for_bit():
    """Why ZeRO-3 can be handed its combined norm as a single group: DeepSpeed combines the groups
    again (`combine_grad_norm_groups`), and the L2 norm of one fp32 value is that value."""
    from deepspeed.runtime.utils import combine_grad_norm_groups

    g = torch.Generator().manual_seed(0)
    exponents = torch.randint(-40, 39, (2000,), generator=g).double()
    values = (torch.rand(2000, generator=g, dtype=torch.float64) * 10.0**exponents).float()
    values = torch.cat([values, torch.tensor([3.4e38, 1.2e-38, 1e-45, 0.0, 1.0 + 2**-23])])
    combined = torch.stack([combine_grad_norm_groups([v]) for v in values])
    assert torch.equal(combined, values)


def test_optimizers_it_cannot_decide_inside_are_refused():
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    with pytest.raises(GateUnsupported, match="AdamW is not supported"):
        NormGate.arm(torch.optim.AdamW(torch.nn.Linear(2, 2).parameters()))
    with pytest.raises(GateUnsupported, match="compute_grad_norm"):
        NormGate.arm(stand_in(DeepSpeedZeroOptimizer, compute_grad_norm=False))


@pytest.mark.parametrize(
    "zero, extra, expected",
    [
        ({"stage": 1}, {}, True),
        ({"stage": 2}, {}, True),
        ({"stage": 3}, {}, True),
        ({"stage": 0}, {}, False),
        ({"stage": 2, "compute_grad_norm": False}, {}, False),
        ({"stage": 1}, {"data_types": {"grad_accum_dtype": "fp32"}}, False),  # (BF16_Optimizer)
        ({"stage": 2}, {"data_types": {"grad_accum_dtype": "fp32"}}, True),
    ],
)
def test_which_engines_get_a_gate(zero, extra, expected):
    bf16 = {"bf16": {"enabled": True}}
    assert gated({"zero_optimization": zero, **bf16, **extra}) is expected
    assert gated({"zero_optimization": zero, **extra}) is False  # (fp32: DeepSpeed's own optimizer)


def test_the_completed_deepspeed_json_turns_deepspeeds_scan_off_exactly_where_a_gate_decides(tmp_path):
    from pretrain.config import EngineConfig
    from pretrain.parallel.engine import BatchPlan, deepspeed_config

    plan = BatchPlan(2, 1, 1, 16)
    scan = {}
    for name in ("zero1", "zero2", "zero3"):
        for one_read in (True, False):
            engine = EngineConfig(deepspeed_config=f"configs/deepspeed/{name}.json", one_host_read=one_read)
            scan[name, one_read] = deepspeed_config(engine, 1.0, plan)["bf16"]["check_grad_overflow"]
    assert scan == {(n, r): not r for n in ("zero1", "zero2", "zero3") for r in (True, False)}
    stage0 = tmp_path / "zero0.json"
    stage0.write_text(
        '{"zero_optimization": {"stage": 0}, "bf16": {"check_grad_overflow": false}}'
    )  # (refused)
    assert deepspeed_config(EngineConfig(deepspeed_config=str(stage0)), 1.0, plan)["bf16"][
        "check_grad_overflow"
    ]


def test_a_step_read_reads_everything_joined_once_and_what_joins_later_once_more():
    read = StepRead()
    with HostSyncs(torch.device("cpu")) as syncs:
        syncs.new_step()
        a = read.join(torch.arange(1.0, 3.0))  # (device values: made by torch, not from Python numbers)
        b = read.join(torch.full((), 3.0, dtype=torch.float64))
        read.read()
        c = read.join(torch.full((1,), 4.0))
        assert (read.values(a), read.values(b), read.values(c)) == ([1.0, 2.0], [3.0], [4.0])
        read.read()  # (nothing joined since)
    assert syncs.per_step() == [2]
    read.begin()
    assert read.grad_norm is None and read.values(read.join(torch.tensor(5.0))) == [5.0]
