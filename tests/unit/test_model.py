import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from pretrain.model.loss import IGNORE_INDEX
from pretrain.model.transformer import RMSNorm, Transformer, apply_rope, rope_tables
from tests.conftest import small_model_config


def make_model(**overrides) -> Transformer:
    torch.manual_seed(0)
    return Transformer(small_model_config(**overrides))


def test_shapes_and_loss():
    model = make_model()
    tokens = torch.randint(0, 97, (3, 17))
    out = model(tokens)
    assert out.logits.shape == (3, 17, 97)
    assert out.loss is None and out.attentions is None
    out = model(tokens, tokens)
    assert out.loss.shape == () and torch.isfinite(out.loss)
    # At init the logits are near zero, so the loss is near ln(V).
    assert abs(out.loss.item() - math.log(97)) < 0.5


def test_loss_ignores_masked_targets():
    model = make_model()
    tokens = torch.randint(0, 97, (2, 9))
    targets = tokens.clone()
    targets[:, :4] = IGNORE_INDEX
    out = model(tokens, targets)
    assert out.logits is None  # the fused loss never forms them
    logits = model(tokens).logits
    expected = F.cross_entropy(logits[:, 4:].reshape(-1, 97), tokens[:, 4:].reshape(-1))
    torch.testing.assert_close(out.loss, expected)


@pytest.mark.parametrize("positions", ["rope", "sinusoidal", "learned"])
@pytest.mark.parametrize("placement", ["pre", "post"])
def test_causality(positions, placement):
    """Changing the token at position t+k never changes the logits at positions <= t."""
    model = make_model(positions=positions, norm_placement=placement).eval()
    tokens = torch.randint(0, 97, (1, 24))
    base = model(tokens).logits
    for t in (0, 7, 22):
        changed = tokens.clone()
        changed[0, t + 1 :] = (changed[0, t + 1 :] + 1) % 97
        logits = model(changed).logits
        torch.testing.assert_close(logits[:, : t + 1], base[:, : t + 1], rtol=0, atol=1e-6)
        assert not torch.allclose(logits[:, t + 1 :], base[:, t + 1 :])


def test_rope_depends_only_on_offset():
    """q·k after rotation is a function of (m - n) only."""
    head_dim = 16
    cos, sin = rope_tables(64, head_dim, 10000.0)
    torch.manual_seed(1)
    q, k = torch.randn(head_dim), torch.randn(head_dim)

    def score(m, n):
        return (apply_rope(q, cos[m], sin[m]) @ apply_rope(k, cos[n], sin[n])).item()

    for offset in (0, 3, 11):
        scores = [score(m + offset, m) for m in (0, 5, 20, 40)]
        assert max(scores) - min(scores) < 1e-4, scores
    # ...and it does depend on the offset.
    assert abs(score(3, 0) - score(11, 0)) > 1e-3
    # The rotation preserves norms.
    torch.testing.assert_close(apply_rope(q, cos[9], sin[9]).norm(), q.norm())


def test_rmsnorm_matches_definition():
    torch.manual_seed(2)
    norm = RMSNorm(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(8))
    x = torch.randn(4, 3, 8)
    expected = x / torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    torch.testing.assert_close(norm(x), expected)
    # In bf16 the statistics are taken in fp32 and the result comes back in bf16.
    assert norm.to(torch.bfloat16)(x.bfloat16()).dtype == torch.bfloat16


SWITCHES = list(
    itertools.product(
        ["rmsnorm", "layernorm"],
        ["pre", "post"],
        ["swiglu", "gelu", "relu"],
        ["rope", "sinusoidal", "learned"],
    )
)


@pytest.mark.parametrize(("norm", "placement", "activation", "positions"), SWITCHES)
def test_every_switch_trains(norm, placement, activation, positions):
    model = make_model(norm=norm, norm_placement=placement, activation=activation, positions=positions)
    tokens = torch.randint(0, 97, (2, 16))
    loss = model(tokens[:, :-1], tokens[:, 1:]).loss
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    # One SGD step on the same batch lowers its loss.
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.05 * p.grad
    assert model(tokens[:, :-1], tokens[:, 1:]).loss < loss


