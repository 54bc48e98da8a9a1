"""Pretraining: a run config from its checks to the last step.

`preflight` finds what can be wrong with the input before any process group starts (`pretrain
launch` runs it too, before it starts the service or any process); `pretrain` gives the run's
lifecycle (`pretrain/run_builder.py`: the run directory, the process group, the checkpoint to
resume from and its restore, the engine, the trainer) what is pretraining's own (`run_plan`): its
identity, the model, the `LanguageModeling` task, the step hooks and the first line.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch

from pretrain.checkpoint import resolve_resume
from pretrain.config import ModelConfig, RunConfig
from pretrain.data import BatchLoader, MixtureStream, WindowStream, read_manifest
from pretrain.data.loader import document_ids
from pretrain.data.provenance import Provenance, documents_or_reason
from pretrain.data.shards import fingerprint, split_windows
from pretrain.data.views import local_sources
from pretrain.errors import UserError
from pretrain.evaluation.held_out import attention_probe, continuations, validation_loss
from pretrain.initial_model import InitialModel, find_initial
from pretrain.model.loss import usable_kernel
from pretrain.model.transformer import Transformer
from pretrain.monitor_link import MonitorLink
from pretrain.optim.schedules import schedule_for
from pretrain.parallel.distributed import DistEnv
from pretrain.parallel.engine import BatchPlan, check_zero3_buckets, deepspeed_config, plan_batches
from pretrain.parallel.sequence import SequenceShard
from pretrain.planning.flops import describe_model, flops_per_token, largest_parameter
from pretrain.reporting.wandb_sink import check_available
from pretrain.run_builder import RunParts, RunPlan, run
from pretrain.run_dir import has_checkpoints, model_identity
from pretrain.stability.faults import FaultInjector
from pretrain.stability.replay import FaultCounts
from pretrain.stability.skip_step import SkipGuard
from pretrain.tokenizer import Tokenizer, check_beside, load_run_tokenizer, run_special_tokens, run_tokenizer
from pretrain.train.hooks import DataTrace, InjectedFaults, StepHook
from pretrain.train.loop import Cadence
from pretrain.train.machine_faults import FaultLedger
from pretrain.train.moe_hook import expert_balance
from pretrain.train.monitor_hook import Monitored
from pretrain.train.move_off import HostMoves
from pretrain.train.precursor_hook import InstabilityPrecursors
from pretrain.train.replay_hook import ReplayCheck
from pretrain.train.replica_hook import ReplicaCheck
from pretrain.train.rollback import Rollbacks
from pretrain.train.skip_hook import SkipBadUpdates
from pretrain.train.straggler_hook import StragglerRule, StragglerWatch


@dataclass(frozen=True)
class PreflightResult:
    """What `preflight` found: the batch plan, the DeepSpeed JSON, the data and the run's identity."""

    plan: BatchPlan
    ds_config: dict
    data_dir: Path  # the first corpus: its tokenizer is every corpus's
    identity: dict  # what defines the run (RUN_DIR/run.json): architecture, tokenizer, data, seq_len
    initial: InitialModel | None = None  # checkpoint.init: the weights the run starts from


def preflight(cfg: RunConfig, world_size: int) -> PreflightResult:
    """The checks a job can fail before it starts: batch arithmetic, the DeepSpeed JSON, the data,
    fault ranks, the checkpoint `checkpoint.resume` names, the one `checkpoint.init` names (its
    model and tokenizer against the run's), the W&B package when W&B is on."""
    check_available(cfg.logging.wandb)  # every rank, before any process group
    check_sequence_parallel(cfg, world_size)
    check_experts(cfg)
    plan = plan_batches(cfg.train, cfg.data.seq_len, world_size, cfg.parallel.sequence, cfg.parallel.expert)
    for key, step in (
        ("kill", "kill_step"),
        ("hang", "hang_step"),
        ("slow", "slow_from_step"),
        ("flip", "flip_step"),
    ):
        rank = getattr(cfg.faults, f"{key}_rank")
        if getattr(cfg.faults, step) is not None and rank >= world_size:
            raise UserError(
                f"faults.{key}_rank={rank} but the job has {world_size} rank(s): pick a rank below {world_size}"
            )
    ds_config = deepspeed_config(cfg.engine, cfg.train.grad_clip, plan, cfg.optim)
    check_zero3_buckets(ds_config, largest_parameter(cfg.model))
    manifests = check_data(cfg, plan.world_size)  # (windows are read per data-parallel rank)
    resolve_resume(cfg.run.dir, cfg.checkpoint.resume)
    tokenizer_sha256 = manifests[0]["tokenizer"]["sha256"]
    identity = model_identity(cfg.model) | {
        "tokenizer.sha256": tokenizer_sha256,
        "data.fingerprint": data_fingerprint(cfg, manifests),
        "data.seq_len": cfg.data.seq_len,
    }
    initial = check_init_unless_resuming(cfg, tokenizer_sha256)
    return PreflightResult(plan, ds_config, local_sources(cfg.data)[0][1], identity, initial)


