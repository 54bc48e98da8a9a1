"""The GPU fast path: flash attention through SDPA, compiled blocks, the fused loss on CUDA, and
`pretrain bench train` reporting MFU. Skipped (by conftest) on machines without a CUDA GPU."""

import json

import pytest
import torch

from pretrain.loss import linear_cross_entropy
from pretrain.model import Transformer
from tests.conftest import small_model_config
from tests.integration.test_commands import run
from tests.unit.test_bench import SMALL_MODEL

pytestmark = pytest.mark.gpu


def gpu_model(**overrides) -> Transformer:
    torch.manual_seed(0)
    cfg = small_model_config(
        **{"d_model": 128, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 256, **overrides}
    )
    return Transformer(cfg).cuda().to(torch.bfloat16)


def test_flash_attention_serves_the_model():
    """With only the flash kernel allowed, SDPA raises if our q/k/v (strided, GQA) cannot use it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = gpu_model()
    tokens = torch.randint(0, 97, (2, 257), device="cuda")
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        model(tokens[:, :-1], tokens[:, 1:]).loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_compiled_blocks_match_eager_on_gpu():
    from pretrain.engine import compile_blocks

    model = gpu_model()
    tokens = torch.randint(0, 97, (2, 129), device="cuda")
    eager = model(tokens[:, :-1], tokens[:, 1:]).loss
    compile_blocks(model)
    compiled = model(tokens[:, :-1], tokens[:, 1:]).loss
    assert abs(eager.item() - compiled.item()) < 2e-2


def test_fused_loss_on_gpu_matches_plain_cross_entropy():
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(4096, 256, device="cuda", generator=g).bfloat16().requires_grad_()
    weight = (0.05 * torch.randn(32000, 256, device="cuda", generator=g)).bfloat16().requires_grad_()
    targets = torch.randint(0, 32000, (4096,), device="cuda", generator=g)
    expected = torch.nn.functional.cross_entropy((hidden @ weight.T).float(), targets)
    want = torch.autograd.grad(expected, (hidden, weight))
    loss = linear_cross_entropy(hidden, weight, targets)
    got = torch.autograd.grad(loss, (hidden, weight))
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-4)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=1e-5)


def test_bench_train_reports_mfu_and_memory_on_gpu(tmp_path):
    preset = tmp_path / "small.yaml"
    preset.write_text("\n".join(f"{k}: {v}" for k, v in SMALL_MODEL.items()) + "\n")
    result = run("bench", "train", str(preset), "--steps", "3", "--warmup", "1", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    r = json.loads(result.stdout)
    assert r["device"] != "cpu" and r["dtype"] == "bf16"
    assert 0 < r["ours_mfu"] < 1 and 0 < r["hf_mfu"] < 1
    assert r["ours_step_peak_memory_bytes"] > 0 and r["hf_step_peak_memory_bytes"] > 0
    assert r["measured_matmul_flops"] > 1e14  # any datacenter GPU in bf16
