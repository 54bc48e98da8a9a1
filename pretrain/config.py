"""Typed run configuration: one dataclass per concern, merged and validated in one place.

Precedence, lowest first: dataclass defaults ← model preset (`configs/model/NAME.yaml`, named by
`model.preset`) ← the run config file ← dotted CLI overrides (`model.n_layers=12`). Merging and
type checking are OmegaConf's structured configs; the cross-field checks live in the
`__post_init__` of the dataclass that owns the fields, and derived values (`n_kv_heads`, `d_ff`)
are filled in there once. Any problem raises `ConfigError` with one line that names the key.

This module must stay light: no torch, no deepspeed.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import sys
from dataclasses import MISSING, asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, ClassVar

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from monitoring.config import FINDINGS, RESPONSES, MonitorConfig, SettingError, check_choice, check_positive
from pretrain.errors import ConfigError

__all__ = ["FINDINGS", "RESPONSES", "MonitorConfig"]  # (re-exported: the run config's monitor section)

# Windows shorter than this are allowed only in unit tests of the model itself.
MIN_PRETRAIN_SEQ_LEN = 512

REPO_CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


# The range checks every section uses (monitoring's sections raise their own SettingError with them).
_choice = functools.partial(check_choice, error=ConfigError)
_positive = functools.partial(check_positive, error=ConfigError)


@dataclass
class ModelConfig:
    """The decoder's shape and its architecture switches (defaults are the Llama style)."""

    # Filled in by __post_init__ when left None; the loader keeps them None in the merge schema so
    # that a default derived for the default d_model never leaks into a preset with another one.
    DERIVED: ClassVar[tuple[str, ...]] = ("n_kv_heads", "d_ff")

    preset: str | None = None  # name of the configs/model/ preset these values came from
    vocab_size: int = 32000
    d_model: int = 768
    n_layers: int = 12
    n_heads: int = 12
    n_kv_heads: int | None = None  # None: = n_heads (plain multi-head attention)
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
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}: "
                "choose n_heads so that head_dim = d_model / n_heads is a whole number"
            )
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
        if self.positions == "sinusoidal" and self.d_model % 2:
            raise ConfigError(
                f"model.d_model={self.d_model} is odd: sinusoidal positions need an even d_model"
            )
        if self.d_ff is None:
            self.d_ff = default_ffn_dim(self.d_model, self.activation, self.ffn_multiple_of)
        _positive("model.d_ff", self.d_ff)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def default_ffn_dim(d_model: int, activation: str, multiple_of: int) -> int:
    """SwiGLU has three matrices, so ~8/3·d keeps its parameter count equal to a 4·d two-matrix MLP."""
    if activation != "swiglu":
        return 4 * d_model
    return multiple_of * math.ceil(8 * d_model / 3 / multiple_of)


@dataclass
class RunSection:
    dir: str = "runs/default"  # everything the run writes goes here
    seed: int = 0
    deterministic: bool = False  # deterministic kernels and settings for bitwise resume


@dataclass
class MixtureSource:
    """One corpus of `data.mixture`: its name (in TensorBoard tags), prepared shards and weight."""

    name: str = ""
    dir: str = ""
    weight: float = 1.0


@dataclass
class DataConfig:
    dir: str | None = None  # prepared shards (`pretrain data prepare --out`); or data.mixture
    # several prepared corpora, interleaved by weight: [{name: web, dir: DIR, weight: 0.7}, ...]
    mixture: list[MixtureSource] = field(default_factory=list)
    seq_len: int = 2048  # tokens per training window (the stream yields seq_len + 1)
    # attention stays inside each document of a window, and rotary positions restart at its start
    document_masking: bool = False

    def __post_init__(self) -> None:
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
            if not math.isfinite(source.weight) or source.weight <= 0:
                raise ConfigError(f"data.mixture[{i}].weight={source.weight} must be a positive number")

    def sources(self) -> list[tuple[str, str, float]]:
        """(name, dir, weight) of each corpus: `data.dir` alone is a mixture of one named "data"."""
        if self.mixture:
            return [(s.name, s.dir, s.weight) for s in self.mixture]
        return [("data", self.dir, 1.0)] if self.dir is not None else []


@dataclass
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


