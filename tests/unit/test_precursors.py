"""The instability precursors (pretrain/stability/precursors.py) against a direct computation on a small model:
explicit full attention scores from the q and k the model's own forward hands to its attention
kernel, the full logits of the model's forward, and parameter snapshots around an AdamW step."""

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from pretrain.config import ModelConfig
from pretrain.parallel.engine import param_groups
from pretrain.stability.precursors import UpdateRatios, forward_precursors, group_of, max_attention_logit
from tests.conftest import packed_document_ids, random_weights_model

SMALL_CHUNKS = 300  # a few queries or tokens per chunk: every chunk boundary is crossed
QK_NORM = [False] + [True] * ("qk_norm" in {f.name for f in dataclasses.fields(ModelConfig)})


def sharp_model(**overrides):
    """Random weights with attention logits and output logits far from 0 (not ties at init)."""
    model = random_weights_model(qkv_scale=8.0, **overrides)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    return model


def batch(document_masking: bool):
    torch.manual_seed(1)
    tokens = torch.randint(0, 97, (3, 48))
    documents = packed_document_ids(3, [5, 17, 9, 3, 14]) if document_masking else None
    return tokens, documents


def recorded_attention_inputs(monkeypatch, model, tokens, documents) -> list[tuple]:
    """(q, k, mask) of each layer, as the model's forward calls its attention kernel with them."""
    calls, kernel = [], F.scaled_dot_product_attention

    def record(q, k, v, attn_mask=None, is_causal=False, **kwargs):
        calls.append((q, k, attn_mask if not is_causal else None))
        return kernel(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", record)
    with torch.no_grad():
        model(tokens, document_ids=documents)
    monkeypatch.undo()
    return calls


def full_scores_max(q, k, mask) -> torch.Tensor:
    """Every head's (T, T) scores written out, masked, and their maximum."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # (B, nh, T, hd)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    T = q.shape[2]
    allowed = mask if mask is not None else torch.ones(T, T, dtype=torch.bool).tril()
    return scores.masked_fill(~allowed, float("-inf")).amax()


@pytest.mark.parametrize("qk_norm", QK_NORM)
@pytest.mark.parametrize("chunk_elements", [SMALL_CHUNKS, None])
@pytest.mark.parametrize("document_masking", [False, True])
def test_attention_logit_max_matches_full_scores(monkeypatch, document_masking, chunk_elements, qk_norm):
    model = sharp_model(**({"qk_norm": True} if qk_norm else {}))
    tokens, documents = batch(document_masking)
    values = forward_precursors(
        model, tokens, documents, sequences=2, max_tokens=40, chunk_elements=chunk_elements
    )
    sub_documents = documents[:2, :40] if document_masking else None
    calls = recorded_attention_inputs(monkeypatch, model, tokens[:2, :40], sub_documents)
    assert len(calls) == 2
    for layer, (q, k, mask) in enumerate(calls):
        assert (mask is not None) == document_masking
        expected = full_scores_max(q, k, mask)
        assert expected > 1.0  # far from init's near-zero scores
        torch.testing.assert_close(values[f"stability/attn_logit_max/layer_{layer}"], expected)


def test_attention_logit_max_only_over_allowed_pairs():
    """Scores planted where a query may not look (a later key; with documents, an earlier one of
    another document) are not the max; a query's own key (the diagonal) is allowed."""
    q = torch.zeros(1, 6, 2, 4)
    k = torch.zeros(1, 6, 1, 4)
    q[0, 1, 0, 0], k[0, 4, 0, 0] = 10.0, 10.0  # query 1 · key 4: in the future
    q[0, 5, 1, 1], k[0, 1, 0, 1] = 3.0, 3.0  # query 5 · key 1: earlier, another document below
    q[0, 2, 1, 3], k[0, 2, 0, 3] = 2.5, 2.5  # query 2 · key 2: itself
    q[0, 4, 1, 2], k[0, 3, 0, 2] = 2.0, 2.0  # query 4 · key 3: allowed in both
    assert max_attention_logit(q, k, None, chunk_elements=8) == 9.0 / 2
    documents = torch.tensor([[0, 0, 0, 1, 1, 1]])
    assert max_attention_logit(q, k, documents, chunk_elements=8) == 6.25 / 2


@pytest.mark.parametrize("sign", [1.0, -1.0])  # the largest |logit| positive, then negative
@pytest.mark.parametrize("chunk_elements", [SMALL_CHUNKS, None])
@pytest.mark.parametrize("document_masking", [False, True])
def test_output_logit_statistics_match_full_logits(document_masking, chunk_elements, sign):
    model = sharp_model()
    with torch.no_grad():
        model.lm_head.weight.mul_(sign)
    tokens, documents = batch(document_masking)
    values = forward_precursors(
        model, tokens, documents, sequences=2, max_tokens=40, chunk_elements=chunk_elements
    )
    sub_documents = documents[:2, :40] if document_masking else None
    with torch.no_grad():
        logits = model(tokens[:2, :40], document_ids=sub_documents).logits.float()  # (2, 40, V)
    lse = torch.logsumexp(logits, dim=-1)
    assert logits.abs().max() > 5.0
    torch.testing.assert_close(values["stability/logit_lse_mean"], lse.mean())
    torch.testing.assert_close(values["stability/logit_lse_max"], lse.max())
    torch.testing.assert_close(values["stability/logit_abs_max"], logits.abs().max())


def test_probe_leaves_the_model_as_it_was():
    """The head never forms the (N, V) logits; then no hook is left behind, the model gives the
    same logits bit for bit, and the values are tensors (no host read)."""
    model = sharp_model()
    tokens, documents = batch(True)
    with torch.no_grad():
        before = model(tokens, document_ids=documents).logits
    formed = []
    handle = model.lm_head.register_forward_hook(lambda module, args, out: formed.append(out.numel()))
    values = forward_precursors(model, tokens, documents)
    handle.remove()
    assert formed == [0]
    assert all(isinstance(v, torch.Tensor) and v.shape == () for v in values.values())
    layers = [f"stability/attn_logit_max/layer_{i}" for i in (0, 1)]
    logits = ["stability/logit_lse_mean", "stability/logit_lse_max", "stability/logit_abs_max"]
    assert sorted(values) == sorted([*layers, *logits])
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
    with torch.no_grad():
        after = model(tokens, document_ids=documents).logits
    assert torch.equal(before, after)


# --------------------------------------------------------------------------- update ratios

GROUPS = {  # the 2-layer model's parameters by group, written out
    "embeddings": ["tok_embeddings.weight"],
    "layers.0.attn": ["layers.0.attn.qkv_proj.weight", "layers.0.attn.o_proj.weight"],
    "layers.0.mlp": ["layers.0.mlp.in_proj.weight", "layers.0.mlp.out_proj.weight"],
    "layers.1.attn": ["layers.1.attn.qkv_proj.weight", "layers.1.attn.o_proj.weight"],
    "layers.1.mlp": ["layers.1.mlp.in_proj.weight", "layers.1.mlp.out_proj.weight"],
    "norms": [f"layers.{i}.{n}_norm.weight" for i in (0, 1) for n in ("attn", "mlp")] + ["norm.weight"],
    "head": ["lm_head.weight"],
}


def test_group_names():
    model = random_weights_model()
    assert {name: group_of(name) for name, _ in model.named_parameters()} == {
        name: group for group, names in GROUPS.items() for name in names
    }


def expected_ratios(before: dict, after: dict, groups: dict) -> dict[str, float]:
    """sqrt(Σ Δ² / Σ w²) per group, in float64, from whole-parameter snapshots."""
    ratios = {}
    for group, names in groups.items():
        update = sum(float((after[n].double() - before[n].double()).pow(2).sum()) for n in names)
        weights = sum(float(before[n].double().pow(2).sum()) for n in names)
        ratios[f"stability/update_ratio/{group}"] = math.sqrt(update / weights)
    return ratios


def train_step(model, optimizer):
    tokens = torch.randint(0, 97, (2, 24))
    model(tokens[:, :-1], tokens[:, 1:]).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("tie", [False, True])
def test_update_ratios_match_parameter_snapshots(tie):
    model = random_weights_model(tie_embeddings=tie)
    optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=3e-3)
    train_step(model, optimizer)  # Adam's first step moves every weight by ~lr: take a later one
    ratios = UpdateRatios(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ratios.before_step()
    train_step(model, optimizer)
    values = ratios.after_step()
    after = {n: p.detach() for n, p in model.named_parameters()}
    groups = {g: names for g, names in GROUPS.items() if not (tie and g == "head")}
    expected = expected_ratios(before, after, groups)
    assert sorted(values) == sorted(expected)
    for key, value in values.items():
        assert isinstance(value, torch.Tensor) and value.shape == ()
        assert math.isclose(value.item(), expected[key], rel_tol=1e-5), key


@pytest.mark.parametrize("zero", ["zero12", "zero3"])
def test_update_ratios_sum_partitions_over_ranks(zero):
    """Two ranks, each holding a share of the fp32 master weights as DeepSpeed lays them out
    (ZeRO-1/2: one flat partition per rank, cut across parameters; ZeRO-3: each parameter cut in
    two, zero-padded): the ratios from the shares, summed by the all-reduce, are those of the
    whole masters."""
    model = random_weights_model()
    named = list(model.named_parameters())
    shares: dict[int, dict[int, torch.Tensor | None]] = {0: {}, 1: {}}  # rank → id(param) → share
    if zero == "zero12":
        master = torch.cat([p.detach().reshape(-1) for _, p in named])
        master = torch.cat([master, torch.zeros(len(master) % 2)])  # padded to a multiple of 2
        size, offset = len(master) // 2, 0
        for _, p in named:
            for rank in (0, 1):
                start, end = max(offset, rank * size), min(offset + p.numel(), (rank + 1) * size)
                shares[rank][id(p)] = master[start:end] if start < end else None
            offset += p.numel()
        whole = {}
        offset = 0
        for name, p in named:
            whole[name] = master[offset : offset + p.numel()]
            offset += p.numel()
    else:
        whole, padded = {}, {}
        for name, p in named:
            padded[name] = torch.zeros(p.numel() + p.numel() % 2)
            padded[name][: p.numel()] = p.detach().reshape(-1)
            whole[name] = padded[name][: p.numel()]
            shares[0][id(p)], shares[1][id(p)] = padded[name].chunk(2)

    def become(rank: int) -> None:
        for index, (_, p) in enumerate(named):
            if zero == "zero12":
                share = shares[rank][id(p)]
                p._hp_mapping = None if share is None else SimpleNamespace(hp_fragment=share)
                p._dp_group = "data-parallel"
            else:
                p.ds_id = index
                p.ds_process_group = "data-parallel"
                p._z3_optimizer = SimpleNamespace(
                    get_local_fp32_param=lambda param, rank=rank: shares[rank][id(param)]
                )

    sent = {}

    def rank_1_reduce(tensor, group):
        sent["sums"] = tensor.clone()

    def rank_0_reduce(tensor, group):
        assert group == "data-parallel"
        tensor += sent["sums"]

    ranks = {
        1: UpdateRatios(model, all_reduce=rank_1_reduce),
        0: UpdateRatios(model, all_reduce=rank_0_reduce),
    }
    for rank, ratios in ranks.items():
        become(rank)
        ratios.before_step()
    before = {n: w.clone() for n, w in whole.items()}
    torch.manual_seed(2)
    for name, w in whole.items():  # the optimizer's step, in place on the masters
        w.add_(torch.randn_like(w) * (0.01 if "norm" in name else 0.002))
    for rank, ratios in ranks.items():
        become(rank)
        values = ratios.after_step()  # rank 0's, last: the all-reduced sums
    expected = expected_ratios(before, whole, GROUPS)
    assert sorted(values) == sorted(expected)
    for key, value in values.items():
        assert math.isclose(value.item(), expected[key], rel_tol=1e-5), key


def test_update_ratios_stride_copies_a_subsample():
    model = random_weights_model()
    ratios = UpdateRatios(model, stride=4)
    ratios.before_step()
    assert sum(piece.numel() for piece in ratios.before) == sum(
        math.ceil(p.numel() / 4) for p in model.parameters()
    )
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)  # every weight moved by 1% of itself: the ratio is 0.01 on any subsample
    for value in ratios.after_step().values():
        assert math.isclose(value.item(), 0.01, rel_tol=1e-4)
    with pytest.raises(RuntimeError, match="before_step"):
        ratios.after_step()
