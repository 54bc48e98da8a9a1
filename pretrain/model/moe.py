"""A mixture of experts in place of a block's feed-forward (`model.moe`; docs/model.md, Mixture of
experts): token-choice top-k routing with softmax or sigmoid scores, no token dropped, routed
experts computed with grouped matrix products, optional shared experts, and the balancing of
DeepSeek-V3 (a per-expert bias on the scores that choose), of Switch/OLMoE/Qwen3 (an auxiliary
loss) or both, plus ST-MoE's router z-loss.

Read top-down: grouped products → router → experts → the layer. Shapes: N tokens (B·T), d d_model,
E experts (of this rank: E_local), K top_k, f expert_ffn_dim.

Where the experts run is not this module's business: the layer hands its tokens, sorted by expert,
to its `dispatch` (the attention core's pattern: `Attention.core`). `LocalDispatch`, the default,
runs every expert here; expert parallelism (`pretrain/parallel/experts.py`) installs one that sends
each token to the rank holding its expert and back. So the model runs unchanged on one rank, and
that one-rank model is the reference the split one is tested against.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.config import ModelConfig, MoEConfig

# --------------------------------------------------------------------------- grouped products


def grouped_products(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x (M, k) sorted by group, w (G, n, k), counts (G,) rows per group → (M, n): each group's rows
    times its matrix transposed, x[rows of g] @ w[g].T. One grouped GEMM (`grouped_mm`) where torch
    has one for these tensors, else a loop over the groups; the two give equal results (tested)."""
    if _grouped_mm_applies(x, w):
        offsets = counts.cumsum(0, dtype=torch.int32)
        return _grouped_mm()(x, w.transpose(-2, -1), offs=offsets)
    rows = x.split(counts.tolist())  # (a host read: the loop needs the sizes)
    return torch.cat([part @ w[g].T for g, part in enumerate(rows)])


