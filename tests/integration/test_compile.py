"""torch.compile of the blocks, and the model's FlexAttention path (compiled: it is what CUDA runs
for document masking) against dense attention on CPU. Inductor compiles in worker processes and
calls the C++ compiler, so these are not unit tests."""

from pretrain.model.transformer import Transformer
from tests.conftest import packed_document_ids, small_model_config
from tests.unit.test_engine import _loss_and_grads


def test_compiled_blocks_compute_the_same_function():
    import torch

    from pretrain.parallel.engine import compile_blocks

    torch.manual_seed(0)
    model = Transformer(small_model_config())
    names = [n for n, _ in model.named_parameters()]
    tokens = torch.randint(0, 97, (2, 17))
    loss, grads = _loss_and_grads(model, tokens)
    compile_blocks(model)
    assert [n for n, _ in model.named_parameters()] == names
    loss2, grads2 = _loss_and_grads(model, tokens)
    torch.testing.assert_close(loss2, loss, rtol=1e-4, atol=1e-5)
    for name in names:
        torch.testing.assert_close(grads2[name], grads[name], rtol=1e-3, atol=1e-5)


def test_the_models_flex_attention_equals_dense_attention_on_cpu():
    """The CUDA document-masking path, run on a CPU: the model's own block mask through its own
    compiled FlexAttention (torch runs the forward on CPU), with GQA and several documents per
    window across the 128-token blocks, against SDPA with the dense mask of the same documents."""
    import torch

    from pretrain.model.transformer import document_mask, flex_attention

    torch.manual_seed(0)
    ids = packed_document_ids(2, [30, 50, 100, 76])  # 256 tokens, 4 documents per row
    q, k, v = torch.randn(2, 8, 256, 32), torch.randn(2, 2, 256, 32), torch.randn(2, 2, 256, 32)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=document_mask(ids, "dense"), enable_gqa=True
    )
    with torch.no_grad():
        flex = flex_attention(q, k, v, document_mask(ids, "flex"), enable_gqa=True)
    assert (flex - dense).abs().max().item() <= 1e-5


def test_a_document_masked_forward_through_flex_attention_equals_the_dense_path(monkeypatch):
    """The whole Transformer with document_ids: masked_attention="flex" (what CUDA runs) against
    "dense" (what the CPU runs); rotary positions restart per document in both."""
    import torch

    from pretrain.model import transformer as model_module
    from tests.conftest import random_weights_model

    calls, flex_attention = [], model_module.flex_attention
    monkeypatch.setattr(model_module, "flex_attention", lambda *a: calls.append(1) or flex_attention(*a))
    model = random_weights_model(qkv_scale=3.0, max_seq_len=256).eval()
    ids = packed_document_ids(2, [7, 60, 1, 90, 98])
    tokens = torch.randint(3, 97, ids.shape)
    with torch.no_grad():
        dense = model(tokens, document_ids=ids).logits
        model.masked_attention = "flex"
        flex = model(tokens, document_ids=ids).logits
        unmasked = model(tokens).logits
    assert len(calls) == model.cfg.n_layers  # every layer took the FlexAttention path
    assert (flex - dense).abs().max().item() <= 1e-5
    assert (unmasked - dense).abs().max().item() > 1e-2  # the documents do change the result


def test_the_compiled_loss_kernel_matches_the_reference():
    """`loss.kernel=compiled` (each chunk's arithmetic one compiled function) against torch's
    cross-entropy on fp32 logits, with the z-loss and ignored rows on chunk boundaries, with the
    eager kernel's tolerances (tests/unit/test_loss.py). The norm, head and loss compiled as one
    graph trace with 0 breaks in tests/unit/test_compiled_path.py; compiled against eager on a GPU
    in test_gpu.py (compiling the whole head here costs minutes of the suite)."""
    import torch

    from pretrain.model.loss import linear_cross_entropy
    from tests.unit.test_loss import boundary_inputs, reference

    hidden, weight, targets = boundary_inputs(torch.float32)
    expected = reference(hidden, weight, targets, 1e-2)
    want = torch.autograd.grad(expected * 2.0, (hidden, weight))
    loss = linear_cross_entropy(hidden, weight, targets, rows=8, z_loss=1e-2, kernel="compiled")
    got = torch.autograd.grad(loss * 2.0, (hidden, weight))
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    ignored = targets == -100
    assert got[0][ignored].abs().max() == 0
