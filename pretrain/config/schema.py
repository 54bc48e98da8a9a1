"""The run configuration's schema: one dataclass per concern, each checking its own fields in
`__post_init__` (one line that names the key: `ConfigError`) and filling in derived values
(`n_kv_heads`, `d_ff`) once; each is keyword-only, built by name as YAML names its keys. The
`monitor:` section (`MonitorConfig`) composes the settings its owners declare: the service's and
the supervisor's (`monitoring/config.py`), the trainer's (`pretrain/stability/settings.py`,
`pretrain/train/settings.py`). No torch, no deepspeed."""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from monitoring.config import (
    FINDINGS,
    RESPONSES,
    ServiceConfig,
    SupervisorConfig,
    check_choice,
    check_positive,
)
from pretrain.errors import ConfigError
from pretrain.stability.settings import ReplaySettings, ReplicaSettings, SkipSettings
from pretrain.train.settings import LinkSettings, StragglerSettings

__all__ = ["FINDINGS", "RESPONSES", "MonitorConfig"]  # (with the sections below: the run config's)


@dataclass(kw_only=True)
class MonitorConfig(
    SupervisorConfig,
    ReplicaSettings,
    ReplaySettings,
    StragglerSettings,
    SkipSettings,
    LinkSettings,
    ServiceConfig,
):
    """The run config's `monitor:` section: one flat section (its keys, `monitor.window`,
    `monitor.timeout`, `monitor.max_restarts`, ..., are a contract) composed of the settings each
    owner declares and checks: the service's, the trainer's link, skip guard, stragglers, replay
    and replica check, then the supervisor's (the fields in that order). Each owner is typed to
    take only its part: the policy and the service a `ServiceConfig`, the hang watch a
    `SupervisorConfig`; the supervisor, which also starts the service, the whole."""

    def __post_init__(self) -> None:
        self.check_service()
        self.check_link()
        self.check_skip()
        self.check_stragglers()
        self.check_replay()
        self.check_replicas()
        self.check_supervisor()


# Windows shorter than this are allowed only in unit tests of the model itself.
MIN_PRETRAIN_SEQ_LEN = 512
URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")  # an object store's (data.dir, checkpoint.mirror)

# The range checks every section uses (monitoring's sections raise their own SettingError with them).
_choice = functools.partial(check_choice, error=ConfigError)
_positive = functools.partial(check_positive, error=ConfigError)


ROPE_SCALING_TYPES = ("llama3", "linear")


@dataclass(kw_only=True)
class RopeScaling:
    """`model.rope_scaling`: the rotary frequencies rescaled for a context longer than the one the
    model was trained at (docs/model.md, Rope scaling). `linear` divides every frequency by `factor`
    (position interpolation, Chen et al. 2023); `llama3` is Llama 3.1's rule (transformers'
    "llama3"): frequencies whose wavelength is longer than original_max_position_embeddings /
    low_freq_factor are divided by `factor`, those shorter than ... / high_freq_factor are kept,
    and those between are blended. Written into an export's config.json as `rope_scaling`."""

    type: str | None = None  # llama3 | linear
    factor: float | None = None  # the new context over the original one (Llama 3.1: 8)
    # llama3 only (Llama 3.1's values when left unset: 1 and 4)
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None  # llama3: the length trained at before (8192)

    def __post_init__(self) -> None:
        key = "model.rope_scaling"
        if self.type is None:
            raise ConfigError(f"{key}.type is not set: choose llama3 (Llama 3.1's rule) or linear")
        _choice(f"{key}.type", self.type, ROPE_SCALING_TYPES)
        if self.factor is None:
            raise ConfigError(f"{key}.factor is not set: give the new context length over the original one")
        if not (math.isfinite(self.factor) and self.factor >= 1):
            raise ConfigError(f"{key}.factor={self.factor} must be a finite number >= 1 (1: no scaling)")
        llama3 = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        if self.type == "linear":
            for name in llama3:
                if getattr(self, name) is not None:
                    raise ConfigError(f"{key}.{name} is llama3's: type linear takes only factor; drop it")
            return
        if self.original_max_position_embeddings is None:
            raise ConfigError(
                f"{key}.original_max_position_embeddings is not set: give the length the model was trained at"
            )
        _positive(f"{key}.original_max_position_embeddings", self.original_max_position_embeddings)
        self.low_freq_factor = 1.0 if self.low_freq_factor is None else self.low_freq_factor
        self.high_freq_factor = 4.0 if self.high_freq_factor is None else self.high_freq_factor
        _positive(f"{key}.low_freq_factor", self.low_freq_factor)
        if not (math.isfinite(self.high_freq_factor) and self.high_freq_factor > self.low_freq_factor):
            raise ConfigError(
                f"{key}.high_freq_factor={self.high_freq_factor} must be above "
                f"low_freq_factor={self.low_freq_factor} (Llama 3.1: 4 and 1)"
            )


ROUTERS = ("softmax", "sigmoid")
BALANCES = ("aux_loss", "bias", "both")


