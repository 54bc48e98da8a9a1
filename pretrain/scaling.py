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

from dataclasses import dataclass

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
