"""The language-model loss without the full-vocabulary logits: the output projection and the
cross-entropy fused, a chunk of rows at a time.

The plain way, `cross_entropy(lm_head(h).float(), targets)`, materializes (N, V) logits, an fp32
copy of them, the log-softmax, and its gradient: for gpt3-125m at 8 × 2048 tokens that is four
arrays of 16k × 32k, 2 GiB each in fp32, and as many passes over memory. Here each chunk's logits
live only while that chunk is processed: the loss and both gradients (the hidden states' and the
weight's, as in Liger-Kernel's fused linear cross-entropy) are computed in the forward pass, so
the backward pass only scales them by the incoming gradient. Numerically it is the same
computation: fp32 logits and softmax, gradients cast to the activations' dtype for the matmuls,
the weight gradient accumulated in fp32.

It is also faster on CPU (the chunk stays in cache); see docs/performance.md.

Kernels (`loss.kernel`): `chunked` (the default, every device) runs each chunk's arithmetic
eagerly; `compiled` runs `chunk_loss` as one compiled function (torch.compile: the logsumexp, the
softmax gradient with its z-loss factor, the target's −1 and the scaling fused around the same
matrix products), measured on CPU no faster and not bit-equal (its sums run in another order), so
a GPU lever; `liger` is Liger-Kernel's fused linear cross-entropy (Triton, CUDA only; elsewhere
`chunked`: `usable_kernel` says why). The GPU check's variants measure them against each other.

The z-loss (PaLM, Chowdhery et al. 2022 §5; OLMo 2): `z_loss` = c adds c · mean over the valid
rows of (log Z)², log Z = logsumexp of the row's fp32 logits. It pulls log Z towards 0 so the
output logits cannot drift (Wortsman et al. 2023), and it is computed in the same pass: its
gradient with respect to the logits is 2c · log Z · softmax / count, folded into the
cross-entropy's softmax term. With c = 0 (the default) none of its operations run, so the
cross-entropy is computed by exactly the same operations as without it.
"""

from __future__ import annotations

import math

import torch

IGNORE_INDEX = -100  # targets with this value are left out of the loss (padding, prompts)
KERNELS = ("chunked", "compiled", "liger")  # loss.kernel (pretrain/config/schema.py LOSS_KERNELS)


def chunk_rows(vocab_size: int, device: torch.device) -> int:
    """Rows per chunk: about 2^20 logits (4 MiB fp32, cache-sized) on a CPU, 2^26 (256 MiB) on a GPU,
    where bigger matmuls run closer to peak."""
    budget = 2**26 if device.type == "cuda" else 2**20
    return max(16, budget // vocab_size)


def chunk_loss(h, weight, t, keep, count, z_loss: float, with_grad: bool):
    """One chunk of rows: (the sum of its cross-entropies, the sum of its (log Z)² or None, and with
    `with_grad` the gradients of the mean loss over all `count` valid rows with respect to its
    hidden states and, in fp32, to the weight). The `compiled` kernel is this function compiled."""
    safe = t.clamp(min=0)  # ignored rows gather any column, then contribute 0
    logits = (h @ weight.T).float()  # (rows, V)
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, safe[:, None]).squeeze(1)
    ce = ((lse - picked) * keep).sum()
    z = (lse.square() * keep).sum() if z_loss else None
    if not with_grad:
        return ce, z, None, None
    # d(mean CE)/d logits = (softmax - onehot(target)) / count, zero on ignored rows;
    # the z-loss adds 2c · log Z · softmax / count: softmax · (1 + 2c · log Z).
    grad = logits.sub_(lse[:, None]).exp_()
    if z_loss:
        grad.mul_((1.0 + 2.0 * z_loss * lse)[:, None])
    grad[torch.arange(len(t), device=t.device), safe] -= 1.0
    grad.mul_((keep / count)[:, None])
    grad = grad.to(h.dtype)
    grad_weight = (grad.T @ h).float()  # (first: its bf16 temporary is freed before grad @ weight)
    return ce, z, grad @ weight, grad_weight


_compiled_chunk_loss = None


