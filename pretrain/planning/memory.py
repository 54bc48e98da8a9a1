"""The memory plan: what one GPU holds while it trains, from the config alone, and the settings
that fit, ranked by expected throughput (`pretrain plan`, and `pretrain launch`'s check before a
job starts). Values in, values out: no torch, no GPU (docs/training.md, "The memory plan",
states every formula and what it was checked against).

Per GPU, in bytes, for Ψ parameters (`flops.param_counts`), N GPUs and bf16 training under
DeepSpeed ZeRO (the fp32 master weights and AdamW's two moments in the optimizer):

- **model states** (parameters, gradients, optimizer states), as DeepSpeed's own estimators
  (`estimate_zero2_model_states_mem_needs`, `estimate_zero3_model_states_mem_needs`) count them:
  ZeRO-1 2Ψ + (2Ψ + 4Ψ/N) + 12Ψ/N; ZeRO-2 2Ψ + 6Ψ/N + 12Ψ/N; ZeRO-3 (2Ψ/N + 4Λ) + 4Ψ/N + 12Ψ/N,
  Λ the largest layer's parameters (DeepSpeed's gathered working set). Under ZeRO-3 the gradients
  are a bf16 partition (2Ψ/N) and, while the optimizer steps, the fp32 gradient of one sub-group
  (`sub_group_size`, 1e9 elements: the whole partition below that), 2Ψ/N to 6Ψ/N; DeepSpeed's
  estimator counts 18Ψ/N + 4Λ in all, so 4Ψ/N here. Offloaded to the CPU, the
  optimizer's part and the fp32 gradients leave the GPU (and under ZeRO-3 with `offload_param`,
  the parameters' 2Ψ/N too). ZeRO partitions over all N ranks, sequence-parallel ones included:
  DeepSpeed's engine gives its ZeRO optimizer the sequence-data-parallel group.
- **experts** (`model.moe`, `parallel.expert: E`): each GPU holds the dense parameters and 1/E of
  the routed experts Ψₑ (bf16: 2(Ψ − Ψₑ + Ψₑ/E), and so ZeRO-1's bf16 gradients); the gradients'
  and optimizer states' partitions hold Ψ/N either way (the experts' over the N/E ranks holding
  the same ones: Ψₑ/E / (N/E)), as DeepSpeed's ZeRO-1/2 keep them.
- **activations**, measured from this model's autograd graph (`pretrain/model/transformer.py`, eager, bf16):
  per layer and token 22h + 6·kv + 8f + 4·nh + 8 bytes (h = d_model, kv = n_kv_heads·head_dim,
  f = d_ff: the RMSNorms' fp32 inputs, the fused qkv and SwiGLU projections, the rotated q and k,
  the attention output and its fp32 log-sum-exp; SDPA/flash keeps no T×T scores); a routed block
  keeps 8Kf + K(6h + 32) + 2h + 5E + 4 in place of 8f (K top_k, f expert_ffn_dim, E experts: each
  token's K copies, bf16 in and fp32 out, the router's fp32 input and scores), + 8Sf + 2h with
  shared experts of S·f, + 4 with a balancing loss, + 4E + 4 with the router z-loss; the fused LM
  head (`pretrain/model/loss.py`) adds 10h per token, its fp32 weight gradient 4Vh, and while a chunk
  is computed 6 bytes per logit of the chunk and 6Vh. With activation checkpointing each layer
  keeps only its 2h input, and one layer is recomputed at a time (its activations plus 4f + 2h
  per token of gradients). Tokens per GPU: micro-batch × sequence length / S.
- **buffers**: DeepSpeed's communication buckets (`reduce_bucket_size`, twice with
  `overlap_comm`; `allgather_bucket_size` under ZeRO-1/2, `stage3_prefetch_bucket_size` under
  ZeRO-3), in bf16; and a fixed reserve for the CUDA context, NCCL and cuBLAS (`RUNTIME_BYTES`).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass, field

from pretrain.config import ModelConfig, RunConfig, config_dir
from pretrain.errors import UserError
from pretrain.planning.flops import PEAK_FLOPS, flops_per_token, largest_parameter, param_counts
from pretrain.planning.scaling import Interconnect, project

GIB = 2**30
BF16, FP32 = 2, 4  # bytes per element
RUNTIME_BYTES = 2 * GIB  # CUDA context, NCCL's and cuBLAS's workspaces (to confirm on a GPU)
FRAGMENTATION = 0.05  # the caching allocator's share on top of what tensors hold
# Logits per chunk of the fused LM head on a GPU (pretrain/model/loss.py, chunk_rows; a test keeps them equal).
GPU_CHUNK_LOGITS = 2**26
DEFAULT_MFU = 0.40  # the MFU assumed for throughput (stated with every plan; `--mfu`)
RECOMPUTE_FACTOR = 4 / 3  # activation checkpointing runs each forward twice: 8 instead of 6 FLOPs/param
PCIE_BYTES_PER_SEC = 25e9  # host ↔ GPU for offloaded states (PCIe 5 x16, about 40% of line rate)
CPU_ADAM_PARAMS_PER_SEC = 1e9  # DeepSpeed's CPU Adam per GPU's process (to confirm on a node)
# The packaged DeepSpeed configs the plan chooses among (configs/deepspeed/).
PACKAGED_ZERO = ("zero1.json", "zero2.json", "zero3.json", "zero3_offload.json")
DEEPSPEED_DEFAULT_BUCKET = 5e8  # DeepSpeed's default bucket sizes, in elements


@dataclass(frozen=True, kw_only=True)
class ZeroSettings:
    """What the plan reads from a DeepSpeed JSON."""

    stage: int
    offload_optimizer: bool
    offload_params: bool
    buffer_elements: float  # communication buckets held on each GPU, in elements
    reduce_bucket_elements: float = DEEPSPEED_DEFAULT_BUCKET  # reduce_bucket_size

    @classmethod
    def from_deepspeed(cls, ds: dict) -> ZeroSettings:
        zero = ds.get("zero_optimization", {})
        stage = int(zero.get("stage", 0))
        reduce = float(zero.get("reduce_bucket_size", DEEPSPEED_DEFAULT_BUCKET))
        overlap = bool(zero.get("overlap_comm", stage == 3))
        gather_key = "stage3_prefetch_bucket_size" if stage == 3 else "allgather_bucket_size"
        gather = float(zero.get(gather_key, DEEPSPEED_DEFAULT_BUCKET)) if stage else 0.0
        return cls(
            stage=stage,
            offload_optimizer=_offloaded(zero, "offload_optimizer"),
            offload_params=_offloaded(zero, "offload_param") and stage == 3,
            buffer_elements=reduce * (2 if overlap else 1) + gather,
            reduce_bucket_elements=reduce,
        )

    def describe(self) -> str:
        parts = [f"ZeRO-{self.stage}"]
        if self.offload_optimizer:
            parts.append("optimizer offloaded")
        if self.offload_params:
            parts.append("parameters offloaded")
        return ", ".join(parts)


def _offloaded(zero: dict, key: str) -> bool:
    return (zero.get(key) or {}).get("device", "none") not in ("none", None)


@dataclass(frozen=True, kw_only=True)
class Setting:
    """One way to run the job: the DeepSpeed config (by its path) and the batch and parallel choices."""

    deepspeed_config: str
    zero: ZeroSettings
    activation_checkpointing: bool
    micro_batch_size: int
    grad_accum: int
    sequence_parallel: int  # S: each window's tokens are split over S ranks
    expert_parallel: int = 1  # E: each MoE block's experts are split over E ranks

    def overrides(self) -> list[str]:
        """The dotted overrides that select this setting."""
        words = [
            f"engine.deepspeed_config={self.deepspeed_config}",
            f"engine.activation_checkpointing={str(self.activation_checkpointing).lower()}",
            f"train.micro_batch_size={self.micro_batch_size}",
            f"train.grad_accum={self.grad_accum}",
        ]
        words += [f"parallel.sequence={self.sequence_parallel}"] if self.sequence_parallel > 1 else []
        return words + ([f"parallel.expert={self.expert_parallel}"] if self.expert_parallel > 1 else [])


@dataclass(frozen=True, kw_only=True)
class Hardware:
    gpus: int
    gpu_memory: float  # bytes per GPU
    peak_flops: float  # dense bf16 FLOP/s per GPU
    mfu: float = DEFAULT_MFU
    interconnect: Interconnect = field(default_factory=Interconnect)

    def __post_init__(self) -> None:
        for flag, value, fine in (
            ("--gpus", self.gpus, self.gpus >= 1),
            ("--gpu-memory-gib", self.gpu_memory / GIB, self.gpu_memory > 0),
            ("--mfu", self.mfu, 0 < self.mfu <= 1),
            ("--gpus-per-node", self.interconnect.gpus_per_node, self.interconnect.gpus_per_node >= 1),
        ):
            if not fine:
                raise UserError(f"{flag} {value:g} is out of range: give a positive number (--mfu in (0, 1])")


@dataclass(frozen=True, kw_only=True)
class Plan:
    """One setting's bytes per GPU and its expected throughput."""

    setting: Setting
    parameters: float
    gradients: float
    optimizer_states: float
    activations: float
    buffers: float  # communication buckets, the runtime reserve and fragmentation
    total: float
    gpu_memory: float
    tokens_per_sec: float  # all GPUs together, expected

    @property
    def fits(self) -> bool:
        return self.total <= self.gpu_memory


