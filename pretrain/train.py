"""The training loop.

    deepspeed [--hostfile H] [--num_gpus N] --module pretrain.train --config CFG [overrides...]
    torchrun --nproc_per_node N -m pretrain.train --config CFG [overrides...]
    pretrain train --config CFG [overrides...]                      (one process)

One function, `train`, reads top to bottom: check the batch arithmetic and the DeepSpeed JSON
(before any process group exists), start the process group, build the model and engine, restore a
checkpoint, then loop: micro-batches → optimizer step → metrics → evaluation → checkpoint. Every
rank runs the same code; rank 0 alone writes logs, TensorBoard and the small JSON files.
SIGTERM/SIGINT: the ranks agree at the next step boundary, save a checkpoint and exit cleanly.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from monitoring.protocol import CONTINUE, Action, StepMetrics
from monitoring.service import append_event
from pretrain import atomic, checkpoint
from pretrain.config import RunConfig, config_hash, load_config, to_yaml
from pretrain.data import BatchLoader, WindowStream, read_manifest
from pretrain.engine import BatchPlan, deepspeed_config, initialize, plan_batches, set_lr, zero_stage
from pretrain.errors import UserError
from pretrain.flops import current_device_peak_flops, flops_per_token, mfu
from pretrain.metrics import MetricsWriter
from pretrain.model import Transformer
from pretrain.monitor_client import MonitorClient
from pretrain.schedules import lr_at
from pretrain.tokenizer import MODEL_FILE


@dataclass
class DistEnv:
    rank: int
    local_rank: int
    world_size: int

    @classmethod
    def from_environ(cls) -> DistEnv:
        """Launchers (deepspeed, torchrun, srun wrappers) set these; one plain process gets defaults."""
        if "WORLD_SIZE" not in os.environ:
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
        return cls(
            int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0")), int(os.environ["WORLD_SIZE"])
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class TrainState:
    """What train_state.json holds besides the data stream's own state."""

    step: int = 0
    tokens: int = 0
    lr_scale: float = 1.0


class StopRequest:
    """SIGTERM/SIGINT set a flag that the ranks agree on at the next step boundary; a second
    SIGINT interrupts at once."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def init_distributed(env: DistEnv) -> None:
    """The process group (NCCL on GPUs, gloo on CPU), for training and fine-tuning alike.

    On CPU, DeepSpeed's shared-memory all-reduce makes a 66 MB /dev/shm/deepspeed_allreduce_buffer_*
    per rank and never unlinks it, so every job leaves them behind until the machine runs out of
    memory. Once every rank has mapped its peers' buffers (they do so while the group starts; the
    barrier waits for all), each rank unlinks its own name: the mappings stay valid, and the memory
    goes when the processes exit, however they exit."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank)
        return
    dist.barrier()
    name = f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR')}_{os.environ.get('MASTER_PORT')}_{env.rank}"
    Path("/dev/shm", name).unlink(missing_ok=True)


def preflight(cfg: RunConfig, world_size: int) -> tuple[BatchPlan, dict, Path]:
    """The checks a job can fail before it starts: batch arithmetic, the DeepSpeed JSON, the data,
    fault ranks. `pretrain launch` runs them too, before it starts the service or any process."""
    plan = plan_batches(cfg.train, cfg.data.seq_len, world_size)
    for key in ("kill", "hang"):
        rank = getattr(cfg.faults, f"{key}_rank")
        if getattr(cfg.faults, f"{key}_step") is not None and rank >= world_size:
            raise UserError(
                f"faults.{key}_rank={rank} but the job has {world_size} rank(s): pick a rank below {world_size}"
            )
    ds_config = deepspeed_config(cfg, plan)
    return plan, ds_config, _check_data(cfg)


