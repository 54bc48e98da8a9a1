"""The training path compiles whole (`engine.compile`): each block and the final norm + LM head +
loss (`Transformer.head_loss`) trace as one graph each, with 0 graph breaks, and so does attention
with its backends in priority order (`sdpa` under `sdpa_kernel(..., set_priority=True)`, the CUDA
path of `engine.attention: cudnn`). `torch._dynamo.explain` traces without compiling kernels, so
this runs in the unit tier; compiled kernels against eager: tests/integration/test_compile.py and,
on a GPU, test_gpu.py."""

import pytest
import torch

from pretrain.model.transformer import SDPA_ORDERS, Transformer, sdpa
from tests.conftest import small_model_config


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(small_model_config(qk_norm=True)).to(torch.bfloat16)


def explained(function, *args):
    torch._dynamo.reset()
    try:
        return torch._dynamo.explain(function)(*args)
    finally:
        torch._dynamo.reset()


def test_a_block_is_one_graph(model):
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 16))
    x = model.tok_embeddings(tokens).requires_grad_()
    rope = tuple(t[:16].unsqueeze(-2).to(x.dtype) for t in (model.rope_cos, model.rope_sin))
    found = explained(model.layers[0], x, rope)
    assert (found.graph_count, found.graph_break_count) == (1, 0), found.break_reasons


@pytest.mark.parametrize("z_loss", [0.0, 1e-4])
def test_the_final_norm_head_and_loss_are_one_graph(model, z_loss):
    """With the chunked loss's autograd function, its loop over chunks and the z-loss."""
    h = torch.randn(2, 16, model.cfg.d_model, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, model.cfg.vocab_size, (2, 16))
    targets[0, :3] = -100
    found = explained(model.head_loss, [h], targets, z_loss)
    assert (found.graph_count, found.graph_break_count) == (1, 0), found.break_reasons


def test_attention_with_its_backends_in_priority_order_is_one_graph_and_the_same_on_cpu():
    q = torch.randn(2, 4, 16, 8, dtype=torch.bfloat16)
    k, v = torch.randn(2, 2, 16, 8, dtype=torch.bfloat16), torch.randn(2, 2, 16, 8, dtype=torch.bfloat16)
    order = SDPA_ORDERS["cudnn"]
    found = explained(lambda q, k, v: sdpa(q, k, v, order, is_causal=True, enable_gqa=True), q, k, v)
    assert (found.graph_count, found.graph_break_count) == (1, 0), found.break_reasons
    plain = sdpa(q, k, v, None, is_causal=True, enable_gqa=True)
    assert torch.equal(sdpa(q, k, v, order, is_causal=True, enable_gqa=True), plain)
