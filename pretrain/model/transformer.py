"""A Llama-style decoder in plain PyTorch, with switches for the classic Transformer recipe.

Read top-down: norms → rotary/sinusoidal positions → attention → feed-forward → block → model.
Defaults are Llama ("Transformer++"): pre-RMSNorm, RoPE, SwiGLU, no biases. The switches
(`norm`, `norm_placement`, `activation`, `positions` in `ModelConfig`) give the original
Vaswani et al. recipe on the same code, so the two can be compared at equal size and tokens.

Against training instabilities (Wortsman et al. 2023; both off by default, and then not a single
operation of the default path changes): `qk_norm` puts an RMSNorm with a learned weight over
head_dim on each head's queries and keys before the rotation, as Qwen3 does (OLMo 2 normalizes
the whole query and key projections, all heads at once), so the attention logits cannot grow
without bound; the z-loss (`pretrain/model/loss.py`) keeps the output logits' log-normaliser near 0. The z-loss coefficient is part of the objective, not of the
architecture, so it is not in `ModelConfig`: it is the attribute `Transformer.z_loss` (a
constructor argument, 0.0 by default), which pretraining sets from `loss.z_loss` when it builds
the model. It is added in training mode only, like dropout: in eval mode (held-out evaluation,
`pretrain eval`) the loss is the plain cross-entropy.

With `model.moe`, the blocks from `moe.dense_layers` on route each token to experts
(`pretrain/model/moe.py`); their auxiliary losses (balancing, router z-loss) join the loss as the
z-loss does, in training mode only. Off (null), not one operation of the dense path changes.

Nothing here knows about DeepSpeed, data or processes: the engine wraps this module as it is.
Shapes: B batch, T sequence, d d_model, nh query heads, nkv key/value heads, hd head_dim, V vocab.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from pretrain.config import ModelConfig, RopeScaling
from pretrain.model.loss import linear_cross_entropy
from pretrain.model.moe import MoE


class ModelOutput(NamedTuple):
    logits: torch.Tensor | None  # (B, T, V); None when targets are given (the loss never forms them)
    loss: torch.Tensor | None  # mean cross-entropy over non-ignored targets (+ z-loss), given targets
    attentions: tuple[torch.Tensor, ...] | None  # per layer (B, nh, T, T), when need_weights=True


# --------------------------------------------------------------------------- norms


class RMSNorm(nn.Module):
    """x / rms(x) · g. Computed in fp32 and cast back, so bf16 activations keep their scale."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)


# --------------------------------------------------------------------------- positions