def _grouped_mm():
    """torch's grouped GEMM: the public `F.grouped_mm` (torch 2.10+), else `torch._grouped_mm`."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _grouped_mm_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """torch's kernel takes these tensors: CPU tensors with 16-byte aligned rows and addresses
    (torch 2.9+'s CPU kernel refuses others), or bf16 on a CUDA device (its only dtype there)."""
    if _grouped_mm() is None:
        return False
    if x.is_cuda:
        return x.dtype == w.dtype == torch.bfloat16
    aligned = all(
        t.data_ptr() % 16 == 0 and all((s * t.element_size()) % 16 == 0 for s in t.stride()[:-1])
        for t in (x, w)
    )
    return aligned and x.device.type == "cpu"


# --------------------------------------------------------------------------- router


class Routing(NamedTuple):
    weights: torch.Tensor  # (N, K) fp32: how much each chosen expert's output counts
    experts: torch.Tensor  # (N, K) int64: the chosen experts, by score (+ bias)
    scores: torch.Tensor  # (N, E) fp32: softmax or sigmoid of the logits, unbiased
    logits: torch.Tensor  # (N, E) fp32


class Router(nn.Module):
    """Scores every expert (fp32 product and scores), chooses each token's top K on the scores
    plus the balancing `bias` (DeepSeek-V3: the bias changes which experts are chosen, never how
    much they count), weights them by their unbiased scores, normalised over the K when asked."""

    def __init__(self, d_model: int, moe: MoEConfig):
        super().__init__()
        self.gate = nn.Linear(d_model, moe.experts, bias=False)
        self.score, self.top_k, self.normalize = moe.router, moe.top_k, moe.normalize_top_k
        # the balancing bias: a buffer (saved in every checkpoint, never a gradient), kept in fp32
        self.register_buffer("bias", torch.zeros(moe.experts) if moe.uses_bias else None)

    def forward(self, x: torch.Tensor) -> Routing:
        logits = F.linear(x.float(), self.gate.weight.float())  # (N, E)
        scores = logits.sigmoid() if self.score == "sigmoid" else logits.softmax(dim=-1)
        choice = scores if self.bias is None else scores + self.bias
        experts = choice.topk(self.top_k, dim=-1).indices  # (N, K)
        weights = scores.gather(1, experts)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return Routing(weights, experts, scores, logits)

    def _apply(self, fn, recurse: bool = True):
        """The bias stays fp32 when the module is cast (DeepSpeed casts it to bf16, whose 8-bit
        mantissa would round away steps of `bias_rate`): its fp32 values, moved where `fn` put it."""
        bias = self.bias
        super()._apply(fn, recurse)
        if bias is not None and self.bias.dtype != torch.float32:
            self.bias = bias.to(device=self.bias.device)
        return self


# --------------------------------------------------------------------------- experts


class Experts(nn.Module):
    """`n` SwiGLU experts as two 3-D weights, transformers' layout: `w_in` (n, 2f, d) is each
    expert's [gate; up] (its `gate_up_proj`), `w_out` (n, d, f) its down projection."""

    def __init__(self, n: int, d_model: int, ffn_dim: int):
        super().__init__()
        self.w_in = nn.Parameter(torch.empty(n, 2 * ffn_dim, d_model))
        self.w_out = nn.Parameter(torch.empty(n, d_model, ffn_dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (M, d), sorted by expert, counts (n,) rows per expert → (M, d)."""
        gate, up = grouped_products(x, self.w_in, counts).chunk(2, dim=-1)  # (M, f) each
        return grouped_products(F.silu(gate) * up, self.w_out, counts)


class LocalDispatch:
    """Every expert on this rank: tokens sorted by expert go straight to them. `global_counts`:
    the tokens per expert of the whole data-parallel micro-batch, here this rank's (the
    balancing loss's f; expert parallelism sums them over every rank)."""

    def __call__(self, x: torch.Tensor, counts: torch.Tensor, experts: Experts) -> torch.Tensor:
        return experts(x, counts)

    def global_counts(self, counts: torch.Tensor) -> torch.Tensor:
        return counts


# --------------------------------------------------------------------------- the layer


class MoE(nn.Module):
    """The routed feed-forward: y = Σ_k w_k · expert_k(x) (+ the shared experts' SwiGLU)."""

    def __init__(self, cfg: ModelConfig, shared: nn.Module | None = None):
        super().__init__()
        moe = cfg.moe
        self.moe = moe
        self.router = Router(cfg.d_model, moe)
        self.experts = Experts(moe.experts, cfg.d_model, moe.expert_ffn_dim)
        self.shared = shared  # a FeedForward of shared_experts × expert_ffn_dim, or None
        self.dispatch = LocalDispatch()
        # What the step hook reads (pretrain/train/moe_hook.py), training forwards only: tokens
        # per expert (E,) and the auxiliary terms added to the loss, summed since it last zeroed them
        self.load: torch.Tensor | None = None
        self.aux_sum: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (B, T, d) → (y (B, T, d), the auxiliary loss: None outside training or when no term is on)."""
        B, T, d = x.shape
        flat = x.reshape(-1, d)
        route = self.router(flat)
        K = route.experts.shape[1]
        chosen = route.experts.reshape(-1)  # (N·K,)
        counts = torch.bincount(chosen, minlength=self.moe.experts)  # (E,)
        order = chosen.argsort(stable=True)  # the (token, k) slots sorted by expert
        routed = self.dispatch(flat[order // K], counts, self.experts)  # (N·K, d), in that order
        slots = torch.empty_like(routed)
        slots[order] = routed  # back to (token, k) order: a permutation, so deterministic
        weighted = slots.view(-1, K, d).float() * route.weights[..., None]  # (N, K, d)
        y = weighted.sum(dim=1).to(x.dtype).view(B, T, d)
        if self.shared is not None:
            y = y + self.shared(x)
        aux = self._aux_loss(route, counts, B) if self.training else None
        if self.training and torch.is_grad_enabled():
            self._record(counts, aux)
        return y, aux

    def _aux_loss(self, route: Routing, counts: torch.Tensor, batch: int) -> torch.Tensor | None:
        """The terms added to the training loss: the balancing loss (`balance: aux_loss` over the
        data-parallel micro-batch, `both` per sequence) and the router z-loss."""
        moe, parts = self.moe, []
        if moe.uses_aux_loss:
            if moe.balance == "aux_loss":
                loss = batch_balance_loss(route, self.dispatch.global_counts(counts.float()))
            else:
                loss = sequence_balance_loss(route, batch)
            parts.append(moe.aux_loss_coef * loss)
        if moe.router_z_loss > 0:
            parts.append(moe.router_z_loss * torch.logsumexp(route.logits, dim=-1).pow(2).mean())
        return sum(parts) if parts else None

    @torch.no_grad()
    def _record(self, counts: torch.Tensor, aux: torch.Tensor | None) -> None:
        """Add a training forward's counts and auxiliary loss to what the step hook reads, never
        twice for one micro-batch (a checkpointed block runs its forward again inside the backward
        pass: there the graph task id is not -1)."""
        if torch._C._current_graph_task_id() != -1:
            return
        if self.load is None or self.load.device != counts.device:
            self.load = torch.zeros(self.moe.experts, device=counts.device)
            self.aux_sum = torch.zeros((), device=counts.device)
        self.load += counts
        if aux is not None:
            self.aux_sum += aux.detach().float()

    @torch.no_grad()
    def reset_parameters(self, std: float, residual_std: float) -> None:
        """The model's init rule: normal(std) for what reads the residual stream, std/√(2L) for
        what writes into it (the experts' down projections)."""
        nn.init.normal_(self.router.gate.weight, std=std)
        nn.init.normal_(self.experts.w_in, std=std)
        nn.init.normal_(self.experts.w_out, std=residual_std)
        if self.router.bias is not None:
            self.router.bias.zero_()
        if self.shared is not None:
            nn.init.normal_(self.shared.in_proj.weight, std=std)
            nn.init.normal_(self.shared.out_proj.weight, std=residual_std)


def normalized_scores(route: Routing) -> torch.Tensor:
    """(N, E) scores summing to 1 over the experts (sigmoid ones divided by their sum; DeepSeek-V3's s')."""
    return route.scores / route.scores.sum(dim=-1, keepdim=True)


def batch_balance_loss(route: Routing, counts: torch.Tensor) -> torch.Tensor:
    """Σ_i f_i·P_i (Switch, OLMoE; with every rank's counts, Qwen3's global-batch balance): f_i =
    E·counts_i / (K·tokens) from `counts` (E,), P_i this rank's mean normalised score of expert i.
    1.0 when the load is even."""
    E = route.scores.shape[1]
    f = counts * E / counts.sum().clamp(min=1)  # Σ counts = K·tokens: f_i = E·c_i / (K·tokens)
    return (f * normalized_scores(route).mean(dim=0)).sum()


def sequence_balance_loss(route: Routing, batch: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss: Σ_i f_i·P_i within each sequence, averaged over
    the `batch` sequences."""
    N, E = route.scores.shape
    K = route.experts.shape[1]
    T = N // batch
    slots = route.experts.view(batch, T * K)
    chosen = route.scores.new_zeros(batch, E).scatter_add_(1, slots, route.scores.new_ones(slots.shape))
    f = chosen * E / (K * T)
    P = normalized_scores(route).view(batch, T, E).mean(dim=1)
    return (f * P).sum(dim=1).mean()
