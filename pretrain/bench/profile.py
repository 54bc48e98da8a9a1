"""`pretrain bench profile CONFIG`: a short torch.profiler capture of our model's training step.

The step is the trainer's: the model wrapped by `engine.initialize` (the same DeepSpeed engine,
ZeRO stage, optimizer, dtype and compile switch as `pretrain bench train`), forward with targets,
`engine.backward`, `engine.step`, on a random batch. After `--warmup` unrecorded steps the
profiler records `--steps` steps, each timed on the wall clock with the device synchronized.

What is summarised is a timeline: on CUDA the device's (kernels, memory copies and sets, by their
own duration), on CPU the host's ops (by their self CPU time; the ops run there). Its entries are
ranked, sorted into categories by name (`classify`), and, on CUDA, the device's idle time inside
each recorded step is measured from the kernels' start and end times (`device_gaps`): the gaps
between one kernel's end and the next one's start are time the GPU waited for the host.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from pretrain.bench.train import BenchSettings, check_settings, deepspeed_json, load_run_config, what_ran
from pretrain.errors import UserError
from pretrain.reporting.console import without_native_chatter

CATEGORIES = ("matmul", "attention", "norm", "elementwise", "optimizer", "communication", "other")
TOP = 15  # entries of the timeline listed
GAP_THRESHOLD_US = 10.0  # device-idle stretches shorter than this are launch spacing, not host stalls
LARGEST_GAPS = 5
DEFAULTS = BenchSettings(steps=3, warmup=3)  # the command's: 3 steps before the recording, 3 recorded

# Names are matched lowercased; the first category whose rule matches wins, in this order. Communication and
# attention come first because their kernels are often built from GEMM libraries (cuDNN's SDPA
# kernels say `wgmma`, xformers' and FlashAttention 3's say `cutlass`), and the optimizer before
# norm because DeepSpeed's gradient norm (`multi_tensor_l2norm`, `linalg_vector_norm`) is not a
# layer norm. A substring matches CUDA kernel names; ATen ops on CPU are matched by their exact
# name (`aten::mm` but not `aten::mul`) unless a substring rule of an earlier category took them.
_SUBSTRINGS = {
    "communication": (
        "nccl",
        "gloo",
        "c10d::",
        "allreduce",
        "all_reduce",
        "allgather",
        "all_gather",
        "reduce_scatter",
        "reducescatter",
        "alltoall",
        "all_to_all",
        "record_param_comms",
    ),
    "attention": ("attention", "attn", "flash", "fmha", "sdpa", "scaled_dot_product"),
    "optimizer": (
        "adam",
        "sgd",
        "multi_tensor",
        "_foreach",
        "optimizer",
        "l2norm",
        "normtwo",
        "vector_norm",
        "clip_grad",
    ),
    "matmul": ("gemm", "gemv", "cutlass", "wgmma", "xmma", "nvjet", "cublas", "splitkreduce", "matmul"),
    "norm": ("rms_norm", "rmsnorm", "layer_norm", "layernorm", "group_norm", "batch_norm", "rsqrt"),
    "elementwise": (
        "elementwise",
        "reduce_kernel",
        "rotary",
        "silu",
        "gelu",
        "relu",
        "softmax",
        "logsumexp",
        "copy",
        "fill",
        "index",
        "gather",
        "scatter",
        "embedding",
        "memcpy",
        "memset",
        "at::native::",
        "compiledfxgraph",
    ),
}
_ATEN_OPS = {
    "matmul": {
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "addbmm",
        "matmul",
        "linear",
        "mv",
        "addmv",
        "dot",
        "vdot",
        "_addmm_activation",
        "_scaled_mm",
    },
    "norm": {
        "rms_norm",
        "_fused_rms_norm",
        "_fused_rms_norm_backward",
        "layer_norm",
        "native_layer_norm",
        "native_layer_norm_backward",
        "group_norm",
        "native_group_norm",
        "batch_norm",
        "rsqrt",
    },
}
# ATen ops that only make views, allocate or dispatch (what is left of an op is elementwise).
_ATEN_BOOKKEEPING = {
    "empty",
    "empty_strided",
    "empty_like",
    "zeros",
    "ones",
    "view",
    "_unsafe_view",
    "reshape",
    "as_strided",
    "slice",
    "select",
    "narrow",
    "transpose",
    "t",
    "permute",
    "expand",
    "unsqueeze",
    "squeeze",
    "split",
    "split_with_sizes",
    "chunk",
    "unbind",
    "detach",
    "detach_",
    "alias",
    "to",
    "contiguous",
    "lift_fresh",
    "resize_",
    "set_",
    "result_type",
    "item",
    "_local_scalar_dense",
    "is_nonzero",
    "numel",
    "size",
    "stride",
}


def classify(name: str) -> str:
    """The category (one of CATEGORIES) of a CUDA kernel's or an op's name."""
    lowered = name.lower()
    if lowered.startswith(("triton_poi", "triton_red", "triton_per")):
        # Inductor's fused pointwise and reduction kernels, named after the ATen ops they hold (also a
        # layout copy made for SDPA says `scaled_dot_product`): a norm when it holds the rsqrt.
        return "norm" if "rsqrt" in lowered else "elementwise"
    op = lowered[len("aten::") :].split(".")[0] if lowered.startswith("aten::") else None
    for category in _SUBSTRINGS:  # in the order of precedence
        if op is not None and op in _ATEN_OPS.get(category, ()):
            return category
        if category in ("matmul", "norm", "elementwise") and op is not None:
            continue  # ATen ops: exact names for these
        if category == "matmul" and lowered.startswith("triton_tem") and "mm" in lowered:
            return category  # Inductor's matrix-product templates (max-autotune)
        if any(s in lowered for s in _SUBSTRINGS[category]):
            return category
    if op is not None and op not in _ATEN_BOOKKEEPING:
        return "elementwise"
    return "other"


def summarize(entries: Iterable[tuple[str, float]], top: int = TOP) -> dict:
    """(name, microseconds) for each event of the timeline → the top names by total time (calls,
    total_ms, share, category), each category's time and share, and the matmul and attention shares.
    Shares are of the timeline's total: they sum to 1 over the categories."""
    by_name: dict[str, list] = {}
    for name, us in entries:
        row = by_name.setdefault(name, [0, 0.0])
        row[0] += 1
        row[1] += us
    total = sum(us for _, us in by_name.values())

    def share(us: float) -> float:
        return us / total if total > 0 else 0.0

    per_category = dict.fromkeys(CATEGORIES, 0.0)
    for name, (_, us) in by_name.items():
        per_category[classify(name)] += us
    ranked = sorted(by_name.items(), key=lambda item: (-item[1][1], item[0]))[:top]
    return {
        "timeline_ms": total / 1000,
        "top_kernels": [
            {
                "name": name,
                "calls": calls,
                "total_ms": us / 1000,
                "share": share(us),
                "category": classify(name),
            }
            for name, (calls, us) in ranked
        ],
        "matmul_share": share(per_category["matmul"]),
        "attention_share": share(per_category["attention"]),
        "categories": {c: {"total_ms": us / 1000, "share": share(us)} for c, us in per_category.items()},
    }