@dataclass(kw_only=True)
class MoEConfig:
    """`model.moe`: the feed-forward of every block from `dense_layers` on is a mixture of experts
    (pretrain/model/moe.py; docs/model.md, Mixture of experts): each token goes to its `top_k` of
    `experts` routed experts (token choice, no token dropped), plus `shared_experts` every token
    goes through. Absent (null), the model is dense, computed as before bit for bit."""

    experts: int = 8  # routed experts per MoE block
    top_k: int = 2  # routed experts per token
    shared_experts: int = 0  # always-on experts: one SwiGLU of shared_experts × expert_ffn_dim
    expert_ffn_dim: int | None = None  # each expert's hidden size; null: model.d_ff
    router: str = "sigmoid"  # softmax | sigmoid scores (fp32)
    # aux_loss: a balancing loss over the data-parallel micro-batch (Switch, OLMoE, Qwen3's global
    # batch) | bias: DeepSeek-V3's auxiliary-loss-free balance, a per-expert bias on the scores
    # that choose, nudged by bias_rate against each expert's load after every step | both: the
    # bias and DeepSeek-V3's small sequence-wise loss
    balance: str = "both"
    aux_loss_coef: float = 1e-4  # the balancing loss's coefficient (DeepSeek-V3 1e-4, OLMoE 1e-2)
    bias_rate: float = 1e-3  # the bias's step (DeepSeek-V3's γ)
    router_z_loss: float = 0.0  # coefficient of the mean squared logsumexp of the router logits
    dense_layers: int = 0  # the first N blocks keep the dense feed-forward (model.d_ff)
    # the top-k weights divided by their sum (DeepSeek-V3, Qwen3; OLMoE does not)
    normalize_top_k: bool = True

    def __post_init__(self) -> None:
        for key in ("experts", "top_k"):
            _positive(f"model.moe.{key}", getattr(self, key))
        for key in ("shared_experts", "dense_layers"):
            _positive(f"model.moe.{key}", getattr(self, key), allow_zero=True)
        if self.expert_ffn_dim is not None:
            _positive("model.moe.expert_ffn_dim", self.expert_ffn_dim)
        _choice("model.moe.router", self.router, ROUTERS)
        _choice("model.moe.balance", self.balance, BALANCES)
        for key in ("aux_loss_coef", "bias_rate", "router_z_loss"):
            _positive(f"model.moe.{key}", getattr(self, key), allow_zero=True)
        if self.top_k > self.experts:
            raise ConfigError(
                f"model.moe.top_k={self.top_k} exceeds model.moe.experts={self.experts}: "
                "each token picks top_k different experts; lower top_k or add experts"
            )
        if not isinstance(self.normalize_top_k, bool):
            raise ConfigError(f"model.moe.normalize_top_k={self.normalize_top_k!r}: use true or false")

    @property
    def uses_bias(self) -> bool:
        return self.balance in ("bias", "both")

    @property
    def uses_aux_loss(self) -> bool:
        return self.balance in ("aux_loss", "both") and self.aux_loss_coef > 0


@dataclass(kw_only=True)
class ModelConfig:
    """The decoder's shape and its architecture switches (defaults are the Llama style)."""

    # Filled in by __post_init__ when left None; the loader keeps them None in the merge schema so
    # that a default derived for the default d_model never leaks into a preset with another one.
    DERIVED: ClassVar[tuple[str, ...]] = ("n_kv_heads", "d_ff", "head_dim")

    preset: str | None = None  # name of the configs/model/ preset these values came from
    vocab_size: int = 32000
    d_model: int = 768
    n_layers: int = 12
    n_heads: int = 12
    n_kv_heads: int | None = None  # None: = n_heads (plain multi-head attention)
    # each head's width; None: d_model / n_heads (Qwen3's are wider: 32 heads × 128 on 2048)
    head_dim: int | None = None
    d_ff: int | None = None  # None: SwiGLU ~8/3·d_model rounded up to ffn_multiple_of, else 4·d_model
    ffn_multiple_of: int = 256
    max_seq_len: int = 2048
    norm: str = "rmsnorm"  # rmsnorm | layernorm
    norm_placement: str = "pre"  # pre | post
    norm_eps: float = 1e-5
    activation: str = "swiglu"  # swiglu | gelu | relu
    positions: str = "rope"  # rope | sinusoidal | learned
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    init_std: float = 0.02
    # RMSNorm (learned weight over head_dim) on each head's queries and keys before rotary
    # embeddings, as in Qwen3 (OLMo 2: over all heads at once): bounds the attention logits
    qk_norm: bool = False
    # rotary frequencies rescaled for a longer context (RopeScaling: llama3 or linear); None: plain RoPE
    rope_scaling: RopeScaling | None = None
    # a mixture of experts in place of the dense feed-forward (MoEConfig); None: dense
    moe: MoEConfig | None = None

    def __post_init__(self) -> None:
        for key in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len", "ffn_multiple_of"):
            _positive(f"model.{key}", getattr(self, key))
        _positive("model.norm_eps", self.norm_eps)
        _positive("model.init_std", self.init_std)
        _positive("model.rope_theta", self.rope_theta)
        _choice("model.norm", self.norm, ("rmsnorm", "layernorm"))
        _choice("model.norm_placement", self.norm_placement, ("pre", "post"))
        _choice("model.activation", self.activation, ("swiglu", "gelu", "relu"))
        _choice("model.positions", self.positions, ("rope", "sinusoidal", "learned"))
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise ConfigError(
                    f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}: "
                    "choose n_heads so that head_dim = d_model / n_heads is a whole number, or set model.head_dim"
                )
            self.head_dim = self.d_model // self.n_heads
        _positive("model.head_dim", self.head_dim)
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        _positive("model.n_kv_heads", self.n_kv_heads)
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={self.n_kv_heads}: "
                "each key/value head must serve a whole group of query heads"
            )
        if self.positions == "rope" and self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} is odd: rotary embeddings need an even head_dim")
        if isinstance(self.rope_scaling, dict):  # as a saved run config (asdict) holds it
            self.rope_scaling = rope_scaling_from_dict(self.rope_scaling)
        if self.rope_scaling is not None and self.positions != "rope":
            raise ConfigError(
                f"model.rope_scaling is set but model.positions={self.positions!r}: it rescales rotary "
                "positions only; drop it or use model.positions=rope"
            )
        if self.positions == "sinusoidal" and self.d_model % 2:
            raise ConfigError(
                f"model.d_model={self.d_model} is odd: sinusoidal positions need an even d_model"
            )
        if self.d_ff is None:
            self.d_ff = default_ffn_dim(self.d_model, self.activation, self.ffn_multiple_of)
        _positive("model.d_ff", self.d_ff)
        if isinstance(self.moe, dict):  # as a saved run config (asdict) holds it
            self.moe = section_from_dict(MoEConfig, "model.moe", self.moe)
        if self.moe is not None:
            self._check_moe(self.moe)

    def _check_moe(self, moe: MoEConfig) -> None:
        """What experts need of the rest of the model, each refusal one line."""
        if self.activation != "swiglu":
            raise ConfigError(
                f"model.moe with model.activation={self.activation!r}: the experts are SwiGLU; use swiglu"
            )
        if moe.dense_layers >= self.n_layers:
            raise ConfigError(
                f"model.moe.dense_layers={moe.dense_layers} leaves no block of model.n_layers="
                f"{self.n_layers} for the experts: lower it, or drop model.moe for a dense model"
            )
        if moe.expert_ffn_dim is None:
            moe.expert_ffn_dim = self.d_ff


