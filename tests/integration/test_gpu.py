"""The GPU paths, each against a reference: flash attention (forced) and cuDNN attention (tried
first, and which backend ran) against SDPA's math kernel, compiled blocks and the compiled head +
loss against eager, FlexAttention document masking against dense SDPA, the fused loss and its
kernels (compiled, Liger-Kernel) against plain cross-entropy, the host synchronizations of a
training step, and `pretrain bench train` reporting MFU and the step's one host sync. Skipped (by tests/conftest.py, one reason line each) without a CUDA GPU;
`scripts/gpu_check.sh` runs them on a lent one (docs/gpu.md).

Tolerances: in fp32 (TF32 off) two kernels of the same function agree to rounding, so gradients
are compared elementwise (rtol 1e-3, atol 1e-5, as the CPU's compile test does); in bf16 (8 bits
of mantissa, rounding at every fused boundary) by relative norm, ‖a − b‖ / ‖b‖ ≤ 2e-2 per tensor,
the band bf16 operands land in against a higher-precision reference (METHOD: 1e-3 to 1e-2), with
room for the reordered sums of a fused kernel."""

import json
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch

import pretrain
from pretrain.model.loss import linear_cross_entropy
from pretrain.model.transformer import Transformer, document_mask, flex_attention, prefer_attention
from tests.conftest import packed_document_ids, small_model_config
from tests.integration.test_commands import run

pytestmark = pytest.mark.gpu

BF16_RELATIVE = 2e-2


@pytest.fixture(autouse=True)
def _no_tf32():
    """fp32 means fp32 here: TF32 matrix products would round inputs to 10 bits."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def gpu_model(dtype=torch.bfloat16, **overrides) -> Transformer:
    torch.manual_seed(0)
    cfg = small_model_config(
        **{"d_model": 128, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 256, **overrides}
    )
    return Transformer(cfg).cuda().to(dtype)


def loss_and_grads(model, tokens, **kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(tokens[:, :-1], tokens[:, 1:], **kwargs).loss
    loss.backward()
    return loss.detach().float(), {n: p.grad.float().clone() for n, p in model.named_parameters()}


def assert_relatively_close(got: dict, want: dict, tolerance: float) -> None:
    for name, expected in want.items():
        error = (got[name] - expected).norm() / expected.norm().clamp(min=1e-12)
        assert error <= tolerance, f"{name}: relative error {error:.2e} > {tolerance:g}"


@pytest.fixture
def torchs_attention_order():
    """The model's SDPA calls in torch's own order (`engine.attention: flash`), so that a test's
    `sdpa_kernel` decides the backend; the default order (cuDNN first) again after."""
    prefer_attention("flash")
    yield
    prefer_attention("cudnn")


def test_forced_flash_attention_computes_what_the_math_kernel_computes(torchs_attention_order):
    """Only the flash kernel allowed (SDPA raises if our strided GQA q/k/v cannot use it): the
    loss and every gradient equal those of SDPA's math kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = gpu_model()
    tokens = torch.randint(0, 97, (2, 257), device="cuda")
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        flash_loss, flash = loss_and_grads(model, tokens)
    with sdpa_kernel(SDPBackend.MATH):
        math_loss, reference = loss_and_grads(model, tokens)
    assert abs(flash_loss.item() - math_loss.item()) <= 1e-2 * abs(math_loss.item())
    assert_relatively_close(flash, reference, BF16_RELATIVE)


