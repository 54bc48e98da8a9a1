"""`pretrain bench train CONFIG`: our model's training step against `transformers.LlamaForCausalLM`.

Both models are built from the same `ModelConfig` (the Hugging Face one through the exporter's
`llama_config_dict`, with `attn_implementation="sdpa"`) and start from the same weights, so the
first step's losses must agree: that is checked and printed, and is what makes the ratio a
comparison of implementations rather than of workloads. Each is wrapped by the trainer's own
`engine.initialize` (the same DeepSpeed ZeRO stage, optimizer, dtype and compile switch) and
trained on the same random batch. Ours takes the trainer's step as the run config sets it up
(`engine.one_host_read`: the norm gate, the step's one host read, which also reads its loss;
`loss.kernel`, `engine.attention`, `engine.compile_head`; KEY=VALUE overrides change them: the GPU
check's variants), Transformers' model DeepSpeed's own engine settings (its overflow scan on).
Each model's first steps count the host's waits for the device (`host_syncs_per_step`,
`pretrain/bench/host_syncs.py`); after warm-up, blocks of BLOCK steps are timed, synchronized at
their ends only (as a training run, where the host runs ahead of the device between its reads),
the two models' blocks alternating A B B A so that drift on a shared machine falls on both; the
figures are medians. `--ours-only` leaves Transformers out (and the matrix-product timing).

Reported: tokens/s each and the ratio; the memory a step holds for its backward pass (saved
activations, measured with autograd's saved-tensor hooks, on any device); on a GPU also the
peak allocated during a block above what was resident before it, and the MFU against the device's
nominal bf16 peak and against a bf16 matrix product measured here in the same process.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from pretrain.bench.host_syncs import HostSyncs
from pretrain.config import (
    ModelConfig,
    RunConfig,
    is_model_preset,
    load_config,
    load_defaults,
    load_model_config,
    read_yaml,
    resolve_config,
)
from pretrain.errors import UserError
from pretrain.parallel.norm_gate import gated, step_read
from pretrain.planning.flops import current_device_peak_flops, flops_per_token, param_counts

ZERO_STAGES = (0, 1, 2, 3)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True, kw_only=True)
class BenchSettings:
    dtype: str = "bf16"
    zero_stage: int = 1
    seq_len: int | None = None  # default: a run config's data.seq_len; a preset's max_seq_len, at most 2048
    micro_batch_size: int | None = None  # default: a run config's train.micro_batch_size; 8 for a preset
    steps: int = 20  # measured steps per model
    warmup: int = 3  # unmeasured steps per model first (compilation, allocator, caches)
    compile: bool | None = None  # default: the run config's engine.compile (off for model presets)
    overrides: tuple[str, ...] = ()  # KEY=VALUE on the run config (the variants' levers)
    reference: bool = True  # also Transformers' model (`--ours-only`: not)


def load_run_config(path: str | Path, settings: BenchSettings) -> RunConfig:
    """A model preset (configs/model/*.yaml) on top of the defaults, or a run config as it is; by
    path, or by a packaged config's name (`gpt3-125m` is the run config, `model/gpt3-125m` the preset);
    then `settings.overrides`."""
    path = resolve_config(path)
    if is_model_preset(read_yaml(path)):
        cfg = load_defaults([o for o in settings.overrides if not o.startswith("model.")])
        cfg.model = load_model_config(path, [o for o in settings.overrides if o.startswith("model.")])
        seq_len, micro_batch_size = min(cfg.model.max_seq_len, 2048), 8
    else:
        cfg = load_config(path, settings.overrides)
        seq_len, micro_batch_size = cfg.data.seq_len, cfg.train.micro_batch_size
    seq_len = settings.seq_len if settings.seq_len is not None else seq_len
    if not 1 <= seq_len <= cfg.model.max_seq_len:
        raise UserError(
            f"--seq-len {seq_len} must be in [1, model.max_seq_len={cfg.model.max_seq_len}] for {path}"
        )
    micro_batch_size = settings.micro_batch_size or micro_batch_size
    cfg.data.seq_len = seq_len
    cfg.train = replace(cfg.train, micro_batch_size=micro_batch_size, grad_accum=1, global_batch_size=None)
    cfg.engine.activation_checkpointing = False
    if settings.compile is not None:
        cfg.engine.compile = settings.compile
    return cfg


def deepspeed_json(settings: BenchSettings, micro_batch_size: int, world_size: int, one_read: bool) -> dict:
    """The engine's DeepSpeed JSON; `one_read`: the norm gate decides (DeepSpeed's bf16 overflow
    scan off, as the trainer's `engine.one_host_read`), else DeepSpeed's own checks."""
    ds = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": 1,
        "train_batch_size": micro_batch_size * world_size,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": settings.zero_stage},
        "bf16": {"enabled": settings.dtype == "bf16"},
        "steps_per_print": 10**9,
    }
    if one_read and gated(ds):
        ds["bf16"]["check_grad_overflow"] = False
    return ds


def hf_model(cfg: ModelConfig, ours: torch.nn.Module) -> torch.nn.Module:
    """transformers' Llama with the same configuration and the same weights as `ours`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pretrain.model.hf import llama_config_dict, to_llama_state_dict

    values = llama_config_dict(cfg)
    values.pop("torch_dtype")
    model = LlamaForCausalLM(LlamaConfig(**values, attn_implementation="sdpa"))
    missing, unexpected = model.load_state_dict(to_llama_state_dict(ours), strict=False)
    if unexpected or [name for name in missing if name != "lm_head.weight"]:
        raise RuntimeError(f"weights do not map onto LlamaForCausalLM: {missing} {unexpected}")
    model.config.use_cache = False
    return model


def saved_activation_bytes(forward: Callable[[], torch.Tensor], parameters: list[torch.Tensor]) -> int:
    """Bytes the autograd graph holds for the backward pass after one forward: distinct storages
    saved by any operation, parameters excluded."""
    skip = {p.untyped_storage().data_ptr() for p in parameters}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skip:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = forward()
    del loss
    return sum(storages.values())


def matmul_flops(dtype: torch.dtype, device: torch.device) -> float:
    """FLOP/s of a large square matrix product in `dtype` on `device`, best of a few timings. On a
    CPU, the largest size up to 1024 whose product takes at most 0.05 s (`_cpu_matmul_size`)."""
    n = 8192 if device.type == "cuda" else _cpu_matmul_size(dtype)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        start = time.perf_counter()
        for _ in range(10):
            a @ b
        _sync(device)
        best = min(best, (time.perf_counter() - start) / 10)
    return 2 * n**3 / best


def _cpu_matmul_size(dtype: torch.dtype, most: int = 1024, seconds: float = 0.05) -> int:
    """A CPU without kernels for `dtype` (bf16 on an AMD EPYC whose oneDNN path is AVX2) took 6 s
    for one product of 1024 (under a load of 10 on its 2 cores): the 50 timed products at that
    size made the reference take minutes (and `gpu_check --cpu`'s bench part run out of time).
    Doubling from 128 while a product of the next size takes under `seconds` keeps it to about a
    second there."""
    n = 128
    while n < most:
        a = torch.randn(2 * n, 2 * n).to(dtype)
        a @ a  # (the first product of a size sets up its kernel)
        start = time.perf_counter()
        a @ a
        if time.perf_counter() - start > seconds:
            break
        n *= 2
    return n


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Contender:
    """One model in its DeepSpeed engine, with a step function and its timings."""

    def __init__(self, name: str, engine, loss_of: Callable, batch: torch.Tensor, reads_loss: bool):
        self.name, self.engine, self.loss_of = name, engine, loss_of
        self.inputs, self.targets = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        # ours reads its loss every step as the trainer does, in the step's one read (the norm
        # gate's, inside the optimizer step; without a gate, after it); Transformers' loop reads
        # it at its logging steps only
        self.read, self.reads_loss = step_read(engine), reads_loss
        self.loss: float | None = None  # the last step's, when read
        self.times: list[float] = []  # per step, of each timed block
        self.step_memory: list[int] = []

    def forward(self) -> torch.Tensor:
        return self.loss_of(self.engine, self.inputs, self.targets)

    def step(self) -> torch.Tensor:
        """One optimizer step, nothing synchronized but what the step itself reads; its loss."""
        self.read.begin()
        loss = self.forward()
        self.engine.backward(loss)
        joined = self.read.join(loss) if self.reads_loss else None
        self.engine.step()
        if joined is not None:
            (self.loss,) = self.read.values(joined)
        return loss

    def block(self, steps: int) -> None:
        """`steps` steps timed together, synchronized at both ends only (as a run is): each step's
        time is the block's share; on a GPU also the peak memory above what was resident."""
        device = self.engine.device
        _sync(device)
        if device.type == "cuda":
            resident = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        for _ in range(steps):
            self.step()
        _sync(device)
        self.times.append((time.perf_counter() - start) / steps)
        if device.type == "cuda":
            self.step_memory.append(torch.cuda.max_memory_allocated(device) - resident)


def check_settings(settings: BenchSettings) -> None:
    """Bad input of `bench train` and `bench profile`: one line each."""
    if settings.dtype not in DTYPES:
        raise UserError(f"--dtype {settings.dtype}: use one of {', '.join(DTYPES)}")
    if settings.zero_stage not in ZERO_STAGES:
        raise UserError(f"--zero-stage {settings.zero_stage}: use 0, 1, 2 or 3")
    for name in ("micro_batch_size", "steps"):
        value = getattr(settings, name)
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1")
    if settings.warmup < 0:
        raise UserError("--warmup must be 0 or more")


def what_ran(cfg: RunConfig, settings: BenchSettings, env, device: torch.device) -> dict:
    """The head of a benchmark's JSON object: the device, the world, the settings."""
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "world_size": env.world_size,
        "rank": env.rank,
        "dtype": settings.dtype,
        "zero_stage": settings.zero_stage,
        "compile": cfg.engine.compile,
        "seq_len": cfg.data.seq_len,
        "micro_batch_size": cfg.train.micro_batch_size,
        "steps": settings.steps,
    }


def run(config_path: str | Path, settings: BenchSettings = BenchSettings(), as_json: bool = False) -> dict:
    """Check the input, measure, then print the table (or the JSON object) on rank 0."""
    check_settings(settings)
    cfg = load_run_config(config_path, settings)
    # DeepSpeed logs and prints to stdout (its loggers bind the stream when imported): send all of
    # that to stderr, so that stdout holds only the result.
    with contextlib.redirect_stdout(sys.stderr):
        result = measure(cfg, settings)
    result = {"config": str(config_path), **result}
    if result["rank"] == 0:
        print(json.dumps(result) if as_json else table(result))
    return result


BLOCK = 5  # measured steps timed together: one synchronization per block, none inside
COUNTED = 2  # each model's first steps, whose waits for the device are counted (the last one's kept)


def contenders(cfg: RunConfig, settings: BenchSettings, env, device: torch.device) -> list[Contender]:
    """Ours (the trainer's step: `engine.one_host_read`'s norm gate) and, with `settings.reference`,
    Transformers' Llama in DeepSpeed's own engine settings; the same weights and random batch (made
    on the host from the seed, so a larger micro-batch starts with the same windows)."""
    from pretrain.parallel.engine import initialize
    from pretrain.pretraining import build_model

    torch.manual_seed(cfg.run.seed)
    ours = build_model(cfg)
    hf = hf_model(cfg.model, ours) if settings.reference else None
    shape = (cfg.train.micro_batch_size, cfg.data.seq_len + 1)
    batch = torch.randint(
        0, cfg.model.vocab_size, shape, generator=torch.Generator().manual_seed(cfg.run.seed)
    )
    batch = batch.to(device)
    mb, world = cfg.train.micro_batch_size, env.world_size
    ours_engine, _ = initialize(
        ours, cfg.engine, cfg.optim, deepspeed_json(settings, mb, world, cfg.engine.one_host_read)
    )
    made = [Contender("ours", ours_engine, lambda e, x, y: e(x, y).loss, batch, reads_loss=True)]
    if hf is not None:
        hf_engine, _ = initialize(
            _HFBlocks(hf), cfg.engine, cfg.optim, deepspeed_json(settings, mb, world, False)
        )
        loss_of = lambda e, x, y: e(input_ids=x, labels=y, shift_labels=y).loss  # noqa: E731
        made.append(Contender("hf", hf_engine, loss_of, batch, reads_loss=False))
    return made


def first_steps(models: list[Contender], device: torch.device) -> tuple[dict, dict]:
    """Each model's first COUNTED steps, its waits for the device counted
    (`pretrain/bench/host_syncs.py`, from the first step: it makes the optimizer's state); the
    first step's loss and the last counted step's waits (their call sites), by model."""
    first_losses, sites = {}, {}
    with HostSyncs(device) as syncs:
        for c in models:
            for index in range(COUNTED):
                syncs.new_step()
                loss = c.step()
                syncs.end_step()
                if index == 0:
                    first_losses[c.name] = c.loss if c.reads_loss else loss.item()
            sites[c.name] = syncs.steps[-1]
    return first_losses, sites


def measure(cfg: RunConfig, settings: BenchSettings) -> dict:
    import deepspeed
    import transformers

    from pretrain.parallel.distributed import DistEnv, init_distributed

    env = DistEnv.from_environ()
    init_distributed(env)
    device = torch.device("cuda", env.local_rank) if torch.cuda.is_available() else torch.device("cpu")
    models = contenders(cfg, settings, env, device)
    # Activation memory first, before any step has changed the weights.
    activations = {
        c.name: saved_activation_bytes(c.forward, list(c.engine.module.parameters())) for c in models
    }
    first_losses, sites = first_steps(models, device)
    for _ in range(settings.warmup):
        for c in models:
            c.step()
    for i, size in enumerate(block_sizes(settings.steps)):
        for c in models if i % 2 == 0 else reversed(models):
            c.block(size)
    result: dict = what_ran(cfg, settings, env, device) | {
        "params": param_counts(cfg.model).total,
        "versions": {
            "torch": torch.__version__,
            "deepspeed": deepspeed.__version__,
            "transformers": transformers.__version__,
        },
        "one_host_read": cfg.engine.one_host_read,
        "loss_kernel": cfg.loss.kernel,
        "attention": cfg.engine.attention,
        "compile_head": cfg.engine.compile_head,
        "block_steps": BLOCK,
        "host_syncs_per_step": {name: len(found) for name, found in sites.items()},
        "host_sync_sites": sites,
    }
    return result | figures(cfg, settings, device, models, first_losses, activations)


def block_sizes(steps: int) -> list[int]:
    """`steps` measured steps as blocks of BLOCK (the last one shorter)."""
    return [min(BLOCK, steps - start) for start in range(0, steps, BLOCK)]


def figures(cfg, settings, device, models: list[Contender], first_losses: dict, activations: dict) -> dict:
    """Tokens/s, MFU, losses and memory per model; the ratio of ours to Transformers'."""
    tokens_per_step = cfg.train.micro_batch_size * cfg.data.seq_len  # per rank
    flops = flops_per_token(cfg.model, cfg.data.seq_len).total
    peak = current_device_peak_flops() if settings.dtype == "bf16" else None
    measured = matmul_flops(DTYPES[settings.dtype], device) if settings.reference else None
    result = {"flops_per_token": flops, "nominal_peak_flops": peak, "measured_matmul_flops": measured}
    for c in models:
        step_time = statistics.median(c.times)
        tokens_per_sec = tokens_per_step / step_time  # per rank
        result[f"{c.name}_step_ms"] = step_time * 1000
        result[f"{c.name}_tokens_per_sec"] = tokens_per_sec
        result[f"{c.name}_first_loss"] = first_losses[c.name]
        result[f"{c.name}_activation_bytes"] = activations[c.name]
        result[f"{c.name}_step_peak_memory_bytes"] = max(c.step_memory) if c.step_memory else None
        result[f"{c.name}_mfu"] = tokens_per_sec * flops / peak if peak else None
        result[f"{c.name}_mfu_of_measured_matmul"] = tokens_per_sec * flops / measured if measured else None
    if len(models) > 1:
        result["ratio"] = result["ours_tokens_per_sec"] / result["hf_tokens_per_sec"]
        result["first_loss_difference"] = abs(first_losses["ours"] - first_losses["hf"])
    return result


class _HFBlocks(torch.nn.Module):
    """LlamaForCausalLM seen with a `layers` attribute, so `engine.initialize` compiles (or
    checkpoints) its decoder layers exactly as it does our blocks. Parameter names are unchanged
    below `model.`; nothing is saved from this wrapper."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        self.layers = model.model.layers

    def forward(self, **kwargs):
        return self.model(**kwargs)


def _bytes(value: int | None) -> str:
    return "—" if value is None else f"{value / 2**20:,.0f} MiB"


def _percent(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def table(r: dict) -> str:
    names = ["ours"] + (["hf"] if "hf_tokens_per_sec" in r else [])
    rows = [
        ("tokens/s (per rank)", lambda n: f"{r[f'{n}_tokens_per_sec']:,.0f}"),
        ("step time, median", lambda n: f"{r[f'{n}_step_ms']:,.1f} ms"),
        ("saved activations", lambda n: _bytes(r[f"{n}_activation_bytes"])),
        ("step peak above resident", lambda n: _bytes(r[f"{n}_step_peak_memory_bytes"])),
        ("MFU of nominal peak", lambda n: _percent(r[f"{n}_mfu"])),
        ("MFU of measured matmul", lambda n: _percent(r[f"{n}_mfu_of_measured_matmul"])),
        ("host syncs per step", lambda n: str(r["host_syncs_per_step"][n])),
        ("first-step loss", lambda n: f"{r[f'{n}_first_loss']:.4f}"),
    ]
    zero = f"ZeRO-{r['zero_stage']}"
    lines = [
        f"{r['config']}: {r['params'] / 1e6:.1f}M parameters, {r['micro_batch_size']} x {r['seq_len']} tokens "
        f"per rank x {r['world_size']} rank(s), {r['dtype']}, DeepSpeed {zero}, "
        f"compile {'on' if r['compile'] else 'off'}, {r['steps']} interleaved steps each, on {r['device']}",
        "",
        f"{'':<26}{'ours':>14}" + (f"{'transformers':>16}" if len(names) > 1 else ""),
    ]
    widths = (14, 16)[: len(names)]
    lines += [
        f"{label:<26}" + "".join(f"{cell(n):>{w}}" for n, w in zip(names, widths, strict=True))
        for label, cell in rows
    ]
    peak, measured = r["nominal_peak_flops"], r["measured_matmul_flops"]
    lines.append("")
    if len(names) > 1:
        lines.append(f"ours / transformers: {r['ratio']:.2f}x tokens/s")
    if measured:
        lines.append(
            f"matrix product here: {measured / 1e12:.2f} TFLOP/s {r['dtype']}"
            + (f" (nominal peak {peak / 1e12:.0f})" if peak else "")
        )
    lines.append(
        f"versions: torch {r['versions']['torch']}, deepspeed {r['versions']['deepspeed']}, "
        f"transformers {r['versions']['transformers']}"
    )
    return "\n".join(lines)
