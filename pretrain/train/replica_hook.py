"""The step hook that compares the replicas (`monitor.consistency_every`; issue 46,
docs/monitoring.md, "Replay and replica checks").

Every `consistency_every` steps, after every step whose update did not land (a rank's wrong copy
of a weight makes its loss non-finite, so no update lands and nothing rewrites the copy), and
before every checkpoint, each rank digests the weights every rank should hold alike
(`pretrain/stability/replicas.py`) and the digests are compared in one small all-gather. The same
on every rank: consistent, and a checkpoint saved now records it (train_state.json
`hooks.replicas`). Not the same: each rank compares its copy of the differing parameters with
what the optimizer's fp32 master weights give (DeepSpeed's `safe_get_full_fp32_param`), which
names the rank at fault; a `replica_mismatch` event and one console line say which, and the fault
counts toward its host's exclusion (`machine_faults.py`). Then the run rolls back as after any
rollback (`rollback.py`, a `Rollback` record of its own: `decision` none, `finding`
"replica_mismatch"): to the newest intact checkpoint recorded consistent (chosen as any resume
point is, `pretrain.checkpoint.newest_intact`), the same data order, nothing quarantined (the data
is innocent), the learning rate's scale as it was. A host that reached its limit is moved off
from there: the job stops at that checkpoint with ExitCode.REPLACE_NODE.

The check runs before the save it precedes, so no checkpoint is written from diverged replicas.
On the other steps it costs nothing: no host read, no collective.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from monitoring.protocol import ReplicaMismatch, Rollback, append_event
from pretrain.checkpoint import newest_intact, step_of
from pretrain.parallel.distributed import DistEnv, all_gather_objects
from pretrain.reporting.metrics import MetricsWriter
from pretrain.stability.replicas import differing, masters_disagree, odd_ranks, own_copies, replica_digests
from pretrain.train.hooks import CONTINUE, Answer, Rewind, SaveAndStop, StepHook, Stop
from pretrain.train.machine_faults import FaultLedger
from pretrain.train.rollback import Rollbacks

NAMED = 5  # differing parameters named in the event and on the console
BY_THE_REPLICA_CHECK = "the replica check"  # who stops the run when it cannot go back


@dataclass(kw_only=True)
class ReplicaCheck(StepHook):
    """Named: each checkpoint keeps the step its replicas were last found consistent at and the
    digest they had (`hooks.replicas`)."""

    priority = 60  # (the order of the hooks: pretrain/train/hooks.py)

    name = "replicas"
    env: DistEnv
    run_dir: Path
    writer: MetricsWriter
    engine: Any  # a DeepSpeed engine (or anything with its interface)
    rollbacks: Rollbacks  # the run's one way back (the monitor's too)
    ledger: FaultLedger
    every: int  # monitor.consistency_every
    checked_at: int | None = None  # the step the replicas were last found consistent at
    digest: str | None = None  # their digest then (sha256 of every parameter's, abbreviated)
    skipped_before: int = 0

    def open(self, stack) -> None:
        self.ledger.open()

    def before_step(self, step: int) -> None:
        self.skipped_before = self.engine.skipped_steps

    def after_step(self, step: int, metrics: dict, batch_ids: list, vote: float) -> Answer:
        rejected = self.engine.skipped_steps != self.skipped_before  # (every rank knows the same)
        if rejected or step % self.every == 0:
            return self.check(step)
        return CONTINUE

    def before_checkpoint(self, step: int, stopping: bool, last: bool) -> Answer:
        return CONTINUE if self.checked_at == step else self.check(step)

    def state_dict(self) -> dict | None:
        return None if self.checked_at is None else {"checked_at": self.checked_at, "digest": self.digest}

    def load_state_dict(self, state: dict) -> None:
        self.checked_at, self.digest = state.get("checked_at"), state.get("digest")

    # --------------------------------------------------------------------------------- the check

    def check(self, step: int) -> Answer:
        named = self.replicated()
        local = replica_digests([p.data for _, p in named]).tolist()
        shards = masters_disagree(own_copies(self.engine.optimizer))
        gathered = all_gather_objects(({name: d for (name, _), d in zip(named, local, strict=True)}, shards))
        digests = [d for d, _ in gathered]
        bad = differing(digests)
        off_master = [r for r, (_, groups) in enumerate(gathered) if groups]
        if not bad and not off_master:
            self.checked_at = step
            self.digest = hashlib.sha256(json.dumps(digests[0], sort_keys=True).encode()).hexdigest()[:16]
            return CONTINUE
        if bad:
            mine = dict(named)
            # (each rank its own copies: ranks holding the same experts go through them alike)
            wrong = all_gather_objects(copy_is_wrong([mine[name] for name in bad if name in mine]))
            ranks = sorted(set(odd_ranks(digests, bad, wrong)) | set(off_master))
        else:
            ranks = off_master
        bad += [f"rank {r}'s bf16 partition {i}" for r in off_master for i in gathered[r][1]]
        return self.go_back(step, ranks, bad)

    def go_back(self, step: int, ranks: list[int], bad: list[str]) -> Answer:
        """Every rank: the mismatch said, counted toward its hosts' exclusion and rolled back to
        the newest intact checkpoint recorded consistent; a host at its limit is moved off there."""
        target = all_gather_objects(self.target(step) if self.env.is_main else None)[0]
        hosts = [self.ledger.hosts[r] for r in ranks]
        where = ", ".join(f"rank {r} on {h}" for r, h in zip(ranks, hosts, strict=True))
        more = f" and {len(bad) - NAMED} more" if len(bad) > NAMED else ""
        finding = f"the replicas differ ({where}: {', '.join(bad[:NAMED])}{more})"
        if self.env.is_main:
            event = ReplicaMismatch(
                step=step, ranks=ranks, hosts=hosts, tensors=bad[:NAMED], rolled_back_to=target
            )
            append_event(self.run_dir, event)
        self.writer.message(
            f"step {step}: machine fault: {finding}"
            + (f"; rolling back to {target}" if target else "; no checkpoint with consistent replicas")
        )
        why = "its copy of the weights differed"
        leaving = self.ledger.count(step, ranks, why, saving=step_of(target) if target else None)
        if target is None:
            return Stop(
                f"{finding} at step {step} and no checkpoint has consistent replicas", BY_THE_REPLICA_CHECK
            )
        rollback = Rollback(
            decision=None,
            step=step,
            target=target,
            seed=None,  # (the same data order: the data is innocent)
            lr_scale=self.rollbacks.lr.scale,  # (the learning rate's scale in force goes on)
            reason=finding,
            finding="replica_mismatch",
        )
        state = self.rollbacks.apply(rollback, step, [])
        if state is None:
            return Stop(
                f"{finding} at step {step} and no intact checkpoint is left at or before {target}",
                BY_THE_REPLICA_CHECK,
            )
        return Rewind(state, leaving if isinstance(leaving, SaveAndStop) else None)

    def replicated(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The parameters every rank holds whole: all of them, but under ZeRO-3 only the persistent
        ones (the others are shards, held by one rank each). Experts split across ranks are named
        with the experts each rank holds (`[experts 0-3]`): only ranks holding the same ones compare."""
        named = [(held_name(n, p), p) for n, p in self.engine.module.named_parameters()]
        if self.engine.zero_optimization_stage() < 3:
            return named
        return [(n, p) for n, p in named if getattr(p, "ds_persist", False) and p.data.numel() == p.ds_numel]

    def target(self, step: int) -> str | None:
        """Rank 0: the newest intact checkpoint at or before `step` whose replicas were found
        consistent as it was saved (chosen as any resume point is)."""
        return newest_intact(
            self.run_dir, step, log=self.writer.message, state_passes=self.recorded_consistent
        )

    @classmethod
    def recorded_consistent(cls, train_state: dict) -> bool:
        """A checkpoint's train_state.json says its replicas were found consistent as it was saved."""
        record = train_state.get("hooks", {}).get(cls.name) or {}
        return record.get("checked_at") == train_state.get("step")


def held_name(name: str, param: torch.nn.Parameter) -> str:
    """A parameter's name, with the experts this rank holds of it when they are split across ranks."""
    held = getattr(param, "held_experts", None)  # (pretrain/parallel/experts.py sets it)
    return name if held is None else f"{name}[experts {held[0]}-{held[1] - 1}]"


def copy_is_wrong(params: list[torch.nn.Parameter]) -> bool | None:
    """Every rank (a collective per parameter): is this rank's copy of any of `params` not what
    the optimizer's fp32 master weights give? None when DeepSpeed cannot say (no master weights)."""
    from deepspeed.utils import safe_get_full_fp32_param

    wrong = False
    for param in params:
        master = safe_get_full_fp32_param(param)
        if master is None:
            return None
        wrong = wrong or not torch.equal(param.data, master.to(param.device, param.dtype))
    return wrong