def device_gaps(
    kernels: Iterable[tuple[float, float, str]],
    windows: list[tuple[float, float]],
    threshold_us: float = GAP_THRESHOLD_US,
    largest: int = LARGEST_GAPS,
) -> dict:
    """The device's idle time inside each step window, from its kernels' (start_us, end_us, name).

    Kernels may overlap (several streams): their union is the busy time. A gap is the stretch from
    the end of the busy time to the next kernel's start, within one window; gaps of `threshold_us` or
    more are counted (shorter ones are the spacing of back-to-back launches). The stretches from a
    window's start to its first kernel and from its last kernel to its end (launch latency, the
    synchronization) are `step_edges_ms_per_step`. With no windows, the span of the kernels is one."""
    kernels = sorted(kernels)
    if not windows:
        windows = [(kernels[0][0], max(end for _, end, _ in kernels))] if kernels else []
    gaps: list[dict] = []
    busy = edges = 0.0
    for index, (w_start, w_end) in enumerate(windows):
        inside = [(max(s, w_start), min(e, w_end), n) for s, e, n in kernels if s < w_end and e > w_start]
        if not inside:
            edges += w_end - w_start
            continue
        run_start, run_end, last = inside[0]
        edges += run_start - w_start
        for start, end, name in inside[1:]:
            if start > run_end:
                busy += run_end - run_start
                if start - run_end >= threshold_us:
                    gaps.append(
                        {
                            "ms": (start - run_end) / 1000,
                            "step": index,
                            "at_ms": (run_end - w_start) / 1000,
                            "after": last,
                            "before": name,
                        }
                    )
                run_start = start
            if end >= run_end:
                run_end, last = end, name
        busy += run_end - run_start
        edges += w_end - run_end
    span = sum(end - start for start, end in windows)
    total_ms = sum(g["ms"] for g in gaps)
    steps = max(len(windows), 1)
    return {
        "threshold_us": threshold_us,
        "steps": len(windows),
        "count": len(gaps),
        "total_ms": total_ms,
        "per_step_ms": total_ms / steps,
        "share": total_ms * 1000 / span if span > 0 else 0.0,
        "step_edges_ms_per_step": edges / 1000 / steps,
        "device_busy_share": busy / span if span > 0 else 0.0,
        "largest": sorted(gaps, key=lambda g: -g["ms"])[:largest],
    }


