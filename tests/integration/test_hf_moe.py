"""Models with experts exported to the transformers class that computes their routing
(pretrain/model/hf_moe.py) and read back: logits against transformers' own Qwen3-MoE, Glm4-MoE
and Mixtral in fp32, and the one-line refusals of what no class expresses."""

import json

import pytest
import torch

from pretrain.config import MoEConfig
from pretrain.errors import UserError
from pretrain.model.hf import load_hf, save_hf
from pretrain.model.transformer import Transformer
from tests.conftest import random_weights_model, small_model_config

transformers = pytest.importorskip("transformers")  # in the `dev` extra; CI installs it

TOLERANCE = 1e-5  # fp32; the differences seen are 0.0 (the same products in the same order)


def moe_model(qk_norm: bool, bias_scale: float = 0.0, head_dim: int | None = None, **moe) -> Transformer:
    """3 blocks, 4 experts of 16, every weight random; the balancing bias (when the routing has
    one) random × bias_scale, large enough against sigmoid scores near 0.5 to change the choice."""
    settings = {"experts": 4, "top_k": 2, "expert_ffn_dim": 16} | moe
    model = random_weights_model(
        n_layers=3, qk_norm=qk_norm, head_dim=head_dim, moe=MoEConfig(**settings)
    ).eval()
    with torch.no_grad():
        for layer in model.layers:
            if layer.routed and layer.mlp.router.bias is not None:
                layer.mlp.router.bias.copy_(bias_scale * torch.randn(settings["experts"]))
    return model


CASES = {  # id: (class, qk_norm, bias scale, model.moe and head_dim)
    # 4 heads × 16 on d_model 32: wider than d_model / heads, as Qwen3-30B-A3B's 32 × 128 on 2048; a
    # bias still all zeros (balance both) chooses as none
    "qwen3-moe-wide-heads-zero-bias": (
        "Qwen3MoeForCausalLM",
        True,
        0.0,
        {"router": "softmax", "balance": "both", "head_dim": 16},
    ),
    "qwen3-moe-dense-unnormalized": (
        "Qwen3MoeForCausalLM",
        True,
        0.0,
        {"router": "softmax", "balance": "aux_loss", "dense_layers": 1, "normalize_top_k": False},
    ),
    "mixtral": ("MixtralForCausalLM", False, 0.0, {"router": "softmax", "balance": "aux_loss"}),
    "glm4-moe-shared-dense-bias": (
        "Glm4MoeForCausalLM",
        False,
        0.1,
        {"router": "sigmoid", "balance": "both", "shared_experts": 1, "dense_layers": 1},
    ),
    "glm4-moe-qk-norm-unnormalized-bias": (
        "Glm4MoeForCausalLM",
        True,
        0.1,
        {"router": "sigmoid", "balance": "bias", "normalize_top_k": False},
    ),
    "glm4-moe-no-bias-2-shared": (
        "Glm4MoeForCausalLM",
        False,
        0.0,
        {"router": "sigmoid", "balance": "aux_loss", "shared_experts": 2},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_export_loads_in_transformers_with_our_logits_and_reads_back_equal(tmp_path, case):
    arch, qk_norm, bias_scale, moe = CASES[case]
    ours = moe_model(qk_norm, bias_scale, **moe)
    save_hf(ours, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [arch]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(theirs).__name__ == arch
    back = load_hf(tmp_path).eval()
    tokens = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b, c = ours(tokens).logits, theirs(tokens).logits, back(tokens).logits
    assert a.std() > 0.1  # logits that carry signal, not a degenerate comparison
    assert (a - b).abs().max().item() <= TOLERANCE
    assert torch.equal(a, c)
    mine, read = ours.state_dict(), back.state_dict()
    for name in mine.keys() | read.keys():  # weight for weight; a bias only one side has is zero
        if name in mine and name in read:
            assert torch.equal(mine[name], read[name]), name
        else:
            assert name.endswith("router.bias") and not (mine.get(name, read.get(name))).any(), name


def test_the_bias_changes_the_choice_so_the_glm4_comparison_would_see_it_dropped():
    """Without its bias the sigmoid router chooses other experts for some tokens: the logits above
    compare a bias that matters (dropping it on export fails them)."""
    model = moe_model(False, 0.1, router="sigmoid", balance="bias")
    router = model.layers[0].mlp.router
    x = torch.randn(64, 32)
    with torch.no_grad():
        biased = router(x).experts.sort(dim=-1).values
        router.bias.zero_()
        plain = router(x).experts.sort(dim=-1).values
    assert not torch.equal(biased, plain)


def test_a_bf16_export_keeps_the_balancing_bias_in_fp32(tmp_path):
    from safetensors import safe_open

    model = moe_model(False, 0.1, router="sigmoid")
    with torch.no_grad():
        model.layers[0].mlp.router.bias.add_(1e-3 / 3)  # a value bf16 rounds
    save_hf(model, tmp_path, dtype=torch.bfloat16)
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        bias = f.get_tensor("model.layers.0.mlp.gate.e_score_correction_bias")
        assert f.get_tensor("model.layers.0.mlp.gate.weight").dtype == torch.bfloat16
    assert torch.equal(bias, model.layers[0].mlp.router.bias)


def transformers_model(arch: str) -> torch.nn.Module:
    """A small model built by transformers itself, every weight random (the router bias too)."""
    shape = dict(vocab_size=97, hidden_size=32, num_hidden_layers=3, num_attention_heads=4)
    shape |= dict(num_key_value_heads=2, head_dim=8, max_position_embeddings=64, num_experts_per_tok=2)
    if arch == "Qwen3MoeForCausalLM":
        config = transformers.Qwen3MoeConfig(
            **shape, intermediate_size=48, moe_intermediate_size=16, num_experts=4, mlp_only_layers=[0]
        )
    elif arch == "Glm4MoeForCausalLM":
        config = transformers.Glm4MoeConfig(
            **shape,
            intermediate_size=48,
            moe_intermediate_size=16,
            n_routed_experts=4,
            n_shared_experts=1,
            first_k_dense_replace=1,
            partial_rotary_factor=1.0,
            use_qk_norm=True,
        )
    else:
        config = transformers.MixtralConfig(**shape, intermediate_size=16, num_local_experts=4)
    torch.manual_seed(3)
    model = getattr(transformers, arch)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.1 * torch.randn_like(b))
    return model


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "Glm4MoeForCausalLM", "MixtralForCausalLM"])
def test_load_hf_reads_a_moe_model_transformers_wrote(tmp_path, arch):
    theirs = transformers_model(arch)
    theirs.save_pretrained(tmp_path)
    ours = load_hf(tmp_path).eval()
    assert ours.cfg.moe.experts == 4 and ours.cfg.moe.top_k == 2
    tokens = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (ours(tokens).logits - theirs(tokens).logits).abs().max().item() <= TOLERANCE