def rope_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None = None, device=None
) -> torch.Tensor:
    """The rotary frequencies (radians per position), (hd/2,): θ^(-2i/hd), rescaled by
    `model.rope_scaling` for a context longer than the one trained at (docs/model.md, Rope
    scaling). `linear` divides each by the factor (position interpolation). `llama3` (Llama 3.1)
    divides only the low frequencies, whose wavelength 2π/f exceeds original/low_freq_factor (they
    never made a full turn in training), keeps the high ones, below original/high_freq_factor (many
    turns: local order), and blends the ones between by where original/wavelength lies between."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if scaling is None:
        return inv_freq
    factor = scaling.factor
    if scaling.type == "linear":
        return inv_freq / factor
    original, low, high = (
        scaling.original_max_position_embeddings,
        scaling.low_freq_factor,
        scaling.high_freq_factor,
    )
    wavelength = 2 * math.pi / inv_freq
    smooth = (original / wavelength - low) / (high - low)  # 0 at the low band's edge, 1 at the high one's
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelength > original / low, inv_freq / factor, blended)
    return torch.where(wavelength < original / high, inv_freq, scaled)


def rope_tables(
    seq_len: int, head_dim: int, theta: float, device=None, scaling: RopeScaling | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each (T, hd), in the half-split layout Llama checkpoints use."""
    inv_freq = rope_frequencies(head_dim, theta, scaling, device)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)  # (T, hd/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, hd)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (x_i, x_{i+hd/2}) pair by its position's angle: q·k then depends only on the offset."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def sinusoidal_table(seq_len: int, dim: int, device=None) -> torch.Tensor:
    """Vaswani et al.'s fixed positional encoding, (T, d): sin on even channels, cos on odd ones."""
    position = torch.arange(seq_len, device=device, dtype=torch.float32)[:, None]  # (T, 1)
    freq = torch.exp(torch.arange(0, dim, 2, device=device, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(seq_len, dim, device=device)
    table[:, 0::2] = torch.sin(position * freq)
    table[:, 1::2] = torch.cos(position * freq)
    return table


# --------------------------------------------------------------------------- attention


def attention_with_probs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention written out, returning the probabilities too (for visualization only).

    q (B, nh, T, hd); k, v (B, nkv, T, hd). Query head h reads key/value head h // (nh / nkv).
    `allowed` (B, 1, T, T), when given, replaces the causal mask (document masking).
    """
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)  # (B, nh, T, hd)
    v = v.repeat_interleave(groups, dim=1)
    T = q.shape[2]
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5  # (B, nh, T, T)
    if allowed is None:
        allowed = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = scores.float().softmax(dim=-1).to(q.dtype)
    return probs @ v, probs


# Document masking: a token attends to the earlier tokens of its own document only. On GPUs the mask
# is a FlexAttention block mask (blocks wholly outside a document are skipped, no T×T tensor); on
# CPU, where FlexAttention has no backward, a boolean (B, 1, T, T) mask for SDPA.
MASK_KINDS = ("auto", "flex", "dense")  # Transformer.masked_attention


def positions_in_document(document_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) document ids → (B, T) positions that restart at 0 at each document's first token."""
    T = document_ids.shape[1]
    index = torch.arange(T, device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return index - torch.where(starts, index, 0).cummax(dim=1).values


def document_mask(document_ids: torch.Tensor, kind: str = "auto"):
    """What each query may attend to: causal and within its document. `kind` "flex": a
    FlexAttention BlockMask; "dense": a boolean (B, 1, T, T) tensor; "auto": flex on CUDA, dense
    elsewhere."""
    B, T = document_ids.shape
    if kind == "auto":
        kind = "flex" if document_ids.is_cuda else "dense"
    if kind == "flex":
        from torch.nn.attention.flex_attention import create_block_mask

        def same_document_causal(b, h, q, kv):
            return (q >= kv) & (document_ids[b, q] == document_ids[b, kv])

        return create_block_mask(same_document_causal, B, None, T, T, device=document_ids.device)
    if kind != "dense":
        raise ValueError(f"mask kind {kind!r}: use one of {', '.join(MASK_KINDS)}")
    causal = torch.ones(T, T, dtype=torch.bool, device=document_ids.device).tril()
    return (document_ids[:, None, :, None] == document_ids[:, None, None, :]) & causal


_compiled_flex = None


def flex_attention(q, k, v, block_mask, enable_gqa: bool) -> torch.Tensor:
    """FlexAttention, compiled once per process (eager FlexAttention materializes the scores). On
    CPU, torch runs its forward only (no backward): enough for evaluation and for the tests that
    prove this path against dense attention without a GPU."""
    global _compiled_flex
    from torch.nn.attention import flex_attention as flex

    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex.flex_attention, dynamic=False)
    return _compiled_flex(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)


# SDPA's backends in the order tried on CUDA (`engine.attention`, `prefer_attention`): cuDNN's first
# (on Hopper training shapes 1.7-2.3x FlashAttention-2: transformers PR #48163), then flash,
# memory-efficient and math, each where it supports the call; "flash": torch's own order. A
# process-wide choice, as torch's own backend switches are; CPU kernels are not affected.
SDPA_ORDERS = {
    "cudnn": (
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.MATH,
    ),
    "flash": None,
}
_sdpa_order = SDPA_ORDERS["cudnn"]


def prefer_attention(first: str) -> None:
    """Which SDPA backend CUDA tries first from now on (a key of SDPA_ORDERS)."""
    global _sdpa_order
    _sdpa_order = SDPA_ORDERS[first]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, order=None, **kwargs) -> torch.Tensor:
    """scaled_dot_product_attention with its backends tried in `order` (None: torch's own). The
    context manager compiles into the graph (0 graph breaks: tests/unit/test_compiled_path.py)."""
    if order is None:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    with sdpa_kernel(list(order), set_priority=True):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None, causal: bool = True):
    """The attention core of `Attention` (its `core`, which sequence parallelism swaps for DeepSpeed's
    Ulysses around this one: `pretrain/parallel/sequence.py`). q (B, nh, T, hd); k, v (B, nkv, S,
    hd) → (B, nh, T, hd). `mask`: None (causal when `causal`), a dense boolean mask or a block mask
    (`document_mask`)."""
    gqa = k.shape[1] != q.shape[1]
    order = _sdpa_order if q.is_cuda else None
    if isinstance(mask, torch.Tensor):
        return sdpa(q, k, v, order, attn_mask=mask, enable_gqa=gqa)
    if mask is not None:
        return flex_attention(q, k, v, mask, gqa)
    # Fused kernels (cuDNN / flash / memory-efficient on GPU); the T×T matrix never exists.
    return sdpa(q, k, v, order, is_causal=causal, enable_gqa=gqa)


