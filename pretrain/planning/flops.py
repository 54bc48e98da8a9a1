"""Parameter counts, training FLOPs per token, and model FLOPs utilization (MFU).

FLOPs per token follow PaLM (appendix B) and torchtitan: 6·N + 12·L·nh·hd·T, where N counts the
parameters that take part in matrix products: every parameter except the input embeddings
(token, and learned positions), with the LM head counted once whether or not it is tied to the
token embedding. With experts (`model.moe`) N counts what one token uses, its active parameters:
the router, its top_k routed experts and the shared ones, not the other routed experts. 6 = 2 FLOPs per multiply-add × (forward + 2× backward). The attention term
counts QK^T and AV over the full T×T (as PaLM does; causal kernels skip about half of it).

MFU = achieved FLOPs/s ÷ the device's peak dense bf16 FLOPs/s. It never counts recomputation
(activation checkpointing) as useful work, nor the optimizer's: with `optim.name: muon` the
Newton–Schulz iterations (`newton_schulz_flops`, per optimizer step) are left out of MFU, as
PaLM's model FLOPs leave out everything but the model.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from pretrain.config import ModelConfig
from pretrain.errors import UserError

# Dense bf16 tensor-core peaks in FLOP/s (no sparsity), from the vendors' datasheets.
PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
}


@dataclass(frozen=True, kw_only=True)
class ParamCounts:
    embedding: int  # token embedding
    positions: int  # learned position embedding (0 for rope / sinusoidal)
    attention: int  # q, k, v and output projections, all layers
    feed_forward: int  # all layers: dense, shared experts and every routed expert
    norms: int  # every norm's weights (and biases for LayerNorm)
    lm_head: int  # 0 when tied: the head is the embedding matrix
    total: int  # unique parameters
    non_embedding: int  # total - embedding - positions (Kaplan et al.'s N)
    router: int = 0  # the MoE blocks' routers (d_model × experts each)
    experts: int = 0  # the routed experts, all of them (in feed_forward)
    active: int = 0  # what one token uses: total less the routed experts it is not routed to


@dataclass(frozen=True)
class FeedForwardCounts:
    """The feed-forward parameters of all blocks, and of the routed experts among them."""

    total: int  # dense blocks, shared and routed experts
    router: int
    routed: int  # every routed expert
    idle: int  # the routed experts a token is not sent to (routed × (E − K) / E)


def feed_forward_counts(cfg: ModelConfig) -> FeedForwardCounts:
    d, L, moe = cfg.d_model, cfg.n_layers, cfg.moe
    matrices = 3 if cfg.activation == "swiglu" else 2
    if moe is None:
        return FeedForwardCounts(L * matrices * d * cfg.d_ff, 0, 0, 0)
    routed_blocks = L - moe.dense_layers
    expert = 3 * d * moe.expert_ffn_dim
    routed = routed_blocks * moe.experts * expert
    shared = routed_blocks * moe.shared_experts * expert
    total = moe.dense_layers * matrices * d * cfg.d_ff + shared + routed
    idle = routed_blocks * (moe.experts - moe.top_k) * expert
    return FeedForwardCounts(total, routed_blocks * d * moe.experts, routed, idle)


def param_counts(cfg: ModelConfig) -> ParamCounts:
    d, L = cfg.d_model, cfg.n_layers
    attention = L * (d * (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim + cfg.n_heads * cfg.head_dim * d)
    ffn = feed_forward_counts(cfg)
    per_norm = d * (2 if cfg.norm == "layernorm" else 1)
    norms = per_norm * (2 * L + (1 if cfg.norm_placement == "pre" else 0))
    norms += 2 * L * cfg.head_dim if getattr(cfg, "qk_norm", False) else 0  # each layer's query and key norm
    embedding = cfg.vocab_size * d
    positions = cfg.max_seq_len * d if cfg.positions == "learned" else 0
    lm_head = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    total = embedding + positions + attention + ffn.total + ffn.router + norms + lm_head
    return ParamCounts(
        embedding=embedding,
        positions=positions,
        attention=attention,
        feed_forward=ffn.total,
        norms=norms,
        lm_head=lm_head,
        total=total,
        non_embedding=total - embedding - positions,
        router=ffn.router,
        experts=ffn.routed,
        active=total - ffn.idle,
    )


def largest_parameter(cfg: ModelConfig) -> int:
    """Elements of the model's largest parameter tensor: the embedding or head, q/k/v, or the
    feed-forward's input projection (SwiGLU's gate and up are one matrix)."""
    d, hd = cfg.d_model, cfg.head_dim
    return max(
        cfg.vocab_size * d,
        cfg.max_seq_len * d if cfg.positions == "learned" else 0,
        (cfg.n_heads + 2 * cfg.n_kv_heads) * hd * d,
        (2 if cfg.activation == "swiglu" else 1) * cfg.d_ff * d,
        2 * cfg.moe.experts * cfg.moe.expert_ffn_dim * d if cfg.moe else 0,  # every expert's [gate; up]
    )


def describe_model(cfg: ModelConfig) -> str:
    """How the console names a model: its size and shape (a preset's name may no longer fit it
    once fields are overridden)."""
    counts = param_counts(cfg)
    active = f", {_size(counts.active)} active" if cfg.moe else ""
    return f"a {_size(counts.total)}-parameter model ({cfg.n_layers} layers, d_model {cfg.d_model}{active})"


def _size(count: int) -> str:
    return f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.1f}M"


@dataclass(frozen=True)
class FlopsBreakdown:
    """Training FLOPs per token by part; the parts add up to `total`."""

    attention_projections: int
    attention_scores: int  # QK^T
    attention_weighted_sum: int  # AV
    feed_forward: int  # the parameters a token uses: dense, shared, its top_k routed experts
    lm_head: int
    norms: int
    router: int = 0

    @property
    def total(self) -> int:
        return sum(asdict(self).values())


def flops_per_token(cfg: ModelConfig, seq_len: int, counts: ParamCounts | None = None) -> FlopsBreakdown:
    counts = counts or param_counts(cfg)
    attention_matmul = 6 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len  # each of QK^T and AV
    idle = counts.total - counts.active  # the routed experts a token is not sent to
    return FlopsBreakdown(
        attention_projections=6 * counts.attention,
        attention_scores=attention_matmul,
        attention_weighted_sum=attention_matmul,
        feed_forward=6 * (counts.feed_forward - idle),
        lm_head=6 * cfg.vocab_size * cfg.d_model,
        norms=6 * counts.norms,
        router=6 * counts.router,
    )


def matmul_params(cfg: ModelConfig, counts: ParamCounts | None = None) -> int:
    """N in 6·N: non-embedding parameters a token uses (with experts, its active ones), plus the
    LM head when it is tied (counted once)."""
    counts = counts or param_counts(cfg)
    idle = counts.total - counts.active
    return counts.non_embedding - idle + (cfg.vocab_size * cfg.d_model if cfg.tie_embeddings else 0)


def newton_schulz_flops(cfg: ModelConfig, method: str = "gram", steps: int = 5) -> int:
    """FLOPs of Muon's Newton–Schulz iterations per optimizer step, over every block matrix (under
    ZeRO-1/2 each rank does those of its partition). For a matrix n × m with n ≤ m: `standard`
    (X ← aX + (bA + cA²)X, A = XXᵀ) 4n²m + 2n³ per iteration; `gram` (DeepSpeed's: the iteration
    on R = XXᵀ, restarted at the third) 8n²m + 28n³ for 5 iterations, `standard`'s on a square."""
    d, hd = cfg.d_model, cfg.head_dim
    shapes = [
        ((cfg.n_heads + 2 * cfg.n_kv_heads) * hd, d),
        (d, cfg.n_heads * hd),
        ((2 if cfg.activation == "swiglu" else 1) * cfg.d_ff, d),
        (d, cfg.d_ff),
    ]
    total = 0
    for rows, cols in shapes:
        n, m = min(rows, cols), max(rows, cols)
        if method == "gram" and m > n and steps == 5:
            total += 8 * n * n * m + 28 * n**3
        else:
            total += steps * (4 * n * n * m + 2 * n**3)
    return cfg.n_layers * total


