"""Instability precursors: what grows before a run diverges, measured at the logging interval.

Wortsman et al. 2023 ("Small-scale proxies for large-scale Transformer training instabilities")
show two instabilities of large runs at small scale: attention logits that grow without bound,
and output logits that drift (their log-normaliser log Z moves away from 0). A third signal, the
size of each optimizer update relative to the weights it changes, rises when the learning rate
is too high for a layer. Three measurements, each a plain dict named like the TensorBoard tags:

- `forward_precursors(model, tokens, document_ids)`: per layer the largest pre-softmax attention
  logit q·k/sqrt(hd) (after rotary, over the positions a query may attend to: causal and, with
  document masking, in its own document) — `stability/attn_logit_max/layer_{i}`; and over the
  tokens, the output logits' log Z (`stability/logit_lse_mean`, `stability/logit_lse_max`) and
  largest magnitude (`stability/logit_abs_max`). One no-grad forward of the bare model on a
  subsample (the first sequence by default), with hooks that compute the scores a chunk of
  queries at a time and the logits a chunk of tokens at a time: never (T, T) scores for all heads
  at once, never (N, V) fp32 logits. The model's own forward is unchanged (the hooks live only for
  the probe's call).
- `UpdateRatios`: `before_step()` just before the `engine.step()` that applies the update,
  `after_step()` just after: per layer group RMS(update) / RMS(weights before the update) —
  `stability/update_ratio/{group}`, groups as `group_of` names them.

Values stay device tensors (0-d, fp32): nothing here reads them on the host, so the caller stacks
them with the step's other numbers and reads everything once (`read_step_values` in
`pretrain/train/loop.py`; docs/performance.md, "Host reads in the step").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from pretrain.model.transformer import Attention, apply_rope

PREFIX = "stability/"


def chunk_elements_for(device: torch.device) -> int:
    """fp32 scores or logits held at once per chunk: 2^18 (1 MiB, cache-sized: measured fastest
    on this project's CPU) on a CPU, 2^24 (64 MiB, few large kernels) on a GPU."""
    return 2**24 if device.type == "cuda" else 2**18


# --------------------------------------------------------------------------- the forward's precursors


@torch.no_grad()
def forward_precursors(
    model: nn.Module,
    tokens: torch.Tensor,
    document_ids: torch.Tensor | None = None,
    sequences: int = 1,
    max_tokens: int | None = None,
    chunk_elements: int | None = None,
) -> dict[str, torch.Tensor]:
    """Attention and output-logit precursors of the bare `Transformer` (`engine.module`) on the
    first `sequences` rows of `tokens` (B, T), cut to their first `max_tokens` tokens: causal
    attention makes a prefix's values exactly those of the same positions in the whole sequence.

    Cost: one no-grad forward of the subsample (the head's full-vocabulary product skipped), plus
    per layer the subsample's q·k scores (B·nh·T²·hd/2 multiply-adds) and one (N, d) × (d, V)
    product for the logits. Memory: `chunk_elements` fp32 numbers per chunk of scores or logits
    (default `chunk_elements_for` the device).
    Under ZeRO-3 it gathers parameters like any forward: every rank calls it. The values are of
    this rank's subsample. torch.compile'd blocks run eagerly for the probe (hooks need eager)."""
    tokens = tokens[:sequences, :max_tokens]
    chunk_elements = chunk_elements or chunk_elements_for(tokens.device)
    if document_ids is not None:
        document_ids = document_ids[:sequences, :max_tokens]
    attention: dict[int, torch.Tensor] = {}
    logits: dict[str, torch.Tensor] = {}
    handles = []
    for module in model.modules():
        if isinstance(module, Attention):
            handles += _attention_hooks(module, document_ids, chunk_elements, attention)
    handles.append(model.lm_head.register_forward_pre_hook(_head_hook(chunk_elements, logits)))
    try:
        with _eager():
            model(tokens, document_ids=document_ids)
    finally:
        for handle in handles:
            handle.remove()
    values = {f"{PREFIX}attn_logit_max/layer_{i}": attention[i] for i in sorted(attention)}
    return values | {PREFIX + name: value for name, value in logits.items()}


def _attention_hooks(
    attn: Attention, document_ids: torch.Tensor | None, chunk_elements: int, out: dict[int, torch.Tensor]
) -> list:
    """Hooks that take q and k where `Attention.forward` last forms them before the rotation — the
    q/k/v projection's output, or with `qk_norm` the outputs of `q_norm` and `k_norm` — rotate
    them with the tables the attention module was called with, and take the largest score. No
    module is called twice (under ZeRO-3 each call would gather its weights again). This repeats
    how `Attention.forward` forms q and k: a change there must come here too, and the reference
    in tests/unit/test_precursors.py, which takes q and k from the model's call of its attention
    kernel, fails until it does."""
    nh, nkv, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
    state: dict = {}

    def keep_rope(module, args):
        state["rope"] = args[1] if len(args) > 1 else None

    def largest(q: torch.Tensor, k: torch.Tensor) -> None:  # (B, T, heads, hd), before the rotation
        rope = state.pop("rope")
        if rope is not None:  # per element: the same numbers as rotating q and k together
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        out[attn.layer_index] = max_attention_logit(q, k, document_ids, chunk_elements)

    def from_projection(module, args, qkv):
        B, T, _ = qkv.shape
        q, k, _ = qkv.view(B, T, nh + 2 * nkv, hd).split([nh, nkv, nkv], dim=2)
        largest(q, k)

    def keep_q(module, args, q):
        state["q"] = q

    def from_norms(module, args, k):
        largest(state.pop("q"), k)

    if getattr(attn, "q_norm", None) is None:
        hooks = [attn.qkv_proj.register_forward_hook(from_projection)]
    else:
        hooks = [attn.q_norm.register_forward_hook(keep_q), attn.k_norm.register_forward_hook(from_norms)]
    return [attn.register_forward_pre_hook(keep_rope), *hooks]


def max_attention_logit(
    q: torch.Tensor, k: torch.Tensor, document_ids: torch.Tensor | None, chunk_elements: int = 2**18
) -> torch.Tensor:
    """max over batch, heads and allowed (query, key) pairs of q·k/sqrt(hd), in fp32. q (B, T, nh,
    hd), k (B, T, nkv, hd): query head h reads key head h // (nh / nkv). A query attends to keys at
    or before it and, given document_ids (B, T), in its own document. Queries a chunk at a time,
    each against the keys up to its last query: at most `chunk_elements` scores at once."""
    B, T, nh, hd = q.shape
    nkv = k.shape[2]
    q = q.float().reshape(B, T, nkv, nh // nkv, hd) * hd**-0.5
    k = k.float()
    rows = max(1, chunk_elements // (B * nh * T))
    index = torch.arange(T, device=q.device)
    best = []
    for start in range(0, T, rows):
        end = min(start + rows, T)
        scores = torch.einsum("bqkgd,bskd->bkgqs", q[:, start:end], k[:, :end])  # (B, nkv, g, c, end)
        allowed = index[:end] <= index[start:end, None]  # (c, end)
        if document_ids is not None:
            allowed = allowed & (document_ids[:, start:end, None] == document_ids[:, None, :end])
            allowed = allowed[:, None, None]  # (B, 1, 1, c, end)
        best.append(scores.masked_fill(~allowed, float("-inf")).amax())
    return torch.stack(best).amax()


def _head_hook(chunk_elements: int, out: dict[str, torch.Tensor]) -> Callable:
    """A pre-hook on the output head: the logits' statistics from its input, a chunk of tokens at
    a time (fp32 logits as the loss forms them: `(h @ W.T).float()`); then it hands the head an
    empty input, so the (N, V) logits are never formed. Under ZeRO-3 it runs after DeepSpeed's
    own pre-hook (registered first), while the head's weight is gathered."""

    def statistics(head, args):
        hidden = args[0]
        h = hidden.flatten(0, -2)  # (N, d)
        weight = head.weight
        rows = max(1, chunk_elements // weight.shape[0])
        lse, abs_max = [], []
        for start in range(0, h.shape[0], rows):
            logits = (h[start : start + rows] @ weight.T).float()  # (rows, V)
            lse.append(torch.logsumexp(logits, dim=-1))
            abs_max.append(logits.abs().amax())
        lse = torch.cat(lse)
        out.update(
            {
                "logit_lse_mean": lse.mean(),
                "logit_lse_max": lse.amax(),
                "logit_abs_max": torch.stack(abs_max).amax(),
            }
        )
        return (hidden[..., :0, :], *args[1:])

    return statistics


def _eager():
    """torch.compile'd modules run eagerly inside (hooks added for one call would recompile them)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


# --------------------------------------------------------------------------- the update's size


def group_of(name: str) -> str:
    """A parameter's group, from its name in the `Transformer`: `embeddings` (token and position
    embeddings; a tied head is the token embedding), `layers.N.attn`, `layers.N.mlp`, `norms` (every
    norm's weights, the blocks' and the final one), `head` (the output projection, and anything
    else). The block index is named as `layer_grad_squares` in pretrain/train/loop.py names it."""
    parts = name.split(".")
    modules = parts[:-1]
    if any("norm" in part for part in modules):
        return "norms"
    if "embeddings" in name:
        return "embeddings"
    if "layers" in modules:
        at = modules.index("layers")
        block = "layers." + parts[at + 1]
        if len(modules) > at + 2 and modules[at + 2] in ("attn", "mlp"):
            return f"{block}.{modules[at + 2]}"
        return block
    return "head"


class UpdateRatios:
    """RMS(update) / RMS(weights) per parameter group over one optimizer step:
    sqrt(Σ(w_after − w_before)² / Σ w_before²) over each group's elements.

        ratios = UpdateRatios(engine.module)       # once
        ratios.before_step()                       # on a logging step, before the boundary's step
        engine.step()
        values = ratios.after_step()               # {"stability/update_ratio/<group>": 0-d tensor}

    What it reads is the optimizer's fp32 master weights where DeepSpeed keeps them, so the update
    is the one the optimizer computed, not its bf16 rounding:
    - ZeRO-1/2 (and DeepSpeed's bf16 optimizer): each parameter's fragment of this rank's fp32
      partition (`param._hp_mapping.hp_fragment`, what `safe_get_full_fp32_param` assembles);
    - ZeRO-3: this rank's fp32 partition of each parameter (`safe_get_local_fp32_param`); the
      partitions' zero padding adds nothing to either sum;
    - otherwise (plain torch, no master copy): the parameters themselves, full replicas.
    With fragments, the per-group sums of squares are summed over the data-parallel group by one
    all-reduce of a (2 × groups) tensor in `after_step`: a collective, so every rank calls both
    methods. No full parameter is ever gathered.

    Cost, on logging steps only: `before_step` copies what it reads (with fragments, this rank's
    share of the fp32 master weights: 4 bytes × parameters / world size, the size of one Adam
    moment partition; with replicas, the parameters in their dtype), held until `after_step`
    frees it; `stride` k copies every k-th element only (1/k of that memory, an estimate of the
    ratio). Two passes over the copied elements, no host read."""

    def __init__(
        self,
        module: nn.Module,
        stride: int = 1,
        all_reduce: Callable[[torch.Tensor, object], None] | None = None,
    ):
        if stride < 1:
            raise ValueError(f"stride={stride}: must be at least 1")
        self.module, self.stride = module, stride
        self.all_reduce = all_reduce or _all_reduce_sum
        self.named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self.groups = list(dict.fromkeys(group_of(name) for name, _ in self.named))
        self.device = self.named[0][1].device
        self.before: list[torch.Tensor | None] | None = None

    def pieces(self) -> tuple[list[torch.Tensor | None], bool, object]:
        """Per parameter, the flat elements this rank reads (None where it holds none); whether
        they are partitions (summed over ranks) and the process group to sum over."""
        pieces, partitioned, group = [], False, None
        for _, param in self.named:
            if hasattr(param, "ds_id"):  # ZeRO-3
                from deepspeed.utils import safe_get_local_fp32_param

                piece = safe_get_local_fp32_param(param)
                partitioned, group = True, group or getattr(param, "ds_process_group", None)
            elif hasattr(param, "_hp_mapping"):  # ZeRO-1/2, DeepSpeed's bf16 optimizer
                mapping = param._hp_mapping
                piece = None if mapping is None else mapping.hp_fragment
                partitioned, group = True, group or getattr(param, "_dp_group", None)
            else:
                piece = param.detach()
            pieces.append(None if piece is None else piece.reshape(-1)[:: self.stride])
        return pieces, partitioned, group

    def before_step(self) -> None:
        pieces, _, _ = self.pieces()
        self.before = [None if piece is None else piece.clone() for piece in pieces]

    def after_step(self) -> dict[str, torch.Tensor]:
        if self.before is None:
            raise RuntimeError("UpdateRatios.after_step without before_step")
        pieces, partitioned, group = self.pieces()
        index = {g: i for i, g in enumerate(self.groups)}
        sums = torch.zeros(2, len(self.groups), dtype=torch.float64, device=self.device)
        for (name, _), old, new in zip(self.named, self.before, pieces, strict=True):
            if old is None or new is None or old.numel() == 0:
                continue
            i = index[group_of(name)]
            sums[0, i] += (new.float() - old.float()).pow(2).sum().double().to(self.device)
            sums[1, i] += old.float().pow(2).sum().double().to(self.device)
        self.before = None
        if partitioned:
            self.all_reduce(sums, group)
        ratios = (sums[0] / sums[1]).sqrt().float()
        return {f"{PREFIX}update_ratio/{g}": ratios[i] for g, i in index.items()}


def _all_reduce_sum(tensor: torch.Tensor, group) -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, group=group)