def train(cfg: RunConfig) -> dict:
    env = DistEnv.from_environ()
    is_main = env.rank == 0

    # Everything that can be wrong with the input is found here, before any process group starts.
    plan, ds_config, data_dir = preflight(cfg, env.world_size)
    run_dir = Path(cfg.run.dir)
    resume_tag = checkpoint.resolve_resume(run_dir, cfg.checkpoint.resume)
    resume = (
        _read_json(checkpoint.checkpoints_dir(run_dir) / resume_tag / checkpoint.TRAIN_STATE)
        if resume_tag
        else None
    )
    universal = resume is not None and resume["world_size"] != env.world_size
    if universal:
        ds_config["checkpoint"] = {**ds_config.get("checkpoint", {}), "load_universal": True}
    _configure_determinism(cfg.run.deterministic)

    init_distributed(env)
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(cfg.run.seed)
    model = Transformer(cfg.model)
    engine, optimizer = initialize(model, cfg, ds_config)
    device = engine.device

    stream = WindowStream(data_dir, cfg.data.seq_len, env.rank, env.world_size, seed=cfg.run.seed)
    state = TrainState()
    if resume_tag is not None:
        if universal:
            _make_universal(run_dir, resume_tag, is_main)
        load_dir = checkpoint.checkpoints_dir(run_dir) / ("universal" if universal else "")
        engine.load_checkpoint(
            str(load_dir), tag=resume_tag, load_module_strict=True, load_lr_scheduler_states=False
        )
        stream.load_state_dict(resume["data"])
        state = TrainState(step=resume["step"], tokens=resume["tokens"], lr_scale=resume["lr_scale"])
        if not universal:
            _set_rng_state(_read_json(checkpoint.checkpoints_dir(run_dir) / resume_tag / _rng_file(env.rank)))
    loader = BatchLoader(stream, plan.micro_batch_size, device)

    writer = MetricsWriter(run_dir, cfg.train.steps, enabled=is_main, tensorboard=cfg.logging.tensorboard)
    flops = flops_per_token(cfg.model, cfg.data.seq_len).total
    peak = cfg.engine.peak_flops or current_device_peak_flops()
    stop = StopRequest()
    faults = FaultInjector(cfg.faults, run_dir, env.rank)
    client = MonitorClient(run_dir, cfg.monitor.timeout) if cfg.monitor.enabled and is_main else None
    if client is not None:
        writer.band_layout()
    summary = {"world_size": env.world_size, "zero_stage": zero_stage(ds_config), "eval": [], "rollbacks": 0}
    if is_main:
        writer.text("config", "```\n" + to_yaml(cfg) + "\n```", state.step)
        writer.message(
            f"training {cfg.model.preset or 'model'} on {env.world_size} process(es), ZeRO-{zero_stage(ds_config)} bf16: "
            f"global batch {plan.global_batch_size} × {plan.seq_len} tokens, steps {state.step + 1}..{cfg.train.steps}"
            + (f" (resumed from {resume_tag})" if resume_tag else "")
        )

    with contextlib.ExitStack() as stack:
        stack.callback(loader.close)
        stack.callback(writer.close)
        stack.callback(stop.restore)
        data_trace = None
        if cfg.logging.data_trace:
            (run_dir / "data_trace").mkdir(parents=True, exist_ok=True)
            data_trace = stack.enter_context(
                open(run_dir / "data_trace" / f"rank_{env.rank:05d}.jsonl", "a", buffering=1)
            )
        if cfg.eval.every and state.step == 0:  # the baseline every curve starts from
            _log_eval(writer, summary, 0, evaluate(engine, data_dir, cfg, plan, env))
            log_attention_probe(writer, engine, cfg, data_dir, 0, is_main)
        last_saved = state.step
        while state.step < cfg.train.steps:
            started = time.perf_counter()
            step = state.step + 1
            faults.before_step(step)
            lr = lr_at(step, cfg.optim.lr, cfg.train.steps, cfg.schedule, cfg.model.d_model) * state.lr_scale
            set_lr(optimizer, lr)
            want_layer_norms = (
                cfg.logging.layer_grad_norms_every and step % cfg.logging.layer_grad_norms_every == 0
            )
            loss_sum = torch.zeros((), device=device)
            layer_norms = None
            windows: list[int] = []
            for _ in range(plan.grad_accum):
                inputs, targets = next(loader)
                windows += loader.last_windows
                loss = faults.apply(step, engine(inputs, targets).loss)
                engine.backward(loss)
                if want_layer_norms and engine.is_gradient_accumulation_boundary():
                    layer_norms = layer_grad_norms(engine.module)
                engine.step()
                loss_sum += loss.detach().float()
            # One collective per step: the mean loss over ranks, and whether any rank was asked to stop.
            agreed = torch.stack(
                [loss_sum / plan.grad_accum, torch.tensor(float(stop.requested), device=device)]
            )
            dist.all_reduce(agreed)
            train_loss, stop_requested = agreed[0].item() / env.world_size, agreed[1].item() > 0
            stop_requested = stop_requested or step == cfg.train.stop_at_step
            grad_norm = _as_float(engine.get_global_grad_norm())
            state = TrainState(step, state.tokens + plan.tokens_per_step, state.lr_scale)
            step_time = time.perf_counter() - started

            tokens_per_sec = plan.tokens_per_step / step_time
            metrics = {
                "train/loss": train_loss,
                "train/lr": lr,
                "train/grad_norm": grad_norm,
                "train/tokens_per_sec": tokens_per_sec,
                "train/tokens_per_sec_per_device": tokens_per_sec / env.world_size,
                "train/mfu": mfu(tokens_per_sec / env.world_size, flops, peak) if peak else None,
                "train/step_time": step_time,
                "train/memory_gb": _memory_gb(),
                "train/skipped_steps": float(engine.skipped_steps),
                "train/tokens": float(state.tokens),
            }
            if layer_norms:
                metrics |= {f"train/grad_norm/{group}": value for group, value in layer_norms.items()}
            faults.mark_fired(step)
            if data_trace is not None:
                data_trace.write(json.dumps({"step": step, "windows": windows}) + "\n")
            if is_main:
                writer.record(step, metrics)
                if step % cfg.logging.every == 0 or step == cfg.train.steps:
                    writer.scalars(step, metrics)
                    writer.console(step, metrics)

            if cfg.monitor.enabled:
                report = StepMetrics(step, train_loss, grad_norm if grad_norm is not None else float("nan"), lr,
                                     step_time, state.tokens, layer_norms or {}) if is_main else None  # fmt: skip
                action = broadcast_action(client.report(report) if client else None, device)
                if client is not None:
                    writer.scalars(step, {"monitor/grad_norm_threshold": client.band("grad_norm"),
                                          "monitor/loss_threshold": client.band("loss")})  # fmt: skip
                if action.action == "stop":
                    summary["stopped_by_monitor"] = action.reason
                    writer.message(f"monitor: {action.reason}; stopping the job")
                    break
                if action.action == "rollback":
                    writer.scalars(step, {"monitor/rollback": 1.0})
                    writer.text(
                        "monitor/rollbacks",
                        f"step {step}: {action.reason} -> {action.tag}, seed {action.seed}",
                        step,
                    )
                    writer.message(f"monitor: {action.reason} at step {step}: rolling back to {action.tag} "
                                   f"with data seed {action.seed}, lr scale {action.lr_scale:g}")  # fmt: skip
                    state = rollback(engine, loader, run_dir, action)
                    summary["rollbacks"] += 1
                    last_saved = state.step
                    continue

            if cfg.eval.every and (step % cfg.eval.every == 0 or step == cfg.train.steps):
                _log_eval(writer, summary, step, evaluate(engine, data_dir, cfg, plan, env))
                log_attention_probe(writer, engine, cfg, data_dir, step, is_main)

            if step % cfg.checkpoint.every == 0 or step == cfg.train.steps or stop_requested:
                save(engine, cfg, env, state, loader.state_dict(), data_dir)
                last_saved = step
                writer.flush()
            if stop_requested:
                reason = "reached train.stop_at_step" if step == cfg.train.stop_at_step else "stop requested"
                writer.message(f"{reason}: saved {checkpoint.tag_for(step)} and exiting")
                break
        if last_saved != state.step and "stopped_by_monitor" not in summary:
            # (not after a circuit-breaker stop: that state is the one the monitor refused)
            save(engine, cfg, env, state, loader.state_dict(), data_dir)

    summary |= {"step": state.step, "tokens": state.tokens, "completed": state.step >= cfg.train.steps}
    if is_main:
        atomic.write_json(run_dir / "train_summary.json", summary)
        if summary["completed"]:
            writer.message(f"done: {state.step} steps, {state.tokens:,} tokens; run directory {run_dir}")
    dist.barrier()
    return summary