def mfu(tokens_per_sec: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilization in [0, 1] (per device: pass that device's tokens/s)."""
    return tokens_per_sec * flops_per_token / peak_flops


def peak_flops_for(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s for a device name such as 'NVIDIA H100 80GB HBM3'; None if unknown."""
    upper = device_name.upper()
    for key, value in PEAK_FLOPS.items():
        if key in upper:
            return value
    return None


def current_device_peak_flops() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return peak_flops_for(torch.cuda.get_device_name())


def flops_report(
    cfg: ModelConfig,
    seq_len: int,
    tokens_per_sec: float | None = None,
    device: str | None = None,
    peak_flops: float | None = None,
) -> dict:
    """Everything `pretrain flops --json` prints: counts and FLOPs per token; with a measured
    tokens/s and a peak (a device name from PEAK_FLOPS, or a number), the MFU."""
    for flag, value in (
        ("--seq-len", seq_len),
        ("--tokens-per-sec", tokens_per_sec),
        ("--peak-flops", peak_flops),
    ):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise UserError(f"{flag} {value} must be a positive number")
    if device is not None:
        peak_flops = peak_flops_for(device)
        if peak_flops is None:
            raise UserError(
                f"--device {device!r}: no known peak; use one of {', '.join(PEAK_FLOPS)} or --peak-flops"
            )
    counts = param_counts(cfg)
    breakdown = flops_per_token(cfg, seq_len, counts)
    report = {
        "params": counts.total,
        "active_params": counts.active,
        "non_embedding_params": counts.non_embedding,
        "matmul_params": matmul_params(cfg, counts),
        "seq_len": seq_len,
        "flops_per_token": breakdown.total,
        "breakdown": asdict(breakdown),
        "param_breakdown": asdict(counts),
        "model": cfg.preset,
        "peak_flops": peak_flops,
    }
    if tokens_per_sec is not None:
        if peak_flops is None:
            raise UserError("--tokens-per-sec needs --device NAME or --peak-flops F to compute MFU")
        report |= {"tokens_per_sec": tokens_per_sec, "mfu": mfu(tokens_per_sec, breakdown.total, peak_flops)}
    return report


def format_report(report: dict) -> str:
    """`pretrain flops` without --json: the report as lines for people."""
    total = report["flops_per_token"]
    lines = [
        f"model {report['model']}: {report['params'] / 1e6:.1f}M params "
        f"({report['non_embedding_params'] / 1e6:.1f}M non-embedding"
        + (
            f", {report['active_params'] / 1e6:.1f}M active"
            if report["active_params"] != report["params"]
            else ""
        )
        + f"), seq_len {report['seq_len']}",
        f"training FLOPs per token: {total / 1e6:.1f}M  (6·N with N = {report['matmul_params'] / 1e6:.1f}M, plus attention)",
    ]
    lines += [
        f"  {part:<24} {value / 1e6:>12.1f}M  {100 * value / total:5.1f}%"
        for part, value in report["breakdown"].items()
    ]
    if "mfu" in report:
        lines.append(
            f"MFU at {report['tokens_per_sec']:,.0f} tokens/s per device: "
            f"{100 * report['mfu']:.1f}% of {report['peak_flops'] / 1e12:.0f} TFLOP/s"
        )
    return "\n".join(lines)