def rope_scaling_from_dict(values: dict) -> RopeScaling:
    """`model.rope_scaling` from a mapping (a saved run config's), unknown keys refused in one line."""
    return section_from_dict(RopeScaling, "model.rope_scaling", values)


def section_from_dict(cls: type, key: str, values: dict):
    """A nested section (`model.rope_scaling`, `model.moe`) from a mapping (a saved run config's),
    unknown keys refused in one line."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{key}: unknown key {unknown[0]!r}: valid keys are {', '.join(sorted(known))}")
    return cls(**values)


def default_ffn_dim(d_model: int, activation: str, multiple_of: int) -> int:
    """SwiGLU has three matrices, so ~8/3·d keeps its parameter count equal to a 4·d two-matrix MLP."""
    if activation != "swiglu":
        return 4 * d_model
    return multiple_of * math.ceil(8 * d_model / 3 / multiple_of)


@dataclass(kw_only=True)
class RunSection:
    dir: str = "runs/default"  # everything the run writes goes here
    seed: int = 0
    deterministic: bool = False  # deterministic kernels and settings for bitwise resume


@dataclass(kw_only=True)
class MixtureSource:
    """One corpus of `data.mixture`: its name (in TensorBoard tags), prepared shards and weight."""

    name: str = ""
    dir: str = ""
    weight: float = 1.0


SOURCE_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")  # a corpus's name is a TensorBoard tag component


def check_mixture(sources: list[tuple[str, Any, float]], error: type[Exception] = ConfigError) -> None:
    """The one check of a mixture's corpora (`data.mixture`, and any `MixtureStream`): at least
    one, names unique and tag-safe, weights positive and finite; one line naming the problem."""
    if not sources:
        raise error("the mixture names no source: give data.dir, or data.mixture with at least one entry")
    seen = set()
    for name, _, weight in sources:
        if not isinstance(name, str) or not SOURCE_NAME.match(name):
            raise error(f"mixture source name {name!r}: use letters, digits, '_', '.' or '-'")
        if name in seen:
            raise error(f"mixture source name {name!r} appears twice: give each source its own name")
        if (
            isinstance(weight, bool)
            or not isinstance(weight, int | float)
            or not math.isfinite(weight)
            or weight <= 0
        ):
            raise error(f"mixture source {name!r} has weight {weight!r}: use a positive number")
        seen.add(name)


@dataclass(kw_only=True)
class DataConfig:
    dir: str | None = None  # prepared shards (`pretrain data prepare --out`); or data.mixture
    # several prepared corpora, interleaved by weight: [{name: web, dir: DIR, weight: 0.7}, ...]
    mixture: list[MixtureSource] = field(default_factory=list)
    seq_len: int = 2048  # tokens per training window (the stream yields seq_len + 1)
    # attention stays inside each document of a window, and rotary positions restart at its start
    document_masking: bool = False
    # The run's tokenizer (samples, evaluation text, checkpoints, export): a SentencePiece
    # tokenizer.model, a Hugging Face tokenizer.json, or a directory holding one. Unset: the one
    # `pretrain data prepare` put beside the shards. Either way it must be the tokenizer the shards
    # were made with (the same sha256 as their manifest names).
    tokenizer: str | None = None
    # A corpus in an object store (data.dir or a mixture's dir as s3://bucket/prefix, gs://, az://,
    # hf://; docs/data.md): its shards are fetched into this node-local cache (null: the temporary
    # directory's pretrain-cache-UID), at most cache_gib GiB of them (least recently used evicted)
    cache_dir: str | None = None
    cache_gib: float = 64.0

    def __post_init__(self) -> None:
        if not (
            isinstance(self.cache_gib, int | float) and math.isfinite(self.cache_gib) and self.cache_gib > 0
        ):
            raise ConfigError(f"data.cache_gib={self.cache_gib!r} must be a positive number of GiB")
        if self.cache_dir is not None and URL.match(str(self.cache_dir)):
            raise ConfigError(f"data.cache_dir={self.cache_dir} is a URL: the cache is a local directory")
        if self.seq_len < MIN_PRETRAIN_SEQ_LEN:
            raise ConfigError(
                f"data.seq_len={self.seq_len} is below {MIN_PRETRAIN_SEQ_LEN}: "
                f"pretraining streams windows of at least {MIN_PRETRAIN_SEQ_LEN} tokens"
            )
        if self.dir is not None and self.mixture:
            raise ConfigError("data.dir and data.mixture are both set: name one corpus, or a mixture of them")
        for i, source in enumerate(self.mixture):
            if not source.name or not source.dir:
                raise ConfigError(
                    f"data.mixture[{i}] needs a name and a dir: {{name: web, dir: DIR, weight: 0.7}}"
                )
        if self.mixture:
            check_mixture(self.sources())

    def sources(self) -> list[tuple[str, str, float]]:
        """(name, dir, weight) of each corpus: `data.dir` alone is a mixture of one named "data"."""
        if self.mixture:
            return [(s.name, s.dir, s.weight) for s in self.mixture]
        return [("data", self.dir, 1.0)] if self.dir is not None else []


@dataclass(kw_only=True)
class TrainConfig:
    steps: int = 1000  # optimizer steps
    micro_batch_size: int = 8  # windows per rank per forward/backward
    grad_accum: int = 1  # micro-batches per optimizer step
    grad_clip: float = 1.0  # global gradient-norm clip; 0 disables
    global_batch_size: int | None = None  # windows per step; if set, must equal micro × accum × world size
    stop_at_step: int | None = None  # save and exit at this step (e.g. to fit a job time limit); resume later

    def __post_init__(self) -> None:
        _positive("train.steps", self.steps)
        _check_train_section(self, optional=("global_batch_size", "stop_at_step"))


def _check_train_section(train, optional: tuple[str, ...]) -> None:
    """The batch and clipping fields pretraining and fine-tuning share; `optional` ones may be None."""
    for key in optional:
        if getattr(train, key) is not None:
            _positive(f"train.{key}", getattr(train, key))
    _positive("train.micro_batch_size", train.micro_batch_size)
    _positive("train.grad_accum", train.grad_accum)
    _positive("train.grad_clip", train.grad_clip, allow_zero=True)


OPTIMIZERS = ("adamw", "muon")
MUON_NS_METHODS = ("gram", "standard")
MUON_SCALES = ("original", "match_rms_adamw")


@dataclass(kw_only=True)
class OptimConfig:
    """The optimizer (docs/training.md, Optimizers). `muon`: DeepSpeed's Muon for the 2-D weights
    inside the blocks, AdamW (lr, betas, eps) for the embeddings, the output head, norms and the
    rest; weight decay as AdamW's, on both (`pretrain/optim/muon.py`)."""

    name: str = "adamw"  # adamw | muon
    lr: float = 3e-4  # peak learning rate (with muon: the AdamW half's)
    weight_decay: float = 0.1  # not applied to norms, biases and embeddings
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    # Muon's peak learning rate, on the same schedule (DeepSpeed's and Keller Jordan's default)
    muon_lr: float = 0.02
    # Muon's momentum (DeepSpeed's default); Nesterov is always on: DeepSpeed 0.19 has no switch
    muon_momentum: float = 0.95
    # the Newton–Schulz iteration, 5 steps (DeepSpeed has no setting for the count): gram
    # (DeepSpeed's default; fp16, fewer products on wide matrices) | standard (bf16)
    muon_ns_method: str = "gram"
    # the update's size by the matrix's shape: original (DeepSpeed's √max(1, rows/cols), Jordan
    # 2024) | match_rms_adamw (0.2·√max(rows, cols): AdamW's update RMS, Liu et al. 2025)
    muon_scale: str = "original"

    def __post_init__(self) -> None:
        _positive("optim.lr", self.lr)
        self._check_all_but_lr()

    def _check_all_but_lr(self) -> None:
        _choice("optim.name", self.name, OPTIMIZERS)
        _positive("optim.weight_decay", self.weight_decay, allow_zero=True)
        for key in ("beta1", "beta2", "muon_momentum"):
            value = getattr(self, key)
            if not 0.0 <= value < 1.0:
                raise ConfigError(f"optim.{key}={value} must be in [0, 1)")
        _positive("optim.eps", self.eps)
        _positive("optim.muon_lr", self.muon_lr)
        _choice("optim.muon_ns_method", self.muon_ns_method, MUON_NS_METHODS)
        _choice("optim.muon_scale", self.muon_scale, MUON_SCALES)