@dataclass
class OptimConfig:
    lr: float = 3e-4  # peak learning rate
    weight_decay: float = 0.1  # not applied to norms, biases and embeddings
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8

    def __post_init__(self) -> None:
        _positive("optim.lr", self.lr)
        _positive("optim.weight_decay", self.weight_decay, allow_zero=True)
        for key in ("beta1", "beta2"):
            value = getattr(self, key)
            if not 0.0 <= value < 1.0:
                raise ConfigError(f"optim.{key}={value} must be in [0, 1)")
        _positive("optim.eps", self.eps)


@dataclass
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


@dataclass
class EngineConfig:
    deepspeed_config: str = "configs/deepspeed/zero2.json"  # a standard DeepSpeed JSON file
    activation_checkpointing: bool = False
    compile: bool = False  # torch.compile the blocks
    peak_flops: float | None = None  # per-device peak for MFU; None: looked up from the device name

    def __post_init__(self) -> None:
        if self.peak_flops is not None:
            _positive("engine.peak_flops", self.peak_flops)


@dataclass
class CheckpointConfig:
    every: int = 1000  # steps between checkpoints
    keep: int = 3  # newest complete checkpoints kept, plus the current rollback target
    # auto: the newest intact checkpoint (or a fresh start when there is none) | fresh: move an
    # earlier run in run.dir to previous/ and start over (`--fresh`) | a checkpoint tag or directory
    resume: str = "auto"
    save_retries: int = (
        2  # failed saves in a row the run survives (trying again at the next save); then it stops
    )

    def __post_init__(self) -> None:
        _positive("checkpoint.every", self.every)
        _positive("checkpoint.save_retries", self.save_retries, allow_zero=True)
        if not isinstance(self.resume, str) or not self.resume:
            raise ConfigError(
                f"checkpoint.resume={self.resume!r}: use auto (the default), fresh, or a checkpoint tag or directory"
            )
        if self.keep < 2:
            raise ConfigError(
                f"checkpoint.keep={self.keep}: keep at least 2 checkpoints, "
                "as the newest one may still be being written when an older one is needed"
            )


@dataclass
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


@dataclass
class WandbConfig:
    """Weights & Biases (extra `[wandb]`): off while `project` is null."""

    project: str | None = None
    mode: str = "online"  # offline: written under RUN_DIR/wandb, to `wandb sync` later
    entity: str | None = None
    name: str | None = None  # null: the run directory's name

    def __post_init__(self) -> None:
        _choice("logging.wandb.mode", self.mode, WANDB_MODES)


@dataclass
class LoggingConfig:
    every: int = 10  # steps between console/TensorBoard scalar writes
    layer_grad_norms_every: int = 50  # steps between per-layer-group gradient norms; 0 disables
    tensorboard: bool = True
    # RUN_DIR/data_trace/rank_NNNNN.jsonl: the window ids each rank trained on at each step, to
    # find the data behind a spike (`pretrain data inspect`; a step run again appends a new line)
    data_trace: bool = True
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def __post_init__(self) -> None:
        _positive("logging.every", self.every)
        _positive("logging.layer_grad_norms_every", self.layer_grad_norms_every, allow_zero=True)


@dataclass
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

    def __post_init__(self) -> None:
        _positive("faults.spike_factor", self.spike_factor)
        _positive("faults.grad_spike_factor", self.grad_spike_factor)
        for key in ("spike_steps", "grad_spike_steps", "nan_steps"):
            for step in getattr(self, key):
                _positive(f"faults.{key}", step)
        for key in ("kill_rank", "hang_rank"):
            _positive(f"faults.{key}", getattr(self, key), allow_zero=True)
        for key in ("kill_step", "hang_step", "corrupt_checkpoint_step"):
            if getattr(self, key) is not None:
                _positive(f"faults.{key}", getattr(self, key))


@dataclass
class RunConfig:
    run: RunSection = field(default_factory=RunSection)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
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


RUN_SECTIONS = tuple(f.name for f in fields(RunConfig))


# --------------------------------------------------------------------------- fine-tuning


FINETUNE_TASKS = ("classification", "sft")


@dataclass
class FinetuneSection:
    init: str | None = (
        None  # our checkpoint (a run or checkpoint directory) or a Hugging Face Llama directory
    )
    task: str = "classification"  # classification (a head on the last token) | sft (prompt → completion)
    epochs: float = 3.0  # passes over the training split; train.steps, when set, wins
    max_length: int | None = None  # tokens per example (longer ones are truncated); default: the model's max

    def __post_init__(self) -> None:
        if self.task not in FINETUNE_TASKS:
            raise ConfigError(f"finetune.task={self.task!r}: choose one of {', '.join(FINETUNE_TASKS)}")
        _positive("finetune.epochs", self.epochs)
        if self.max_length is not None and self.max_length < 2:
            raise ConfigError(f"finetune.max_length={self.max_length} must be at least 2")


