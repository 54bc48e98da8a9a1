"""Document masking: a document inside a packed window computes what it computes alone; all-zero
ids are the plain forward; gradients flow; the loader's ids follow the EOS positions; the model's
FlexAttention block mask (the GPU's) allows exactly what its dense mask (the CPU's) allows."""

import pytest
import torch

from pretrain.data.loader import document_ids
from pretrain.model.transformer import document_mask, positions_in_document
from tests.conftest import random_weights_model

EOS = 2


def packed(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One window of documents of these lengths, each ending in EOS (the last may be cut off)."""
    g = torch.Generator().manual_seed(seed)
    documents = []
    for n in lengths:
        doc = torch.randint(3, 97, (n,), generator=g)
        doc[-1] = EOS
        documents.append(doc)
    return torch.cat(documents), documents


@pytest.mark.parametrize(
    ("positions", "norm_placement"), [("rope", "pre"), ("learned", "pre"), ("rope", "post")]
)
def test_each_document_in_a_packed_window_computes_what_it_computes_alone(positions, norm_placement):
    model = random_weights_model(qkv_scale=3.0, positions=positions, norm_placement=norm_placement).eval()
    window, documents = packed([7, 1, 12, 9, 5])
    window[-1] = 50  # the last document is cut off by the window's end
    ids = document_ids(window[None], EOS)
    with torch.no_grad():
        logits = model(window[None], document_ids=ids).logits[0]
        start = 0
        for doc in documents:
            doc = window[start : start + len(doc)]
            alone = model(doc[None]).logits[0]
            assert (logits[start : start + len(doc)] - alone).abs().max().item() <= 1e-5
            start += len(doc)


def test_all_zero_ids_are_the_plain_forward_and_the_loss_agrees():
    model = random_weights_model(qkv_scale=3.0).eval()
    tokens = torch.randint(0, 97, (3, 40))
    with torch.no_grad():
        plain = model(tokens).logits
        zeros = model(tokens, document_ids=torch.zeros_like(tokens)).logits
        assert (plain - zeros).abs().max().item() <= 1e-5
        loss = model(tokens, tokens, document_ids=torch.zeros_like(tokens)).loss
        torch.testing.assert_close(loss, model(tokens, tokens).loss, rtol=1e-5, atol=1e-5)


def test_gradients_flow_through_the_mask_and_stay_inside_the_document():
    model = random_weights_model()
    window, _ = packed([10, 14])
    ids = document_ids(window[None], EOS)
    captured = []
    model.tok_embeddings.register_forward_hook(
        lambda module, args, out: captured.append(out) or out.retain_grad()
    )
    hidden, _ = model.hidden_states(window[None], document_ids=ids)
    hidden[0, :10].sum().backward()  # the first document's outputs depend on its own inputs only
    grad = captured[0].grad[0]
    assert grad[:10].abs().sum() > 0 and grad[10:].abs().sum() == 0
    model.zero_grad()
    loss = model(window[None], window[None], document_ids=ids).loss
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_the_loader_ids_start_a_document_after_each_eos():
    tokens = torch.tensor([[5, 6, EOS, 7, EOS, EOS, 8], [EOS, 9, 9, 9, 9, 9, 9]])
    assert document_ids(tokens, EOS).tolist() == [[0, 0, 0, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1]]
    assert positions_in_document(document_ids(tokens, EOS)).tolist() == [
        [0, 1, 2, 0, 1, 0, 0],
        [0, 0, 1, 2, 3, 4, 5],
    ]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_the_flex_block_mask_allows_what_the_dense_mask_allows():
    """The model's own block mask (what CUDA trains with), through eager FlexAttention with GQA; the
    compiled kernel the model calls is checked against dense attention in tests/integration/test_compile.py."""
    from torch.nn.attention.flex_attention import flex_attention

    window, _ = packed([30, 50, 100, 76])  # 256 tokens: two 128-token blocks, documents across them
    ids = document_ids(torch.stack([window, window.roll(37)]), EOS)
    block, dense = document_mask(ids, "flex"), document_mask(ids, "dense")
    q, k, v = torch.randn(2, 4, 256, 16), torch.randn(2, 2, 256, 16), torch.randn(2, 2, 256, 16)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)
    with torch.no_grad():
        got = flex_attention(q, k, v, block_mask=block, enable_gqa=True)
    assert (got - expected).abs().max().item() < 1e-5


def test_auto_is_dense_on_cpu_and_an_unknown_kind_is_refused():
    ids = torch.zeros(1, 8, dtype=torch.int32)
    assert isinstance(document_mask(ids), torch.Tensor) and document_mask(ids).shape == (1, 1, 8, 8)
    with pytest.raises(ValueError, match="mask kind 'sparse'"):
        document_mask(ids, "sparse")
