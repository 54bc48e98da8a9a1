"""Prevention in the model (issue 31): the z-loss against a direct computation with full logits,
QK-norm against a direct computation of attention, evaluation still reporting plain cross-entropy,
and a QK-norm model exported as Qwen3 that transformers loads with our logits."""

import json
from dataclasses import asdict

import pytest
import torch
import torch.nn.functional as F

from pretrain.config import ModelConfig, load_config
from pretrain.errors import UserError
from pretrain.evaluation.held_out import validation_loss
from pretrain.model.classifier import SequenceClassifier
from pretrain.model.hf import load_hf, save_hf
from pretrain.model.loss import IGNORE_INDEX, linear_cross_entropy
from pretrain.model.transformer import Transformer, apply_rope
from pretrain.pretraining import build_model
from tests.conftest import random_weights_model, small_model_config
from tests.helpers import TINY
from tests.unit.fakes import ONE_PROCESS, FakeEngine

# --------------------------------------------------------------------------- z-loss


def inputs(n=50, d=16, v=37, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    hidden = (scale * torch.randn(n, d, generator=g)).to(dtype).requires_grad_()
    weight = torch.randn(v, d, generator=g).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::7] = IGNORE_INDEX
    return hidden, weight, targets


def direct(hidden, weight, targets, c, dtype=torch.float64):
    """cross-entropy + c · mean over valid targets of logsumexp(logits)², from the full logits."""
    logits = hidden.to(dtype) @ weight.to(dtype).T
    valid = targets != IGNORE_INDEX
    log_z = torch.logsumexp(logits, dim=-1)
    ce = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX)
    return ce + c * (log_z[valid] ** 2).mean()


@pytest.mark.parametrize("rows", [1, 7, 50, 64])  # chunks of one row, uneven, one, more than n
@pytest.mark.parametrize("c", [1e-4, 0.5])  # OLMo 2's, and one where the term dominates the gradient
def test_z_loss_value_and_gradients_match_a_direct_computation_in_fp64(rows, c):
    hidden, weight, targets = inputs(scale=2.0)  # log Z far from 0
    expected = direct(hidden, weight, targets, c)
    want = torch.autograd.grad(expected * 3.0, (hidden, weight))
    loss = linear_cross_entropy(hidden, weight, targets, rows=rows, z_loss=c)
    got = torch.autograd.grad(loss * 3.0, (hidden, weight))  # the incoming gradient is applied
    assert loss.dtype == torch.float32
    z_term = (expected - direct(hidden, weight, targets, 0.0)).item()
    assert z_term > 10 * c  # the term is there and large: (log Z)² > 10
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=1e-6)
    for g, w in zip(got, want, strict=True):  # the hidden states' and the weight's, to fp32 precision
        assert (g - w).abs().max() <= 2e-6 * w.abs().max(), (g - w).abs().max()


def test_z_loss_matches_the_same_computation_in_fp32_and_bf16():
    hidden, weight, targets = inputs(n=64, d=32, v=300)
    expected = direct(hidden, weight, targets, 1e-2, dtype=torch.float32)
    want = torch.autograd.grad(expected, (hidden, weight))
    loss = linear_cross_entropy(hidden, weight, targets, rows=16, z_loss=1e-2)
    got = torch.autograd.grad(loss, (hidden, weight))
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    h16, w16 = hidden.detach().bfloat16().requires_grad_(), weight.detach().bfloat16().requires_grad_()
    # the reference from the same bf16 logits, in fp32 (as the fused loss computes them)
    logits = (h16 @ w16.T).float()
    valid = targets != IGNORE_INDEX
    reference = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX)
    reference = reference + 1e-2 * (torch.logsumexp(logits, -1)[valid] ** 2).mean()
    want16 = torch.autograd.grad(reference, (h16, w16))
    loss16 = linear_cross_entropy(h16, w16, targets, rows=16, z_loss=1e-2)
    got16 = torch.autograd.grad(loss16, (h16, w16))
    torch.testing.assert_close(loss16, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got16[0], want16[0], rtol=2e-2, atol=1e-4)
    torch.testing.assert_close(got16[1], want16[1], rtol=2e-2, atol=1e-4)


def test_ignored_targets_add_no_z_loss():
    hidden, weight, targets = inputs()
    loss = linear_cross_entropy(hidden, weight, torch.full_like(targets, IGNORE_INDEX), rows=8, z_loss=0.5)
    loss.backward()
    assert loss.item() == 0.0
    assert hidden.grad.abs().max() == 0 and weight.grad.abs().max() == 0
    # only the valid rows count, and they are averaged over the valid rows
    _, _, some = inputs()
    some[10:] = IGNORE_INDEX
    expected = direct(hidden, weight, some, 0.5)
    torch.testing.assert_close(linear_cross_entropy(hidden, weight, some, z_loss=0.5).double(), expected)