def check_init_unless_resuming(cfg: RunConfig, tokenizer_sha256: str) -> InitialModel | None:
    """`check_init`; but a run that will resume from checkpoints of its own does not read
    checkpoint.init's weights, so there a problem with them (moved, deleted) is a note, not an
    error (`first_model` refuses the run if it has no checkpoint to resume from after all)."""
    try:
        return check_init(cfg, tokenizer_sha256)
    except UserError as problem:
        if cfg.checkpoint.resume == "fresh" or not has_checkpoints(cfg.run.dir):
            raise
        print(f"note: {problem}; the run resumes from its own checkpoints, which do not need it", flush=True)
        return None


# What a run may change in the model it starts from (checkpoint.init): its context. Every other
# field decides the weights' shapes or what they compute (preset, init_std and ffn_multiple_of
# decide neither: d_ff is compared itself).
CONTEXT_FIELDS = ("max_seq_len", "rope_theta", "rope_scaling")
NOT_ARCHITECTURE = ("preset", "init_std", "ffn_multiple_of")


def init_mismatch(initial: ModelConfig, model: ModelConfig) -> str | None:
    """Why the weights of `initial` cannot start a run of `model`, or None when they can."""
    differing = [
        f"model.{f.name} {getattr(initial, f.name)!r} → {getattr(model, f.name)!r}"
        for f in fields(ModelConfig)
        if f.name not in CONTEXT_FIELDS + NOT_ARCHITECTURE
        and getattr(initial, f.name) != getattr(model, f.name)
    ]
    if model.positions == "learned" and initial.max_seq_len != model.max_seq_len:
        differing.append(
            f"model.max_seq_len {initial.max_seq_len} → {model.max_seq_len} with learned positions (one weight per position)"
        )
    if not differing:
        return None
    return (
        f"its model differs from this run's in shape or kind ({'; '.join(differing)}): only model.max_seq_len, "
        "model.rope_theta and model.rope_scaling may change; set the others as the checkpoint has them"
    )


def check_init(cfg: RunConfig, tokenizer_sha256: str) -> InitialModel | None:
    """`checkpoint.init`, before any process group and without reading its weights: a checkpoint
    (or Hugging Face directory) whose model has this run's shapes and whose tokenizer made the data."""
    if cfg.checkpoint.init is None:
        return None
    initial = find_initial(cfg.checkpoint.init)
    problem = init_mismatch(initial.model_cfg, cfg.model)
    if problem is not None:
        raise UserError(f"checkpoint.init={cfg.checkpoint.init}: {problem}")
    if initial.tokenizer.sha256 != tokenizer_sha256:
        raise UserError(
            f"checkpoint.init={cfg.checkpoint.init}: its tokenizer ({initial.tokenizer.path}) is not the one the "
            "data was prepared with: prepare the data with the model's tokenizer (`pretrain data prepare --tokenizer`)"
        )
    return initial


def check_sequence_parallel(cfg: RunConfig, world_size: int) -> None:
    """`parallel.sequence` against the job (the model and the window are the config's own checks)."""
    S = cfg.parallel.sequence
    if S == 1:
        return
    if world_size % S:
        raise UserError(
            f"parallel.sequence={S} but the job has {world_size} process(es): each window is shared by "
            f"{S} ranks, so run a multiple of {S} processes or set parallel.sequence to a divisor of {world_size}"
        )
    if cfg.engine.compile:
        raise UserError(
            f"engine.compile=true with parallel.sequence={S}: compiled blocks around DeepSpeed's "
            "all-to-all are not proven here; set engine.compile=false"
        )