@dataclass
class FinetuneDataConfig:
    train: str | None = None  # a local .csv/.jsonl/.json/.parquet file, or a split of data.hub
    validation: str | None = None
    hub: str | None = None  # a dataset name for datasets.load_dataset; then train/validation name splits
    text_column: str = "text"  # classification
    text_pair_column: str | None = None  # classification of pairs (entailment, similarity)
    label_column: str = "label"  # classification: strings or integers
    prompt_column: str = "prompt"  # sft
    completion_column: str = "completion"  # sft


@dataclass
class FinetuneTrainConfig:
    steps: int | None = None  # optimizer steps; default: finetune.epochs over the training split
    micro_batch_size: int = 8  # examples per rank per forward/backward
    grad_accum: int = 1
    grad_clip: float = 1.0
    global_batch_size: int | None = None  # if set, must equal micro × accum × world size

    def __post_init__(self) -> None:
        _check_train_section(self, optional=("steps", "global_batch_size"))


@dataclass
class FinetuneEvalConfig:
    every: int = 0  # steps between validation passes (always one at the end); 0: only at the end


@dataclass
class FinetuneConfig:
    """`pretrain finetune` / `python -m pretrain.finetune`: the model comes from `finetune.init`."""

    run: RunSection = field(default_factory=RunSection)
    finetune: FinetuneSection = field(default_factory=FinetuneSection)
    data: FinetuneDataConfig = field(default_factory=FinetuneDataConfig)
    train: FinetuneTrainConfig = field(default_factory=FinetuneTrainConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=3e-5, weight_decay=0.01))
    schedule: ScheduleConfig = field(default_factory=lambda: ScheduleConfig(warmup_steps=10))
    engine: EngineConfig = field(default_factory=EngineConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: FinetuneEvalConfig = field(default_factory=FinetuneEvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

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


# --------------------------------------------------------------------------- loading


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path} is a directory, not a config file: pass a .yaml file")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist: check the path")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not UTF-8 text: pass a YAML config file") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}: not valid YAML{where}: fix the syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of keys to values, got {type(data).__name__}")
    return data


def is_model_preset(data: dict[str, Any]) -> bool:
    """A run config has sections at top level; a model preset holds flat ModelConfig fields (a file
    with neither is taken as a run config, so its unknown keys are reported against the sections)."""
    model_fields = {f.name for f in fields(ModelConfig)}
    return not set(data) & set(RUN_SECTIONS) and bool(set(data) & model_fields)


def available_presets() -> list[str]:
    return sorted(p.stem for p in (config_dir() / "model").glob("*.yaml"))


def config_dir() -> Path:
    """configs/ of the source tree (editable installs), else the copy a wheel installs."""
    if REPO_CONFIG_DIR.is_dir():
        return REPO_CONFIG_DIR
    return Path(sys.prefix) / "share" / "pretrain" / "configs"


CONFIG_KINDS = ("train", "finetune", "model", "ablation")  # the packaged config directories, by name


def packaged_configs() -> dict[str, Path]:
    """The packaged configs by the name `--config` takes: run configs (configs/train/) by their file's
    stem (`demo`, `tiny`, `gpt3-125m`), the others as KIND/STEM (`finetune/classification`)."""
    found: dict[str, Path] = {}
    for kind in CONFIG_KINDS:
        for path in sorted((config_dir() / kind).glob("*.yaml")):
            found[path.stem if kind == "train" else f"{kind}/{path.stem}"] = path
    return found