def largest_layer(cfg: ModelConfig) -> int:
    """Λ: the most parameters any one module holds itself (DeepSpeed's `largest_layer_params`)."""
    d, hd = cfg.d_model, cfg.head_dim
    ffn_in = (2 if cfg.activation == "swiglu" else 1) * cfg.d_ff
    experts = 3 * cfg.moe.experts * cfg.moe.expert_ffn_dim * d if cfg.moe else 0  # one Experts module
    return max(
        cfg.vocab_size * d,
        (cfg.n_heads + 2 * cfg.n_kv_heads) * hd * d,
        cfg.n_heads * hd * d,
        ffn_in * d,
        experts,
    )


def model_states(
    params: int, largest: int, gpus: int, zero: ZeroSettings, experts: int = 0, expert_parallel: int = 1
) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer states) in bytes per GPU, as DeepSpeed's estimators count
    them (module docstring): bf16 parameters and gradients, fp32 gradients, master weights and
    AdamW's two moments (12 bytes per parameter) in the optimizer's partition. `experts` of the
    `params` are split over `expert_parallel` ranks: each GPU holds its share of them."""
    share = params / (gpus if zero.stage else 1)  # ZeRO-0: nothing partitioned
    held = params - experts + experts / expert_parallel  # the parameters this GPU holds
    if zero.stage >= 3:
        parameters = (0 if zero.offload_params else BF16 * share) + 2 * BF16 * largest
    else:
        parameters = BF16 * held
    if zero.offload_optimizer:
        return parameters, (BF16 * held if zero.stage <= 1 else 0.0), 0.0
    if zero.stage >= 3:  # DeepSpeed's 18Ψ/N less the optimizer's 12 (module docstring)
        gradients = FP32 * share
    else:  # the bf16 gradients (whole under ZeRO-0/1, a partition under ZeRO-2), the fp32 partition
        gradients = (BF16 * held if zero.stage <= 1 else BF16 * share) + FP32 * share
    return parameters, gradients, 3 * FP32 * share


def layer_activation_bytes(cfg: ModelConfig, routed: bool = False) -> int:
    """What one block's autograd graph keeps per token (eager, bf16; module docstring): a dense
    block's, or a `routed` one's (its feed-forward a mixture of experts)."""
    h, kv, f = cfg.d_model, cfg.n_kv_heads * cfg.head_dim, cfg.d_ff
    feed_forward = moe_activation_bytes(cfg) if routed else 8 * f
    return 22 * h + 6 * kv + feed_forward + FP32 * cfg.n_heads + 2 * FP32


def moe_activation_bytes(cfg: ModelConfig) -> int:
    """A routed feed-forward's bytes per token (measured on this model: module docstring)."""
    moe, h = cfg.moe, cfg.d_model
    K, f, E = moe.top_k, moe.expert_ffn_dim, moe.experts
    kept = 8 * K * f + K * (6 * h + 32) + 2 * h + 5 * E + 4
    kept += 8 * moe.shared_experts * f + 2 * h if moe.shared_experts else 0
    kept += 4 if moe.uses_aux_loss else 0
    return kept + (4 * E + 4 if moe.router_z_loss > 0 else 0)


