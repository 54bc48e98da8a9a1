"""Experts across ranks (`parallel.expert: E`; docs/training.md, Experts across ranks): which rank
holds which expert, and the all-to-all that takes each token to its expert and back.

Ranks E·g .. E·g + E − 1 form expert-parallel group g (DeepSpeed's `ep_size_E` groups: its
`_create_expert_and_data_parallel`, consecutive ranks); rank r holds experts
[(r % E)·n/E, (r % E + 1)·n/E) of each MoE block's n, the r % E-th slice of the one-rank model's
tensors, so every layout starts from the same weights. Every rank routes its own tokens; the
layer (`pretrain/model/moe.py`) hands its dispatch the tokens sorted by expert, which here are
sent to the ranks holding their experts (`all_to_all_single`: gloo and NCCL both have it), run
through the local experts with grouped products, and sent back in the same order. The backward
pass is the reverse all-to-all (`AllToAll`).

Gradients and optimizer states go through DeepSpeed's ZeRO-1/2 as its own MoE layer's do: the
expert parameters carry its marks (`allreduce=False`, `group_name`), the optimizer's groups are
split by its `split_params_into_different_moe_groups_for_optimizer`, and ZeRO then sums each
expert's gradient over the ranks holding the same experts (the expert-data-parallel group),
divides it by the data-parallel size (every rank's tokens reached the expert, through the
all-to-all: the mean over the whole batch, never E times it), and partitions its states over that
group. DeepSpeed's engine configures this only for a model holding an instance of its `MoE`
class: `ExpertGroups` is one, with no parameters. Proven against the one-rank fp32 reference in
tests/integration/test_experts.py.

The balancing loss of `balance: aux_loss` takes its load from every rank's tokens
(`global_counts`: an all-reduce of the E counts per block and micro-batch), so a job of any size
computes the loss the one-rank reference computes on the whole batch.
"""

from __future__ import annotations

import torch
from torch import nn

from pretrain.model.moe import Experts, LocalDispatch


def expert_group(size: int):
    """DeepSpeed's expert-parallel group of `size` consecutive ranks holding this rank (made once
    per process, with its expert-data-parallel groups)."""
    from deepspeed.utils import groups

    name = group_name(size)
    if name not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(size)
    return groups._get_expert_parallel_group(name)


def group_name(size: int) -> str:
    return f"ep_size_{size}"  # DeepSpeed's name for its groups of this size


class AllToAll(torch.autograd.Function):
    """Rows of x sent to the group's ranks in `send` sizes, rows received in `receive` sizes; the
    gradient goes back the same way, reversed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, receive: list[int], send: list[int], group) -> torch.Tensor:
        import torch.distributed as dist

        ctx.sizes, ctx.group = (receive, send), group
        out = x.new_empty((sum(receive), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), receive, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        receive, send = ctx.sizes
        return AllToAll.apply(grad, send, receive, ctx.group), None, None, None


class DataParallelCounts(LocalDispatch):
    """Every expert on every rank (parallel.expert: 1) in a job of several ranks: the experts run
    here; the balancing loss's counts are every rank's."""

    def global_counts(self, counts: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        total = counts.detach().clone()
        dist.all_reduce(total)
        return total


class ExpertParallelDispatch(DataParallelCounts):
    """The layer's dispatch with its experts split over an expert-parallel group of `size`."""

    def __init__(self, group, size: int):
        self.group, self.size = group, size

    def __call__(self, x: torch.Tensor, counts: torch.Tensor, experts: Experts) -> torch.Tensor:
        """x (M, d) sorted by (global) expert, counts (n,) → the experts' outputs, in x's order."""
        import torch.distributed as dist

        local = experts.w_in.shape[0]
        outgoing = counts.view(self.size, local)  # [rank, its local expert]: tokens this rank sends
        incoming = torch.empty_like(outgoing)  # [source rank, local expert]: tokens sent here
        dist.all_to_all_single(incoming, outgoing.contiguous(), group=self.group)
        send, receive = outgoing.sum(dim=1).tolist(), incoming.sum(dim=1).tolist()  # (host reads)
        arrived = AllToAll.apply(x, receive, send, self.group)  # by source rank, then expert
        expert_of = torch.arange(local, device=x.device).repeat(self.size)
        expert_of = expert_of.repeat_interleave(incoming.flatten())
        order = expert_of.argsort(stable=True)  # by local expert, then source rank
        out = torch.empty_like(arrived)
        out[order] = experts(arrived[order], incoming.sum(dim=0))
        return AllToAll.apply(out, send, receive, self.group)


def split_experts(model: nn.Module, size: int) -> None:
    """Every MoE block of `model` (a `Transformer`) across the expert-parallel groups of `size`
    ranks (at size 1, the experts stay whole on every rank and only the balancing loss's counts
    are summed over the ranks); marks the experts for DeepSpeed's ZeRO and adds the `ExpertGroups`
    marker its engine looks for. Before `deepspeed.initialize`."""
    import torch.distributed as dist

    blocks = [block.mlp for block in model.layers if block.routed]
    if not blocks or (size == 1 and dist.get_world_size() == 1):
        return
    if size == 1:
        for mlp in blocks:
            mlp.dispatch = DataParallelCounts()
        return
    group = expert_group(size)
    position = dist.get_rank(group)
    for mlp in blocks:
        local = mlp.moe.experts // size
        mine = slice(position * local, (position + 1) * local)
        for name in ("w_in", "w_out"):
            whole = getattr(mlp.experts, name)
            part = nn.Parameter(whole.detach()[mine].clone())
            part.allreduce, part.group_name = False, group_name(size)  # DeepSpeed's marks
            part.held_experts = (mine.start, mine.stop)  # (which, for the replica check and checkpoints)
            setattr(mlp.experts, name, part)
        mlp.dispatch = ExpertParallelDispatch(group, size)
    model.expert_groups = expert_groups_marker(blocks[0].moe.experts, size)


def expert_groups_marker(experts: int, size: int) -> nn.Module:
    """An instance of DeepSpeed's `MoE` (so its engine hands its ZeRO optimizer the expert groups)
    that holds nothing and runs nothing: the experts are the model's own."""
    from deepspeed.moe.layer import MoE

    class ExpertGroups(MoE):
        def __init__(self):
            nn.Module.__init__(self)
            self.num_experts, self.ep_size = experts, size
            self.num_local_experts, self.expert_group_name = experts // size, group_name(size)

        def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
            pass  # (the groups exist: `expert_group`)

    return ExpertGroups()


def expert_param_groups(groups: list[dict]) -> list[dict]:
    """The optimizer's parameter groups with the split experts in groups of their own, marked
    `moe` (DeepSpeed's `split_params_into_different_moe_groups_for_optimizer`): ZeRO reduces and
    partitions those over the expert-data-parallel group. Unchanged without split experts."""
    if not any(is_expert_split(p) for group in groups for p in group["params"]):
        return groups
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    named = [group | {"name": f"group_{i}"} for i, group in enumerate(groups)]
    return split_params_into_different_moe_groups_for_optimizer(named)


def is_expert_split(param: torch.Tensor) -> bool:
    """Whether each expert-parallel rank holds its own part of this parameter (DeepSpeed's mark)."""
    return getattr(param, "allreduce", True) is False