def resolve_config(name: str | Path) -> Path:
    """A config file: the path as given when it exists, else a packaged config by name (from any
    directory), so `--config demo` and `--config configs/train/demo.yaml` are the same file — the
    latter, as the docs print it, also outside the repository (the shipped `configs/`)."""
    path = Path(name)
    if not path.is_file() and not path.is_absolute() and path.parts[:1] == ("configs",):
        shipped = config_dir() / Path(*path.parts[1:])
        if shipped.is_file():
            return shipped
    if path.is_file() or path.suffix in (".yaml", ".yml") or len(path.parts) > 2:
        return path  # a path: read_yaml reports a missing file with the path
    packaged = packaged_configs()
    key = str(name).removeprefix("train/")
    if key in packaged:  # also beside a directory of that name (`runs/demo` after `pretrain demo`)
        return packaged[key]
    if path.exists():
        return path  # read_yaml says what it is
    raise ConfigError(
        f"no config {str(name)!r}: not a file, nor a packaged config name; "
        "`pretrain config list` shows the names (or pass a path to a .yaml file)"
    )


def find_preset(name: str, config_path: Path | None = None) -> Path:
    """Resolve `model.preset`: a path to a YAML file, or a name under some `configs/model/`."""
    candidates: list[Path] = []
    if name.endswith((".yaml", ".yml")):
        if config_path is not None:
            candidates.append(config_path.parent / name)
        candidates.append(Path(name))
    else:
        if config_path is not None:
            candidates.append(config_path.resolve().parent.parent / "model" / f"{name}.yaml")
        candidates.append(Path("configs/model") / f"{name}.yaml")
        candidates.append(config_dir() / "model" / f"{name}.yaml")
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise ConfigError(
        f"unknown model preset {name!r}: no configs/model/{name}.yaml; "
        f"available presets: {', '.join(available_presets()) or 'none found'}"
    )


def parse_overrides(overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r} is not KEY=VALUE (for example model.n_layers=12)")
    try:
        parsed = OmegaConf.from_dotlist(list(overrides))
    except (OmegaConfBaseException, yaml.YAMLError) as exc:
        raise ConfigError(f"could not parse overrides {' '.join(overrides)!r}: {_first_line(exc)}") from None
    return OmegaConf.to_container(parsed)


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _schema(cls: type) -> DictConfig:
    """The typed, empty-of-derived-values config that YAML layers are merged onto."""
    schema = OmegaConf.structured(cls)
    if cls is ModelConfig or "model" in schema:
        model = schema if cls is ModelConfig else schema.model
        for name in ModelConfig.DERIVED:
            model[name] = None
    return schema


def _check_shape(layer: dict[str, Any], cls: type, source: str, prefix: str = "") -> None:
    """Sections must be mappings and list fields lists, before OmegaConf sees them (its own
    messages for these cases name internals, not keys)."""
    for f in fields(cls):
        if f.name not in layer or layer[f.name] is None:
            continue
        key, value = prefix + f.name, layer[f.name]
        if is_dataclass(f.default_factory if f.default_factory is not MISSING else None):
            if not isinstance(value, dict):
                raise ConfigError(
                    f"{source}: {key} must be a section (a mapping of keys to values), got {value!r}"
                )
            _check_shape(value, f.default_factory, source, key + ".")
        elif f.default_factory is list and not isinstance(value, list):
            raise ConfigError(f"{source}: {key} must be a list, for example {key}=[10,20]; got {value!r}")


def _merge_layer(base: DictConfig, layer: dict[str, Any], cls: type, source: str) -> DictConfig:
    """Merge one layer onto the typed config, naming the key and the source on failure."""
    _check_shape(layer, cls, source)
    try:
        return OmegaConf.merge(base, layer)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        message = _first_line(exc)
        if message.startswith("Key ") and "not in" in message:
            section = key.rsplit(".", 1)[0] if "." in key else None
            raise ConfigError(
                f"{source}: unknown key {key!r}: check the spelling; valid keys"
                f"{' in ' + repr(section) if section else ''} are {', '.join(_known_keys(cls, section))}"
            ) from None
        raise ConfigError(f"{source}: {key}: {message}: set it to a value of the field's type") from None


def _known_keys(cls: type, section: str | None) -> list[str]:
    for part in section.split(".") if section else []:
        owner = {f.name: f.default_factory for f in fields(cls)}.get(part)
        if owner is None or not is_dataclass(owner):
            return []
        cls = owner
    return [f.name for f in fields(cls)]


def _to_object(merged: DictConfig) -> Any:
    try:
        return OmegaConf.to_object(merged)
    except SettingError as exc:  # monitoring's own sections say it in the same words
        raise ConfigError(str(exc)) from None
    except OmegaConfBaseException as exc:
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, ConfigError):
            raise cause from None
        if isinstance(cause, SettingError):
            raise ConfigError(str(cause)) from None
        key = getattr(exc, "full_key", None) or "?"
        raise ConfigError(f"{key}: {_first_line(exc)}") from None