def check_experts(cfg: RunConfig) -> None:
    """What `model.moe` and `parallel.expert` need of the engine and the optimizer (the model's own
    checks are the config's; ZeRO's are the DeepSpeed JSON's, `engine.check_expert_parallel_zero`)."""
    if cfg.model.moe is None:
        return
    if cfg.engine.compile:
        raise UserError(
            "engine.compile=true with model.moe: the routed blocks' shapes depend on the routing and are "
            "not compiled here; set engine.compile=false"
        )
    if cfg.parallel.expert > 1 and cfg.optim.name == "muon":
        raise UserError(
            f"optim.name=muon with parallel.expert={cfg.parallel.expert}: Muon over experts split across "
            "ranks is not proven here; use optim.name=adamw or parallel.expert=1"
        )


def data_fingerprint(cfg: RunConfig, manifests: list[dict]) -> str:
    """The corpus's fingerprint; for a mixture, a digest of its sources' names and fingerprints
    (not their weights: a run may change them when it resumes)."""
    if len(manifests) == 1:
        return fingerprint(manifests[0])
    parts = [
        f"{name}:{fingerprint(m)}" for (name, _, _), m in zip(cfg.data.sources(), manifests, strict=True)
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def check_data(cfg: RunConfig, world_size: int) -> list[dict]:
    """Each prepared corpus, before it is trusted: its manifest, its tokenizer's sha256 (the same
    for all), every shard's size, and enough windows in each split the run reads for every rank."""
    sources = local_sources(cfg.data)  # (a URL: its local view in data.cache_dir)
    if not sources:
        raise UserError(
            "data.dir is not set: prepare a corpus with `pretrain data prepare` and pass data.dir=DIR "
            "(or name several in data.mixture)"
        )
    manifests = []
    for _, directory, _ in sources:
        data_dir = Path(directory)
        manifest = read_manifest(data_dir)
        vocab = manifest["tokenizer"]["vocab_size"]
        if vocab > cfg.model.vocab_size:
            raise UserError(
                f"the data in {data_dir} uses a tokenizer of {vocab} pieces but model.vocab_size={cfg.model.vocab_size}: "
                f"set model.vocab_size={vocab}"
            )
        check_beside(data_dir, manifest, cfg.data.tokenizer)  # data.tokenizer, or the one beside the shards
        if cfg.eval.every > 0:  # each corpus is evaluated on its own
            check_windows(
                cfg,
                "validation",
                data_dir,
                split_windows(manifest, "validation", cfg.data.seq_len),
                world_size,
                manifest.get("val_fraction"),
            )
            WindowStream(data_dir, cfg.data.seq_len, 0, world_size, split="validation")  # shard sizes
        manifests.append(manifest)
    MixtureStream(sources, cfg.data.seq_len)  # one tokenizer for all, names and weights
    train = sum(split_windows(m, "train", cfg.data.seq_len) for m in manifests)  # the mixture's windows
    check_windows(cfg, "train", Path(sources[0][1]) if len(sources) == 1 else None, train, world_size)
    for _, directory, _ in sources:
        WindowStream(directory, cfg.data.seq_len, 0, world_size, split="train")
    return manifests


def check_windows(
    cfg: RunConfig,
    split: str,
    data_dir: Path | None,
    windows: int,
    world_size: int,
    val_fraction: float | None = None,
) -> None:
    """At least one micro-batch of `split` per rank. Training serves windows round-robin to the
    ranks; fewer per rank than a micro-batch would put a window twice into one step. The evaluation
    reads min(eval.batches, windows per rank // micro-batch) micro-batches on each rank: none is a
    failure at the first evaluation (after the job has started), fewer than eval.batches is not."""
    seq_len, micro = cfg.data.seq_len, cfg.train.micro_batch_size
    per_rank = windows // world_size
    if per_rank >= micro:
        return
    where = (
        f"the {split} split of {data_dir} gives"
        if data_dir is not None
        else f"the mixture's {split} splits give"
    )
    has = (
        f"{where} {per_rank} window(s) of {seq_len + 1} tokens per rank at data.seq_len={seq_len} "
        f"({windows} over {world_size} rank(s))"
    )
    if split == "train":
        raise UserError(
            f"{has}, fewer than one micro-batch (train.micro_batch_size={micro}): "
            "lower data.seq_len or train.micro_batch_size, or add data"
        )
    share = f" (this one was prepared with {val_fraction})" if val_fraction is not None else ""
    raise UserError(
        f"{has}, fewer than the {micro} of one evaluation micro-batch (train.micro_batch_size): lower "
        f"data.seq_len or train.micro_batch_size, prepare with a larger --val-fraction{share}, or set eval.every=0"
    )


class LanguageModeling:
    """Next-token prediction on windows of the token stream (one corpus or a weighted mixture);
    held-out loss (per corpus of a mixture) and the attention probe."""

    def __init__(self, cfg: RunConfig, data_dir: Path, plan: BatchPlan, env: DistEnv, device):
        self.data_dir, self.seq_len, self.env, self.run_dir = data_dir, cfg.data.seq_len, env, cfg.run.dir
        self.micro_batch_size, self.eval_batches = plan.micro_batch_size, cfg.eval.batches
        self.grad_accum = plan.grad_accum
        # parallel.sequence: the group's ranks read the same windows, each keeping its shard
        self.shard = SequenceShard.of(env.rank, env.world_size, plan.sequence_parallel)
        self.evaluates = cfg.eval.every > 0
        self.probe_text, self.max_seq_len = cfg.eval.attention_probe, cfg.model.max_seq_len
        self.sampling = cfg.eval
        self.named_tokenizer = cfg.data.tokenizer
        self.sources = local_sources(cfg.data)
        stream = MixtureStream(
            self.sources, cfg.data.seq_len, self.shard.data_rank, self.shard.data_world, seed=cfg.run.seed
        )
        self.loader = BatchLoader(stream, plan.micro_batch_size, device)
        # document masking: attention within each document; ids computed from EOS positions
        self.eos_id = read_manifest(data_dir)["tokenizer"]["eos_id"] if cfg.data.document_masking else None

    def next_batch(self) -> dict[str, torch.Tensor]:
        inputs, targets = next(self.loader)
        batch = {"tokens": inputs, "targets": targets}
        if self.eos_id is not None:
            batch["document_ids"] = document_ids(inputs, self.eos_id)
        return self.shard.split(batch)

    def last_batch_ids(self) -> list:
        return list(self.loader.last_windows)

    def scalars(self) -> dict[str, float]:
        """Tokens consumed per corpus of a mixture (all ranks, as of the last batch handed out)."""
        if len(self.sources) == 1:
            return {}
        state = self.loader.state_dict()["sources"]
        return {
            f"train/tokens/{name}": float(state[name]["served"] * self.seq_len) for name, _, _ in self.sources
        }

    def windows_of(self, state: dict) -> list[tuple[int, int]]:
        stream = MixtureStream(self.sources, self.seq_len, seed=0)  # (the seed comes from the state)
        stream.load_state_dict(state)
        return stream.windows(self.micro_batch_size * self.grad_accum * self.shard.data_world)

    def evidence(self, windows: list[int]) -> dict:
        return {"windows": windows} | documents_or_reason(self._provenance, windows)

    def quarantine(self, entries: list[tuple[int, int]]) -> None:
        self.loader.quarantine(entries)

    @functools.cached_property
    def _provenance(self) -> Provenance:
        return Provenance(self.sources, self.seq_len)

    def evaluate(self, engine) -> dict[str, float]:
        """The held-out loss; for a mixture, per corpus (`loss/NAME`) and their weighted mean."""
        losses = {
            name: validation_loss(
                engine,
                Path(directory),
                self.seq_len,
                self.micro_batch_size,
                self.eval_batches,
                self.env,
                self.eos_id,
                self.shard,
            )["loss"]
            for name, directory, _ in self.sources
        }
        total = sum(weight for _, _, weight in self.sources)
        loss = sum(losses[name] * weight / total for name, _, weight in self.sources)
        results = {"loss": loss, "perplexity": math.exp(min(loss, 50.0))}
        if len(self.sources) > 1:
            results |= {f"loss/{name}": value for name, value in losses.items()}
        return results

    def probe(self, engine, step: int) -> np.ndarray | None:
        if not self.probe_text:
            return None
        return attention_probe(
            engine, self._tokenizer, self.probe_text, self.max_seq_len, step, self.env.is_main
        )

    def samples(self, engine, step: int) -> list[tuple[str, str]]:
        prompts = self.sampling.sample_prompts
        if not prompts:
            return []
        texts = continuations(
            engine,
            self._tokenizer,
            prompts,
            self.sampling.sample_tokens,
            self.sampling.sample_temperature,
            step,
        )
        return list(zip(prompts, texts, strict=True))

    @functools.cached_property
    def _tokenizer(self) -> Tokenizer:
        return load_run_tokenizer(self.named_tokenizer, self.data_dir)

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)

    def reshuffle(self, seed: int) -> None:
        self.loader.reshuffle(seed)

    def close(self) -> None:
        self.loader.close()

    def pause(self) -> None:
        """Before a rollback: stop prefetching; the stream stays at the last batch handed out."""
        self.loader.close()

    def finish(self, summary: dict) -> str | None:
        if not summary["completed"]:
            return None
        return f"done: {summary['step']} steps, {summary['tokens']:,} tokens; run directory {self.run_dir}"