@dataclass(kw_only=True)
class FinetuneOptimConfig(OptimConfig):
    """Fine-tuning's optimizer: as pretraining's, with a learning rate that follows the checkpoint
    when left unset (`pretrain/initial_model.py`, `InitialModel.learning_rate`)."""

    # None: a tenth of the pretraining run's peak rate (that run's own rate for a fine-tuned
    # checkpoint; 1e-4 from a Hugging Face directory, which does not record it)
    lr: float | None = None
    weight_decay: float = 0.01

    def __post_init__(self) -> None:
        if self.lr is not None:
            _positive("optim.lr", self.lr)
        self._check_all_but_lr()


ATTENTION_FIRST = ("cudnn", "flash")  # engine.attention
LOSS_KERNELS = ("chunked", "compiled", "liger")  # loss.kernel


@dataclass(kw_only=True)
class LossConfig:
    """The pretraining objective beyond next-token cross-entropy (evaluation reports plain CE)."""

    # z-loss coefficient c: adds c · mean over valid tokens of (log Z)², log Z = logsumexp of the
    # output logits (PaLM uses 1e-4, OLMo 2 1e-5); 0 disables it
    z_loss: float = 0.0
    # the fused LM head + cross-entropy (pretrain/model/loss.py): chunked (eager chunks, every
    # device) | compiled (each chunk's arithmetic one compiled function) | liger (Liger-Kernel's
    # fused linear cross-entropy, CUDA only: elsewhere chunked, said once)
    kernel: str = "chunked"

    def __post_init__(self) -> None:
        _positive("loss.z_loss", self.z_loss, allow_zero=True)
        _choice("loss.kernel", self.kernel, LOSS_KERNELS)