# --------------------------------------------------------------------------- pieces of the loop


ACTION_CODES = {"continue": 0, "rollback": 1, "stop": 2}


def broadcast_action(action: Action | None, device) -> Action:
    """Rank 0's action to every rank, as four numbers: (kind, target step, seed, lr scale)."""
    packed = torch.zeros(4, dtype=torch.float64, device=device)
    if action is not None:
        target = checkpoint.step_of(action.tag) if action.tag else 0
        packed = torch.tensor(
            [ACTION_CODES[action.action], target, action.seed or 0, action.lr_scale],
            dtype=torch.float64,
            device=device,
        )
    dist.broadcast(packed, src=0)
    kind = {v: k for k, v in ACTION_CODES.items()}[int(packed[0].item())]
    if kind == "rollback":
        return Action("rollback", tag=checkpoint.tag_for(int(packed[1].item())), seed=int(packed[2].item()),
                      lr_scale=float(packed[3].item()), reason=action.reason if action else None)  # fmt: skip
    if kind == "stop":
        return Action("stop", reason=(action.reason if action else None) or "stopped by the monitor")
    return CONTINUE


def rollback(engine, loader: BatchLoader, run_dir: Path, action: Action) -> TrainState:
    """Every rank: load the target checkpoint, put the data stream at its position, reshuffle the
    rest of the epoch with the new seed, and carry on with the scaled learning rate."""
    root = checkpoint.checkpoints_dir(run_dir)
    loader.close()
    engine.load_checkpoint(str(root), tag=action.tag, load_module_strict=True, load_lr_scheduler_states=False)
    saved = _read_json(root / action.tag / checkpoint.TRAIN_STATE)
    digest = params_digest(engine)
    dist.barrier()  # every rank has read the target before newer checkpoints move away
    if dist.get_rank() == 0:
        abandoned = checkpoint.abandon_after(run_dir, saved["step"])
        append_event(run_dir, {"type": "rollback_applied", "step": saved["step"], "tag": action.tag, "seed": action.seed,
                               "params_sha256": digest, "matches_checkpoint": digest == saved.get("params_sha256"),
                               "abandoned": abandoned})  # fmt: skip
    loader.load_state_dict(saved["data"])
    loader.reshuffle(action.seed)
    return TrainState(step=saved["step"], tokens=saved["tokens"], lr_scale=action.lr_scale)