def test_a_zero_coefficient_gives_exactly_the_plain_loss_and_gradients():
    hidden, weight, targets = inputs(n=64, d=32, v=300, dtype=torch.bfloat16)
    plain = linear_cross_entropy(hidden, weight, targets, rows=16)
    grads = torch.autograd.grad(plain, (hidden, weight))
    zero = linear_cross_entropy(hidden, weight, targets, rows=16, z_loss=0.0)
    assert torch.equal(zero, plain)
    for a, b in zip(torch.autograd.grad(zero, (hidden, weight)), grads, strict=True):
        assert torch.equal(a, b)
    for bad in (-1e-4, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="z_loss"):
            linear_cross_entropy(hidden, weight, targets, z_loss=bad)


def test_the_model_trains_on_ce_plus_z_loss_and_evaluates_plain_ce():
    """Through the whole model: in training mode the loss and every parameter's gradient are those
    of cross_entropy + c · mean (log Z)² on the full logits; in eval mode the loss is the plain CE,
    and a zero coefficient is bit for bit the model without one."""
    torch.manual_seed(0)
    c = 0.05
    model = Transformer(small_model_config(qk_norm=True), z_loss=c)
    tokens = torch.randint(0, 97, (3, 21))
    inputs_, targets = tokens[:, :-1], tokens[:, 1:].clone()
    targets[0, :5] = IGNORE_INDEX
    loss = model(inputs_, targets).loss
    loss.backward()
    fused = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    logits = model(inputs_).logits.flatten(0, 1).float()
    valid = targets.flatten() != IGNORE_INDEX
    ce = F.cross_entropy(logits, targets.flatten(), ignore_index=IGNORE_INDEX)
    expected = ce + c * (torch.logsumexp(logits, -1)[valid] ** 2).mean()
    expected.backward()
    torch.testing.assert_close(loss, expected)
    for name, param in model.named_parameters():
        torch.testing.assert_close(fused[name], param.grad, msg=name)
    with torch.no_grad():
        assert model.eval()(inputs_, targets).loss.item() == pytest.approx(ce.item(), rel=1e-6)
        plain = Transformer(small_model_config(qk_norm=True)).train()
        plain.load_state_dict(model.state_dict())
        model.z_loss = 0.0
        assert torch.equal(model.train()(inputs_, targets).loss, plain(inputs_, targets).loss)


def test_pretraining_builds_the_model_with_the_coefficient_and_evaluation_reports_ce(train_data, tmp_path):
    cfg = load_config(TINY, [f"data.dir={train_data}", "loss.z_loss=0.01", f"run.dir={tmp_path}"])
    torch.manual_seed(0)
    model = build_model(cfg)
    assert model.z_loss == 0.01
    plain = Transformer(cfg.model)
    plain.load_state_dict(model.state_dict())
    engine = FakeEngine(model, torch.optim.SGD(model.parameters(), lr=0.0))
    reference = FakeEngine(plain, torch.optim.SGD(plain.parameters(), lr=0.0))

    def evaluate(e):
        return validation_loss(e, train_data, 512, 2, 2, ONE_PROCESS)["loss"]

    assert evaluate(engine) == evaluate(reference)  # the held-out loss is plain cross-entropy
    assert model.training  # and the engine is back in training mode, where the z-loss counts
    tokens = torch.randint(0, 512, (2, 65))
    with torch.no_grad():
        assert engine(tokens[:, :-1], tokens[:, 1:]).loss > reference(tokens[:, :-1], tokens[:, 1:]).loss


# --------------------------------------------------------------------------- QK-norm


def test_qk_norm_adds_two_head_dim_weights_per_layer_and_leaves_the_default_names_alone():
    plain = dict(Transformer(small_model_config()).named_parameters())
    normed = dict(Transformer(small_model_config(qk_norm=True)).named_parameters())
    assert not any("q_norm" in n or "k_norm" in n for n in plain)
    extra = {n: tuple(p.shape) for n, p in normed.items() if n not in plain}
    assert extra == {f"layers.{i}.attn.{w}_norm.weight": (8,) for i in range(2) for w in "qk"}
    assert all(torch.equal(p, torch.ones(8)) for n, p in normed.items() if n in extra)  # init: ones