@dataclass(kw_only=True)
class ScheduleConfig:
    name: str = "cosine"  # cosine | wsd | inverse_sqrt | constant
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1  # final lr / peak lr (cosine, wsd)
    decay_fraction: float = 0.2  # wsd: share of the steps spent in the final decay

    def __post_init__(self) -> None:
        _choice("schedule.name", self.name, ("cosine", "wsd", "inverse_sqrt", "constant"))
        _positive("schedule.warmup_steps", self.warmup_steps, allow_zero=True)
        if self.name == "inverse_sqrt" and self.warmup_steps == 0:
            raise ConfigError("schedule.warmup_steps=0: inverse_sqrt needs a warm-up of at least 1 step")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"schedule.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ConfigError(f"schedule.decay_fraction={self.decay_fraction} must be in (0, 1]")


@dataclass(kw_only=True)
class EngineConfig:
    deepspeed_config: str = "configs/deepspeed/zero2.json"  # a standard DeepSpeed JSON file
    activation_checkpointing: bool = False
    compile: bool = False  # torch.compile each block (one graph, no graph break)
    # with compile: the final norm, the LM head and the loss as one compiled region too
    compile_head: bool = True
    # the SDPA backend tried first on CUDA: cudnn (then flash, memory-efficient, math) | flash
    # (torch's own order); FlexAttention for document masking either way; no effect on a CPU
    attention: str = "cudnn"
    # the step reads the host once, inside DeepSpeed's optimizer step (pretrain/parallel/norm_gate.py);
    # false: DeepSpeed's bf16 overflow scan and checks, four more reads per step under ZeRO-1/2
    one_host_read: bool = True
    peak_flops: float | None = None  # per-device peak for MFU; None: looked up from the device name

    def __post_init__(self) -> None:
        _choice("engine.attention", self.attention, ATTENTION_FIRST)
        if self.peak_flops is not None:
            _positive("engine.peak_flops", self.peak_flops)


@dataclass(kw_only=True)
class ParallelConfig:
    """How the job's ranks share the work besides data parallelism (docs/training.md, Long context)."""

    # S: each window's tokens split across the S ranks of a sequence-parallel group (DeepSpeed
    # Ulysses); the data-parallel degree is the number of processes / S
    sequence: int = 1
    # E: each group of E consecutive ranks splits model.moe's experts, rank r holding the r % E-th
    # E-th of them, tokens moved to their experts by all-to-all (pretrain/parallel/experts.py)
    expert: int = 1

    def __post_init__(self) -> None:
        _positive("parallel.sequence", self.sequence)
        _positive("parallel.expert", self.expert)

    def check(self, model: ModelConfig, seq_len: int) -> None:
        """What sequence and expert parallelism need of the model and the window, each refusal one line."""
        self._check_experts(model)
        S = self.sequence
        if S == 1:
            return
        if model.moe is not None:
            raise ConfigError(
                f"model.moe with parallel.sequence={S}: experts with sequence parallelism are not proven "
                "here; set parallel.sequence=1"
            )
        if seq_len % S:
            raise ConfigError(
                f"data.seq_len={seq_len} is not divisible by parallel.sequence={S}: each rank "
                "holds an equal share of the window; choose a multiple of it"
            )
        if model.n_heads % S:
            raise ConfigError(
                f"model.n_heads={model.n_heads} is not divisible by parallel.sequence={S}: each rank "
                "attends with an equal share of the heads; choose S dividing the heads"
            )
        kv = model.n_kv_heads
        if kv % S and S % kv:
            raise ConfigError(
                f"model.n_kv_heads={kv} and parallel.sequence={S}: one must divide the other (fewer "
                "key/value heads than S are replicated, as DeepSpeed does); choose S accordingly"
            )

    def _check_experts(self, model: ModelConfig) -> None:
        E = self.expert
        if E == 1:
            return
        if model.moe is None:
            raise ConfigError(
                f"parallel.expert={E} but the model has no experts: set model.moe, or parallel.expert=1"
            )
        if model.moe.experts % E:
            raise ConfigError(
                f"model.moe.experts={model.moe.experts} is not divisible by parallel.expert={E}: each rank "
                "of an expert-parallel group holds an equal share of the experts; choose E dividing them"
            )


