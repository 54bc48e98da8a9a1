"""Sequence parallelism (`parallel.sequence: S`): each window's tokens split across the S ranks of a
sequence-parallel group, through DeepSpeed's Ulysses around the model's own attention
(docs/training.md, Long context).

Ranks S·d .. S·d + S − 1 form group d (DeepSpeed's `parallel_state_sp`): they read the same
windows (the stream is keyed by the data-parallel rank d of world / S), and rank s of a group keeps
the tokens [s·T/S, (s+1)·T/S) of each (`SequenceShard.split`), with each token's position in the
window, for RoPE, and the window's document ids, for the mask. Everything outside attention is
per token and runs on the shard. Each attention layer's core (`Attention.core`, the model's
`local_attention`: SDPA or FlexAttention) is wrapped in DeepSpeed's `DistributedAttention`: an
all-to-all turns q, k and v from a sequence split into a head split (rank s holds every position
of heads [s·nh/S, (s+1)·nh/S)), the core attends over the whole window with the whole window's
mask, and a second all-to-all turns the output back. With fewer key/value heads than S, each is
replicated S / nkv times first (as DeepSpeed's `UlyssesSPAttentionHF` does), so each rank's
query heads find theirs.

The loss is the mean over the whole window: each rank's shard mean, weighted by its share of
the counted targets, summed over the group (`WindowMean`: the all-reduce in the forward pass,
the identity in the backward). Each rank's gradient is then its shard's part of the window
mean's, and DeepSpeed, handed the groups as `mpu`, sums gradients over all S × D ranks and
divides by D (`dp_world_size / sequence_parallel_size` in its ZeRO optimizers): the gradient of
the mean over the D windows, as one process computes it. ZeRO partitions over all S × D ranks
(DeepSpeed's `seq_data_parallel_group`), so a checkpoint's files are those of a job of as many
processes at S = 1, and resuming at another S or world size is DeepSpeed's usual load or its
universal conversion.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from pretrain.model.loss import IGNORE_INDEX
from pretrain.model.transformer import ModelOutput, Transformer, local_attention, positions_in_document


@dataclass(frozen=True)
class SequenceShard:
    """Where a rank sits: its place in its sequence-parallel group of `size`, and the data-parallel
    rank and degree its windows are read by."""

    size: int  # S
    rank: int  # in the group: which S-th of each window this rank keeps
    data_rank: int
    data_world: int

    @classmethod
    def of(cls, rank: int, world_size: int, size: int) -> SequenceShard:
        return cls(size, rank % size, rank // size, world_size // size)

    def split(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A micro-batch of whole windows → this rank's shard of it, as the model's keyword
        arguments (`Transformer.forward`); the batch itself at S = 1."""
        if self.size == 1:
            return batch
        tokens, ids = batch["tokens"], batch.get("document_ids")
        T = tokens.shape[1]
        part = slice(self.rank * T // self.size, (self.rank + 1) * T // self.size)
        positions = (  # (B, T/S) restarting at each document; else (T/S,), as the model's default
            positions_in_document(ids)[:, part].contiguous()
            if ids is not None
            else torch.arange(part.start, part.stop, device=tokens.device)
        )
        shard = {
            "tokens": tokens[:, part].contiguous(),
            "targets": batch["targets"][:, part].contiguous(),
            "positions": positions,
        }
        if ids is not None:
            shard["document_ids"] = ids
        return shard

    def calling(self, model):
        """`model` as a function of whole windows, `(tokens, targets, **kwargs)`, that passes it this
        rank's shard of them (the held-out loss); `model` itself at S = 1."""
        if self.size == 1:
            return model

        def forward(tokens, targets, **kwargs):
            return model(**self.split({"tokens": tokens, "targets": targets, **kwargs}))

        return forward


def sequence_groups(size: int):
    """DeepSpeed's sequence-parallel groups (`parallel_state_sp`, what `deepspeed.initialize` takes
    as `mpu`), made once per process."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu

    if mpu._SEQUENCE_PARALLEL_GROUP is None:
        mpu.initialize_sequence_parallel(size)
    elif mpu.get_sequence_parallel_world_size() != size:
        raise RuntimeError(
            f"sequence-parallel groups of {mpu.get_sequence_parallel_world_size()} exist, not {size}"
        )
    return mpu


class UlyssesAttention(nn.Module):
    """`Attention.core` across a sequence-parallel group: DeepSpeed's `DistributedAttention` around
    `local_attention`. Takes and returns this rank's shard, (B, heads, T/S, hd)."""

    def __init__(self, group, n_kv_heads: int, size: int):
        super().__init__()
        from deepspeed.sequence.layer import DistributedAttention

        self.kv_copies = max(1, size // n_kv_heads)  # nkv < S: each key/value head S / nkv times
        # DeepSpeed's batch-first layout (B, T, heads, hd): heads scattered (2), sequence gathered (1)
        self.distributed = DistributedAttention(_batch_first_core, group, scatter_idx=2, gather_idx=1)
        self.split = True  # False: this rank's tokens alone (`unsplit`)

    def forward(self, q, k, v, mask=None, causal: bool = True) -> torch.Tensor:
        if not self.split:
            return local_attention(q, k, v, mask, causal)
        if self.kv_copies > 1:
            k, v = k.repeat_interleave(self.kv_copies, dim=1), v.repeat_interleave(self.kv_copies, dim=1)
        y = self.distributed(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0, None, mask, causal)
        return y.transpose(1, 2)  # (B, nh, T/S, hd)


def _batch_first_core(q, k, v, mask, causal) -> torch.Tensor:
    """`local_attention` on DeepSpeed's layout: (B, T, heads, hd) in and out, the whole window."""
    return local_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, causal).transpose(
        1, 2
    )


class WindowMean(torch.autograd.Function):
    """[loss × counted targets, counted targets] of this rank's shard → their sums over the group
    (the window's, whose ratio is its mean) in the forward pass; the backward pass hands each
    rank's shard its own part (the identity through the sum), so the group's gradients add up to
    the window mean's."""

    @staticmethod
    def forward(ctx, parts: torch.Tensor, group) -> torch.Tensor:
        import torch.distributed as dist

        total = parts.detach().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def window_mean_loss(group):
    """A forward hook on the model: its loss (the shard's mean) → the window's (`WindowMean`)."""

    def hook(module, args, kwargs, output: ModelOutput) -> ModelOutput | None:
        if output.loss is None:
            return None
        targets = kwargs["targets"] if "targets" in kwargs else args[1]
        counted = (targets != IGNORE_INDEX).sum().to(output.loss.dtype)
        total = WindowMean.apply(torch.stack([output.loss * counted, counted]), group)
        return output._replace(loss=total[0] / total[1].clamp(min=1))

    return hook


def split_attention(model: Transformer, size: int):
    """Every attention layer of `model` across S = `size` ranks, its loss the window's; returns the
    groups for `deepspeed.initialize(mpu=...)`."""
    mpu = sequence_groups(size)
    group = mpu.get_sequence_parallel_group()
    for block in model.layers:
        block.attn.core = UlyssesAttention(group, model.cfg.n_kv_heads, size)
    model.register_forward_hook(window_mean_loss(group), with_kwargs=True)
    return mpu


def own_document_ids(batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """Document ids of the batch's own tokens (None without document masking): a shard's
    (`SequenceShard.split`), numbered from the document its first token is in, where the batch
    holds the whole window's; else the batch's."""
    ids = batch.get("document_ids")
    if ids is None or ids.shape[1] == batch["tokens"].shape[1]:
        return ids
    return torch.cumsum(batch["positions"] == 0, dim=1, dtype=torch.int32)


@contextlib.contextmanager
def unsplit(model: nn.Module):
    """Attention over this rank's own tokens alone while inside (a probe of a prefix of its shard:
    the instability precursors); nothing changes for a model that is not split."""
    cores = [m for m in model.modules() if isinstance(m, UlyssesAttention)]
    for core in cores:
        core.split = False
    try:
        yield
    finally:
        for core in cores:
            core.split = True
