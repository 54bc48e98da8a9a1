"""The reference the Muon tests hold DeepSpeed to: one process, Muon for `muon_groups`' Muon
groups as DeepSpeed 0.19.8 applies it under ZeRO-1/2 (the rule in pretrain/optim/muon.py,
`muon_direction`: written from the algorithm, and checked against torch.optim.Muon in
tests/unit/test_optimizers.py), torch.optim.AdamW for the rest."""

from __future__ import annotations

import torch

from pretrain.optim.muon import muon_direction


class ReferenceMuon(torch.optim.Optimizer):
    """Muon on whole matrices: per step, momentum, Nesterov, Newton–Schulz (in `ns_compute_dtype`,
    default DeepSpeed's for the method), the shape rule, then decoupled weight decay and the step."""

    def __init__(self, groups: list[dict], ns_compute_dtype: torch.dtype | None = None) -> None:
        super().__init__([g for g in groups if g["use_muon"]], {})
        self.dtype = ns_compute_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                update = muon_direction(
                    p.grad, state["momentum_buffer"], group["momentum"], group["ns_method"], self.dtype
                )
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-group["lr"])
        return loss


def reference_optimizers(groups: list[dict], ns_compute_dtype=None) -> list[torch.optim.Optimizer]:
    """The reference for `muon_groups`' groups, in their order: ReferenceMuon, then
    torch.optim.AdamW (foreach off: DeepSpeed's AdamW half steps one flat tensor per group)."""
    adamw = [{k: v for k, v in g.items() if k != "use_muon"} for g in groups if not g["use_muon"]]
    return [ReferenceMuon(groups, ns_compute_dtype), torch.optim.AdamW(adamw, foreach=False)]
