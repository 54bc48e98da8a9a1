"""The mixture-of-experts layer (pretrain/model/moe.py) against computations written out here:
grouped products against the loop, the router against its formula, the layer against a
token-by-token sum of its experts, the balancing losses against their definitions, and the model
with experts: counts, forced routing, activation checkpointing, the bias kept in fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pretrain.config import ModelConfig, MoEConfig
from pretrain.model import moe as moe_module
from pretrain.model.moe import (
    MoE,
    Router,
    batch_balance_loss,
    grouped_products,
    normalized_scores,
    sequence_balance_loss,
)
from pretrain.model.transformer import Transformer


def config(**moe) -> ModelConfig:
    settings = {"experts": 4, "top_k": 2, "expert_ffn_dim": 16} | moe
    return ModelConfig(
        vocab_size=97,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        max_seq_len=64,
        moe=MoEConfig(**settings),
    )


def layer(**moe) -> MoE:
    torch.manual_seed(0)
    model = Transformer(config(**moe))
    return model.layers[-1].mlp


def loop_products(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    out, start = [], 0
    for g, n in enumerate(counts):
        out.append(x[start : start + n] @ w[g].T)
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_products_equal_the_loop_forward_and_backward(dtype):
    """With empty groups; the gradients of both operands, from a random (not expanded) output gradient."""
    torch.manual_seed(1)
    counts = [5, 0, 11, 4]
    x = torch.randn(20, 16, dtype=dtype, requires_grad=True)
    w = torch.randn(4, 8, 16, dtype=dtype, requires_grad=True)
    assert moe_module._grouped_mm_applies(x, w)  # (the kernel, not the loop, is what is compared)
    got = grouped_products(x, w, torch.tensor(counts))
    grad = torch.randn_like(got)
    got.backward(grad)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    want = loop_products(x2, w2, counts)
    want.backward(grad)
    assert torch.equal(got, want)
    assert torch.equal(x.grad, x2.grad) and torch.equal(w.grad, w2.grad)


def test_grouped_products_fall_back_to_the_loop_where_the_kernel_refuses():
    """Rows of 12 bytes are not 16-byte aligned: torch's CPU kernel refuses them; the loop runs."""
    x, w = torch.randn(6, 3), torch.randn(3, 5, 3)
    assert not moe_module._grouped_mm_applies(x, w)
    assert torch.equal(grouped_products(x, w, torch.tensor([2, 4, 0])), loop_products(x, w, [2, 4, 0]))


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
@pytest.mark.parametrize("normalize", [True, False])
def test_the_router_chooses_on_scores_plus_bias_and_weighs_by_the_scores(router, normalize):
    torch.manual_seed(2)
    moe = MoEConfig(experts=6, top_k=2, router=router, normalize_top_k=normalize, balance="bias")
    r = Router(8, moe)
    # expert 1 always chosen, 5 never; the others' small biases move the second choice
    r.bias.copy_(torch.tensor([0.0, 5.0, 0.2, -0.1, 0.05, -5.0]))
    x = torch.randn(30, 8)
    route = r(x)
    logits = x @ r.gate.weight.T
    scores = logits.sigmoid() if router == "sigmoid" else logits.softmax(-1)
    assert torch.allclose(route.scores, scores, atol=1e-6)
    assert (route.experts == 1).any(dim=1).all() and not (route.experts == 5).any()
    second = (scores + r.bias).topk(2, dim=-1).indices
    assert torch.equal(route.experts.sort(dim=1).values, second.sort(dim=1).values)
    weights = scores.gather(1, route.experts)  # unbiased
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    assert torch.allclose(route.weights, weights, atol=1e-6)


def test_the_layer_is_the_weighted_sum_of_each_tokens_experts_plus_the_shared_ones():
    """Token by token: Σ_k w_k · SwiGLU_{e_k}(x) + the shared SwiGLU, against the layer's sorted,
    grouped computation."""
    mlp = layer(shared_experts=1, router="softmax", balance="aux_loss")
    torch.manual_seed(3)
    x = torch.randn(2, 7, 32)
    y, _ = mlp(x)
    flat = x.reshape(-1, 32)
    route = mlp.router(flat)
    w_in, w_out = mlp.experts.w_in, mlp.experts.w_out
    want = []
    for t in range(flat.shape[0]):
        out = mlp.shared(flat[t])
        for k in range(2):
            e = route.experts[t, k]
            gate, up = (w_in[e] @ flat[t]).chunk(2)
            out = out + route.weights[t, k] * (w_out[e] @ (F.silu(gate) * up))
        want.append(out)
    assert torch.allclose(y.reshape(-1, 32), torch.stack(want), atol=1e-5)


def test_tokens_per_expert_sum_to_tokens_times_top_k_and_eval_counts_nothing():
    mlp = layer(top_k=3)
    mlp.train()
    x = torch.randn(3, 10, 32)
    with torch.no_grad():
        mlp(x)  # (no gradients: a probe, not a training forward)
    assert mlp.load is None
    mlp(x)
    mlp(x[:1])
    assert mlp.load.sum().item() == (30 + 10) * 3
    mlp.eval()
    mlp(x)
    assert mlp.load.sum().item() == (30 + 10) * 3


def test_routing_forced_onto_one_expert_gives_the_others_zero_gradients_not_none():
    mlp = layer(balance="bias", router="sigmoid", top_k=1)
    mlp.router.bias.copy_(torch.tensor([0.0, 0.0, 100.0, 0.0]))
    y, _ = mlp(torch.randn(2, 8, 32))
    y.pow(2).sum().backward()
    assert mlp.load.tolist() == [0.0, 0.0, 16.0, 0.0]
    for w in (mlp.experts.w_in, mlp.experts.w_out):
        assert w.grad is not None
        assert all(w.grad[e].abs().sum() == 0 for e in (0, 1, 3))
        assert w.grad[2].abs().sum() > 0


