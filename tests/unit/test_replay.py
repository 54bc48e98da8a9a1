"""The pure parts of telling a machine fault from bad data (pretrain/stability/replay.py): the comparison of a
step's two passes, the per-host fault counts, and the
gradient tally (a real module, no process group)."""

import math

import pytest
import torch

from pretrain.stability.replay import (
    FaultCounts,
    GradientTally,
    changed_ranks,
    same,
)


@pytest.mark.parametrize(
    ("a", "b", "rtol", "expected"),
    [
        (1.5, 1.5, 0.0, True),
        (1.5, math.nextafter(1.5, 2.0), 0.0, False),  # one ulp: not the same bits
        (math.nan, math.nan, 0.0, True),  # a NaN replayed is the same value
        (math.inf, math.inf, 0.0, True),
        (1.0, 1.0 + 1e-4, 1e-3, True),  # within a GPU's tolerance
        (1.0, 2.0**64, 1e-3, False),  # a flipped exponent bit
        (math.inf, 1.0, 1e-3, False),
    ],
)
def test_same_is_bitwise_or_within_the_tolerance(a, b, rtol, expected):
    assert same(a, b, rtol) is expected


def test_the_ranks_whose_values_changed_are_named():
    first = [(2.0, 1.0), (2.0, 3.0e19), (2.1, 1.1)]
    assert changed_ranks(first, [(2.0, 1.0), (2.0, 1.2), (2.1, 1.1)]) == [1]  # a transient gradient fault
    assert changed_ranks(first, first) == []  # the data: the same values again
    assert changed_ranks([(math.nan, math.inf)], [(math.nan, math.inf)]) == []


def test_fault_counts_reach_the_limit_once_per_host():
    counts = FaultCounts(limit=2, counts={"a": 1})
    assert counts.add(["b", "b"]) == []  # (one fault per host per finding)
    assert counts.add(["a", "b"]) == ["a", "b"]
    assert counts.add(["a"]) == []  # (past the limit: already named)
    assert counts.counts == {"a": 3, "b": 2}


def test_the_tally_sees_each_micro_batchs_gradient_before_any_accumulation():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    tally = GradientTally(model)
    xs = [torch.randn(5, 4), torch.randn(5, 4)]
    expected = 0.0
    for x in xs:
        model(x).sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        expected += sum(float(g.double().square().sum()) for g in grads)
        model.zero_grad()
    assert tally.take().item() == pytest.approx(math.sqrt(expected), rel=1e-6)
    params = list(model.parameters())
    torch.autograd.grad(model(xs[0]).sum(), params)  # a replay: no .grad, the tally still sees it
    assert all(p.grad is None for p in params) and tally.take().item() > 0
    tally.remove()
    model(xs[0]).sum().backward()
    assert tally.take().item() == 0.0