def attention_ops(model, tokens) -> set[str]:
    """The SDPA operations a training step of `model` ran (the profiler's op names)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        loss_and_grads(model, tokens)
    return {e.name for e in prof.events() if "scaled_dot_product" in e.name}


@pytest.mark.parametrize("first, op", [("cudnn", "cudnn"), ("flash", "flash")])
def test_the_attention_backend_tried_first_is_the_one_that_runs(first, op, torchs_attention_order):
    """`engine.attention`: cuDNN's SDPA kernel first (where the GPU and cuDNN take the call), or
    torch's own order (flash); the profiler names the one that ran. Heads as the GPT-3 presets'
    (no grouped key/value heads). cuDNN's loss and gradients against the math kernel's, in bf16."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = gpu_model(n_kv_heads=4)
    tokens = torch.randint(0, 97, (2, 257), device="cuda")
    prefer_attention(first)
    ran = attention_ops(model, tokens)
    assert any(f"_scaled_dot_product_{op}_attention" in name for name in ran), ran
    if first == "cudnn":
        loss, grads = loss_and_grads(model, tokens)
        prefer_attention("flash")
        with sdpa_kernel(SDPBackend.MATH):
            math_loss, reference = loss_and_grads(model, tokens)
        assert abs(loss.item() - math_loss.item()) <= 1e-2 * abs(math_loss.item())
        assert_relatively_close(grads, reference, BF16_RELATIVE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_blocks_match_eager_in_loss_and_every_gradient(dtype):
    from pretrain.parallel.engine import compile_blocks

    model = gpu_model(dtype)
    tokens = torch.randint(0, 97, (2, 129), device="cuda")
    eager_loss, eager = loss_and_grads(model, tokens)
    compile_blocks(model)
    compiled_loss, compiled = loss_and_grads(model, tokens)
    if dtype == torch.float32:
        torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-4, atol=1e-5)
        for name in eager:
            torch.testing.assert_close(compiled[name], eager[name], rtol=1e-3, atol=1e-5, msg=name)
    else:
        assert abs(compiled_loss.item() - eager_loss.item()) <= 1e-2 * abs(eager_loss.item())
        assert_relatively_close(compiled, eager, BF16_RELATIVE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_flex_attention_document_masking_matches_dense_sdpa_forward_and_backward(dtype):
    """The model's own block mask and compiled FlexAttention (what training on CUDA runs), GQA
    (8 query heads on 2 key/value heads), documents across the 128-token blocks."""
    ids = packed_document_ids(2, [30, 50, 300, 76, 56]).cuda()  # 512 tokens
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(2, 8, 512, 64), (2, 2, 512, 64), (2, 2, 512, 64)]
    inputs = [torch.randn(s, device="cuda", generator=g).to(dtype).requires_grad_() for s in shapes]
    out = flex_attention(*inputs, document_mask(ids), enable_gqa=True)
    grads = torch.autograd.grad(out.float().square().sum(), inputs)
    dense = document_mask(ids, "dense")
    expected = torch.nn.functional.scaled_dot_product_attention(*inputs, attn_mask=dense, enable_gqa=True)
    want = torch.autograd.grad(expected.float().square().sum(), inputs)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
        for a, b in zip(grads, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
    else:
        names = ("output", "grad q", "grad k", "grad v")
        got = {n: t.float() for n, t in zip(names, [out, *grads], strict=True)}
        assert_relatively_close(
            got, {n: t.float() for n, t in zip(names, [expected, *want], strict=True)}, BF16_RELATIVE
        )


def test_a_document_masked_training_step_on_flex_attention_matches_the_dense_path():
    """The whole model on CUDA: document_ids take FlexAttention by default ("auto"); the loss and
    every gradient equal those of the dense-mask path."""
    model = gpu_model(torch.float32)
    ids = packed_document_ids(2, [7, 60, 1, 90, 98]).cuda()
    tokens = torch.randint(3, 97, (2, 257), device="cuda")
    flex_loss, flex = loss_and_grads(model, tokens, document_ids=ids)
    model.masked_attention = "dense"
    dense_loss, dense = loss_and_grads(model, tokens, document_ids=ids)
    torch.testing.assert_close(flex_loss, dense_loss, rtol=1e-4, atol=1e-5)
    for name in dense:
        torch.testing.assert_close(flex[name], dense[name], rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.parametrize("kernel", ["compiled", "liger"])
def test_the_loss_kernels_match_plain_cross_entropy_with_the_z_loss_and_ignored_rows(kernel):
    """`loss.kernel` compiled and liger (Liger-Kernel 0.8.5, from .whl/) against torch's
    cross-entropy on the fp32 logits plus the z-loss written out; targets ignored on chunk
    boundaries. Tolerances: the loss to 1e-4 relative (fp32 from the same bf16 logits), each
    gradient within BF16_RELATIVE by relative norm (bf16 operands, fused sums in another order)."""
    from pretrain.model.loss import IGNORE_INDEX

    if kernel == "liger":
        pytest.importorskip("liger_kernel", reason="liger-kernel is not installed (docs/gpu.md: .whl/)")
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(4096, 256, device="cuda", generator=g).bfloat16().requires_grad_()
    weight = (0.05 * torch.randn(32000, 256, device="cuda", generator=g)).bfloat16().requires_grad_()
    targets = torch.randint(0, 32000, (4096,), device="cuda", generator=g)
    targets[::2048] = IGNORE_INDEX  # (the first row of each 2048-row chunk)
    targets[2047::2048] = IGNORE_INDEX
    logits = (hidden @ weight.T).float()
    valid = targets != IGNORE_INDEX
    expected = (
        torch.nn.functional.cross_entropy(logits, targets)
        + 1e-4 * logits.logsumexp(-1)[valid].square().mean()
    )
    want = torch.autograd.grad(expected, (hidden, weight))
    loss = linear_cross_entropy(hidden, weight, targets, z_loss=1e-4, kernel=kernel)
    got = torch.autograd.grad(loss, (hidden, weight))
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-4)
    names = ("hidden", "weight")
    assert_relatively_close(
        {n: t.float() for n, t in zip(names, got, strict=True)},
        {n: t.float() for n, t in zip(names, want, strict=True)},
        BF16_RELATIVE,
    )


def test_the_compiled_head_and_loss_match_eager():
    """`engine.compile_head`: the final norm, the LM head and the loss as one compiled graph
    (fullgraph), in fp32 against eager."""
    from pretrain.config import EngineConfig
    from pretrain.parallel.engine import compile_model

    model = gpu_model(torch.float32)
    tokens = torch.randint(0, 97, (2, 129), device="cuda")
    eager_loss, eager = loss_and_grads(model, tokens)
    compile_model(model, EngineConfig(compile=True), {"zero_optimization": {"stage": 1}})
    compiled_loss, compiled = loss_and_grads(model, tokens)
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-4, atol=1e-5)
    for name in eager:
        torch.testing.assert_close(compiled[name], eager[name], rtol=1e-3, atol=1e-5, msg=name)


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