def rms_norm(x, weight, eps):
    return weight * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_qk_norm_normalizes_each_head_before_rotary(n_kv_heads):
    """One attention layer against the computation written out: per head, queries and keys
    RMS-normalized over head_dim with their own weights, then rotated, then causal attention."""
    model = random_weights_model(qkv_scale=5.0, qk_norm=True, n_kv_heads=n_kv_heads).eval()
    cfg, attn = model.cfg, model.layers[0].attn
    assert not torch.equal(attn.q_norm.weight, attn.k_norm.weight)
    B, T, nh, hd = 2, 11, cfg.n_heads, cfg.head_dim
    x = torch.randn(B, T, cfg.d_model)
    cos, sin = model.rope_cos[:T, None], model.rope_sin[:T, None]
    wq, wk, wv = attn.qkv_proj.weight.split([nh * hd, n_kv_heads * hd, n_kv_heads * hd])
    q = (x @ wq.T).view(B, T, nh, hd)
    k = (x @ wk.T).view(B, T, n_kv_heads, hd)
    v = (x @ wv.T).view(B, T, n_kv_heads, hd)

    def attend(q, k):
        q, k, vv = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        k, vv = k.repeat_interleave(nh // n_kv_heads, 1), vv.repeat_interleave(nh // n_kv_heads, 1)
        scores = (q @ k.transpose(-2, -1)) / hd**0.5
        scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        y = (scores.softmax(-1) @ vv).transpose(1, 2).reshape(B, T, nh * hd)
        return y @ attn.o_proj.weight.T

    eps = cfg.norm_eps
    qn, kn = rms_norm(q, attn.q_norm.weight, eps), rms_norm(k, attn.k_norm.weight, eps)
    expected = attend(apply_rope(qn, cos, sin), apply_rope(kn, cos, sin))
    with torch.no_grad():
        got, _ = attn(x, (cos, sin))
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        # the order matters with learned weights: norm after rotary is another function
        after = attend(
            rms_norm(apply_rope(q, cos, sin), attn.q_norm.weight, eps),
            rms_norm(apply_rope(k, cos, sin), attn.k_norm.weight, eps),
        )
        assert (got - after).abs().max() > 1e-3
        # the attention maps, the KV cache and document masking go through the same norms
        tokens = torch.randint(0, 97, (2, 16))
        full = model(tokens).logits
        weights = model(tokens, need_weights=True)
        torch.testing.assert_close(weights.logits, full, rtol=1e-5, atol=1e-5)
        from pretrain.model.transformer import KVCache

        cache = KVCache(cfg, 2, 16, torch.float32)
        steps = [model(tokens[:, :10], cache=cache).logits[:, -1]]
        steps += [model(tokens[:, t : t + 1], cache=cache).logits[:, -1] for t in range(10, 16)]
        torch.testing.assert_close(torch.stack(steps, 1), full[:, 9:], rtol=1e-5, atol=1e-5)
        one_document = torch.zeros(2, 16, dtype=torch.long)
        torch.testing.assert_close(
            model(tokens, document_ids=one_document).logits, full, rtol=1e-5, atol=1e-5
        )


def test_a_qk_norm_model_fine_tunes_and_reloads_as_a_classifier():
    """What fine-tuning and `pretrain predict` do with a checkpoint's weights and config."""
    cfg = small_model_config(qk_norm=True)
    state = random_weights_model(qk_norm=True).state_dict()
    saved = json.loads(json.dumps({"model": asdict(cfg)}))  # as run_config.json holds it
    backbone = Transformer.from_state_dict(ModelConfig(**saved["model"]), state)
    assert torch.equal(backbone.layers[1].attn.k_norm.weight, state["layers.1.attn.k_norm.weight"])
    classifier = SequenceClassifier(backbone, num_labels=3)
    again = SequenceClassifier.from_state_dict(ModelConfig(**saved["model"]), 3, classifier.state_dict())
    tokens = torch.randint(0, 97, (2, 9))
    lengths = torch.tensor([9, 4])
    with torch.no_grad():
        assert torch.equal(again(tokens, lengths).logits, classifier.eval()(tokens, lengths).logits)
    old = {k: v for k, v in saved["model"].items() if k != "qk_norm"}  # a run from before the switch
    assert ModelConfig(**old).qk_norm is False


def test_a_qk_norm_pretraining_checkpoint_is_where_fine_tuning_starts(tmp_path, train_data, monkeypatch):
    """Two steps of the loop with qk_norm (tests/unit/fakes.py), then `finetune.init` on the run:
    the config comes from the checkpoint's run_config.json and the trained norms are loaded."""
    from safetensors.torch import load_file

    from pretrain.evaluation import inference
    from pretrain.initial_model import find_initial
    from tests.helpers import FAST
    from tests.unit.fakes import pretraining_trainer

    overrides = [f"run.dir={tmp_path}", f"data.dir={train_data}", "train.steps=2", "checkpoint.every=2"]
    trainer = pretraining_trainer(
        load_config(TINY, [*FAST, *overrides, "eval.every=0", "model.qk_norm=true"])
    )
    trainer.train()
    initial = find_initial(str(tmp_path))
    assert initial.model_cfg.qk_norm
    found = initial.directory
    state = load_file(found / "model.safetensors")  # the fake engine's weights file
    monkeypatch.setattr(inference, "read_checkpoint", lambda path: (found, {}, state))
    model = initial.load_model()
    trained = trainer.engine.module.layers[0].attn.q_norm.weight
    assert not torch.equal(trained, torch.ones_like(trained))  # it was trained
    assert torch.equal(model.layers[0].attn.q_norm.weight, trained)


# --------------------------------------------------------------------------- Hugging Face: Qwen3


transformers = pytest.importorskip("transformers")  # in the `dev` extra; CI installs it


@pytest.mark.parametrize(
    ("n_kv_heads", "tie"), [(4, False), (2, True), (1, False)], ids=["mha-untied", "gqa-tied", "mqa-untied"]
)
def test_a_qk_norm_model_exports_as_qwen3_with_our_logits(tmp_path, n_kv_heads, tie):
    ours = random_weights_model(
        qkv_scale=3.0,
        qk_norm=True,
        n_kv_heads=n_kv_heads,
        tie_embeddings=tie,
        rope_theta=500000.0,
        norm_eps=1e-6,
    ).eval()
    save_hf(ours, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(theirs).__name__ == "Qwen3ForCausalLM"
    assert theirs.config.layer_types == ["full_attention"] * 2 and theirs.config.head_dim == 8
    assert theirs.config.num_key_value_heads == n_kv_heads and theirs.config.tie_word_embeddings == tie
    norm = theirs.model.layers[1].self_attn.k_norm.weight
    assert torch.equal(norm, ours.layers[1].attn.k_norm.weight)  # loaded, not initialized
    tokens = torch.randint(0, 97, (2, 40))
    with torch.no_grad():
        a, b = ours(tokens).logits, theirs(tokens).logits
    assert a.std() > 0.1  # logits that carry signal, not a degenerate comparison
    assert (a - b).abs().max().item() <= 1e-4
    back = load_hf(tmp_path).eval()  # and read back by us, weight for weight
    assert back.cfg.qk_norm
    for (name, x), (_, y) in zip(ours.state_dict().items(), back.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


def test_load_hf_reads_a_qwen3_model_transformers_wrote(tmp_path):
    config = transformers.Qwen3Config(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    torch.manual_seed(3)
    theirs = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    theirs.save_pretrained(tmp_path, safe_serialization=True)
    ours = load_hf(tmp_path).eval()
    assert ours.cfg.qk_norm and ours.cfg.n_kv_heads == 2
    tokens = torch.randint(0, 97, (2, 30))
    with torch.no_grad():
        assert (ours(tokens).logits - theirs(tokens).logits).abs().max().item() <= 1e-4
    saved = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(saved | {"use_sliding_window": True}))
    with pytest.raises(UserError, match="sliding-window attention is not supported") as refused:
        load_hf(tmp_path)
    assert "\n" not in str(refused.value)


def test_a_model_without_qk_norm_still_exports_as_llama(tmp_path):
    save_hf(random_weights_model(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "use_sliding_window" not in config


def test_export_hf_of_a_qk_norm_model_is_a_complete_qwen3_directory(tmp_path, tokenizer_dir):
    """`pretrain export-hf`'s path (export_trained): Qwen3 weights and config with our tokenizer
    files, which AutoTokenizer reads as ours (not as Qwen's tokenizer); our commands read it back."""
    from pretrain.evaluation.inference import Trained, export_trained, load_trained
    from pretrain.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(tokenizer_dir)
    model = random_weights_model(qk_norm=True, vocab_size=tokenizer.vocab_size).eval()
    run_config = {"data": {"seq_len": 32, "document_masking": False}}
    out = export_trained(Trained(model, tokenizer, run_config, tmp_path / "ckpt"), tmp_path / "hf")
    text = "def f(x):\n\treturn x  # café"
    theirs_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert theirs_tok(text, add_special_tokens=False)["input_ids"] == tokenizer.encode(text)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(theirs).__name__ == "Qwen3ForCausalLM"
    ids = torch.tensor([tokenizer.encode_document(text)])
    with torch.no_grad():
        assert (theirs(ids).logits - model(ids).logits).abs().max().item() <= 1e-4
    loaded = load_trained(out)
    assert loaded.model.cfg.qk_norm and loaded.run_config == run_config