def load_model_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> ModelConfig:
    """Load a model preset file (flat ModelConfig fields). Overrides may be written `n_layers=2`
    or, as for run configs, `model.n_layers=2`."""
    path = resolve_config(path)
    data = read_yaml(path)
    if "preset" in data:
        raise ConfigError(f"{path}: a model preset cannot name another preset; list the fields instead")
    cli = parse_overrides(overrides)
    cli = {**{k: v for k, v in cli.items() if k != "model"}, **(cli.get("model") or {})}
    merged = _merge_layer(_schema(ModelConfig), data, ModelConfig, str(path))
    merged = _merge_layer(merged, cli, ModelConfig, "override")
    model = _to_object(merged)
    if model.preset is None:
        model.preset = path.stem
    return model


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Load a run config: defaults ← model preset ← file ← dotted overrides, then validate."""
    path = resolve_config(path)
    data = read_yaml(path)
    if is_model_preset(data):
        raise ConfigError(
            f"{path} is a model preset, not a run config: name it from a run config as "
            f"`model: {{preset: {path.stem}}}` (see configs/train/)"
        )
    cli = parse_overrides(overrides)
    _check_shape(data, RunConfig, str(path))
    _check_shape(cli, RunConfig, "override")
    preset = (cli.get("model") or {}).get("preset") or (data.get("model") or {}).get("preset")
    merged = _schema(RunConfig)
    if preset is not None:
        preset_path = find_preset(str(preset), path)
        preset_data = read_yaml(preset_path)
        merged = _merge_layer(merged, {"model": preset_data}, RunConfig, str(preset_path))
    merged = _merge_layer(merged, data, RunConfig, str(path))
    merged = _merge_layer(merged, cli, RunConfig, "override")
    return _to_object(merged)


def load_finetune_config(
    path: str | Path, overrides: list[str] | tuple[str, ...] = (), *, runnable: bool = True
) -> FinetuneConfig:
    """Load a fine-tuning config: defaults ← file ← dotted overrides, then validate (`runnable`:
    also that it names its initial checkpoint and training data, which `config show` does not need)."""
    path = resolve_config(path)
    data = read_yaml(path)
    if "finetune" not in data:
        raise ConfigError(
            f"{path} has no finetune: section, so it is not a fine-tuning config: start from "
            "configs/finetune/classification.yaml or configs/finetune/sft.yaml"
        )
    cli = parse_overrides(overrides)
    merged = _merge_layer(_schema(FinetuneConfig), data, FinetuneConfig, str(path))
    merged = _merge_layer(merged, cli, FinetuneConfig, "override")
    cfg = _to_object(merged)
    return cfg.check_runnable() if runnable else cfg


def finetune_config_from_dict(values: dict[str, Any]) -> FinetuneConfig:
    """A FinetuneConfig from a saved run_config.json (its extra keys, such as model, are ignored)."""
    sections = {k: v for k, v in values.items() if k in {f.name for f in fields(FinetuneConfig)}}
    return _to_object(
        _merge_layer(_schema(FinetuneConfig), sections, FinetuneConfig, "run_config.json")
    ).check_runnable()


def load_defaults(overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """The default run config with dotted overrides (for tools that take no config file)."""
    cli = parse_overrides(overrides)
    _check_shape(cli, RunConfig, "override")
    return _to_object(_merge_layer(_schema(RunConfig), cli, RunConfig, "override"))


def load_any(
    path: str | Path, overrides: list[str] | tuple[str, ...] = (), *, runnable: bool = True
) -> RunConfig | ModelConfig | FinetuneConfig:
    """A run config, a model preset file (as `pretrain flops configs/model/gpt3-125m.yaml` takes) or
    a fine-tuning config (`runnable`: see load_finetune_config)."""
    path = resolve_config(path)
    data = read_yaml(path)
    if is_model_preset(data):
        return load_model_config(path, overrides)
    if "finetune" in data:
        return load_finetune_config(path, overrides, runnable=runnable)
    return load_config(path, overrides)


def to_yaml(cfg: RunConfig | ModelConfig | FinetuneConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def config_hash(cfg: RunConfig | ModelConfig) -> str:
    """A stable digest of the resolved values (for checkpoints to say what produced them)."""
    text = json.dumps(asdict(cfg), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
