"""The pure parts of comparing the replicas (pretrain/stability/replicas.py): the digests of a module's
weights, the parameters that differ, and the ranks at fault."""

import pytest
import torch

from pretrain.stability.faults import flip_top_exponent_bit
from pretrain.stability.replicas import differing, odd_ranks, replica_digests


def test_a_flipped_bit_anywhere_changes_the_digest_and_nothing_else_does():
    torch.manual_seed(0)
    weights = [torch.randn(7, 5).to(torch.bfloat16), torch.randn(3), torch.randn(4).to(torch.bfloat16)]
    clean = replica_digests(weights)
    assert clean.shape == (3, 2) and clean.dtype == torch.int64
    assert torch.equal(replica_digests([w.clone() for w in weights]), clean)  # the same bits, the same digest
    for index in (0, 1, 2):
        for element in (0, 1, weights[index].numel() - 1):
            copy = [w.clone() for w in weights]
            flip_top_exponent_bit(copy[index].view(-1)[element : element + 1])
            changed = (replica_digests(copy) != clean).any(dim=1)
            assert changed.tolist() == [i == index for i in range(3)], (index, element)
    lowest = [w.clone() for w in weights]
    lowest[0].view(torch.int16).view(-1)[3] ^= 1  # the mantissa's lowest bit: one ulp
    assert not torch.equal(replica_digests(lowest), clean)


def test_the_digests_name_the_parameters_that_differ():
    same = {"a": [1, 2], "b": [3, 4]}
    assert differing([same, dict(same)]) == []
    assert differing([same, {"a": [1, 2], "b": [3, 5]}]) == ["b"]
    assert differing([same, {"a": [1, 2]}]) == []  # (a parameter one rank does not hold whole: not compared)


def test_experts_split_across_ranks_are_compared_among_the_ranks_holding_them():
    """Four ranks, experts split in two (parallel.expert=2): ranks 0 and 2 hold experts 0-1,
    ranks 1 and 3 experts 2-3, and the dense weights are everyone's."""
    low, high = "w[experts 0-1]", "w[experts 2-3]"
    ranks = [{"d": [1, 1], low: [5, 5]}, {"d": [1, 1], high: [7, 7]}, {"d": [1, 1], low: [5, 5]}]
    ranks.append({"d": [1, 1], high: [7, 7]})
    assert differing(ranks) == []  # (experts 0-1 differ from 2-3: never compared)
    ranks[3] = {"d": [1, 1], high: [8, 8]}
    assert differing(ranks) == [high]
    assert odd_ranks(ranks, [high], [None] * 4) == [1, 3]  # two holders, no master: both
    assert odd_ranks(ranks, [high], [False, False, False, True]) == [3]


@pytest.mark.parametrize(
    ("digests", "names", "wrong", "expected"),
    [
        ([{"w": [1, 1]}, {"w": [9, 9]}], ["w"], [False, True], [1]),  # the master weights say which
        ([{"w": [9, 9]}, {"w": [1, 1]}], ["w"], [True, None], [0]),
        ([{"w": [1, 1]}, {"w": [1, 1]}, {"w": [9, 9]}], ["w"], [None] * 3, [2]),  # else the majority
        ([{"w": [1, 1]}, {"w": [9, 9]}], ["w"], [None, None], [0, 1]),  # two ranks, no master: both
        ([{"w": [1, 1]}, {"w": [9, 9]}], ["w"], [False, False], [0, 1]),
    ],
)
def test_the_ranks_at_fault(digests, names, wrong, expected):
    assert odd_ranks(digests, names, wrong) == expected