def direct_balance(scores: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Σ_i f_i P_i written out: f_i = E/(K·N) · #{(t, k): e_tk = i}, P_i = mean_t s_ti / Σ_j s_tj."""
    N, E = scores.shape
    K = experts.shape[1]
    f = torch.tensor([(experts == i).sum().item() * E / (K * N) for i in range(E)])
    P = (scores / scores.sum(-1, keepdim=True)).mean(0)
    return (f * P).sum()


def test_the_balancing_losses_are_their_definitions():
    """The batch form from given (global) counts, the sequence form sequence by sequence; both 1.0
    for a perfectly even load with uniform scores."""
    mlp = layer(router="sigmoid", top_k=2)
    torch.manual_seed(4)
    route = mlp.router(torch.randn(3 * 9, 32))
    counts = torch.bincount(route.experts.flatten(), minlength=4).float()
    assert torch.allclose(batch_balance_loss(route, counts), direct_balance(route.scores, route.experts))
    doubled = batch_balance_loss(route, counts + torch.tensor([40.0, 0, 0, 0]))  # other ranks' counts
    assert not torch.allclose(doubled, batch_balance_loss(route, counts))
    per_sequence = [
        direct_balance(route.scores[s * 9 : (s + 1) * 9], route.experts[s * 9 : (s + 1) * 9])
        for s in range(3)
    ]
    assert torch.allclose(sequence_balance_loss(route, 3), torch.stack(per_sequence).mean())
    even = route._replace(scores=torch.ones(8, 4), experts=torch.tensor([[0, 1], [2, 3]] * 4))
    assert batch_balance_loss(even, torch.full((4,), 4.0)).item() == pytest.approx(1.0)
    assert normalized_scores(even).sum(-1).eq(1).all()


def test_the_training_loss_adds_the_balancing_and_router_z_losses_in_training_mode_only():
    """One routed block (the first is dense): its terms, and nothing in eval mode."""
    cfg = config(
        balance="aux_loss", aux_loss_coef=0.01, router_z_loss=0.001, router="softmax", dense_layers=1
    )
    torch.manual_seed(5)
    model = Transformer(cfg)
    tokens = torch.randint(0, 97, (2, 12))
    loss = model(tokens, tokens).loss
    mlp = model.layers[1].mlp
    captured = {}
    mlp.router.register_forward_hook(lambda m, a, out: captured.setdefault("route", out))
    model(tokens, tokens)
    route = captured["route"]
    counts = torch.bincount(route.experts.flatten(), minlength=4).float()
    aux = (
        0.01 * direct_balance(route.scores, route.experts)
        + 0.001 * torch.logsumexp(route.logits, -1).pow(2).mean()
    )
    assert torch.allclose(model.aux_loss, aux, atol=1e-7) and counts.sum() == 48
    model.eval()
    assert torch.allclose(loss - model(tokens, tokens).loss, aux, atol=1e-6)


def test_activation_checkpointing_counts_each_micro_batch_once_and_changes_no_gradient():
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    cfg = config(balance="both", aux_loss_coef=0.01)
    torch.manual_seed(6)
    plain, wrapped = Transformer(cfg), Transformer(cfg)
    wrapped.load_state_dict(plain.state_dict())
    for block in wrapped.layers:
        block.forward = lambda *a, _f=block.forward: checkpoint(_f, *a, use_reentrant=False)
    tokens = torch.randint(0, 97, (2, 12))
    plain(tokens, tokens).loss.backward()
    with set_checkpoint_early_stop(False):  # (the recompute runs the whole block, counting included)
        wrapped(tokens, tokens).loss.backward()
    assert torch.equal(wrapped.layers[1].mlp.load, plain.layers[1].mlp.load)
    assert wrapped.layers[1].mlp.load.sum() == 2 * 12 * 2
    for (name, a), b in zip(plain.named_parameters(), wrapped.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name


def test_the_bias_stays_fp32_when_the_model_is_cast():
    mlp = layer(balance="bias")
    mlp.router.bias.copy_(torch.tensor([1e-3, 1 + 1e-3, -2e-4, 0.0]))
    before = mlp.router.bias.clone()
    mlp.bfloat16()
    assert mlp.experts.w_in.dtype == torch.bfloat16 and mlp.router.bias.dtype == torch.float32
    assert torch.equal(mlp.router.bias, before)
    assert layer(balance="aux_loss").router.bias is None  # (no bias, nothing in the state dict)


def test_a_dense_model_keeps_its_parameters_and_computes_no_auxiliary_loss():
    """Without model.moe: the parameter names and shapes of a model from before the experts existed
    (the golden run, tests/integration/test_golden.py, holds its computation bit for bit)."""
    cfg = ModelConfig(vocab_size=97, d_model=32, n_layers=1, n_heads=4, max_seq_len=64)
    model = Transformer(cfg)
    assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == [
        ("tok_embeddings.weight", (97, 32)),
        ("layers.0.attn_norm.weight", (32,)),
        ("layers.0.attn.qkv_proj.weight", (96, 32)),
        ("layers.0.attn.o_proj.weight", (32, 32)),
        ("layers.0.mlp_norm.weight", (32,)),
        ("layers.0.mlp.in_proj.weight", (512, 32)),
        ("layers.0.mlp.out_proj.weight", (32, 256)),
        ("norm.weight", (32,)),
        ("lm_head.weight", (97, 32)),
    ]
    tokens = torch.randint(0, 97, (1, 8))
    model(tokens, tokens)
    assert not model.layers[0].routed and model.aux_loss is None