def layer_kinds(cfg: ModelConfig) -> list[tuple[int, bool]]:
    """(blocks, routed) for the dense and the routed blocks."""
    dense = cfg.moe.dense_layers if cfg.moe else cfg.n_layers
    return [(n, routed) for n, routed in ((dense, False), (cfg.n_layers - dense, True)) if n]


def activation_bytes(
    cfg: ModelConfig,
    tokens: int,
    checkpointing: bool,
    chunk_logits: int = GPU_CHUNK_LOGITS,
) -> float:
    """Peak activation bytes for `tokens` tokens per GPU (micro-batch × seq_len / S): the layers'
    saved tensors and the fused LM head's, at the larger of the end of the forward pass (the
    head's chunk in flight) and, with checkpointing, one layer's recompute and backward."""
    h, V, L = cfg.d_model, cfg.vocab_size, cfg.n_layers
    layers = sum(n * layer_activation_bytes(cfg, routed) for n, routed in layer_kinds(cfg))
    chunk = min(max(16, chunk_logits // V), tokens) * V  # logits of one chunk of rows
    head = tokens * (10 * h + 8) + FP32 * V * h
    head_in_flight = head + 6 * chunk + 6 * V * h
    if not checkpointing:
        return tokens * layers + head_in_flight
    recompute = max(
        layer_activation_bytes(cfg, routed) + 4 * (hidden_per_token(cfg) if routed else cfg.d_ff) + 2 * h
        for _, routed in layer_kinds(cfg)
    )
    return tokens * L * BF16 * h + max(head_in_flight, tokens * recompute)


def hidden_per_token(cfg: ModelConfig) -> int:
    """A routed block's hidden width per token: its K experts' and its shared ones'."""
    return (cfg.moe.top_k + cfg.moe.shared_experts) * cfg.moe.expert_ffn_dim


def muon_share(cfg: ModelConfig) -> float:
    """The fraction of the parameters Muon trains (the blocks' matrices: one momentum buffer, not two)."""
    counts = param_counts(cfg)
    return (counts.attention + counts.feed_forward - counts.experts) / counts.total  # (experts: 3-D, AdamW's)


def plan(
    cfg: ModelConfig, seq_len: int, setting: Setting, hardware: Hardware, optimizer: str = "adamw"
) -> Plan:
    """One setting's memory per GPU and expected tokens/s."""
    counts = param_counts(cfg)
    parameters, gradients, optimizer_states = model_states(
        counts.total, largest_layer(cfg), hardware.gpus, setting.zero, counts.experts, setting.expert_parallel
    )
    if optimizer == "muon":  # master weights (4) + one moment (4) where Muon trains, two (8) elsewhere
        share = muon_share(cfg)
        optimizer_states *= (FP32 + FP32 * share + 2 * FP32 * (1 - share)) / (3 * FP32)
    tokens = setting.micro_batch_size * seq_len // setting.sequence_parallel
    activations = activation_bytes(cfg, tokens, setting.activation_checkpointing)
    held = parameters + gradients + optimizer_states + activations + BF16 * setting.zero.buffer_elements
    total = held * (1 + FRAGMENTATION) + RUNTIME_BYTES
    return Plan(
        setting=setting,
        parameters=parameters,
        gradients=gradients,
        optimizer_states=optimizer_states,
        activations=activations,
        buffers=total - (held - BF16 * setting.zero.buffer_elements),
        total=total,
        gpu_memory=hardware.gpu_memory,
        tokens_per_sec=throughput(cfg, seq_len, setting, hardware),
    )


def throughput(cfg: ModelConfig, seq_len: int, setting: Setting, hardware: Hardware) -> float:
    """Expected tokens/s, all GPUs: the FLOPs at the stated MFU (less with recomputation), ZeRO's
    exposed communication (`zero_step_seconds`), Ulysses' all-to-alls and the offloaded states'
    traffic and CPU optimizer, neither overlapped."""
    gpus, S = hardware.gpus, setting.sequence_parallel
    micro_tokens = setting.micro_batch_size * gpus // S * seq_len  # one micro-step, all GPUs
    step = zero_step_seconds(cfg, seq_len, setting, hardware, micro_tokens)
    if S > 1:  # q, k, v in and the output back, each layer, forward and backward (and the recompute)
        kv = cfg.n_kv_heads * cfg.head_dim
        moved = micro_tokens / gpus * BF16 * (2 * cfg.d_model + 2 * kv) * (S - 1) / S
        passes = 3 if setting.activation_checkpointing else 2
        step += setting.grad_accum * cfg.n_layers * passes * moved / hardware.interconnect.bus_bandwidth(S)
    step += setting.grad_accum * all_to_all_seconds(cfg, setting, hardware, micro_tokens / gpus)
    share = param_counts(cfg).total / gpus
    if setting.zero.offload_optimizer:  # bf16 gradients down, bf16 parameters up, Adam on the CPU
        step += 2 * BF16 * share / PCIE_BYTES_PER_SEC + share / CPU_ADAM_PARAMS_PER_SEC
    if setting.zero.offload_params:  # the partition up for each forward and backward
        step += setting.grad_accum * 2 * BF16 * share / PCIE_BYTES_PER_SEC
    return setting.grad_accum * micro_tokens / step


def all_to_all_seconds(cfg: ModelConfig, setting: Setting, hardware: Hardware, tokens: float) -> float:
    """Experts across E ranks, one micro-step: each routed block sends each of a GPU's `tokens`
    K copies to their experts and takes them back, in the forward and the backward pass (and the
    recompute), (E − 1)/E of them to other ranks, not overlapped."""
    E = setting.expert_parallel
    if E == 1:
        return 0.0
    routed = cfg.n_layers - cfg.moe.dense_layers
    moved = tokens * cfg.moe.top_k * BF16 * cfg.d_model * (E - 1) / E
    passes = 3 if setting.activation_checkpointing else 2
    return routed * passes * 2 * moved / hardware.interconnect.bus_bandwidth(E)


def held_params(cfg: ModelConfig, expert_parallel: int) -> float:
    """The parameters one GPU holds: the dense ones and its share of the routed experts."""
    counts = param_counts(cfg)
    return counts.total - counts.experts + counts.experts / expert_parallel


def zero_step_seconds(
    cfg: ModelConfig, seq_len: int, setting: Setting, hardware: Hardware, micro_tokens: int
) -> float:
    """One optimizer step's compute and exposed ZeRO communication (`scaling.project`'s model):
    ZeRO-1 reduces the accumulated gradients once per step; ZeRO-2 reduce-scatters them after every
    micro-batch's backward and gathers the parameters once; ZeRO-3 gathers and reduces at every
    micro-batch."""
    mfu = hardware.mfu / (RECOMPUTE_FACTOR if setting.activation_checkpointing else 1)
    args = (held_params(cfg, setting.expert_parallel), flops_per_token(cfg, seq_len).total, hardware.gpus)
    stage, accum = setting.zero.stage, setting.grad_accum
    common = {"interconnect": hardware.interconnect, "zero_stage": max(stage, 1)}
    if stage <= 1:
        whole = project(*args, accum * micro_tokens, mfu, hardware.peak_flops, **common)
        return accum * micro_tokens / whole.tokens_per_sec
    micro = project(*args, micro_tokens, mfu, hardware.peak_flops, **common)
    if stage == 3:
        return accum * micro_tokens / micro.tokens_per_sec
    one_pass = micro.communication_seconds / 2  # the reduce-scatter, and the all-gather
    return accum * (micro.compute_seconds + max(0.0, one_pass - 2 / 3 * micro.compute_seconds)) + one_pass


def candidate_settings(
    cfg: ModelConfig, seq_len: int, global_windows: int, gpus: int, zero_configs: dict[str, ZeroSettings]
) -> list[Setting]:
    """Every setting that keeps the global batch (`global_windows` per step): each packaged ZeRO
    config, checkpointing off and on, micro-batches of powers of two, S dividing the GPUs, the
    window and the heads, E dividing the GPUs and the experts."""
    found = []
    for S in (s for s in _powers_of_two(gpus) if gpus % s == 0 and seq_len % s == 0 and cfg.n_heads % s == 0):
        ranks = gpus // S  # windows in flight at once
        for micro in _powers_of_two(global_windows):
            if global_windows % (micro * ranks):
                continue
            for E, (path, zero), checkpointing in itertools.product(
                expert_degrees(cfg, gpus), zero_configs.items(), (False, True)
            ):
                found.append(
                    Setting(
                        deepspeed_config=path,
                        zero=zero,
                        activation_checkpointing=checkpointing,
                        micro_batch_size=micro,
                        grad_accum=global_windows // (micro * ranks),
                        sequence_parallel=S,
                        expert_parallel=E,
                    )
                )
    return found


def expert_degrees(cfg: ModelConfig, gpus: int) -> list[int]:
    """The E a run may split its experts over: powers of two dividing the GPUs and the experts."""
    if cfg.moe is None:
        return [1]
    return [e for e in _powers_of_two(gpus) if gpus % e == 0 and cfg.moe.experts % e == 0]


def runs_with(cfg: ModelConfig, setting: Setting, compiled: bool) -> bool:
    """Whether a run takes the setting's S and E (pretraining's preflight, the config's checks,
    engine.check_zero3_buckets and check_expert_parallel_zero): experts split only under ZeRO-1/2,
    never with S > 1; and `runs_with_sequence_parallel`."""
    if setting.expert_parallel > 1 and setting.zero.stage not in (1, 2):
        return False
    if cfg.moe is not None and setting.sequence_parallel > 1:
        return False
    return runs_with_sequence_parallel(cfg, setting, compiled)


def runs_with_sequence_parallel(cfg: ModelConfig, setting: Setting, compiled: bool) -> bool:
    """Whether a run refuses the setting's S (pretraining's preflight, engine.check_zero3_buckets):
    key/value heads and S that do not divide one another, compiled blocks, and under ZeRO-3 a
    parameter larger than reduce_bucket_size."""
    S = setting.sequence_parallel
    if S == 1:
        return True
    if compiled or (cfg.n_kv_heads % S and S % cfg.n_kv_heads):
        return False
    return setting.zero.stage != 3 or largest_parameter(cfg) <= setting.zero.reduce_bucket_elements


def _powers_of_two(limit: int) -> list[int]:
    return [1 << i for i in range(max(limit, 1).bit_length()) if 1 << i <= limit]


def ranked(plans: list[Plan]) -> list[Plan]:
    """The plans that fit, fastest first (then the larger micro-batch: fewer, larger kernels; then
    the most memory to spare)."""
    key = lambda p: (-p.tokens_per_sec, -p.setting.micro_batch_size, p.total)  # noqa: E731
    return sorted((p for p in plans if p.fits), key=key)


def packaged_zero_configs() -> dict[str, ZeroSettings]:
    """The packaged DeepSpeed configs by the path a run config names them with."""
    found = {}
    for name in PACKAGED_ZERO:
        path = config_dir() / "deepspeed" / name
        if path.is_file():
            found[f"configs/deepspeed/{name}"] = ZeroSettings.from_deepspeed(json.loads(path.read_text()))
    return found


@dataclass(frozen=True, kw_only=True)
class JobShape:
    """The run config's own choices the plan starts from."""

    deepspeed_config: str
    ds: dict  # its DeepSpeed JSON
    activation_checkpointing: bool
    micro_batch_size: int
    grad_accum: int
    sequence_parallel: int
    global_windows: int  # windows per optimizer step, all GPUs
    compiled: bool = False  # engine.compile: refused with parallel.sequence > 1, so none is offered
    expert_parallel: int = 1  # parallel.expert


def memory_plan(
    cfg: ModelConfig, seq_len: int, job: JobShape, hardware: Hardware, optimizer: str = "adamw"
) -> dict:
    """`pretrain plan --json`: the config's own plan and the settings that fit, fastest first."""
    own = Setting(
        deepspeed_config=job.deepspeed_config,
        zero=ZeroSettings.from_deepspeed(job.ds),
        activation_checkpointing=job.activation_checkpointing,
        micro_batch_size=job.micro_batch_size,
        grad_accum=job.grad_accum,
        sequence_parallel=job.sequence_parallel,
        expert_parallel=job.expert_parallel,
    )
    mine = plan(cfg, seq_len, own, hardware, optimizer)
    options = candidate_settings(cfg, seq_len, job.global_windows, hardware.gpus, packaged_zero_configs())
    options = [s for s in options if runs_with(cfg, s, job.compiled)]
    feasible = ranked([plan(cfg, seq_len, s, hardware, optimizer) for s in options])
    return {
        "model": cfg.preset,
        "params": param_counts(cfg).total,
        "active_params": param_counts(cfg).active,
        "seq_len": seq_len,
        "global_batch_windows": job.global_windows,
        "assumptions": {
            "gpus": hardware.gpus,
            "gpu_memory_gib": hardware.gpu_memory / GIB,
            "peak_flops": hardware.peak_flops,
            "mfu": hardware.mfu,
            "recompute_factor": RECOMPUTE_FACTOR,
            "runtime_gib": RUNTIME_BYTES / GIB,
            "fragmentation": FRAGMENTATION,
            "optimizer": optimizer,
            "interconnect": asdict(hardware.interconnect),
            "activations": "eager bf16, measured on CPU; to confirm on a GPU",
        },
        "plan": plan_json(mine),
        "feasible": [plan_json(p) for p in feasible],
    }


def plan_json(p: Plan) -> dict:
    return {
        "setting": {**asdict(p.setting), "overrides": p.setting.overrides()},
        "zero": p.setting.zero.describe(),
        "bytes": {
            "parameters": p.parameters,
            "gradients": p.gradients,
            "optimizer_states": p.optimizer_states,
            "activations": p.activations,
            "buffers": p.buffers,
            "total": p.total,
        },
        "gpu_memory": p.gpu_memory,
        "fits": p.fits,
        "tokens_per_sec": p.tokens_per_sec,
    }


def refusal(report: dict) -> str | None:
    """`pretrain launch`'s one line for a plan that cannot fit (None when it fits): its figures,
    and the fastest setting that would, or that none does."""
    own = report["plan"]
    if own["fits"]:
        return None
    b = own["bytes"]
    figures = (
        f"{b['total'] / GIB:.1f} GiB per GPU (parameters {b['parameters'] / GIB:.1f}, gradients "
        f"{b['gradients'] / GIB:.1f}, optimizer {b['optimizer_states'] / GIB:.1f}, activations "
        f"{b['activations'] / GIB:.1f}, buffers {b['buffers'] / GIB:.1f}) of {own['gpu_memory'] / GIB:.1f} GiB"
    )
    if report["feasible"]:
        hint = "it would fit with " + " ".join(report["feasible"][0]["setting"]["overrides"])
    else:
        hint = "no packaged ZeRO config, micro-batch, checkpointing or S fits: use more GPUs"
    return f"the memory plan needs {figures}: {hint} (`pretrain plan` lists what fits)"


def sequence_parallel(cfg: RunConfig) -> int:
    """S: `parallel.sequence` where the config has it, else 1."""
    return int(getattr(getattr(cfg, "parallel", None), "sequence", 1) or 1)


def run_plan(
    cfg: RunConfig,
    ds: dict,
    gpus: int,
    gpu_memory_gib: float,
    *,
    mfu: float = DEFAULT_MFU,
    gpus_per_node: int = 8,
) -> dict:
    """The memory plan of a run config at `gpus` GPUs of `gpu_memory_gib` GiB (`ds`: its DeepSpeed
    JSON): what `pretrain plan` prints and `pretrain launch` checks."""
    S = sequence_parallel(cfg)
    hardware = Hardware(
        gpus=gpus,
        gpu_memory=gpu_memory_gib * GIB,
        peak_flops=cfg.engine.peak_flops or PEAK_FLOPS["H100"],
        mfu=mfu,
        interconnect=Interconnect(gpus_per_node=gpus_per_node),
    )
    if gpus % S:
        raise UserError(f"--gpus {gpus} is not a multiple of parallel.sequence={S}: use a multiple of {S}")
    E = getattr(getattr(cfg, "parallel", None), "expert", 1)
    if gpus % E:
        raise UserError(f"--gpus {gpus} is not a multiple of parallel.expert={E}: use a multiple of {E}")
    train = cfg.train
    job = JobShape(
        deepspeed_config=cfg.engine.deepspeed_config,
        ds=ds,
        activation_checkpointing=cfg.engine.activation_checkpointing,
        micro_batch_size=train.micro_batch_size,
        grad_accum=train.grad_accum,
        sequence_parallel=S,
        global_windows=train.global_batch_size or train.micro_batch_size * train.grad_accum * gpus // S,
        compiled=cfg.engine.compile,
        expert_parallel=E,
    )
    return memory_plan(cfg.model, cfg.data.seq_len, job, hardware, cfg.optim.name)


def format_plan(report: dict, top: int = 10) -> str:
    """`pretrain plan` without --json: the config's own plan as a table, then what fits, fastest first."""
    a, own = report["assumptions"], report["plan"]
    params = report["params"]
    size = f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"
    b = own["bytes"]
    lines = [
        f"model {report['model']}: {size} params, seq_len {report['seq_len']}, "
        f"{report['global_batch_windows']} windows per step on {a['gpus']} GPU(s) of {a['gpu_memory_gib']:.0f} GiB",
        f"this config ({own['zero']}, activation checkpointing "
        f"{'on' if own['setting']['activation_checkpointing'] else 'off'}, micro-batch "
        f"{own['setting']['micro_batch_size']}, S={own['setting']['sequence_parallel']}"
        + (f", E={own['setting']['expert_parallel']}" if report["active_params"] != params else "")
        + "), per GPU:",
    ]
    for name, key in (
        ("parameters", "parameters"),
        ("gradients", "gradients"),
        ("optimizer states", "optimizer_states"),
        ("activations", "activations"),
        ("buffers and runtime", "buffers"),
    ):
        lines.append(f"  {name:<20} {b[key] / GIB:8.1f} GiB")
    verdict = "fits" if own["fits"] else "does NOT fit"
    lines.append(f"  {'total':<20} {b['total'] / GIB:8.1f} GiB of {a['gpu_memory_gib']:.0f}: {verdict}")
    lines.append(
        f"settings that fit, by expected tokens/s (MFU {100 * a['mfu']:.0f}% of "
        f"{a['peak_flops'] / 1e12:.0f} TFLOP/s, x{1 / a['recompute_factor']:.2f} with checkpointing):"
    )
    for p in report["feasible"][:top]:
        lines.append(
            f"  {p['tokens_per_sec']:>12,.0f} tok/s {p['bytes']['total'] / GIB:6.1f} GiB  "
            + " ".join(p["setting"]["overrides"])
        )
    if not report["feasible"]:
        lines.append("  none: use more GPUs (or GPUs with more memory)")
    return "\n".join(lines)