def first_model(cfg: RunConfig, initial: InitialModel | None) -> Transformer:
    """The model of a run's first start: from checkpoint.init's weights where it names them."""
    if cfg.checkpoint.init is not None and initial is None:
        raise UserError(
            f"checkpoint.init={cfg.checkpoint.init} could not be read (above) and {cfg.run.dir} has no "
            "intact checkpoint to resume from: restore it, or start with checkpoint.init=null"
        )
    return build_model(cfg, initial)


def build_model(cfg: RunConfig, initial: InitialModel | None = None) -> Transformer:
    """The model pretraining trains: `cfg.model`, with the objective's z-loss coefficient
    (`loss.z_loss`, added to the loss in training mode only; evaluation reports plain cross-entropy)
    and the loss's kernel (`loss.kernel`, as it can run here: `usable_kernel`); randomly
    initialized, or with the weights of `checkpoint.init` (`initial`)."""
    model = Transformer(cfg.model) if initial is None else initial.load_model(cfg.model)
    model.z_loss = cfg.loss.z_loss
    model.loss_kernel, _ = usable_kernel(cfg.loss.kernel)
    return model


def pretrain(cfg: RunConfig) -> dict:
    """Train as `cfg` says, on every rank the launcher started; returns the run's summary."""
    return run(cfg.run.dir, functools.partial(run_plan, cfg))


