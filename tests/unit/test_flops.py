import itertools

import pytest
import torch

from pretrain.config import REPO_CONFIG_DIR, available_presets, load_model_config
from pretrain.flops import flops_per_token, flops_report, matmul_params, mfu, param_counts, peak_flops_for
from pretrain.model import Transformer
from tests.conftest import small_model_config


def test_gpt3_125m_by_hand():
    cfg = load_model_config(REPO_CONFIG_DIR / "model" / "gpt3-125m.yaml")
    d, L, V, T, ff = 768, 12, 32000, 2048, 2048
    attention = 4 * d * d  # q, k, v, o: 12 heads × 64 = 768 each
    mlp = 3 * d * ff  # gate, up, down
    norms = 2 * d  # two RMSNorm weight vectors per block
    non_embedding = L * (attention + mlp + norms) + d + V * d  # + final norm + untied head
    assert non_embedding == 109_529_856
    report = flops_report(cfg, T)
    assert report["params"] == non_embedding + V * d == 134_105_856
    assert report["non_embedding_params"] == non_embedding
    expected = 6 * non_embedding + 12 * L * 12 * 64 * T
    assert expected == 883_671_552
    assert report["flops_per_token"] == expected
    b = report["breakdown"]
    assert b["attention_scores"] == b["attention_weighted_sum"] == 6 * L * 12 * 64 * T
    assert b["feed_forward"] == 6 * L * mlp and b["lm_head"] == 6 * V * d
    assert b["attention_projections"] == 6 * L * attention
    assert sum(b.values()) == expected


def test_tied_head_is_counted_once():
    untied, tied = small_model_config(), small_model_config(tie_embeddings=True)
    V, d = untied.vocab_size, untied.d_model
    assert param_counts(tied).total == param_counts(untied).total - V * d
    # The head's matmul still happens: FLOPs do not change with tying.
    assert flops_per_token(tied, 64).total == flops_per_token(untied, 64).total
    assert matmul_params(tied) == matmul_params(untied)


SWITCH_CONFIGS = [
    small_model_config(norm=n, norm_placement=p, activation=a, positions=pos, tie_embeddings=t)
    for n, p, a, pos, t in itertools.product(
        ["rmsnorm", "layernorm"], ["pre", "post"], ["swiglu", "relu"], ["rope", "learned"], [False, True]
    )
] + [small_model_config(qk_norm=True)]


@pytest.mark.parametrize(
    "cfg",
    SWITCH_CONFIGS,
    ids=lambda c: f"{c.norm}-{c.norm_placement}-{c.activation}-{c.positions}-{c.tie_embeddings}-{c.qk_norm}",
)
def test_param_counts_match_the_model(cfg):
    model = Transformer(cfg)
    counts = param_counts(cfg)
    assert counts.total == sum(p.numel() for p in model.parameters())
    assert counts.embedding == model.tok_embeddings.weight.numel()
    # 6·N plus the attention term, N = every parameter that multiplies activations.
    N = (
        counts.total
        - counts.embedding
        - counts.positions
        + (cfg.vocab_size * cfg.d_model if cfg.tie_embeddings else 0)
    )
    assert flops_per_token(cfg, 50).total == 6 * N + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * 50


@pytest.mark.parametrize("name", available_presets())
def test_preset_counts_match_a_meta_model(name):
    cfg = load_model_config(REPO_CONFIG_DIR / "model" / f"{name}.yaml")
    with torch.device("meta"):
        model = Transformer(cfg)
    assert param_counts(cfg).total == sum(p.numel() for p in model.parameters())


def test_mfu_and_peaks():
    assert peak_flops_for("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops_for("NVIDIA H200") == 989e12
    assert peak_flops_for("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops_for("Tesla T4") is None
    assert mfu(100_000, 883_671_552, 989e12) == pytest.approx(100_000 * 883_671_552 / 989e12)
    assert 0.08 < mfu(100_000, 883_671_552, 989e12) < 0.09
