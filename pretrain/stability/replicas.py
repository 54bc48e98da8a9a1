"""Do the replicas hold the same weights? The parts of the answer that need no loop (issue 46;
docs/monitoring.md, "Replay and replica checks").

Under ZeRO-0/1/2 every rank holds the whole bf16 model, and every copy must be the same bits:
after each update DeepSpeed writes each rank's partition from its fp32 master weights and
all-gathers it. Under ZeRO-3 a parameter is held in full by every rank only when it is persistent
(below `stage3_param_persistence_threshold`: the norms' weights, say); the others are shards, each
held by one rank alone, which no comparison of replicas can check.

* `replica_digests`: per parameter, two integer sums of its bit patterns on the device (all of
  them, and every other one): exact, no host read until the check reads them all at once. A
  flipped bit changes an element's pattern by ±2^k, so it always changes the first sum; two faults
  that cancel in both sums are what it misses.
* `own_copies`: each rank's own partition of the bf16 weights beside its fp32 master weights (every
  ZeRO stage): the only copy of a ZeRO-3 shard, which must equal its master rounded to bf16. A
  rank whose does not is at fault whatever the replicas say (`masters_disagree`).
* `differing`: the parameters whose digests are not the same on every rank.
* `odd_ranks`: which ranks hold the wrong copy — those whose copy is not what the optimizer's fp32
  master weights give (`wrong` from each rank), else the minority of a strict majority, else every
  rank (two ranks that differ, with no master to ask).

Pure where they can be (tests/unit/test_replicas.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

import torch

_INTEGER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def replica_digests(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """(len(tensors), 2) int64 on the tensors' device: per tensor, the sum of its elements' bit
    patterns as integers, and the sum over its even-numbered elements."""
    rows = []
    for tensor in tensors:
        bits = tensor.detach().reshape(-1).view(_INTEGER[tensor.element_size()])
        rows.append(torch.stack([bits.sum(dtype=torch.int64), bits[::2].sum(dtype=torch.int64)]))
    if not rows:
        return torch.zeros((0, 2), dtype=torch.int64)
    return torch.stack(rows)


def differing(digests: Sequence[Mapping[str, Sequence[int]]]) -> list[str]:
    """Every rank's digests by parameter name → the parameters whose digests are not the same on
    every rank holding them (every rank; for experts split across ranks, named by the experts
    they hold, the ranks holding the same ones), in the order of first appearance."""
    names = list(dict.fromkeys(name for d in digests for name in d))
    return [name for name in names if len({tuple(d[name]) for d in digests if name in d}) > 1]


def odd_ranks(
    digests: Sequence[Mapping[str, Sequence[int]]], names: Sequence[str], wrong: Sequence[bool | None]
) -> list[int]:
    """The ranks whose copies of the parameters `names` are wrong: `wrong[r]` is rank r's own
    finding against the fp32 master weights (None: it could not read them). Where no rank found
    itself wrong, the ranks outside a strict majority of each parameter's digests; where there is
    none, every rank holding it."""
    found = [r for r, w in enumerate(wrong) if w]
    if found:
        return found
    odd: set[int] = set()
    for name in names:
        copies = {r: tuple(d[name]) for r, d in enumerate(digests) if name in d}  # (its holders')
        value, votes = Counter(copies.values()).most_common(1)[0]
        if 2 * votes <= len(copies):
            return sorted(copies)  # (every rank holding it)
        odd |= {r for r, c in copies.items() if c != value}
    return sorted(odd)


def own_copies(optimizer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(this rank's bf16 partition, its fp32 master partition) per parameter group of DeepSpeed's
    bf16 optimizers: ZeRO-3's shards, ZeRO-1/2's (`stage_1_and_2`) and BF16_Optimizer's partitions
    (which after every landed update are the master rounded; no update changes one without the
    other). [] for an optimizer without them."""
    if getattr(optimizer, "fp32_partitioned_groups_flat", None):  # ZeRO-3
        return [
            (low, master)
            for low, master in zip(
                optimizer.fp16_partitioned_groups_flat, optimizer.fp32_partitioned_groups_flat, strict=True
            )
            if low is not None and master is not None
        ]
    for partitions, masters in (
        ("parallel_partitioned_bit16_groups", "single_partition_of_fp32_groups"),  # ZeRO-1/2
        ("bf16_partitioned_groups", "fp32_groups_flat_partition"),  # BF16_Optimizer
    ):
        if getattr(optimizer, masters, None) and getattr(optimizer, partitions, None):
            import torch.distributed as dist

            groups = optimizer.real_dp_process_group
            return [
                (getattr(optimizer, partitions)[i][dist.get_rank(group=groups[i])], master)
                for i, master in enumerate(getattr(optimizer, masters))
            ]
    return []


def masters_disagree(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[int]:
    """The groups whose bf16 partition is not its fp32 master rounded (bit for bit)."""
    return [
        i
        for i, (low, master) in enumerate(pairs)
        if low.numel() == master.numel()
        and not torch.equal(low.reshape(-1), master.reshape(-1).to(low.dtype))
    ]
