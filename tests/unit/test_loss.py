"""The fused, chunked output projection + cross-entropy against torch's plain one on fp32 logits
(`F.cross_entropy`, plus the z-loss written out): the loss and both gradients, fp32 and bf16, with
ignored rows falling on chunk boundaries; and which kernel runs where (`loss.kernel`). The
compiled kernel against the same reference: tests/integration/test_compile.py; Liger-Kernel's:
tests/integration/test_gpu.py."""

import pytest
import torch
import torch.nn.functional as F

from pretrain.config.schema import LOSS_KERNELS
from pretrain.model.loss import IGNORE_INDEX, KERNELS, chunk_rows, linear_cross_entropy, usable_kernel
from pretrain.model.transformer import Transformer
from tests.conftest import small_model_config


def reference(hidden, weight, targets, z_loss=0.0):
    """torch's cross-entropy on the fp32 logits, plus c · the mean over valid rows of (log Z)²."""
    logits = (hidden @ weight.T).float()
    loss = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX)
    if z_loss:
        valid = targets != IGNORE_INDEX
        loss = loss + z_loss * logits.logsumexp(-1)[valid].square().mean()
    return loss


def inputs(n=50, d=16, v=37, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g).to(dtype).requires_grad_()
    weight = torch.randn(v, d, generator=g).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::7] = IGNORE_INDEX
    return hidden, weight, targets


@pytest.mark.parametrize("rows", [1, 7, 16, 50, 64])  # chunks of one row, uneven, exact, one, more than n
def test_loss_and_gradients_match_plain_cross_entropy(rows):
    hidden, weight, targets = inputs()
    expected = reference(hidden, weight, targets)
    want = torch.autograd.grad(expected * 3.0, (hidden, weight))
    loss = linear_cross_entropy(hidden, weight, targets, rows=rows)
    got = torch.autograd.grad(loss * 3.0, (hidden, weight))  # the incoming gradient is applied
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


def boundary_inputs(dtype, rows=8, chunks=5, d=16, v=37):
    """Targets ignored on the first and last row of every chunk of `rows` and on one whole chunk,
    with distinct hidden states on every row: a chunk slice off by one row, or an ignored row
    counted, changes the loss or a gradient."""
    hidden, weight, targets = inputs(n=rows * chunks + 3, d=d, v=v, dtype=dtype, seed=1)
    targets = targets.clone()
    targets[::rows] = IGNORE_INDEX
    targets[rows - 1 :: rows] = IGNORE_INDEX
    targets[2 * rows : 3 * rows] = IGNORE_INDEX
    return hidden, weight, targets


@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_across_chunk_boundaries_with_ignored_rows_and_the_z_loss(dtype, z_loss):
    hidden, weight, targets = boundary_inputs(dtype)
    expected = reference(hidden, weight, targets, z_loss)
    want = torch.autograd.grad(expected * 2.0, (hidden, weight))
    loss = linear_cross_entropy(hidden, weight, targets, rows=8, z_loss=z_loss)
    got = torch.autograd.grad(loss * 2.0, (hidden, weight))
    assert loss.dtype == torch.float32
    # fp32: the same function to rounding; bf16: the loss from the same bf16 logits in fp32, the
    # gradients cast to bf16 before the matrix products (ours) or after (autograd's)
    close = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 1e-3}
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[0].float(), want[0].float(), **close)
    torch.testing.assert_close(got[1].float(), want[1].float(), **close)
    ignored = targets == IGNORE_INDEX
    assert got[0][ignored].abs().max() == 0  # no gradient reaches an ignored row


def test_the_kernels_are_the_configs_and_liger_falls_back_to_chunked_without_a_gpu():
    assert KERNELS == LOSS_KERNELS
    assert usable_kernel("chunked") == ("chunked", None) and usable_kernel("compiled") == ("compiled", None)
    kernel, why = usable_kernel("liger")
    assert kernel == "chunked" and "loss.kernel=liger runs as chunked" in why and "CUDA" in why
    hidden, weight, targets = boundary_inputs(torch.bfloat16)
    plain = linear_cross_entropy(hidden, weight, targets, rows=8, z_loss=1e-3)
    liger = linear_cross_entropy(hidden, weight, targets, rows=8, z_loss=1e-3, kernel="liger")
    assert torch.equal(plain, liger)  # (CPU tensors: the chunked path, bit for bit)
    with pytest.raises(ValueError, match="loss kernel"):
        usable_kernel("fused")


def test_a_run_config_asking_for_liger_trains_chunked_here(tmp_path):
    from pretrain.config import load_config
    from pretrain.pretraining import build_model
    from tests.helpers import FAST, TINY

    cfg = load_config(TINY, [*FAST, f"run.dir={tmp_path}", "loss.kernel=liger", "loss.z_loss=1e-4"])
    model = build_model(cfg)
    assert model.loss_kernel == "chunked" and model.z_loss == 1e-4
    assert build_model(load_config(TINY, [*FAST, "loss.kernel=compiled"])).loss_kernel == "compiled"


def test_bf16_matches_the_plain_loss_at_bf16_precision():
    hidden, weight, targets = inputs(n=300, d=64, v=500, dtype=torch.bfloat16)
    expected = reference(hidden, weight, targets)
    want = torch.autograd.grad(expected, (hidden, weight))
    loss = linear_cross_entropy(hidden, weight, targets, rows=64)
    got = torch.autograd.grad(loss, (hidden, weight))
    assert loss.dtype == torch.float32
    assert got[0].dtype == got[1].dtype == torch.bfloat16
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)  # fp32 from the same bf16 logits
    torch.testing.assert_close(got[0], want[0], rtol=2e-2, atol=1e-4)
    torch.testing.assert_close(got[1], want[1], rtol=2e-2, atol=1e-4)


def test_all_targets_ignored_gives_zero_loss_and_gradient():
    hidden, weight, targets = inputs()
    loss = linear_cross_entropy(hidden, weight, torch.full_like(targets, IGNORE_INDEX), rows=8)
    loss.backward()
    assert loss.item() == 0.0
    assert hidden.grad.abs().max() == 0 and weight.grad.abs().max() == 0


def test_without_grad_only_the_loss_is_computed():
    hidden, weight, targets = inputs()
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, targets, rows=8)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, reference(hidden, weight, targets).detach())


def test_chunk_rows_bounds_the_chunk():
    assert chunk_rows(32000, torch.device("cpu")) * 32000 <= 2**20 + 32000
    assert chunk_rows(32000, torch.device("cuda")) * 32000 <= 2**26
    assert chunk_rows(10**9, torch.device("cpu")) == 16


@pytest.mark.parametrize("tie", [False, True])
def test_model_gradients_equal_the_unfused_loss(tie):
    """Through the whole model, tied head or not: every parameter's gradient is the one the plain
    `cross_entropy(lm_head(h))` gives."""
    torch.manual_seed(0)
    model = Transformer(small_model_config(tie_embeddings=tie))
    tokens = torch.randint(0, 97, (3, 20))
    model(tokens[:, :-1], tokens[:, 1:]).loss.backward()
    fused = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    logits = model(tokens[:, :-1]).logits
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(fused[name], param.grad, msg=name)
