"""`pretrain bench profile`'s pure parts, on names and synthetic timelines (no GPU needed): the
classifier of kernel and op names, the summary, the device-idle gaps between kernels, the reading
of the profiler's events, the table; and its refusals of bad input (in this process). The real
capture starts a process group, so it runs in tests/integration/test_bench.py."""

import pytest
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

from pretrain.bench.profile import CATEGORIES, classify, device_gaps, summarize, table, timeline
from tests.helpers import assert_one_line_error

# Kernel names as an H100 profile shows them (cuBLAS, cuBLASLt, CUTLASS, FlashAttention, cuDNN,
# Inductor, NCCL, DeepSpeed's fused Adam), and the ATen ops of a CPU profile.
NAMES = {
    "matmul": [
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off",
        "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT",
        "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8>(Params)",
        "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_tn",
        "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, false>(Params)",
        "std::enable_if<!(false), void>::type internal::gemvx::kernel<int, int, float, float>(Params)",
        "triton_tem_fused_mm_3",
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
        "aten::matmul",
        "aten::linear",
    ],
    "attention": [
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 64, 4, false, false, "
        "cutlass::bfloat16_t>, false, true, false>(Flash_fwd_params)",
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<...>>",
        "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<...>::Params)",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64_4x1x1_kernel0_0",
        "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<...>>>(Params)",
        "triton_tem_fused_flex_attention_0",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
    ],
    "norm": [
        "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_1",
        "void at::native::vectorized_elementwise_kernel<4, at::native::rsqrt_kernel_cuda(...)::{lambda()#1}>",
        "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>(...)",
        "aten::rsqrt",
        "aten::native_layer_norm",
        "aten::_fused_rms_norm",
    ],
    "elementwise": [
        "triton_poi_fused_add_cat_mul_neg_2",
        "triton_poi_fused__scaled_dot_product_flash_attention_transpose_4",  # a layout copy for SDPA
        "triton_per_fused__to_copy_silu_5",
        "void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, float, float, "
        "at::native::binary_internal::MulFunctor<float> > >(int, at::native::BinaryFunctor<...>)",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float>>>",
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>",
        "Memcpy DtoD (Device -> Device)",
        "Memset (Device)",
        "aten::mul",
        "aten::copy_",
        "aten::cat",
        "aten::silu_backward",
        "aten::logsumexp",
        "## Call CompiledFxGraph fs5w3wzmwyb3y3xj3r6wnbtfyjsznqt5qpkkx ##",  # Inductor's C++ kernels (CPU)
    ],
    "optimizer": [
        "void multi_tensor_apply_kernel<TensorListMetadata<4>, AdamFunctor<c10::BFloat16, float>, float>",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::NormTwoOps<float>>>",
        "aten::_fused_adamw_",
        "aten::_foreach_mul_",
        "aten::linalg_vector_norm",
        "Optimizer.step#AdamW.step",
    ],
    "communication": [
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
        "ncclKernel_ReduceScatter_RING_LL_Sum_bfloat16(ncclWork*)",
        "c10d::allreduce_",
        "gloo:all_reduce",
        "record_param_comms",
    ],
    "other": [
        "aten::view",
        "aten::empty_strided",
        "aten::transpose",
        "torch::autograd::AccumulateGrad",
        "_LinearCrossEntropy",
    ],
}


@pytest.mark.parametrize(
    "category, name", [(category, name) for category, names in NAMES.items() for name in names]
)
def test_classify_sorts_kernel_and_op_names(category, name):
    assert classify(name) == category


def test_every_category_is_tested():
    assert set(NAMES) == set(CATEGORIES)