REFUSED = {  # model.moe (+ qk_norm), the refusal's words
    "softmax-shared": (
        {"router": "softmax", "shared_experts": 1},
        True,
        "softmax routing with shared_experts",
    ),
    "mixtral-dense": ({"router": "softmax", "dense_layers": 1}, False, "without qk_norm exports as Mixtral"),
    "mixtral-unnormalized": (
        {"router": "softmax", "normalize_top_k": False},
        False,
        "without qk_norm exports as Mixtral",
    ),
    "one-sigmoid-expert": ({"router": "sigmoid", "experts": 1, "top_k": 1}, False, "experts=1"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_routing_no_class_computes_is_refused_in_one_line_before_anything_is_written(tmp_path, case):
    moe, qk_norm, words = REFUSED[case]
    model = Transformer(small_model_config(qk_norm=qk_norm, moe=MoEConfig(**moe)))
    with pytest.raises(UserError, match=words) as refused:
        save_hf(model, tmp_path / "out")
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "out").exists()


def test_a_non_zero_bias_with_softmax_routing_is_refused(tmp_path):
    """Qwen3-MoE and Mixtral choose by the scores alone: a trained bias would be silently dropped."""
    model = moe_model(True, 0.1, router="softmax", balance="bias")
    with pytest.raises(UserError, match="block 0's balancing bias is non-zero and Qwen3MoeForCausalLM"):
        save_hf(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"n_group": 2}, "n_group=2 is not supported"),
        ({"routed_scaling_factor": 2.5}, "routed_scaling_factor=2.5"),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
            "partial rotary",
        ),
    ],
)
def test_glm4_moe_settings_we_do_not_compute_are_refused_on_reading(tmp_path, change, words):
    save_hf(moe_model(False, 0.1, router="sigmoid"), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("partial_rotary_factor")
    (tmp_path / "config.json").write_text(json.dumps(config | change))
    with pytest.raises(UserError, match=words):
        load_hf(tmp_path)


def test_export_hf_of_a_moe_model_is_a_complete_directory_fine_tuning_starts_from(
    tmp_path, tokenizer_dir, cli
):
    """`pretrain export-hf`'s path (export_trained) with experts, then `finetune.init` on it
    (find_initial → load_model): the same weights, the bias included; `pretrain export-hf` of the
    export writes it again, and a setting we do not compute is one line, exit status 2."""
    from pretrain.evaluation.inference import Trained, export_trained, load_trained
    from pretrain.initial_model import find_initial
    from pretrain.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(tokenizer_dir)
    model = random_weights_model(
        vocab_size=tokenizer.vocab_size, moe=MoEConfig(experts=4, top_k=2, shared_experts=1)
    ).eval()
    with torch.no_grad():
        model.layers[1].mlp.router.bias.copy_(torch.tensor([0.1, -0.2, 0.3, 0.0]))
    run_config = {"data": {"seq_len": 32, "document_masking": False}}
    out = export_trained(Trained(model, tokenizer, run_config, tmp_path / "ckpt"), tmp_path / "hf")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(theirs).__name__ == "Glm4MoeForCausalLM"
    ids = torch.tensor([tokenizer.encode_document("def f(x):\n\treturn x")])
    with torch.no_grad():
        assert (theirs(ids).logits - model(ids).logits).abs().max().item() <= TOLERANCE
    assert load_trained(out).model.cfg.moe == model.cfg.moe
    initial = find_initial(str(out)).load_model()
    for name, weight in model.state_dict().items():
        assert torch.equal(initial.state_dict()[name], weight), name
    result = cli("export-hf", "--checkpoint", out, "--out", tmp_path / "again")
    assert result.returncode == 0, result.stderr
    again = (tmp_path / "again" / "model.safetensors").read_bytes()
    assert again == (out / "model.safetensors").read_bytes()
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"routed_scaling_factor": 2.5}))
    result = cli("export-hf", "--checkpoint", out, "--out", tmp_path / "refused")
    assert result.returncode == 2 and "routed_scaling_factor=2.5 is not supported" in result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert not (tmp_path / "refused").exists()