def run_plan(cfg: RunConfig, env: DistEnv) -> RunPlan:
    """Pretraining's part of the lifecycle: its checks (all bad input is found here), identity,
    model, schedule, the `LanguageModeling` task, its step hooks and its first line."""
    checked = preflight(cfg, env.world_size)
    tokenizer = run_tokenizer(cfg.data.tokenizer, checked.data_dir)
    cadence = Cadence.of(cfg, cfg.train.steps, cfg.train.stop_at_step)
    return RunPlan(
        config=cfg,
        steps=cfg.train.steps,
        identity=checked.identity,
        ds_config=checked.ds_config,
        batches=checked.plan,
        cadence=cadence,
        lr_at=schedule_for(cfg.optim.lr, cfg.train.steps, cfg.schedule, cfg.model.d_model),
        tokenizer=tokenizer,
        special_tokens=run_special_tokens(tokenizer, checked.data_dir),
        faults=cfg.faults,
        flops_per_token=flops_per_token(cfg.model, cfg.data.seq_len).total,
        make_model=functools.partial(first_model, cfg, checked.initial),
        make_resumed_model=functools.partial(build_model, cfg),  # (its checkpoint's weights replace these)
        make_task=lambda env, engine: LanguageModeling(
            cfg, checked.data_dir, checked.plan, env, engine.device
        ),
        make_hooks=functools.partial(step_hooks, cfg, cadence),
        first_lines=lambda parts: [first_line(cfg, checked.plan, parts, checked.initial)],
    )