def test_summarize_ranks_names_and_its_shares_add_up():
    entries = [
        ("aten::mm", 300.0),
        ("aten::mm", 300.0),
        ("flash_fwd_kernel", 200.0),
        ("aten::mul", 150.0),
        ("aten::view", 50.0),
    ] + [(f"k{i}", 1.0) for i in range(20)]
    s = summarize(entries, top=3)
    assert [k["name"] for k in s["top_kernels"]] == ["aten::mm", "flash_fwd_kernel", "aten::mul"]
    mm = s["top_kernels"][0]
    assert mm["calls"] == 2 and mm["total_ms"] == pytest.approx(0.6) and mm["category"] == "matmul"
    assert s["timeline_ms"] == pytest.approx(1.02)
    assert mm["share"] == pytest.approx(600 / 1020)
    assert s["matmul_share"] == pytest.approx(600 / 1020)
    assert s["attention_share"] == pytest.approx(200 / 1020)
    assert set(s["categories"]) == set(CATEGORIES)
    assert sum(c["share"] for c in s["categories"].values()) == pytest.approx(1.0)
    assert s["categories"]["other"]["total_ms"] == pytest.approx(0.07)  # aten::view and the k's
    assert summarize([])["matmul_share"] == 0.0  # an empty timeline: no division by zero


def test_device_gaps_counts_idle_time_between_kernels_within_each_step():
    windows = [(0.0, 1000.0), (1000.0, 2000.0)]
    kernels = [
        # step 0: edges 10 + 100 µs; a 5 µs gap (launch spacing, not counted), a 200 µs gap, and two
        # kernels on two streams that overlap (their union is busy: no gap between them).
        (10.0, 300.0, "a"),
        (305.0, 400.0, "b"),
        (600.0, 800.0, "c"),
        (700.0, 900.0, "d"),
        # step 1: one 40 µs gap; a short kernel on another stream inside a long one (no gap after
        # it); given out of order (the function sorts)
        (1500.0, 1990.0, "f"),
        (1000.0, 1460.0, "e"),
        (1100.0, 1200.0, "g"),
    ]
    g = device_gaps(kernels, windows, threshold_us=10.0)
    assert g["steps"] == 2 and g["count"] == 2
    assert g["total_ms"] == pytest.approx(0.24) and g["per_step_ms"] == pytest.approx(0.12)
    assert g["share"] == pytest.approx(240 / 2000)
    busy = (290 + 95 + 300) + (460 + 490)
    assert g["device_busy_share"] == pytest.approx(busy / 2000)
    assert g["step_edges_ms_per_step"] == pytest.approx((10 + 100 + 0 + 10) / 1000 / 2)
    assert g["largest"][0] == {
        "ms": pytest.approx(0.2),
        "step": 0,
        "at_ms": pytest.approx(0.4),
        "after": "b",
        "before": "c",
    }
    assert g["largest"][1]["after"] == "e" and g["largest"][1]["before"] == "f"
    # Idle time, busy time and edges account for the whole of every step.
    edges_us, idle_below_threshold_us, span_us = 2 * g["step_edges_ms_per_step"] * 1000, 5.0, 2000.0
    assert g["share"] + g["device_busy_share"] + (
        edges_us + idle_below_threshold_us
    ) / span_us == pytest.approx(1)
    # A lower threshold counts the 5 µs one too; the largest are listed first, at most `largest`.
    assert device_gaps(kernels, windows, threshold_us=1.0, largest=1)["count"] == 3
    assert len(device_gaps(kernels, windows, threshold_us=1.0, largest=1)["largest"]) == 1


def test_device_gaps_without_step_windows_takes_the_kernels_span():
    g = device_gaps([(100.0, 200.0, "a"), (250.0, 300.0, "b")], [])
    assert g["steps"] == 1 and g["total_ms"] == pytest.approx(0.05) and g["share"] == pytest.approx(0.25)
    assert g["step_edges_ms_per_step"] == 0.0
    assert device_gaps([], [])["total_ms"] == 0.0


def _event(name, start, end, device_type=DeviceType.CPU, **kwargs):
    return FunctionEvent(
        id=0,
        name=name,
        thread=0,
        start_us=start,
        end_us=end,
        device_type=device_type,
        use_device="cuda",
        **kwargs,
    )


