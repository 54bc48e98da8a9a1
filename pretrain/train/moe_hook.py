"""The step hook of a model with experts (`model.moe`): how evenly each MoE block spreads its tokens,
reported, and the balancing bias moved after every step (DeepSeek-V3's auxiliary-loss-free balance).

Each block counts the tokens routed to each of its experts in every training forward
(pretrain/model/moe.py: `load`), and the auxiliary loss it added (`aux_sum`). The hook zeroes them
before a step, votes them into the step's one all-reduce (so the counts are every rank's, all
micro-batches: E numbers and one per block), and on the agreed counts, on the device:

- the load of expert i is its tokens over the block's mean (1.0 everywhere: a perfect balance);
  `moe/load_max` is the largest over experts and blocks, `moe/load_min` the smallest,
  `moe/top_share` the largest share of a block's tokens one expert takes, per block
  `moe/load_max/layer_N`; `moe/aux_loss` the auxiliary terms added to the loss (balancing and
  router z-loss, summed over blocks, the mean over micro-batches and ranks). They join the step's
  one host read (metrics.jsonl, TensorBoard, the monitor's report); at logged steps each block's
  loads also go to TensorBoard as a histogram (`moe/loads/layer_N`).
- with `balance: bias` or `both`, each block's bias moves by bias_rate · sign(mean − load): an
  overloaded expert's down, an underloaded one's up. Only when the step's update landed (a step
  DeepSpeed or the skip guard skipped leaves the bias as it was); every rank moves it alike. The
  bias is a module buffer: every checkpoint holds it and every load (a resume, a rollback) puts it back.
- for the monitor (rank 0, with the service on): per block its least loaded expert and the share of
  its tokens its most chosen expert takes, with their indices (`StepMetrics.experts`; the service
  warns when an expert collapses, monitoring/experts.py), computed on the host from the agreed
  counts the step's one host read already brought (`expert_loads`): no read of its own.
"""

from __future__ import annotations

import torch

from pretrain.monitor_link import MonitorLink
from pretrain.train.hooks import CONTINUE, Answer, StepHook

PREFIX = "moe/"


class ExpertBalance(StepHook):
    priority = 25  # before the monitor's: its report carries the loads (pretrain/train/hooks.py)

    def __init__(
        self, engine, writer, logged, world_size: int, grad_accum: int, link: MonitorLink | None = None
    ) -> None:
        self.engine, self.writer, self.logged, self.link = engine, writer, logged, link
        self.blocks = {i: block.mlp for i, block in enumerate(engine.module.layers) if block.routed}
        moe = next(iter(self.blocks.values())).moe
        self.experts, self.top_k = moe.experts, moe.top_k
        self.bias_rate = moe.bias_rate if moe.uses_bias else 0.0
        self.micro_batches = world_size * grad_accum  # forwards the aux sums cover, all ranks
        self.values: dict[str, torch.Tensor] = {}
        self.step_of_bias: torch.Tensor | None = None  # (blocks, E): the bias's move, if the update lands
        self.skipped_before = 0

    def before_step(self, step: int) -> None:
        device = self.engine.device
        for mlp in self.blocks.values():
            mlp.load = torch.zeros(self.experts, device=device)
            mlp.aux_sum = torch.zeros((), device=device)

    def vote(self) -> torch.Tensor:
        """Per block: its E counts, then its auxiliary loss sum."""
        return torch.cat([torch.cat([mlp.load, mlp.aux_sum.reshape(1)]) for mlp in self.blocks.values()])

    def agreed(self, step: int, vote: torch.Tensor) -> None:
        summed = vote.view(len(self.blocks), self.experts + 1)
        loads = summed[:, :-1]  # (blocks, E): tokens per expert, every rank, every micro-batch
        mean = loads.mean(dim=1, keepdim=True)
        share = loads / mean.clamp(min=1e-9)
        tokens = loads.sum(dim=1) / self.top_k
        self.values = {
            PREFIX + "load_max": share.max(),
            PREFIX + "load_min": share.min(),
            PREFIX + "top_share": (loads.max(dim=1).values / tokens.clamp(min=1)).max(),
            PREFIX + "aux_loss": summed[:, -1].sum() / self.micro_batches,
        }
        self.values |= {f"{PREFIX}load_max/layer_{i}": share[n].max() for n, i in enumerate(self.blocks)}
        self.skipped_before = self.engine.skipped_steps
        self.step_of_bias = self.bias_rate * torch.sign(mean - loads) if self.bias_rate else None

    def readings(self, step: int) -> dict[str, torch.Tensor]:
        if self.step_of_bias is not None and self.engine.skipped_steps == self.skipped_before:
            with torch.no_grad():
                for n, mlp in enumerate(self.blocks.values()):
                    mlp.router.bias += self.step_of_bias[n]
        self.step_of_bias = None
        return self.values

    def after_step(self, step: int, metrics: dict, batch_ids: list, vote: list[float]) -> Answer:
        if self.logged(step):
            counts = torch.tensor(vote).view(len(self.blocks), self.experts + 1)[:, :-1]
            for n, i in enumerate(self.blocks):
                load = counts[n] / counts[n].mean().clamp(min=1e-9)
                self.writer.histogram(f"{PREFIX}loads/layer_{i}", load, step)
        if self.link is not None:  # (the vote: host numbers already)
            self.link.note_experts(step, expert_loads(vote, list(self.blocks), self.experts, self.top_k))
        return CONTINUE


def expert_loads(vote: list[float], layers: list[int], experts: int, top_k: int) -> list[dict]:
    """The monitor's `StepMetrics.experts` from the agreed vote (per block its E token counts, then
    its auxiliary loss sum): per block its least loaded expert's tokens over the block's mean
    (`moe/load_min` is the smallest over blocks) and its most chosen expert's share of the block's
    tokens (`moe/top_share` the largest), each with the expert's index (the first, on a tie).
    Plain Python on the host numbers: no tensor is read."""
    out = []
    for n, layer in enumerate(layers):
        counts = vote[n * (experts + 1) : n * (experts + 1) + experts]
        low = min(range(experts), key=counts.__getitem__)
        high = max(range(experts), key=counts.__getitem__)
        mean, tokens = max(sum(counts) / experts, 1e-9), max(sum(counts) / top_k, 1.0)
        out.append(
            {
                "layer": layer,
                "load_min": counts[low] / mean,
                "min_expert": low,
                "top_share": counts[high] / tokens,
                "top_expert": high,
            }
        )
    return out


def expert_balance(parts, cadence, link: MonitorLink | None = None) -> list[StepHook]:
    """The hook for a run's parts (`RunParts`: engine, writer, env) as pretraining and fine-tuning
    build them (`link`: the monitor's, when the service is on); none for a dense model."""
    engine = parts.engine
    if not any(block.routed for block in engine.module.layers):
        return []
    grad_accum = engine.gradient_accumulation_steps()
    return [ExpertBalance(engine, parts.writer, cadence.logged, parts.env.world_size, grad_accum, link)]
