import json

import pytest
import torch

from pretrain.errors import UserError
from pretrain.model.hf import load_hf, save_hf
from pretrain.model.transformer import Transformer
from tests.conftest import random_weights_model, small_model_config

transformers = pytest.importorskip("transformers")  # in the `dev` extra; CI installs it


def random_model(**overrides) -> Transformer:
    return random_weights_model(**overrides).eval()


@pytest.mark.parametrize(
    ("n_kv_heads", "tie"),
    [(4, False), (2, False), (1, True), (2, True)],
    ids=["mha-untied", "gqa-untied", "mqa-tied", "gqa-tied"],
)
def test_llama_parity(tmp_path, n_kv_heads, tie):
    ours = random_model(n_kv_heads=n_kv_heads, tie_embeddings=tie, rope_theta=500000.0, norm_eps=1e-6)
    save_hf(ours, tmp_path)
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32).eval()
    assert theirs.config.num_key_value_heads == n_kv_heads
    assert theirs.config.tie_word_embeddings == tie
    tokens = torch.randint(0, 97, (2, 40))
    with torch.no_grad():
        a, b = ours(tokens).logits, theirs(tokens).logits
    assert a.std() > 0.1  # logits that carry signal, not a degenerate comparison
    assert (a - b).abs().max().item() <= 1e-4


def test_load_hf_reads_a_model_transformers_wrote(tmp_path):
    """The reverse direction, against weights written by transformers itself."""
    config = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    torch.manual_seed(3)
    theirs = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    theirs.save_pretrained(tmp_path, safe_serialization=True)
    ours = load_hf(tmp_path).eval()
    assert ours.cfg.n_kv_heads == 2 and ours.cfg.d_ff == 48
    tokens = torch.randint(0, 97, (2, 30))
    with torch.no_grad():
        assert (ours(tokens).logits - theirs(tokens).logits).abs().max().item() <= 1e-4


@pytest.mark.parametrize("tie", [False, True])
def test_round_trip(tmp_path, tie):
    ours = random_model(tie_embeddings=tie)
    back = load_hf(save_hf(ours, tmp_path)).eval()
    assert back.cfg.tie_embeddings == tie
    if tie:
        assert back.lm_head.weight is back.tok_embeddings.weight
    for (name, a), (_, b) in zip(ours.state_dict().items(), back.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_bf16_export(tmp_path):
    save_hf(random_model(), tmp_path, dtype=torch.bfloat16, token_ids={"bos_token_id": 1, "eos_token_id": 2})
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["eos_token_id"] == 2
    assert load_hf(tmp_path, dtype=torch.bfloat16).tok_embeddings.weight.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("field", "value"),
    [("norm", "layernorm"), ("norm_placement", "post"), ("activation", "gelu"), ("positions", "learned")],
)
def test_non_llama_models_are_refused(tmp_path, field, value):
    model = Transformer(small_model_config(**{field: value}))
    with pytest.raises(UserError, match=f"model.{field}="):
        save_hf(model, tmp_path / "out")
    assert not (tmp_path / "out" / "config.json").exists()


def test_load_hf_refusals(tmp_path):
    with pytest.raises(UserError, match="no config.json"):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(UserError, match="not 'llama'"):
        load_hf(tmp_path)
    save_hf(random_model(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(
        json.dumps(config | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    )
    with pytest.raises(UserError, match="yarn"):
        load_hf(tmp_path)