class KVCache:
    """Keys and values of the tokens seen so far, for incremental decoding: prefill once from empty,
    then one token per forward call. (L, B, nkv, max_len, hd) each; `length` tokens are filled."""

    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int, dtype: torch.dtype, device=None):
        shape = (cfg.n_layers, batch_size, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + k.shape[2]
        self.k[layer, :, :, self.length : end] = k
        self.v[layer, :, :, self.length : end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]  # (B, nkv, length + T, hd)


class Attention(nn.Module):
    """Causal self-attention with optional grouped-query heads (n_kv_heads < n_heads)."""

    def __init__(self, cfg: ModelConfig, layer_index: int = 0):
        super().__init__()
        self.layer_index = layer_index
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        # One matmul for q, k and v: rows [q heads | k heads | v heads].
        self.qkv_proj = nn.Linear(
            cfg.d_model, (self.n_heads + 2 * self.n_kv_heads) * self.head_dim, bias=False
        )
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.d_model, bias=False)
        # QK-norm: an RMSNorm over head_dim with one learned weight for all query heads, one for all
        # key heads (Qwen3's q_norm / k_norm); None without it, so the parameters are unchanged.
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        # q, k, v → the heads' outputs: `local_attention`, or a module around it (sequence parallelism)
        self.core = local_attention

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        need_weights: bool = False,
        cache: KVCache | None = None,
        mask=None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`rope`: cos and sin, broadcastable to (B, T, heads, hd); `mask`: None (causal), or a
        document mask from `document_mask`."""
        B, T, _ = x.shape
        qkv = self.qkv_proj(x).view(B, T, self.n_heads + 2 * self.n_kv_heads, self.head_dim)
        qk, v = qkv.split([self.n_heads + self.n_kv_heads, self.n_kv_heads], dim=2)
        if self.q_norm is None:
            if rope is not None:  # q and k heads rotated together: one pass instead of two
                cos, sin = rope
                qk = apply_rope(qk, cos, sin)  # (B, T, nh + nkv, hd)
            q, k = qk.split([self.n_heads, self.n_kv_heads], dim=2)
        else:  # each head's queries and keys normalized over hd, then rotated
            q, k = qk.split([self.n_heads, self.n_kv_heads], dim=2)
            q, k = self.q_norm(q), self.k_norm(k)
            if rope is not None:
                cos, sin = rope
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, hd)
        causal = True
        if cache is not None:
            causal = cache.length == 0  # prefill is causal; a decoded token sees everything cached
            k, v = cache.append(self.layer_index, k, v)  # (B, nkv, length + T, hd)
        probs = None
        if need_weights:
            y, probs = attention_with_probs(q, k, v, mask)
        else:  # (decoding with a cache reads this process's own sequence: the local core)
            y = (self.core if cache is None else local_attention)(q, k, v, mask, causal)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, nh·hd)
        return self.o_proj(y), probs


# --------------------------------------------------------------------------- feed-forward


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) · up(x)); or the classic down(act(up(x))) with GELU/ReLU."""

    def __init__(self, cfg: ModelConfig, d_ff: int | None = None):
        """`d_ff`: the hidden size, model.d_ff unless given (the shared experts' is theirs)."""
        super().__init__()
        d_ff = d_ff or cfg.d_ff
        self.activation = cfg.activation
        self.gated = cfg.activation == "swiglu"
        # For SwiGLU, gate and up share one matmul: rows [gate | up].
        self.in_proj = nn.Linear(cfg.d_model, (2 if self.gated else 1) * d_ff, bias=False)
        self.out_proj = nn.Linear(d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.in_proj(x)  # (B, T, d_ff) or (B, T, 2·d_ff)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        elif self.activation == "gelu":
            h = F.gelu(h)
        else:
            h = F.relu(h)
        return self.out_proj(h)


# --------------------------------------------------------------------------- block and model


class LMHead(nn.Linear):
    """The output projection. Given targets it returns the loss straight from the hidden states
    (`pretrain/model/loss.py`: chunked, no full-vocabulary logits); otherwise the logits. The weight is
    used only inside this module's forward, so ZeRO-3 gathers it here like any layer's. `z_loss`:
    the z-loss coefficient added to the loss; `kernel`: the loss's (`linear_cross_entropy`)."""

    def forward(
        self,
        h: torch.Tensor,
        targets: torch.Tensor | None = None,
        z_loss: float = 0.0,
        kernel: str = "chunked",
    ) -> torch.Tensor:
        if targets is None:
            return super().forward(h)
        flat = h.flatten(0, -2)
        return linear_cross_entropy(flat, self.weight, targets.flatten(), z_loss=z_loss, kernel=kernel)


def feed_forward(cfg: ModelConfig, layer_index: int) -> nn.Module:
    """A block's feed-forward: the dense SwiGLU, or from `model.moe.dense_layers` on a mixture of
    experts (pretrain/model/moe.py) with its shared experts' SwiGLU."""
    moe = cfg.moe
    if moe is None or layer_index < moe.dense_layers:
        return FeedForward(cfg)
    shared = FeedForward(cfg, moe.shared_experts * moe.expert_ffn_dim) if moe.shared_experts else None
    return MoE(cfg, shared)


class Block(nn.Module):
    """pre: x + f(norm(x)) (Llama, GPT-2+); post: norm(x + f(x)) (Vaswani et al.). With experts, f
    also gives the routing's auxiliary loss, which the block returns beside its output."""

    def __init__(self, cfg: ModelConfig, layer_index: int = 0):
        super().__init__()
        self.pre_norm = cfg.norm_placement == "pre"
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg, layer_index)
        self.mlp_norm = make_norm(cfg)
        self.mlp = feed_forward(cfg, layer_index)
        self.routed = isinstance(self.mlp, MoE)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        need_weights: bool = False,
        cache: KVCache | None = None,
        mask=None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(x, attention probabilities when asked, the experts' auxiliary loss or None)."""
        if self.pre_norm:
            a, probs = self.attn(self.attn_norm(x), rope, need_weights, cache, mask)
            x = x + a
            m, aux = self.feed_forward(self.mlp_norm(x))
            x = x + m
        else:
            a, probs = self.attn(x, rope, need_weights, cache, mask)
            x = self.attn_norm(x + a)
            m, aux = self.feed_forward(x)
            x = self.mlp_norm(x + m)
        return x, probs, aux

    def feed_forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.mlp(x) if self.routed else (self.mlp(x), None)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, z_loss: float = 0.0):
        super().__init__()
        self.cfg = cfg
        # loss.z_loss: c · mean (log Z)² added to the training loss (training mode only; see the top)
        self.z_loss = z_loss
        # loss.kernel: how the fused head and loss compute (pretrain/model/loss.py KERNELS)
        self.loss_kernel = "chunked"
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_embeddings = (
            nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.positions == "learned" else None
        )
        # Vaswani et al. scale token embeddings by sqrt(d) so they are not drowned by the unit-size sinusoids.
        self.embed_scale = math.sqrt(cfg.d_model) if cfg.positions == "sinusoidal" else 1.0
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        # Post-norm blocks already end in a norm; pre-norm needs one before the head.
        self.norm = make_norm(cfg) if cfg.norm_placement == "pre" else nn.Identity()
        self.lm_head = LMHead(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_embeddings.weight
        # Position tables are derived, not learned: kept out of the state dict.
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.register_buffer("pos_table", torch.empty(0), persistent=False)
        # The experts' auxiliary losses of the last forward (training mode; `hidden_states`),
        # which `forward` adds to the loss given targets: None for a dense model
        self.aux_loss: torch.Tensor | None = None
        # How document_ids become an attention mask (MASK_KINDS): "auto" takes FlexAttention on
        # CUDA and a dense mask elsewhere; tests set "flex" to run the GPU's path on a CPU.
        self.masked_attention = "auto"
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, init_std) everywhere; the projections that write into the residual stream
        (o_proj, out_proj) get init_std/sqrt(2·n_layers) so the residual's variance stays O(1)
        with depth (GPT-2). Rebuilds the position tables on the parameters' device, so it can be
        re-run after creating the model on the meta device and moving it."""
        cfg = self.cfg
        std, residual_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)
        nn.init.normal_(self.tok_embeddings.weight, std=std)
        if self.pos_embeddings is not None:
            nn.init.normal_(self.pos_embeddings.weight, std=std)
        for layer in self.layers:
            nn.init.normal_(layer.attn.qkv_proj.weight, std=std)
            nn.init.normal_(layer.attn.o_proj.weight, std=residual_std)
            if layer.routed:
                layer.mlp.reset_parameters(std, residual_std)
            else:
                nn.init.normal_(layer.mlp.in_proj.weight, std=std)
                nn.init.normal_(layer.mlp.out_proj.weight, std=residual_std)
            layer.attn_norm.reset_parameters()
            layer.mlp_norm.reset_parameters()
            if layer.attn.q_norm is not None:
                layer.attn.q_norm.reset_parameters()
                layer.attn.k_norm.reset_parameters()
        if not isinstance(self.norm, nn.Identity):
            self.norm.reset_parameters()
        if cfg.tie_embeddings:
            # Re-tie: moving a model off the meta device (to_empty) gives the head its own storage.
            self.lm_head.weight = self.tok_embeddings.weight
        else:
            nn.init.normal_(self.lm_head.weight, std=std)
        self.init_buffers()

    @classmethod
    def from_state_dict(
        cls, cfg: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32
    ) -> Transformer:
        """Build from trained weights without a random init: parameters start on the meta device
        and take the given tensors. A tied head may be left out of `state`."""
        with torch.device("meta"):
            model = cls(cfg)
        if cfg.tie_embeddings:
            state = {**state, "lm_head.weight": state["tok_embeddings.weight"]}
        model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, assign=True, strict=True)
        if cfg.tie_embeddings:
            model.lm_head.weight = model.tok_embeddings.weight
        model.init_buffers()
        return model

    @torch.no_grad()
    def init_buffers(self) -> None:
        cfg, device = self.cfg, self.tok_embeddings.weight.device
        self.rope_cos = self.rope_sin = self.pos_table = torch.empty(
            0, device=device
        )  # unused ones stay empty
        if cfg.positions == "rope":
            self.rope_cos, self.rope_sin = rope_tables(
                cfg.max_seq_len, cfg.head_dim, cfg.rope_theta, device, cfg.rope_scaling
            )
        if cfg.positions == "sinusoidal":
            self.pos_table = sinusoidal_table(cfg.max_seq_len, cfg.d_model, device)

    def hidden_states(
        self,
        tokens: torch.Tensor,
        need_weights: bool = False,
        cache: KVCache | None = None,
        document_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        final_norm: bool = True,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """tokens (B, T) → final-norm hidden states (B, T, d) (`final_norm=False`: the last block's,
        before the norm), and per-layer attention if asked.
        With a cache, tokens continue the cached sequence (positions start at cache.length). With
        document_ids (B, T), attention stays inside each document and positions restart at its start.
        `positions` (B, T) or (T,), when given, are the tokens' positions (`forward`)."""
        T = tokens.shape[1]
        start = cache.length if cache is not None else 0
        if start + T > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence of {start + T} tokens exceeds model.max_seq_len={self.cfg.max_seq_len}"
            )
        if cache is not None and start and (T != 1 or need_weights):
            raise ValueError("after the prefill, a cache takes one token per call (and no attention maps)")
        if cache is not None and document_ids is not None:
            raise ValueError("document_ids are for training windows: decode one document with a cache")
        mask, given = None, positions is not None
        if not given:
            positions = slice(start, start + T)
        if document_ids is not None:
            mask = document_mask(document_ids, "dense" if need_weights else self.masked_attention)
            positions = positions if given else positions_in_document(document_ids)  # (B, T)
        h = self.tok_embeddings(tokens)  # (B, T, d)
        if self.embed_scale != 1.0:
            h = h * self.embed_scale
        rope = None
        if self.cfg.positions == "rope":
            # (T, 1, hd) or, per document, (B, T, 1, hd): broadcast over the heads
            rope = (
                self.rope_cos[positions].unsqueeze(-2).to(h.dtype),
                self.rope_sin[positions].unsqueeze(-2).to(h.dtype),
            )
        elif self.cfg.positions == "sinusoidal":
            h = h + self.pos_table[positions].to(h.dtype)
        else:
            where = (
                positions
                if not isinstance(positions, slice)
                else torch.arange(start, start + T, device=tokens.device)
            )
            h = h + self.pos_embeddings(where)
        attentions, auxes = [], []
        for layer in self.layers:
            h, probs, aux = layer(h, rope, need_weights, cache, mask)
            attentions.append(probs)
            if aux is not None:
                auxes.append(aux)
        self.aux_loss = torch.stack(auxes).sum() if auxes else None
        if cache is not None:
            cache.length += T
        return (self.norm(h) if final_norm else h), (tuple(attentions) if need_weights else None)

    def head_loss(self, held: list[torch.Tensor], targets: torch.Tensor, z_loss: float) -> torch.Tensor:
        """The final norm, the LM head and the loss of the last block's hidden states: one region,
        which `engine.compile_head` compiles as one graph. `held` is a one-element list the states
        are taken out of, so that nothing keeps them through the head once normed (the memory plan,
        `pretrain/planning/memory.py`, counts only the normed ones, as `hidden_states` returns)."""
        return self.lm_head(self.norm(held.pop()), targets, z_loss, self.loss_kernel)

    def forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        need_weights: bool = False,
        cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
    ) -> ModelOutput:
        """tokens (B, T) int64 → logits (B, T, V); with targets (B, T), instead the mean
        cross-entropy over positions whose target is not IGNORE_INDEX (in fp32), and no logits
        (in training mode with `z_loss` > 0, plus the z-loss over the same positions).
        document_ids (B, T), equal within a document: attention stays inside each document and
        rotary positions restart at its first token (document masking).

        Sequence parallelism (`pretrain/parallel/sequence.py`) gives each rank a shard of the
        window: `tokens` and `targets` are the shard's, `positions` each token's position in the
        window ((T,); (B, T) under document masking, restarting at each document's first token),
        and `document_ids` the whole window's (B, T·S), which the mask, and the attention core
        that sees the whole window's keys, need."""
        h, attentions = self.hidden_states(
            tokens, need_weights, cache, document_ids, positions, final_norm=False
        )
        if targets is None:
            return ModelOutput(self.lm_head(self.norm(h)), None, attentions)
        held = [h]
        del h  # (head_loss takes the only reference: the states are freed once normed)
        z_loss = self.z_loss if self.training else 0.0
        loss = self.head_loss(held, targets, z_loss)
        if self.aux_loss is not None:  # (training mode only, as the z-loss)
            loss = loss + self.aux_loss
        return ModelOutput(None, loss, attentions)