def test_timeline_reads_kernels_from_the_profilers_events():
    """The CUDA branch, on the profiler's own FunctionEvent objects: the device's kernels and copies
    count; a host annotation projected onto the device (`gpu_user_annotation`), a synchronization
    record and the host's ops do not; the steps are the host's `ProfilerStep` frames."""
    cuda = DeviceType.CUDA
    events = [
        _event("ProfilerStep*", 0, 1000, is_user_annotation=True),
        _event("ProfilerStep*", 1000, 2000, is_user_annotation=True),
        _event("aten::mm", 5, 50),
        _event("sm90_xmma_gemm_bf16", 20, 120, cuda, activity_type="kernel"),
        _event("Memcpy DtoD (Device -> Device)", 130, 140, cuda, activity_type="gpu_memcpy"),
        _event("ProfilerStep#7", 0, 1000, cuda, is_user_annotation=True, activity_type="gpu_user_annotation"),
        _event("Optimizer.step#FusedAdam.step", 300, 400, cuda, is_user_annotation=True),
        _event("Context Sync", 140, 990, cuda),
        _event("Stream Sync", 140, 990, cuda, activity_type="cuda_sync"),
        _event("## Call CompiledFxGraph fabc123 ##", 1050, 1900, cuda),  # an annotation, unflagged
        _event("flash_fwd_kernel", 1100, 1300, cuda),
    ]
    entries, kernels, windows = timeline(events, cuda=True)
    assert windows == [(0.0, 1000.0), (1000.0, 2000.0)]
    assert kernels == [
        (20.0, 120.0, "sm90_xmma_gemm_bf16"),
        (130.0, 140.0, "Memcpy DtoD (Device -> Device)"),
        (1100.0, 1300.0, "flash_fwd_kernel"),
    ]
    assert entries == [(name, end - start) for start, end, name in kernels]
    # On CPU the host's ops count, by self time, and the step frames do not.
    entries, kernels, windows = timeline(events, cuda=False)
    assert entries == [("aten::mm", 45.0)] and kernels == [] and len(windows) == 2


def test_the_table_shows_the_kernels_and_the_gaps():
    """Both branches of the table: a CUDA result (synthetic) with its host gaps, a CPU one without."""
    kernels = [(0.0, 400.0, "sm90_xmma_gemm_bf16" + "x" * 100), (500.0, 900.0, "flash_fwd_kernel")]
    result = {
        "config": "gpt3-125m",
        "device": "NVIDIA H100 80GB HBM3",
        "world_size": 1,
        "dtype": "bf16",
        "zero_stage": 1,
        "compile": True,
        "seq_len": 2048,
        "micro_batch_size": 16,
        "warmup": 3,
        "steps": 1,
        "step_ms": 1.0,
        "versions": {"torch": "2.11", "deepspeed": "0.19"},
        "timeline": "cuda",
        **summarize([(n, e - s) for s, e, n in kernels]),
        "host_gaps": device_gaps(kernels, [(0.0, 1000.0)]),
        "host_gaps_reason": None,
        "trace": "trace.json",
    }
    text = table(result)
    assert "top kernels by device time" in text and "matmul 50.0%, attention 50.0%" in text
    assert "0.10 ms per step, 10.0% of the steps, 1 gaps" in text
    assert "after sm90_xmma_gemm_bf16" in text and "before flash_fwd_kernel" in text
    assert "chrome trace: trace.json" in text
    cpu = {**result, "timeline": "cpu", "host_gaps": None, "host_gaps_reason": "no device timeline"}
    text = table(cpu)
    assert "top ops by self CPU time" in text and "host gaps: — (no device timeline)" in text


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--steps", "0"], "--steps must be at least 1"),
        (["--warmup", "-1"], "--warmup must be 0 or more"),
        (["--micro-batch-size", "0"], "--micro-batch-size must be at least 1"),
        (["--seq-len", "4096"], "must be in [1, model.max_seq_len=512]"),
        (["--trace", "no/such/dir/trace.json"], "its directory does not exist"),
        (["--zero-stage", "4"], "invalid choice"),
        (["--dtype", "fp16"], "invalid choice"),
    ],
)
def test_bench_profile_refuses_bad_input(small_preset, args, fragment, cli):
    assert_one_line_error(cli("bench", "profile", str(small_preset), *args), fragment)


def test_bench_profile_refuses_a_missing_config(tmp_path, cli):
    assert_one_line_error(cli("bench", "profile", str(tmp_path / "nope.yaml")), "does not exist")
    assert_one_line_error(cli("bench", "profile", "no-such-preset"), "nor a packaged config name")