def test_gqa_equals_mha_with_repeated_kv_heads():
    """A GQA model computes what an MHA model computes when each kv head is copied to its group."""
    gqa = make_model(n_heads=4, n_kv_heads=2).eval()
    mha = Transformer(small_model_config(n_heads=4, n_kv_heads=4)).eval()
    state = gqa.state_dict()
    hd, d = 8, 32
    for i in range(2):
        w = state[f"layers.{i}.attn.qkv_proj.weight"]
        q, k, v = w.split([4 * hd, 2 * hd, 2 * hd])
        k = k.view(2, hd, d).repeat_interleave(2, dim=0).reshape(4 * hd, d)
        v = v.view(2, hd, d).repeat_interleave(2, dim=0).reshape(4 * hd, d)
        state[f"layers.{i}.attn.qkv_proj.weight"] = torch.cat([q, k, v])
    mha.load_state_dict(state)
    tokens = torch.randint(0, 97, (2, 20))
    torch.testing.assert_close(mha(tokens).logits, gqa(tokens).logits, rtol=1e-5, atol=1e-5)


def test_attention_probabilities():
    model = make_model().eval()
    tokens = torch.randint(0, 97, (2, 12))
    out = model(tokens, need_weights=True)
    assert len(out.attentions) == 2
    for probs in out.attentions:
        assert probs.shape == (2, 4, 12, 12)
        torch.testing.assert_close(probs.sum(-1), torch.ones(2, 4, 12))
        assert (probs.triu(1) == 0).all()
    # The explicit path computes the same function as the fused SDPA path.
    torch.testing.assert_close(out.logits, model(tokens).logits, rtol=1e-5, atol=1e-5)


def test_init_weights():
    model = Transformer(
        small_model_config(d_model=256, n_heads=4, n_kv_heads=4, n_layers=8, d_ff=512, vocab_size=500)
    )
    std = lambda t: t.float().std().item()  # noqa: E731
    assert abs(std(model.tok_embeddings.weight) - 0.02) < 0.002
    assert abs(std(model.layers[0].attn.qkv_proj.weight) - 0.02) < 0.002
    residual = 0.02 / math.sqrt(2 * 8)
    assert abs(std(model.layers[3].attn.o_proj.weight) - residual) < 0.1 * residual
    assert abs(std(model.layers[3].mlp.out_proj.weight) - residual) < 0.1 * residual
    assert (model.layers[0].attn_norm.weight == 1).all()


def test_meta_device_then_init_weights():
    """The model can be built without memory and materialized later by re-running init_weights."""
    cfg = small_model_config()
    with torch.device("meta"):
        model = Transformer(cfg)
    assert model.tok_embeddings.weight.is_meta
    model.to_empty(device="cpu")
    model.init_weights()
    out = model(torch.randint(0, 97, (1, 10)))
    assert torch.isfinite(out.logits).all()


def test_tied_model_from_meta_device_stays_tied():
    with torch.device("meta"):
        model = Transformer(small_model_config(tie_embeddings=True))
    model.to_empty(device="cpu")
    model.init_weights()
    assert model.lm_head.weight is model.tok_embeddings.weight
    assert abs(model.lm_head.weight.std().item() - 0.02) < 0.004


def test_tied_embeddings_share_storage():
    model = make_model(tie_embeddings=True)
    assert model.lm_head.weight is model.tok_embeddings.weight
    assert (
        sum(p.numel() for p in model.parameters())
        == sum(p.numel() for p in make_model().parameters()) - 97 * 32
    )


def test_bf16_forward_backward():
    model = make_model().to(torch.bfloat16)
    tokens = torch.randint(0, 97, (2, 16))
    assert model(tokens).logits.dtype == torch.bfloat16
    out = model(tokens[:, :-1], tokens[:, 1:])
    assert out.loss.dtype == torch.float32
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_too_long_sequence_is_refused():
    with pytest.raises(ValueError, match="max_seq_len"):
        make_model()(torch.zeros(1, 65, dtype=torch.long))


@pytest.mark.parametrize("positions", ["rope", "sinusoidal", "learned"])
def test_kv_cache_decoding_matches_the_full_forward(positions):
    from pretrain.model.transformer import KVCache

    model = make_model(positions=positions).eval()
    tokens = torch.randint(0, 97, (2, 20))
    with torch.no_grad():
        full = model(tokens).logits
        cache = KVCache(model.cfg, batch_size=2, max_len=20, dtype=torch.float32)
        steps = [model(tokens[:, :12], cache=cache).logits]
        for t in range(12, 20):
            steps.append(model(tokens[:, t : t + 1], cache=cache).logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    assert cache.length == 20
    with pytest.raises(ValueError, match="one token per call"):
        model(tokens[:, :2], cache=cache)