def params_digest(engine) -> str | None:
    """sha256 of the model's parameters as every rank holds them (not under ZeRO-3, which shards them)."""
    if engine.zero_optimization_stage() >= 3:
        return None
    import hashlib

    digest = hashlib.sha256()
    for name, param in engine.module.named_parameters():
        digest.update(name.encode())
        digest.update(param.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()


class FaultInjector:
    """`faults.*`: scale the loss (and so the gradients) or make it NaN at given steps, kill or hang
    a rank at a step. Each fault fires once: the faults fired ("spike:10", "kill:7", ...) are kept
    in RUN_DIR/faults_fired.json across rollbacks and restarts, so the same step then runs clean.
    Every rank keeps the same set; rank 0 writes it, or the rank about to be killed or hung."""

    def __init__(self, faults, run_dir: Path, rank: int):
        self.faults, self.rank = faults, rank
        self.path = run_dir / "faults_fired.json"
        self.fired = set(json.loads(self.path.read_text())) if self.path.exists() else set()

    def _pending(self, kind: str, step: int) -> bool:
        return f"{kind}:{step}" not in self.fired

    def _loss_fault(self, step: int) -> str | None:
        if step in self.faults.nan_steps and self._pending("nan", step):
            return "nan"
        if step in self.faults.spike_steps and self._pending("spike", step):
            return "spike"
        return None

    def before_step(self, step: int) -> None:
        """Kill or hang `faults.kill_rank` / `faults.hang_rank` as step `step` begins."""
        for kind, at, rank in (
            ("kill", self.faults.kill_step, self.faults.kill_rank),
            ("hang", self.faults.hang_step, self.faults.hang_rank),
        ):
            if at != step or not self._pending(kind, step):
                continue
            self.fired.add(f"{kind}:{step}")
            if self.rank != rank:
                continue
            atomic.write_json(self.path, sorted(self.fired))
            print(f"faults: {kind} rank {rank} at step {step}", file=sys.stderr, flush=True)
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            while True:  # hung: alive, but never reaching the next collective
                time.sleep(3600)

    def apply(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        kind = self._loss_fault(step)
        if kind == "nan":
            return loss * float("nan")
        return loss * self.faults.spike_factor if kind == "spike" else loss

    def mark_fired(self, step: int) -> None:
        kind = self._loss_fault(step)
        if kind is not None:
            self.fired.add(f"{kind}:{step}")
            if self.rank == 0:
                atomic.write_json(self.path, sorted(self.fired))


def layer_grad_norms(module: torch.nn.Module) -> dict[str, float]:
    """Gradient norm per layer group (embeddings, layers.N, head); works under every ZeRO stage
    (a collective under ZeRO-3, so every rank calls it)."""
    from deepspeed.utils import safe_get_full_grad

    squares: dict[str, float] = defaultdict(float)
    for name, param in module.named_parameters():
        grad = safe_get_full_grad(param)
        if grad is None:
            continue
        if name.startswith("layers."):
            group = ".".join(name.split(".")[:2])
        elif "embeddings" in name:
            group = "embeddings"
        else:
            group = "head"
        squares[group] += grad.float().pow(2).sum().item()
    return {group: math.sqrt(value) for group, value in squares.items()}


@torch.no_grad()
def evaluate(engine, data_dir: Path, cfg: RunConfig, plan: BatchPlan, env: DistEnv) -> float:
    """Mean loss over the first eval.batches micro-batches of every rank's validation share."""
    stream = WindowStream(data_dir, cfg.data.seq_len, env.rank, env.world_size, split="validation")
    loader = BatchLoader(stream, plan.micro_batch_size, engine.device)
    engine.eval()
    totals = torch.zeros(2, device=engine.device)  # loss sum, batches
    try:
        for batch_index, (inputs, targets) in enumerate(loader):
            if batch_index == cfg.eval.batches:
                break
            totals += torch.stack(
                [engine(inputs, targets).loss.float(), torch.ones((), device=engine.device)]
            )
    finally:
        loader.close()
        engine.train()
    dist.all_reduce(totals)
    if totals[1].item() == 0:
        raise UserError(
            f"the validation split of {data_dir} has fewer than train.micro_batch_size={plan.micro_batch_size} "
            "windows per rank: prepare with a larger --val-fraction, or set eval.every=0"
        )
    return (totals[0] / totals[1]).item()


def log_attention_probe(
    writer: MetricsWriter, engine, cfg: RunConfig, data_dir: Path, step: int, is_main: bool
) -> None:
    """`eval.attention_probe`: every rank runs the forward (ZeRO-3 gathers parameters collectively);
    rank 0 draws the (layers × heads) grid into TensorBoard as `attention/probe`."""
    if not cfg.eval.attention_probe:
        return
    from pretrain.attention import attention_maps, grid_image, piece_labels
    from pretrain.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(data_dir / MODEL_FILE)
    ids = [tokenizer.eos_id, *tokenizer.encode(cfg.eval.attention_probe)][: cfg.model.max_seq_len]
    maps = attention_maps(engine.module, ids)
    if is_main and writer.writer is not None:
        image = grid_image(maps, piece_labels(tokenizer, ids), f"step {step}")
        writer.writer.add_image("attention/probe", image, step, dataformats="HWC")


def _log_eval(writer: MetricsWriter, summary: dict, step: int, loss: float) -> None:
    perplexity = math.exp(min(loss, 50.0))
    summary["eval"].append({"step": step, "loss": loss})
    writer.scalars(step, {"eval/loss": loss, "eval/perplexity": perplexity})
    writer.message(f"eval at step {step}: loss {loss:.4f}, perplexity {perplexity:.2f}")


def save(engine, cfg: RunConfig, env: DistEnv, state: TrainState, data_state: dict, data_dir: Path) -> str:
    """A pretraining checkpoint: DeepSpeed's files, train_state.json, run_config.json, the tokenizer."""
    train_state = asdict(state) | {
        "data": data_state,
        "world_size": env.world_size,
        "config_hash": config_hash(cfg),
    }
    return write_checkpoint(engine, Path(cfg.run.dir), state.step, env, train_state, asdict(cfg),
                            data_dir / MODEL_FILE, cfg.checkpoint.keep)  # fmt: skip


def write_checkpoint(
    engine,
    run_dir: Path,
    step: int,
    env: DistEnv,
    train_state: dict,
    run_config: dict,
    tokenizer: Path,
    keep: int,
) -> str:
    """Every rank writes its part; rank 0 then marks the checkpoint complete, moves `latest`, and
    applies retention. Shared by pretraining and fine-tuning."""
    from deepspeed.checkpoint.constants import (
        UNIVERSAL_CHECKPOINT_INFO,
        UNIVERSAL_CHECKPOINT_VERSION_KEY,
        UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    )

    root = checkpoint.checkpoints_dir(run_dir)
    tag = checkpoint.tag_for(step)
    directory = root / tag
    if env.rank == 0 and directory.exists():  # left by an earlier attempt that did not finish
        shutil.rmtree(directory)
    dist.barrier()
    client_state = {
        UNIVERSAL_CHECKPOINT_INFO: {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}
    }
    engine.save_checkpoint(str(root), tag=tag, client_state=client_state, save_latest=False)
    digest = params_digest(engine)
    atomic.write_json(directory / _rng_file(env.rank), _rng_state())
    if env.rank == 0:
        atomic.write_json(directory / checkpoint.TRAIN_STATE, train_state | {"params_sha256": digest})
        atomic.write_json(directory / checkpoint.RUN_CONFIG, run_config)
        shutil.copyfile(tokenizer, directory / MODEL_FILE)
    dist.barrier()  # every rank has finished writing
    if env.rank == 0:
        checkpoint.mark_complete(directory, {"tag": tag, "step": step, "world_size": env.world_size})
        checkpoint.set_latest(run_dir, tag)
        checkpoint.apply_retention(run_dir, keep)
    dist.barrier()
    return tag


def _make_universal(run_dir: Path, tag: str, is_main: bool) -> None:
    """Convert a checkpoint to DeepSpeed's universal format (world-size independent) once."""
    source = checkpoint.checkpoints_dir(run_dir) / tag
    target = checkpoint.checkpoints_dir(run_dir) / "universal" / tag
    if is_main and checkpoint.check_complete(target, verify_hashes=False) is not None:
        shutil.rmtree(target, ignore_errors=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            str(source),
            "--output_folder",
            str(target),
            "--num_extract_workers",
            "1",
            "--num_merge_workers",
            "1",
        ]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(
                f"converting {source} to a universal checkpoint failed:\n{result.stderr[-2000:]}"
            )
        checkpoint.mark_complete(target, {"tag": tag, "universal": True})
    dist.barrier()


def _check_data(cfg: RunConfig) -> Path:
    if cfg.data.dir is None:
        raise UserError(
            "data.dir is not set: prepare a corpus with `pretrain data prepare` and pass data.dir=DIR"
        )
    data_dir = Path(cfg.data.dir)
    manifest = read_manifest(data_dir)
    vocab = manifest["tokenizer"]["vocab_size"]
    if vocab > cfg.model.vocab_size:
        raise UserError(
            f"the data in {data_dir} uses a tokenizer of {vocab} pieces but model.vocab_size={cfg.model.vocab_size}: "
            f"set model.vocab_size={vocab}"
        )
    return data_dir


def _configure_determinism(deterministic: bool) -> None:
    if not deterministic:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=torch.cuda.is_available())
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def _rng_file(rank: int) -> str:
    return f"rng_rank_{rank:05d}.json"


def _rng_state() -> dict:
    encode = lambda t: base64.b64encode(t.numpy().tobytes()).decode()  # noqa: E731
    state = {"python": random.getstate(), "numpy": _numpy_state(), "torch": encode(torch.get_rng_state())}
    if torch.cuda.is_available():
        state["cuda"] = encode(torch.cuda.get_rng_state())
    return json.loads(json.dumps(state))


def _numpy_state() -> list:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return [kind, keys.tolist(), pos, has_gauss, cached]


def _set_rng_state(state: dict) -> None:
    decode = lambda s: torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)  # noqa: E731
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(decode(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(decode(state["cuda"]))


def _memory_gb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import psutil

    return psutil.Process().memory_info().rss / 2**30


def _as_float(value) -> float | None:
    if value is None:
        return None
    return float(value.item() if hasattr(value, "item") else value)


def _read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


# --------------------------------------------------------------------------- entry point


def entry_point(prog: str, description: str, config_help: str, run, argv: list[str] | None = None) -> int:
    """The command line every launcher calls (`--config CFG [overrides...]`; launchers may add
    --local_rank). `run(config_path, overrides)` returns the exit status; bad input is one line
    from rank 0 and status 2 (`--debug`: the traceback)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", required=True, help=config_help)
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.micro_batch_size=4")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--debug", action="store_true", help="show tracebacks for bad input")
    args = parser.parse_args(argv)
    try:
        return run(args.config, args.overrides)
    except UserError as exc:
        if args.debug:
            raise
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"pretrain: error: {exc}", file=sys.stderr)
        return 2


def _train_command(config: str, overrides: list[str]) -> int:
    summary = train(load_config(config, overrides))
    if summary.get("stopped_by_monitor"):
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"pretrain: stopped by the monitor: {summary['stopped_by_monitor']}", file=sys.stderr)
        return 3  # not a crash: the supervisor does not restart it
    return 0


def main(argv: list[str] | None = None) -> int:
    return entry_point("pretrain.train", "Train under DeepSpeed (see module docstring).",
                       "run config (configs/train/*.yaml)", _train_command, argv)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
