"""torch.compile of the blocks (inductor compiles in worker processes, so this is not a unit test)."""

from pretrain.model import Transformer
from tests.conftest import small_model_config
from tests.unit.test_engine import _loss_and_grads


def test_compiled_blocks_compute_the_same_function():
    import torch

    from pretrain.engine import compile_blocks

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