def compiled_chunk_loss():
    """`chunk_loss` compiled, once per process (one graph per chunk shape: the last chunk's may differ)."""
    global _compiled_chunk_loss
    if _compiled_chunk_loss is None:
        _compiled_chunk_loss = torch.compile(chunk_loss, dynamic=False, fullgraph=True)
    return _compiled_chunk_loss


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, rows, with_grad, z_loss, chunk):
        n = hidden.shape[0]
        valid = targets != IGNORE_INDEX
        count = valid.sum().clamp(min=1).to(torch.float32)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        z_total = torch.zeros((), dtype=torch.float32, device=hidden.device) if z_loss else None
        grad_hidden = torch.empty_like(hidden) if with_grad else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if with_grad else None
        )
        for start in range(0, n, rows):
            part = slice(start, start + rows)
            ce, z, gh, gw = chunk(hidden[part], weight, targets[part], valid[part], count, z_loss, with_grad)
            total += ce
            if z_loss:
                z_total += z
            if with_grad:
                grad_hidden[part] = gh
                grad_weight += gw
            del gh, gw  # (not held through the next chunk: one chunk's buffers at a time, as planned)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        if z_loss:
            return total / count + z_loss * (z_total / count)
        return total / count

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        return (
            grad_hidden * grad_loss.to(grad_hidden.dtype),
            (grad_weight * grad_loss).to(ctx.weight_dtype),
            None,
            None,
            None,
            None,
            None,
        )


def liger_available() -> str | None:
    """Why Liger-Kernel's fused linear cross-entropy cannot run here (None: it can)."""
    if not torch.cuda.is_available():
        return "Liger-Kernel's kernels are Triton's, for CUDA GPUs, and there is no CUDA GPU here"
    try:
        import liger_kernel.transformers.functional  # noqa: F401
    except ImportError as exc:
        return f"liger-kernel is not importable ({exc}): pip install liger-kernel"
    return None


def usable_kernel(kernel: str) -> tuple[str, str | None]:
    """`loss.kernel` as it can run here: (the kernel, the reason it fell back to `chunked`, or None)."""
    if kernel not in KERNELS:
        raise ValueError(f"loss kernel {kernel!r}: use one of {', '.join(KERNELS)}")
    why = liger_available() if kernel == "liger" else None
    return ("chunked", f"loss.kernel=liger runs as chunked: {why}") if why else (kernel, None)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    rows: int | None = None,
    z_loss: float = 0.0,
    kernel: str = "chunked",
) -> torch.Tensor:
    """mean over non-ignored targets of cross_entropy(hidden @ weight.T, targets), in fp32; with
    `z_loss` = c > 0, plus c · the mean over the same targets of logsumexp(logits)².

    hidden (N, d), weight (V, d), targets (N,) int64 with IGNORE_INDEX for rows left out. `kernel`
    (KERNELS): `chunked` (the chunks above, eager), `compiled` (`chunk_loss` compiled), `liger`
    (Liger-Kernel's, for CUDA tensors; `chunked` for others)."""
    if not (math.isfinite(z_loss) and z_loss >= 0.0):
        raise ValueError(f"z_loss={z_loss!r}: use a finite coefficient >= 0")
    if kernel == "liger" and hidden.is_cuda:
        return liger_cross_entropy(hidden, weight, targets, z_loss)
    rows = rows or chunk_rows(weight.shape[0], hidden.device)
    with_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    chunk = compiled_chunk_loss() if kernel == "compiled" else chunk_loss
    return _LinearCrossEntropy.apply(hidden, weight, targets, rows, with_grad, float(z_loss), chunk)


def liger_cross_entropy(hidden, weight, targets, z_loss: float) -> torch.Tensor:
    """Liger-Kernel's fused linear cross-entropy with our conventions: the ignore index, the z-loss
    as its `lse_square_scale` (c · lse² per valid row, the same mean and gradient as ours), logits
    in the activations' dtype and softmax in fp32 as ours, the weight gradient accumulated in fp32
    as ours (`accum_dtype`). It reads the number of valid rows on the host once per call (its
    `.item()`): one wait for the GPU per micro-batch, which the GPU check counts."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return liger_fused_linear_cross_entropy(
        hidden,
        weight,
        targets,
        ignore_index=IGNORE_INDEX,
        lse_square_scale=float(z_loss),
        reduction="mean",
        accum_dtype=torch.float32,
    )
