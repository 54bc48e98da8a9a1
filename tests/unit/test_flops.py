import itertools

import pytest
import torch

from pretrain.config import REPO_CONFIG_DIR, available_presets, load_model_config
from pretrain.model.transformer import Transformer
from pretrain.planning.flops import (
    flops_per_token,
    flops_report,
    matmul_params,
    mfu,
    param_counts,
    peak_flops_for,
)
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


# GPT-3 (Brown et al. 2020), table D.1: parameters and total training compute over 300B tokens,
# computed there as 6 FLOPs per parameter per token (attention left out).
GPT3_PUBLISHED = {
    "gpt3-6.7b": (6.66e9, 1.20e22),
    "gpt3-13b": (12.85e9, 2.31e22),
    "gpt3-175b": (174.6e9, 3.14e23),
}


@pytest.mark.parametrize("name", sorted(GPT3_PUBLISHED))
def test_gpt3_presets_match_the_papers_counts_and_compute(name):
    """Within 1.5% of table D.1's parameters: the Llama-style blocks differ from GPT-3's by an untied
    32,000-piece head instead of a tied 50,257-piece embedding and 2,048 learned positions, SwiGLU
    with d_ff rounded up to a multiple of 256 (3·d·d_ff: +0.8% per block at 6.7B) instead of a 4·d
    MLP, no biases and RMSNorm, and for 13B d_model 5120 = 40 × 128 instead of the table's 5140
    (+1.2%, +1.3%, +0.1% in all). The compute, 6 · N · 300B with N every parameter that multiplies
    activations, within 1%."""
    cfg = load_model_config(REPO_CONFIG_DIR / "model" / f"{name}.yaml")
    params, compute = GPT3_PUBLISHED[name]
    assert param_counts(cfg).total == pytest.approx(params, rel=0.015)
    assert 6 * matmul_params(cfg) * 300e9 == pytest.approx(compute, rel=0.01)


# Llama 3 (Llama Team 2024): the released checkpoints' parameter counts, to the parameter.
LLAMA3_PUBLISHED = {"llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496}


@pytest.mark.parametrize("name", sorted(LLAMA3_PUBLISHED))
def test_llama3_presets_match_the_released_models(name):
    """The same blocks as Llama 3 (GQA with 8 KV heads, vocabulary 128,256, RoPE θ 500,000): the
    count is exact, and FLOPs per token at 8,192 tokens are 6·N (N: all but the input embedding,
    the paper's 6·N·D rule) plus attention's 12·L·d·T, 29% (8B) and 15% (70B) on top."""
    cfg = load_model_config(REPO_CONFIG_DIR / "model" / f"{name}.yaml")
    assert (cfg.n_kv_heads, cfg.vocab_size, cfg.rope_theta, cfg.max_seq_len) == (8, 128256, 500000.0, 8192)
    assert param_counts(cfg).total == LLAMA3_PUBLISHED[name]
    N = LLAMA3_PUBLISHED[name] - cfg.vocab_size * cfg.d_model
    attention = 12 * cfg.n_layers * cfg.d_model * 8192
    assert flops_per_token(cfg, 8192).total == 6 * N + attention


# The released mixtures of experts: parameters and the active parameters per token, to the
# parameter (OLMoE's QK-norm covers the whole projections, ours each head: 61,440 fewer weights).
MOE_PUBLISHED = {
    "qwen3-30b-a3b": (30_532_122_624, 3_353_032_704),
    "olmoe-1b-7b": (6_919_161_856 - 61_440, 1_281_955_840),
}


@pytest.mark.parametrize("name", sorted(MOE_PUBLISHED))
def test_moe_presets_count_what_the_released_models_hold(name):
    """Every expert in `params`, a token's own in `active_params` (the router, its top_k experts),
    and FLOPs per token 6·N over the active parameters N (all but the input embedding) plus attention."""
    cfg = load_model_config(REPO_CONFIG_DIR / "model" / f"{name}.yaml")
    total, active = MOE_PUBLISHED[name]
    report = flops_report(cfg, 4096)
    assert (report["params"], report["active_params"]) == (total, active)
    N = active - cfg.vocab_size * cfg.d_model
    attention = 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * 4096
    assert report["flops_per_token"] == 6 * N + attention
    assert report["breakdown"]["router"] == 6 * cfg.n_layers * cfg.d_model * cfg.moe.experts


def test_tiny_moe_uses_tinys_active_parameters_and_a_router():
    """The packaged tiny-moe: 3 of 8 routed experts of 128 and one shared, each token's feed-forward
    4 × 128 = tiny's d_ff; its active parameters are tiny's plus 3 routers of 128 × 8."""
    from pretrain.config import load_config

    tiny = load_config(REPO_CONFIG_DIR / "train" / "tiny.yaml").model
    moe = load_config(REPO_CONFIG_DIR / "train" / "tiny-moe.yaml").model
    assert param_counts(moe).active == param_counts(tiny).total + 3 * 128 * 8
    assert param_counts(moe).total == param_counts(moe).active + 3 * 5 * 3 * 128 * 128
    with torch.device("meta"):
        model = Transformer(moe)
    assert sum(p.numel() for p in model.parameters()) == param_counts(moe).total
