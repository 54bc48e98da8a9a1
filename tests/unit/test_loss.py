"""The fused, chunked output projection + cross-entropy against torch's plain one."""

import pytest
import torch
import torch.nn.functional as F

from pretrain.model.loss import IGNORE_INDEX, chunk_rows, linear_cross_entropy
from pretrain.model.transformer import Transformer
from tests.conftest import small_model_config


def reference(hidden, weight, targets):
    return F.cross_entropy((hidden @ weight.T).float(), targets, ignore_index=IGNORE_INDEX)


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