@dataclass(kw_only=True)
class CheckpointConfig:
    every: int = 1000  # steps between checkpoints
    keep: int = 3  # newest complete checkpoints kept, plus the current rollback target
    # auto: the newest intact checkpoint (or a fresh start when there is none) | fresh: move an
    # earlier run in run.dir to previous/ and start over (`--fresh`) | a checkpoint tag or directory
    resume: str = "auto"
    # the weights to start from, and nothing else of that run: a fresh optimizer, step 0, the data
    # and the schedule from their start; a run directory (its newest complete checkpoint), one
    # checkpoint's directory, or a Hugging Face Llama directory. Only model.max_seq_len, rope_theta
    # and rope_scaling may differ from its model: continuing at a longer context (docs/training.md,
    # Long context). A run with checkpoints of its own resumes from those instead.
    init: str | None = None
    save_retries: int = (
        2  # failed saves in a row the run survives (trying again at the next save); then it stops
    )
    # the loop waits only while the state is copied off the training buffers; the files, their
    # hashes and the completion marker are written in the background (docs/run-directory.md,
    # "Checkpoints in the background"). Megatron's --async-save; its former name, checkpoint.async,
    # still reads as this key (pretrain/config/loading.py, RENAMED)
    async_save: bool = False
    # each complete checkpoint is also uploaded here (s3://bucket/prefix or another fsspec URL), in
    # the background; a run whose run.dir holds none resumes from it (docs/run-directory.md)
    mirror: str | None = None

    def __post_init__(self) -> None:
        _positive("checkpoint.every", self.every)
        if self.mirror is not None and not URL.match(str(self.mirror)):
            raise ConfigError(
                f"checkpoint.mirror={self.mirror}: use a URL (s3://bucket/prefix, gs://..., az://...), or null"
            )
        if not isinstance(self.async_save, bool):
            raise ConfigError(f"checkpoint.async_save={self.async_save!r}: use true or false")
        _positive("checkpoint.save_retries", self.save_retries, allow_zero=True)
        if self.init == "":
            raise ConfigError(
                "checkpoint.init is empty: name a run or checkpoint directory, or leave it null"
            )
        if not isinstance(self.resume, str) or not self.resume:
            raise ConfigError(
                f"checkpoint.resume={self.resume!r}: use auto (the default), fresh, or a checkpoint tag or directory"
            )
        if self.keep < 2:
            raise ConfigError(
                f"checkpoint.keep={self.keep}: keep at least 2 checkpoints, "
                "as the newest one may still be being written when an older one is needed"
            )


@dataclass(kw_only=True)
class EvalConfig:
    every: int = 500  # steps between held-out evaluations; 0 disables
    batches: int = 20  # validation micro-batches per evaluation
    # attention maps of this text go to TensorBoard (images, tag attention/probe) at each
    # evaluation; null or "" turns them off
    attention_probe: str | None = "The quick brown fox jumps over the lazy dog."
    # at each evaluation, the model continues each prompt (KV cache): printed on the console and
    # logged to TensorBoard's text tab (samples/<i>); [] turns it off
    sample_prompts: list[str] = field(default_factory=list)
    sample_tokens: int = 32  # new tokens per sample
    sample_temperature: float = 0.0  # 0: greedy; else sampled with a generator seeded by the step

    def __post_init__(self) -> None:
        _positive("eval.every", self.every, allow_zero=True)
        _positive("eval.batches", self.batches)
        _positive("eval.sample_tokens", self.sample_tokens)
        _positive("eval.sample_temperature", self.sample_temperature, allow_zero=True)
        for i, prompt in enumerate(self.sample_prompts):
            if not prompt.strip():
                raise ConfigError(f"eval.sample_prompts[{i}] is empty: give text for the model to continue")


WANDB_MODES = ("online", "offline", "disabled")


@dataclass(kw_only=True)
class WandbConfig:
    """Weights & Biases (extra `[wandb]`): off while `project` is null."""

    project: str | None = None
    mode: str = "online"  # offline: written under RUN_DIR/wandb, to `wandb sync` later
    entity: str | None = None
    name: str | None = None  # null: the run directory's name

    def __post_init__(self) -> None:
        _choice("logging.wandb.mode", self.mode, WANDB_MODES)


@dataclass(kw_only=True)
class LoggingConfig:
    every: int = 10  # steps between console/TensorBoard scalar writes
    layer_grad_norms_every: int = 50  # steps between per-layer-group gradient norms; 0 disables
    # steps between measurements of the instability precursors (pretrain/stability/precursors.py: largest
    # attention logit per layer, output log Z, update/weight RMS per layer group); 0 disables
    precursors_every: int = 10
    precursor_tokens: int = 256  # of the first sequence of the last micro-batch, for the probe
    tensorboard: bool = True
    # RUN_DIR/data_trace/rank_NNNNN.jsonl: the window ids each rank trained on at each step, to
    # find the data behind a spike (`pretrain data inspect`; a step run again appends a new line)
    data_trace: bool = True
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def __post_init__(self) -> None:
        _positive("logging.every", self.every)
        _positive("logging.layer_grad_norms_every", self.layer_grad_norms_every, allow_zero=True)
        _positive("logging.precursors_every", self.precursors_every, allow_zero=True)
        _positive("logging.precursor_tokens", self.precursor_tokens)