_SYNC_NAMES = ("context sync", "stream sync", "event sync", "stream wait", "device sync")


def device_work(event) -> bool:
    """A CUDA event that is work on the device (a kernel, a memcpy, a memset): not a host annotation
    projected onto the device's timeline (`gpu_user_annotation`), nor a synchronization record."""
    from torch.autograd import DeviceType

    if event.device_type != DeviceType.CUDA or getattr(event, "is_user_annotation", False):
        return False
    kind = (getattr(event, "activity_type", None) or "").lower()  # kineto's name, where torch has it
    name = event.name.lower()
    # (an annotation torch does not flag, such as inductor's "## Call CompiledFxGraph … ##", by its name)
    return not (
        "annotation" in kind or "sync" in kind or name.startswith(("profilerstep", "## ", *_SYNC_NAMES))
    )


def timeline(events, cuda: bool) -> tuple[list[tuple[str, float]], list, list[tuple[float, float]]]:
    """From the profiler's FunctionEvents: the timeline's (name, us) entries, the device's kernels
    as (start_us, end_us, name) (CUDA only), and the recorded steps' (start_us, end_us) on the host.

    On CUDA the entries are the device's work (`device_work`) by duration; on CPU the host's ops by
    self time, less the `ProfilerStep#` frames (their self time is everything outside the ops)."""
    from torch.autograd import DeviceType

    def host(event) -> bool:
        return event.device_type == DeviceType.CPU

    windows = sorted(
        (float(e.time_range.start), float(e.time_range.end))
        for e in events
        if host(e) and e.name.startswith("ProfilerStep")
    )
    if not cuda:
        entries = [
            (e.name, float(e.self_cpu_time_total))
            for e in events
            if host(e) and not e.name.startswith("ProfilerStep")
        ]
        return entries, [], windows
    kernels = [(float(e.time_range.start), float(e.time_range.end), e.name) for e in events if device_work(e)]
    return [(name, end - start) for start, end, name in kernels], kernels, windows


def check(settings: BenchSettings, trace: str | None) -> None:
    check_settings(settings)
    if trace is not None and not Path(trace).resolve().parent.is_dir():
        raise UserError(f"--trace {trace}: its directory does not exist; create it first")


def run(
    config: str,
    settings: BenchSettings = DEFAULTS,
    as_json: bool = False,
    trace: str | None = None,
) -> dict:
    """Check the input, profile, then print the summary (or the JSON object) on rank 0."""
    check(settings, trace)
    cfg = load_run_config(config, settings)
    # DeepSpeed logs and prints to stdout: all of that goes to stderr, stdout holds the result.
    with contextlib.redirect_stdout(sys.stderr):
        result = capture(cfg, settings, trace)
    result = {"config": str(config), **result}
    if result["rank"] == 0:
        print(json.dumps(result) if as_json else table(result))
    return result