def first_line(cfg: RunConfig, plan: BatchPlan, parts: RunParts, initial: InitialModel | None = None) -> str:
    """What trains on what, and from which step (and which weights)."""
    start = ""
    if parts.resume:
        start = f" (resumed from {parts.resume.tag})"
    elif initial is not None:
        start = f" (weights from {initial.source}, checkpoint.init)"
    _, fallback = usable_kernel(cfg.loss.kernel)
    return (
        f"training {describe_model(cfg.model)} on {parts.env.world_size} process(es), ZeRO-{parts.zero} bf16"
        + (f", sequence parallel {plan.sequence_parallel}" if plan.sequence_parallel > 1 else "")
        + ": "
        f"global batch {plan.global_batch_size} × {plan.seq_len} tokens, steps {parts.state.step + 1}..{cfg.train.steps}"
        + start
        + (f" ({fallback})" if fallback else "")
    )


def step_hooks(cfg: RunConfig, cadence: Cadence, parts: RunParts) -> list[StepHook]:
    """The step hooks this run's config switches on, in the order of their `priority` (the loop
    calls them so; the table and its reasons: pretrain/train/hooks.py)."""
    run_dir, env, engine, writer = Path(cfg.run.dir), parts.env, parts.engine, parts.writer
    faults = FaultInjector(cfg.faults, run_dir, env.rank)
    hooks: list[StepHook] = [InjectedFaults(faults, engine)]
    monitor = (
        MonitorLink(run_dir, cfg.monitor.timeout, env, engine.device, cfg.train.steps)
        if cfg.monitor.enabled
        else None
    )
    if cfg.logging.data_trace:
        hooks.append(DataTrace(run_dir, env.rank))
    if cfg.logging.precursors_every:
        hooks.append(
            InstabilityPrecursors(
                engine, cfg.logging.precursors_every, cfg.logging.precursor_tokens, writer, cadence.logged
            )
        )
    # (with experts: their loads, for the service too, and the balancing bias's step)
    hooks += expert_balance(parts, cadence, link=monitor)
    if cfg.monitor.skip_step:
        guard = SkipGuard.for_run(
            cfg.monitor.skip_ratio, cfg.monitor.skip_window, grad_norm_ratio=cfg.monitor.skip_grad_norm_ratio
        )
        hooks.append(SkipBadUpdates(guard, engine, env, run_dir, writer))
    link = monitor if env.is_main else None  # (rank 0 tells the service what became of a rollback)
    rollbacks = Rollbacks(
        env, run_dir, engine, parts.task, parts.checkpointer, link, writer, cfg.monitor.quarantine
    )
    moves = HostMoves(env=env, run_dir=run_dir, writer=writer)
    hooks.append(
        StragglerWatch(
            env=env,
            run_dir=run_dir,
            writer=writer,
            logged=cadence.logged,
            rule=StragglerRule(cfg.monitor.straggler_factor, cfg.monitor.straggler_windows),
            replace=cfg.monitor.on_straggler == "replace",
            engine=engine,
            moves=moves,
            link=monitor,
        )
    )
    hooks += machine_fault_checks(cfg, parts, faults, rollbacks, moves)
    if monitor is not None:
        writer.band_layout()
        hooks.append(Monitored(monitor, rollbacks, parts.task, writer))
    return sorted(hooks, key=lambda hook: hook.priority)


def machine_fault_checks(
    cfg: RunConfig, parts: RunParts, faults: FaultInjector, rollbacks: Rollbacks, moves: HostMoves
) -> list[StepHook]:
    """The replica check and the replay, with one ledger of the machine faults they find."""
    run_dir, env, engine, writer = Path(cfg.run.dir), parts.env, parts.engine, parts.writer
    ledger = FaultLedger(
        env=env, run_dir=run_dir, counts=FaultCounts(cfg.monitor.machine_faults_to_exclude), moves=moves
    )
    hooks: list[StepHook] = []
    if cfg.monitor.consistency_every:
        hooks.append(
            ReplicaCheck(
                env=env,
                run_dir=run_dir,
                writer=writer,
                engine=engine,
                rollbacks=rollbacks,
                ledger=ledger,
                every=cfg.monitor.consistency_every,
            )
        )
    if cfg.monitor.replay:
        hooks.append(
            ReplayCheck(
                env=env,
                run_dir=run_dir,
                writer=writer,
                engine=engine,
                faults=faults,
                grad_accum=engine.gradient_accumulation_steps(),
                ledger=ledger,
            )
        )
    return hooks