@dataclass(kw_only=True)
class FaultsConfig:
    """Fault injection for tests and rehearsals; everything is off unless set. Each fault fires once."""

    spike_steps: list[int] = field(default_factory=list)
    spike_factor: float = 50.0  # multiplies the loss and gradients at spike_steps
    grad_spike_steps: list[int] = field(default_factory=list)
    grad_spike_factor: float = 50.0  # multiplies the gradients (not the loss) at grad_spike_steps
    nan_steps: list[int] = field(default_factory=list)
    kill_step: int | None = None
    kill_rank: int = 0
    hang_step: int | None = None
    hang_rank: int = 0
    # as this step begins, rank 0 changes bytes (not the size) in the newest checkpoint's optimizer
    # file, which holds the fp32 master weights: a rehearsal of a corrupt rollback target
    corrupt_checkpoint_step: int | None = None
    # every save of this step's checkpoint pauses slow_save_seconds on every rank after writing
    # its first file: a rehearsal of a slow disk (a kill meanwhile leaves a half-written
    # checkpoint). A pause changes nothing saved, so it is not recorded as fired: it pauses each time
    slow_save_step: int | None = None
    slow_save_seconds: float = 5.0
    # from slow_from_step on, slow_rank's forward and backward passes take slow_factor times as
    # long (each followed by (factor - 1) x its own time, computing on CPU, idle on a GPU): a
    # rehearsal of a straggler. Like the pause it is not recorded as fired: slow in every start
    slow_rank: int = 0
    slow_factor: float = 3.0
    slow_from_step: int | None = None
    # at flip_step, the exponent's top bit of one element on flip_rank: of its local gradient
    # before the reduction, in that step's backward only (grad: a transient machine fault), or of
    # its bf16 copy of a weight after that step's update, which stays wrong (weight: a persistent
    # one); a rehearsal of the replay and the replica check (docs/monitoring.md)
    flip_step: int | None = None
    flip_rank: int = 0
    flip_target: str = "grad"

    def save_pause(self, step: int) -> float:
        """`slow_save_step`: the seconds every rank pauses, after writing its first file, while it
        saves the checkpoint of `step` (0: none). Each save of that step pauses: a pause changes
        nothing that is saved, so unlike the other faults it is not recorded as fired."""
        return float(self.slow_save_seconds) if self.slow_save_step == step else 0.0

    def __post_init__(self) -> None:
        _positive("faults.spike_factor", self.spike_factor)
        _positive("faults.grad_spike_factor", self.grad_spike_factor)
        for key in ("spike_steps", "grad_spike_steps", "nan_steps"):
            for step in getattr(self, key):
                _positive(f"faults.{key}", step)
        for key in ("kill_rank", "hang_rank", "slow_rank", "flip_rank"):
            _positive(f"faults.{key}", getattr(self, key), allow_zero=True)
        for key in (
            "kill_step",
            "hang_step",
            "corrupt_checkpoint_step",
            "slow_save_step",
            "slow_from_step",
            "flip_step",
        ):
            if getattr(self, key) is not None:
                _positive(f"faults.{key}", getattr(self, key))
        _positive("faults.slow_save_seconds", self.slow_save_seconds, allow_zero=True)
        if self.flip_target not in ("grad", "weight"):
            raise ConfigError(f"faults.flip_target={self.flip_target!r} must be grad or weight")
        if not (math.isfinite(self.slow_factor) and self.slow_factor >= 1):
            raise ConfigError(
                f"faults.slow_factor={self.slow_factor} must be a finite number >= 1 (1: not slow)"
            )


@dataclass(kw_only=True)
class RunConfig:
    run: RunSection = field(default_factory=RunSection)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)

    def __post_init__(self) -> None:
        if self.data.seq_len > self.model.max_seq_len:
            raise ConfigError(
                f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}: "
                "raise model.max_seq_len or shorten data.seq_len"
            )
        self.parallel.check(self.model, self.data.seq_len)
        if self.monitor.skip_step and not self.engine.one_host_read:
            raise ConfigError(
                "monitor.skip_step=true needs engine.one_host_read=true: the skip guard decides "
                "inside the step's one host read (pretrain/parallel/norm_gate.py)"
            )
        self.check_expert_collapse_share()

    def check_expert_collapse_share(self) -> None:
        """A dominant expert takes more of the tokens than a perfect balance gives each one."""
        moe, monitor = self.model.moe, self.monitor
        if moe is None or not monitor.enabled or monitor.on_expert_collapse == "ignore":
            return
        balanced = moe.top_k / moe.experts
        if monitor.expert_collapse_share <= balanced:
            raise ConfigError(
                f"monitor.expert_collapse_share={monitor.expert_collapse_share} is at or below the share "
                f"of the tokens every expert gets in a perfect balance (model.moe.top_k / experts = "
                f"{balanced:g}): set it above, or monitor.on_expert_collapse=ignore"
            )


RUN_SECTIONS = tuple(f.name for f in fields(RunConfig))