def capture(cfg, settings: BenchSettings, trace: str | None) -> dict:
    import deepspeed
    from torch.profiler import ProfilerActivity, profile, schedule

    from pretrain.parallel.distributed import DistEnv, init_distributed
    from pretrain.parallel.engine import initialize
    from pretrain.pretraining import build_model

    env = DistEnv.from_environ()
    init_distributed(env)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", env.local_rank) if cuda else torch.device("cpu")
    torch.manual_seed(cfg.run.seed)
    ds = deepspeed_json(settings, cfg.train.micro_batch_size, env.world_size, cfg.engine.one_host_read)
    engine, _ = initialize(build_model(cfg), cfg.engine, cfg.optim, ds)
    batch = torch.randint(
        0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.data.seq_len + 1), device=device
    )
    inputs, targets = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    # --warmup steps before the recording: all but the last unrecorded, the last the profiler's own
    # warm-up (tracing on, events dropped), then --steps recorded.
    warm = min(settings.warmup, 1)
    plan = schedule(wait=settings.warmup - warm, warmup=warm, active=settings.steps, repeat=1)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    times = []
    with without_native_chatter(), profile(activities=activities, schedule=plan) as prof:
        for index in range(settings.warmup + settings.steps):
            sync()
            start = time.perf_counter()
            loss = engine(tokens=inputs, targets=targets).loss
            engine.backward(loss)
            engine.step()
            sync()
            if index >= settings.warmup:
                times.append(time.perf_counter() - start)
            prof.step()
    if trace is not None and env.rank == 0:
        prof.export_chrome_trace(trace)
    entries, kernels, windows = timeline(prof.events(), cuda)
    if cuda and not kernels:
        raise RuntimeError("the profiler recorded no CUDA kernels: its CUDA activity needs CUPTI (libcupti)")
    return what_ran(cfg, settings, env, device) | {
        "warmup": settings.warmup,
        "step_ms": statistics.median(times) * 1000,
        "step_ms_each": [t * 1000 for t in times],
        "versions": {"torch": torch.__version__, "deepspeed": deepspeed.__version__},
        "timeline": "cuda" if cuda else "cpu",
        **summarize(entries),
        "host_gaps": device_gaps(kernels, windows) if cuda else None,
        "host_gaps_reason": None if cuda else "no device timeline on CPU: the ops run on the host",
        "trace": trace if env.rank == 0 else None,
    }


def _short(name: str, width: int) -> str:
    return name if len(name) <= width else name[: width - 1] + "…"


def table(r: dict) -> str:
    what = "kernels by device time" if r["timeline"] == "cuda" else "ops by self CPU time"
    lines = [
        f"{r['config']}: {r['micro_batch_size']} x {r['seq_len']} tokens per rank x {r['world_size']} "
        f"rank(s), {r['dtype']}, DeepSpeed ZeRO-{r['zero_stage']}, compile {'on' if r['compile'] else 'off'}, "
        f"{r['steps']} steps recorded after {r['warmup']}, on {r['device']}",
        f"step time, median: {r['step_ms']:,.1f} ms (wall, device synchronized, under the profiler)",
        f"{r['timeline']} timeline: {r['timeline_ms']:,.1f} ms over {r['steps']} steps",
        "",
        f"top {what:<58}{'calls':>7}{'ms':>10}{'share':>8}  category",
    ]
    for k in r["top_kernels"]:
        lines.append(
            f"{_short(k['name'], 62):<62}{k['calls']:>7}{k['total_ms']:>10,.2f}"
            f"{100 * k['share']:>7.1f}%  {k['category']}"
        )
    lines += [
        "",
        "categories: " + ", ".join(f"{c} {100 * v['share']:.1f}%" for c, v in r["categories"].items()),
    ]
    gaps = r["host_gaps"]
    if gaps is None:
        lines.append(f"host gaps: — ({r['host_gaps_reason']})")
    else:
        lines.append(
            f"host gaps (device idle ≥ {gaps['threshold_us']:.0f} µs between kernels): "
            f"{gaps['per_step_ms']:,.2f} ms per step, {100 * gaps['share']:.1f}% of the steps, "
            f"{gaps['count']} gaps; device busy {100 * gaps['device_busy_share']:.1f}%, "
            f"step edges {gaps['step_edges_ms_per_step']:,.2f} ms per step"
        )
        for g in gaps["largest"]:
            lines.append(
                f"  {g['ms']:8.3f} ms in step {g['step']} at {g['at_ms']:,.2f} ms, "
                f"after {_short(g['after'], 40)}, before {_short(g['before'], 40)}"
            )
    lines.append(f"versions: torch {r['versions']['torch']}, deepspeed {r['versions']['deepspeed']}")
    if r.get("trace"):
        lines.append(f"chrome trace: {r['trace']}")
    return "\n".join(lines)
