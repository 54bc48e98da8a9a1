"""The step hook that measures the instability precursors every `logging.precursors_every` steps
(pretrain/stability/precursors.py says what each is and how it is computed against a direct computation).

On a measuring step it copies the fp32 master weights it needs just before the update lands
(`before_update`) and, after it, reads the update/weight RMS ratios and probes the model with the
first `logging.precursor_tokens` tokens of this rank's last micro-batch. Every value joins the
step's one host read (`readings`): per layer `stability/attn_logit_max/layer_{i}`, the output
logits' `stability/logit_lse_mean`, `stability/logit_lse_max` and `stability/logit_abs_max`, per
group `stability/update_ratio/{group}`, and two summaries the monitoring service grades against
their own bands: `stability/attn_logit_max` (over layers) and `stability/update_ratio_max` (over
groups). TensorBoard gets them at every measuring step, metrics.jsonl and the service's report too.
Every rank measures (the ratios end with an all-reduce; under ZeRO-3 the probe gathers).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pretrain.parallel.sequence import own_document_ids, unsplit
from pretrain.stability.precursors import PREFIX, UpdateRatios, forward_precursors
from pretrain.train.hooks import CONTINUE, Answer, StepHook


class InstabilityPrecursors(StepHook):
    """`logging.precursors_every`: what grows before a divergence, measured every N steps and read
    with the step (`pretrain/stability/precursors.py`)."""

    priority = 20  # (the order of the hooks: pretrain/train/hooks.py)

    def __init__(self, engine, every: int, tokens: int, writer, logged: Callable[[int], bool]) -> None:
        self.engine, self.every, self.tokens, self.writer = engine, every, tokens, writer
        self.logged = logged  # whether the loop writes a step's scalars itself
        self.ratios = UpdateRatios(engine.module)
        self.batch: dict[str, torch.Tensor] | None = None

    def before_update(self, step: int, mean_loss: torch.Tensor, batch: dict[str, torch.Tensor]) -> None:
        if step % self.every == 0:
            self.batch = batch
            self.ratios.before_step()

    def readings(self, step: int) -> dict[str, torch.Tensor]:
        if self.batch is None:
            return {}
        batch, self.batch = self.batch, None
        values = self.ratios.after_step()
        # parallel.sequence: a prefix of this rank's own shard, attended to locally (rank 0's is
        # the window's); the logits depend on positions' offsets only, as in training
        with unsplit(self.engine.module):
            values |= forward_precursors(
                self.engine.module, batch["tokens"], own_document_ids(batch), max_tokens=self.tokens
            )
        return values | summaries(values)

    def after_step(self, step: int, metrics: dict, batch_ids: list, vote: float) -> Answer:
        if step % self.every == 0 and not self.logged(step):
            self.writer.scalars(step, {k: v for k, v in metrics.items() if k.startswith(PREFIX)})
        return CONTINUE


def summaries(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The largest attention logit over layers and the largest update ratio over groups (device)."""
    out = {}
    for name in ("attn_logit_max", "update_ratio"):
        parts = [v for k, v in values.items() if k.startswith(f"{PREFIX}{name}/")]
        if parts:
            out[f"{PREFIX}{name.removesuffix('_max')}_max"] = torch.stack([p.float() for p in parts]).max()
    return out