# --------------------------------------------------------------------------- fine-tuning


FINETUNE_TASKS = ("classification", "sft")
POOLINGS = ("mean", "last")


@dataclass(kw_only=True)
class FinetuneSection:
    init: str | None = (
        None  # our checkpoint (a run or checkpoint directory) or a Hugging Face Llama directory
    )
    task: str = "classification"  # classification (a head on the last token) | sft (prompt → completion)
    epochs: float = 3.0  # passes over the training split; train.steps, when set, wins
    max_length: int | None = None  # tokens per example (longer ones are truncated); default: the model's max
    # classification: what the head reads, the mean of the final hidden states of the example's
    # tokens or the last one's (GPT-1); docs/finetuning.md has the measurements behind the default
    pooling: str = "last"
    # classification: fit the head on the frozen model's features first, then train everything
    # (LP-FT, Kumar et al. 2022: a random head's first gradients distort the pretrained features)
    linear_probe: bool = False
    # classification: micro-batches of examples of like length (each padded to its longest), the order
    # still shuffled, by groups (docs/finetuning.md)
    group_by_length: bool = True
    # classification: λ in GPT-1's loss, cross-entropy + λ × the next-token loss over the example's
    # own tokens (Radford et al. 2018, sec. 3.2); 0: the head's loss alone, the LM head dropped
    lm_loss_weight: float = 0.0
    # classification with a validation split: answers blend the network's logits with a bag of
    # words' log P(label | text), weighted as fits a tenth of the training split held out from
    # training (pretrain/finetune/blend.py, docs/finetuning.md)
    bag_of_words: bool = True

    def __post_init__(self) -> None:
        if self.task not in FINETUNE_TASKS:
            raise ConfigError(f"finetune.task={self.task!r}: choose one of {', '.join(FINETUNE_TASKS)}")
        _positive("finetune.epochs", self.epochs)
        if self.max_length is not None and self.max_length < 2:
            raise ConfigError(f"finetune.max_length={self.max_length} must be at least 2")
        if self.pooling not in POOLINGS:
            raise ConfigError(f"finetune.pooling={self.pooling!r}: choose one of {', '.join(POOLINGS)}")
        if not (math.isfinite(self.lm_loss_weight) and self.lm_loss_weight >= 0):
            raise ConfigError(
                f"finetune.lm_loss_weight={self.lm_loss_weight!r}: use a finite weight >= 0 (0: off)"
            )
        if self.lm_loss_weight and self.task != "classification":
            raise ConfigError(
                f"finetune.lm_loss_weight={self.lm_loss_weight:g} is for classification; "
                f"finetune.task={self.task} trains the language model already: set it to 0"
            )


@dataclass(kw_only=True)
class FinetuneDataConfig:
    train: str | None = None  # a local .csv/.jsonl/.json/.parquet file, or a split of data.hub
    validation: str | None = None
    hub: str | None = None  # a dataset name for datasets.load_dataset; then train/validation name splits
    text_column: str = "text"  # classification
    text_pair_column: str | None = None  # classification of pairs (entailment, similarity)
    label_column: str = "label"  # classification: strings or integers
    prompt_column: str = "prompt"  # sft
    completion_column: str = "completion"  # sft


@dataclass(kw_only=True)
class FinetuneTrainConfig:
    steps: int | None = None  # optimizer steps; default: finetune.epochs over the training split
    micro_batch_size: int = 8  # examples per rank per forward/backward
    grad_accum: int = 1
    grad_clip: float = 1.0
    global_batch_size: int | None = None  # if set, must equal micro × accum × world size

    def __post_init__(self) -> None:
        _check_train_section(self, optional=("steps", "global_batch_size"))


@dataclass(kw_only=True)
class FinetuneEvalConfig:
    every: int = 0  # steps between validation passes (always one at the end); 0: only at the end


@dataclass(kw_only=True)
class FinetuneConfig:
    """`pretrain finetune` / `python -m pretrain.finetune`: the model comes from `finetune.init`."""

    run: RunSection = field(default_factory=RunSection)
    finetune: FinetuneSection = field(default_factory=FinetuneSection)
    data: FinetuneDataConfig = field(default_factory=FinetuneDataConfig)
    train: FinetuneTrainConfig = field(default_factory=FinetuneTrainConfig)
    optim: FinetuneOptimConfig = field(default_factory=FinetuneOptimConfig)
    schedule: ScheduleConfig = field(default_factory=lambda: ScheduleConfig(warmup_steps=10))
    engine: EngineConfig = field(default_factory=EngineConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: FinetuneEvalConfig = field(default_factory=FinetuneEvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        if self.checkpoint.init is not None:
            raise ConfigError(
                "checkpoint.init is pretraining's: a fine-tuning run starts from finetune.init; set that instead"
            )

    def check_runnable(self) -> FinetuneConfig:
        """What a fine-tuning run needs that a shown config may leave to the command line."""
        if not _is_set(self.finetune.init):
            raise ConfigError(
                "finetune.init is not set: name a checkpoint (run directory) or a Hugging Face Llama directory"
            )
        if not _is_set(self.data.train):
            raise ConfigError(
                "data.train is not set: name a .csv/.jsonl/.parquet file (or a split, with data.hub)"
            )
        return self


def _is_set(value: str | None) -> bool:
    return value is not None and value != ""