def test_collectives_take_host_tensors_in_an_nccl_group(tmp_path):
    """The checkpointer agrees on a failed save and compares weight digests with host tensors; an
    NCCL group takes CUDA tensors only (gloo, on CPU, takes both), so `all_reduce_sum` and
    `broadcast` carry a host tensor to the GPU and back."""
    import torch.distributed as dist

    from pretrain.parallel.distributed import all_reduce_sum, broadcast

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        summed = all_reduce_sum(torch.tensor([1.0, 2.0]))
        assert summed.device.type == "cpu" and summed.tolist() == [1.0, 2.0]
        assert broadcast(torch.tensor([7])).tolist() == [7]
        assert all_reduce_sum(torch.ones(2, device="cuda")).tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()


PACKAGE, OWNERS = str(Path(pretrain.__file__).parent), ("/tests/", "/deepspeed/")


def synchronizing_caller() -> str | None:
    """file:line in the project's library that led to the synchronization being warned about now,
    or None when the test's stand-in engine (or DeepSpeed) did: the innermost frame that is ours."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(PACKAGE):
            return f"{Path(name).name}:{frame.f_lineno}"
        if any(owner in name for owner in OWNERS):
            return None
        frame = frame.f_back
    return None


@pytest.mark.parametrize("masking", [False, True], ids=["plain", "document_masking"])
def test_a_training_step_synchronizes_with_the_host_once(tmp_path, train_data, masking):
    """torch's sync debug mode warns at every operation that makes the host wait for the GPU; the
    loop's own code (data, model, loss, the step's numbers) may do so once per step: its one read
    (tests/unit/test_host_reads.py counts the reads on CPU)."""
    from pretrain.config import load_config
    from pretrain.train.hooks import StepHook
    from tests.helpers import FAST, TINY
    from tests.unit.fakes import pretraining_trainer

    cfg = load_config(
        TINY,
        [
            *FAST,
            f"run.dir={tmp_path}",
            f"data.dir={train_data}",
            "train.steps=6",
            "checkpoint.every=6",
            "eval.every=0",
            f"data.document_masking={masking}",
        ],
    )
    trainer = pretraining_trainer(cfg, device="cuda")
    syncs: list[tuple[int, str]] = []
    step_now = [0]

    class Mark(StepHook):
        priority = -1  # (first: before any other hook's work of the step)

        def before_step(self, step):
            step_now[0] = step

    def record(message, category, *args, **kwargs):
        where = synchronizing_caller()
        on_the_loop = threading.current_thread() is threading.main_thread()  # (not the prefetch thread)
        if on_the_loop and where is not None and "synchroniz" in str(message):
            syncs.append((step_now[0], where))

    trainer.hooks.insert(0, Mark())
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.train()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    per_step = {step: [w for s, w in syncs if s == step] for step in range(2, 6)}  # (step 1 warms up)
    assert all(len(found) == 1 for found in per_step.values()), per_step


def test_bench_train_reports_mfu_and_memory_on_gpu(small_preset):
    result = run("bench", "train", str(small_preset), "--steps", "3", "--warmup", "1", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    r = json.loads(result.stdout)
    assert r["device"] != "cpu" and r["dtype"] == "bf16"
    assert 0 < r["ours_mfu"] < 1 and 0 < r["hf_mfu"] < 1
    assert r["ours_step_peak_memory_bytes"] > 0 and r["hf_step_peak_memory_bytes"] > 0
    assert r["measured_matmul_flops"] > 1e14  # any datacenter GPU in bf16
    # the step's one host read (the norm gate's); Transformers' in DeepSpeed's own engine: more
    assert r["host_syncs_per_step"]["ours"] == 1, r["host_sync_sites"]
    assert r["host_syncs_per_step"]["hf"] > 1, r["host_sync_sites"]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_replayed_step_repeats_its_loss_and_gradient_norm_within_the_gpu_tolerance(
    record_property, compiled
):
    """Issue 46's tolerance on a GPU (pretrain/stability/replay.py GPU_RTOL): the same micro-batches forward
    and backward 12 times on the same weights, in bf16, the gradient norm taken by the replay's own
    GradientTally. The largest relative difference from the first pass, of the loss and of the
    norm, is recorded (summary.json's pytest figures) and must stay below GPU_RTOL / 10; one
    flipped exponent bit in one gradient element moves the norm far beyond GPU_RTOL."""
    from pretrain.parallel.engine import compile_blocks
    from pretrain.stability.replay import GPU_RTOL, GradientTally

    model = gpu_model(d_model=512, n_heads=8, n_kv_heads=4, n_layers=6, max_seq_len=1024, vocab_size=32000)
    if compiled:
        compile_blocks(model)
    tally = GradientTally(model)
    torch.manual_seed(1)
    micro_batches = [torch.randint(0, 32000, (4, 1025), device="cuda") for _ in range(2)]

    def one_pass() -> tuple[float, float]:
        model.zero_grad(set_to_none=True)
        losses = []
        for tokens in micro_batches:
            loss = model(tokens[:, :-1], tokens[:, 1:]).loss
            loss.backward()
            losses.append(loss.detach().float())
        return float(torch.stack(losses).sum()), float(tally.take())

    first = one_pass()
    passes = [one_pass() for _ in range(11)]
    loss_rtol = max(abs(loss - first[0]) / abs(first[0]) for loss, _ in passes)
    norm_rtol = max(abs(norm - first[1]) / abs(first[1]) for _, norm in passes)
    record_property("replay_loss_max_rtol", f"{loss_rtol:.3e}")
    record_property("replay_grad_norm_max_rtol", f"{norm_rtol:.3e}")
    record_property("replay_bitwise_repeats", sum(p == first for p in passes))
    assert loss_rtol < GPU_RTOL / 10 and norm_rtol < GPU_RTOL / 10, (loss_rtol, norm_rtol)

    grad = model.layers[0].attn.o_proj.weight.grad  # (the last pass's, in bf16)
    flipped = grad.clone()
    flipped.view(torch.int16).view(-1)[0] ^= 1 << 14  # bf16: the exponent's top bit is bit 14
    clean, faulty = (float(torch.linalg.vector_norm(g.float())) for g in (grad, flipped))
    assert not abs(faulty - clean) <= GPU_RTOL * clean  # (inf when the norm overflows: also a change)
    tally.remove()
