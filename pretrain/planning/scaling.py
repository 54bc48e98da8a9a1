"""Scaling on paper: tokens/s and MFU of ZeRO data parallelism at N GPUs, from one GPU's figures.

Per optimizer step each GPU computes its share of the global batch and exchanges the gradients
and parameters (Rajbhandari et al., 2020, "ZeRO", section 7):

- ZeRO-1/2: a reduce-scatter of the gradients and, after the optimizer step, an all-gather of the
  updated parameters: each moves Ψ·(N−1)/N elements per GPU, 2Ψ in all (the volume of plain
  data parallelism's all-reduce).
- ZeRO-3: one more all-gather of the parameters (forward and backward each gather them): 3Ψ.

Elements are bf16 (2 bytes). The reduce-scatter overlaps the backward pass (DeepSpeed's
`overlap_comm`, about 2/3 of the compute); under ZeRO-1/2 the final all-gather follows the
optimizer step and is exposed; under ZeRO-3 the gathers are prefetched during compute. So:

    exposed = max(0, reduce_scatter - 2/3·compute) + all_gather           (ZeRO-1/2)
    exposed = max(0, communication - compute)                              (ZeRO-3)
    MFU(N) = MFU(1) · compute / (compute + exposed)

The bandwidths are bus bandwidths (what NCCL's tests report as busbw) and are assumptions,
printed with the result: NVLink within a node, the per-GPU network share across nodes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pretrain.errors import UserError

BYTES_PER_ELEMENT = 2  # bf16 gradients and parameters on the wire


@dataclass(frozen=True)
class Interconnect:
    gpus_per_node: int = 8
    intra_node_bytes_per_sec: float = 360e9  # H100 SXM NVLink 4, NCCL all-reduce busbw
    inter_node_bytes_per_sec: float = 40e9  # one 400 Gb/s NDR InfiniBand NIC per GPU, ~80% of line rate

    def bus_bandwidth(self, gpus: int) -> float:
        return self.intra_node_bytes_per_sec if gpus <= self.gpus_per_node else self.inter_node_bytes_per_sec


@dataclass(frozen=True)
class Projection:
    gpus: int
    zero_stage: int
    tokens_per_gpu_per_step: float
    compute_seconds: float
    communication_seconds: float
    exposed_seconds: float
    mfu: float
    tokens_per_sec: float  # all GPUs together


def project(
    params: int,
    flops_per_token: float,
    gpus: int,
    global_batch_tokens: int,
    single_gpu_mfu: float,
    peak_flops: float,
    zero_stage: int = 1,
    interconnect: Interconnect = Interconnect(),
) -> Projection:
    tokens_per_gpu = global_batch_tokens / gpus
    compute = tokens_per_gpu * flops_per_token / (single_gpu_mfu * peak_flops)
    if gpus == 1:
        return Projection(
            1, zero_stage, tokens_per_gpu, compute, 0.0, 0.0, single_gpu_mfu, tokens_per_gpu / compute
        )
    one_pass = params * BYTES_PER_ELEMENT * (gpus - 1) / gpus / interconnect.bus_bandwidth(gpus)
    if zero_stage == 3:
        communication = 3 * one_pass
        exposed = max(0.0, communication - compute)
    else:
        communication = 2 * one_pass
        exposed = max(0.0, one_pass - 2 / 3 * compute) + one_pass
    step = compute + exposed
    return Projection(
        gpus=gpus,
        zero_stage=zero_stage,
        tokens_per_gpu_per_step=tokens_per_gpu,
        compute_seconds=compute,
        communication_seconds=communication,
        exposed_seconds=exposed,
        mfu=single_gpu_mfu * compute / step,
        tokens_per_sec=global_batch_tokens / step,
    )


def scaling_report(
    report: dict,
    gpu_counts: str,
    single_gpu_mfu: float | None = None,
    global_batch_tokens: int = 2**20,
    zero_stage: int = 1,
    inter_node_gbs: float = 40.0,
) -> dict:
    """`pretrain flops --scale`: projections to `gpu_counts` ("8,64,512") from a flops report that
    holds the per-GPU peak and, measured or given, the one-GPU MFU."""
    try:
        counts = [int(v) for v in gpu_counts.split(",")]
    except ValueError:
        raise UserError(f"--scale {gpu_counts!r}: give GPU counts such as 8,64,512") from None
    if not counts or min(counts) < 1:
        raise UserError(f"--scale {gpu_counts!r}: GPU counts must be at least 1")
    peak = report.get("peak_flops")
    if peak is None:
        raise UserError("--scale needs --device NAME or --peak-flops F (the per-GPU peak)")
    single = report.get("mfu", single_gpu_mfu)
    if single is None or not 0 < single <= 1:
        raise UserError(
            "--scale needs the one-GPU MFU: --tokens-per-sec (measured) or --single-gpu-mfu in (0, 1]"
        )
    for flag, value in (("--global-batch-tokens", global_batch_tokens), ("--inter-node-gbs", inter_node_gbs)):
        if not value > 0:
            raise UserError(f"{flag} {value} must be positive")
    net = Interconnect(inter_node_bytes_per_sec=inter_node_gbs * 1e9)
    rows = [
        project(
            report["params"], report["flops_per_token"], n, global_batch_tokens, single, peak, zero_stage, net
        )
        for n in counts
    ]
    return {
        "single_gpu_mfu": single,
        "global_batch_tokens": global_batch_tokens,
        "zero_stage": zero_stage,
        "interconnect": asdict(net),
        "projections": [asdict(r) for r in rows],
    }


def format_scaling(scaling: dict) -> str:
    net = scaling["interconnect"]
    lines = [
        f"ZeRO-{scaling['zero_stage']} data parallelism, global batch {scaling['global_batch_tokens']:,} tokens, "
        f"one-GPU MFU {100 * scaling['single_gpu_mfu']:.0f}%, bus bandwidth {net['intra_node_bytes_per_sec'] / 1e9:.0f} GB/s "
        f"within {net['gpus_per_node']}-GPU nodes, {net['inter_node_bytes_per_sec'] / 1e9:.0f} GB/s per GPU across them:",
        f"  {'GPUs':>5} {'tokens/GPU/step':>16} {'compute':>9} {'comm':>9} {'exposed':>9} {'MFU':>6} {'tokens/s':>12}",
    ]
    for r in scaling["projections"]:
        lines.append(
            f"  {r['gpus']:>5} {r['tokens_per_gpu_per_step']:>16,.0f} {1000 * r['compute_seconds']:>7.0f}ms "
            f"{1000 * r['communication_seconds']:>7.0f}ms {1000 * r['exposed_seconds']:>7.0f}ms "
            f"{100 * r['mfu']:>5.1f}% {r['tokens_per_sec']:>12,.0f}"
        )
    return "\n".join(lines)
