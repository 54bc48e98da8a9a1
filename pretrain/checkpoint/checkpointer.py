"""Save and load checkpoints with a DeepSpeed engine: the one interface for the state a run saves.

A checkpoint is DeepSpeed's files (weights, optimizer, ZeRO shards) plus ours: `train_state.json`
(a `TrainState`, the task's data state, the world size, the config hash, digests of the weights
each rank holds, fp32 master weights included), `run_config.json`, the tokenizer, and each rank's
RNG state. Every rank writes its part; rank 0 then marks the checkpoint complete, moves `latest`
and applies retention. Resuming at another world size goes through DeepSpeed's universal
checkpoint format, converted once (universal.py: with Muon's momentum).

Every load verifies first (rank 0 hashes every file against the manifest; the verdict is
broadcast): a corrupt checkpoint is set aside and the next older intact one is used
(`integrity.newest_intact`). A save that fails on any rank (no space, no permission) leaves no
directory behind, says so in one line with the free space, and the run tries again at the next
save, up to `checkpoint.save_retries` failures in a row; then it stops with status 4.

With `checkpoint.async_save` the loop waits only while the state is copied; the files, their hashes and
the marker are written in the background (background.py), and the next save, a load, the run's
last save and the process's exit wait for them. A background save's failure is known at the next
of these, and counts then.
"""

from __future__ import annotations

import atexit
import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from pretrain import atomic
from pretrain.checkpoint import background, integrity, layout, retention, rng, universal
from pretrain.checkpoint.mirror import Mirror
from pretrain.config import CheckpointConfig, FaultsConfig
from pretrain.errors import ExitCode, UserError
from pretrain.optim.muon import LR_SCALE
from pretrain.parallel.distributed import DistEnv, all_gather_objects, all_reduce_sum, barrier, broadcast_int
from pretrain.tokenizer import copy_tokenizer, stored_name, write_special_tokens


class CheckpointSaveError(UserError):
    """Saves kept failing (no space, no permission): the job stops, and is not restarted."""

    exit_code = ExitCode.CHECKPOINT_FAILED


@dataclass
class TrainState:
    """Where a run is: what train_state.json holds besides the data stream's own state."""

    step: int = 0
    tokens: int = 0
    hooks: dict = field(default_factory=dict)  # the loop's step hooks' own state, by hook name


@dataclass(frozen=True)
class Resume:
    """A checkpoint to resume from, found before the engine exists (universal loading must be
    switched on in the DeepSpeed config it is built with)."""

    tag: str
    saved: dict  # its train_state.json
    universal: bool  # saved at another world size: loaded through DeepSpeed's universal format

    @property
    def state(self) -> TrainState:
        saved, hooks = self.saved, dict(self.saved.get("hooks", {}))
        if saved.get("lr_scale", 1.0) != 1.0 and "monitor" not in hooks:  # (a checkpoint from before
            hooks["monitor"] = {"lr": {"scale": saved["lr_scale"]}}  # the monitor's hook kept its scale)
        return TrainState(saved["step"], saved.get("tokens", 0), hooks)

    @property
    def data(self) -> dict | None:
        return self.saved.get("data")

    def deepspeed_config(self, ds_config: dict) -> dict:
        if not self.universal:
            return ds_config
        return ds_config | {"checkpoint": {**ds_config.get("checkpoint", {}), "load_universal": True}}


def choose_resume(
    run_dir: str | Path,
    resume: str,
    env: DistEnv,
    log=None,
    *,
    mirror: str | None = None,
    expert_parallel: int = 1,
) -> Resume | None:
    """Every rank, once the process group is up: the checkpoint to resume from, or None for a fresh
    start. Rank 0 picks it — the one `checkpoint.resume` names (a tag or directory; "auto": the
    newest) if its files verify, else the next older intact one — moves newer checkpoints, which
    belong to another timeline, to checkpoints/abandoned/, and broadcasts its step. With
    `checkpoint.mirror`, a run directory that never held a checkpoint (a new node, a wiped disk;
    not a --fresh start) resumes from the newest complete, verified one in the mirror."""
    step = -1
    if env.is_main:
        wanted = layout.resolve_resume(run_dir, resume)
        if mirror and wanted is None and never_checkpointed(run_dir):
            Mirror(mirror, run_dir).restore_newest(log)
        tag = integrity.newest_intact(run_dir, None if wanted is None else layout.step_of(wanted), log=log)
        if tag is not None:
            step = layout.step_of(tag)
            retention.abandon_after(run_dir, step)
            if wanted is not None and tag != wanted:
                (log or print)(f"checkpoint.resume={resume}: resuming from {tag} instead")
    step = broadcast_int(step, env)
    if step < 0:
        return None
    tag = layout.tag_for(step)
    saved = read_train_state(run_dir, tag)
    universal = saved["world_size"] != env.world_size or saved.get("expert_parallel", 1) != expert_parallel
    return Resume(tag, saved, universal)


def never_checkpointed(run_dir: str | Path) -> bool:
    """No checkpoints/ and no previous/ (where --fresh moves an earlier run): nothing to resume
    here, and no earlier run this one was told to start over from."""
    return not layout.checkpoints_dir(run_dir).exists() and not (Path(run_dir) / "previous").exists()


def read_train_state(run_dir: str | Path, tag: str) -> dict:
    return json.loads((layout.checkpoints_dir(run_dir) / tag / layout.TRAIN_STATE).read_text())


def params_digest(engine) -> str | None:
    """sha256 of the model's parameters as every rank holds them (not under ZeRO-3, which shards them)."""
    if engine.zero_optimization_stage() >= 3:
        return None
    return background.params_digest_of(list(engine.module.named_parameters()))


def _master_weights(optimizer) -> list[torch.Tensor]:
    """This rank's fp32 master weights under DeepSpeed's bf16 optimizers (ZeRO-0, 1/2, 3), which
    a load restores from the optimizer files, separately from the module's weights."""
    for name in (
        "single_partition_of_fp32_groups",
        "fp32_groups_flat_partition",
        "fp32_partitioned_groups_flat",
    ):
        groups = getattr(optimizer, name, None)
        if groups:
            return [g for g in groups if torch.is_tensor(g)]
    return []


def weights_digest(engine) -> str:
    """sha256 of all this rank holds of the weights: the module's parameters (its shard, under
    ZeRO-3) and its fp32 master weights."""
    return background.digest_of(held_weights(engine))


def held_weights(engine) -> list[torch.Tensor]:
    """What `weights_digest` reads, in order. Under ZeRO-3 a parameter's shard is `ds_tensor`, not
    the module's view of the parameter, which may or may not be gathered at the time (DeepSpeed
    leaves its small persistent parameters partitioned after a skipped step until the next forward)."""
    held = []
    for _, param in engine.module.named_parameters():
        shard = getattr(param, "ds_tensor", None)
        held.append(param if shard is None else shard)
    return held + _master_weights(engine.optimizer)


class Checkpointer:
    """Writes this run's checkpoints and reads them back into an engine."""

    def __init__(
        self,
        run_dir: str | Path,
        env: DistEnv,
        config: CheckpointConfig,
        *,
        run_config: dict,
        tokenizer: str | Path,
        config_hash: str,
        faults: FaultsConfig | None = None,
        special_tokens: dict | None = None,
        expert_parallel: int = 1,
    ):
        """`config`: `checkpoint.keep`, `save_retries` and `async_save`; `run_config`: the run's
        whole config, written into each checkpoint as run_config.json; `faults`: the slow save's
        (`faults.slow_save_step`); `special_tokens`: a Hugging Face tokenizer's, as the run uses
        it (else read beside it)."""
        self.run_dir, self.env, self.keep = Path(run_dir), env, config.keep
        self.run_config, self.tokenizer, self.config_hash = run_config, Path(tokenizer), config_hash
        self.faults, self.special_tokens = faults, special_tokens
        self.expert_parallel = expert_parallel  # parallel.expert: recorded, a resume at another is universal
        self.root = layout.checkpoints_dir(run_dir)
        self.save_retries = config.save_retries
        self.failures = 0  # failed saves in a row
        self.last_tag: str | None = None  # the newest checkpoint this timeline wrote or loaded
        self.in_background = config.async_save
        self.pending: background.BackgroundSave | None = None  # the save in flight
        self._exit_hook = False
        # rank 0: each complete checkpoint uploaded to checkpoint.mirror in the background
        url = getattr(config, "mirror", None)
        self.mirror = Mirror(url, run_dir) if url and env.is_main else None

    def save(self, engine, state: TrainState, data: dict | None, last: bool = False) -> str | None:
        """Every rank: write checkpoint `step_<state.step>`; its tag once it is complete, or None
        when the save failed and the run may try again (`checkpoint.save_retries`). The `last`
        save of a run (its final step, a stop) has no next one: its failure always stops the job.
        In the background (`checkpoint.async_save`): first wait for the save in flight, copy the state,
        and return None while the copy is written (the `last` save waits for it: its tag)."""
        if self.pending is not None:
            self.wait()
        if self.in_background:
            unable = background.can_capture(engine)
            if unable is None:
                return self._save_in_background(engine, state, data, last)
            if self.env.is_main:
                print(
                    f"warning: checkpoint.async_save: {unable}; saving in the loop",
                    file=sys.stderr,
                    flush=True,
                )
            self.in_background = False
        tag = layout.tag_for(state.step)
        directory = self.root / tag
        if self.env.is_main:
            self._make_room(tag)
        problem = self._agree(self._space_problem(tag) if self.env.is_main else None)
        if problem is None:
            problem = self._agree(self._write(engine, state, data, directory))
        if problem is None and self.env.is_main:
            try:
                self._complete(directory, tag, state.step)
            except OSError as exc:
                problem = _failure(exc)
        problem = self._agree(problem)
        if problem is not None:
            return self._failed(directory, problem, last)
        self.failures, self.last_tag = 0, tag
        return tag

    def _write(self, engine, state: TrainState, data: dict | None, directory: Path) -> str | None:
        """Every rank writes its part; what went wrong here, or None."""
        client_state = self._client_state()
        digests = all_gather_objects(weights_digest(engine))  # a collective: before anything can fail
        try:
            engine.save_checkpoint(
                str(self.root), tag=directory.name, client_state=client_state, save_latest=False
            )
        except Exception as exc:  # any failure to write (torch reports a full disk as a RuntimeError)
            # DeepSpeed's closing barrier, which this rank skipped: its writes come between its
            # opening barrier and that one (the directory exists already: see _space_problem).
            barrier()
            return _failure(exc)
        pause = self.faults.save_pause(state.step) if self.faults else 0.0
        if pause:
            if self.env.is_main:
                print(
                    f"faults: pausing the save of {directory.name} for {pause:g} s (faults.slow_save_step)",
                    flush=True,
                )
            time.sleep(pause)
        train_state = self._train_state(state, data)
        train_state |= {"params_sha256": params_digest(engine), "weights_sha256": digests}
        try:
            atomic.write_json(directory / rng.rng_file(self.env.rank), rng.capture())
            if self.env.is_main:
                atomic.write_json(directory / layout.TRAIN_STATE, train_state)
                atomic.write_json(directory / layout.RUN_CONFIG, self.run_config)
                copy_tokenizer(
                    self.tokenizer, directory, self.special_tokens
                )  # (.json: + its special tokens)
        except OSError as exc:
            return _failure(exc)
        return None

    def _train_state(self, state: TrainState, data: dict | None) -> dict:
        """train_state.json but the weights digests."""
        train_state = {k: v for k, v in asdict(state).items() if k != "hooks" or v}  # (none: as before)
        train_state |= {"data": data} if data is not None else {}
        train_state |= {"expert_parallel": self.expert_parallel} if self.expert_parallel > 1 else {}
        return train_state | {"world_size": self.env.world_size, "config_hash": self.config_hash}

    def _client_state(self) -> dict:
        from deepspeed.checkpoint.constants import (
            UNIVERSAL_CHECKPOINT_INFO,
            UNIVERSAL_CHECKPOINT_VERSION_KEY,
            UNIVERSAL_CHECKPOINT_VERSION_VALUE,
        )

        return {
            UNIVERSAL_CHECKPOINT_INFO: {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}
        }

    # ------------------------------------------------------------------ in the background

    def _save_in_background(self, engine, state: TrainState, data: dict | None, last: bool) -> str | None:
        """Every rank: copy what the checkpoint holds (DeepSpeed's state dicts, the RNG states,
        what the weights digests read) and start writing it in the background."""
        started = time.perf_counter()
        tag = layout.tag_for(state.step)
        directory = self.root / tag
        if self.env.is_main:
            self._make_room(tag)
        problem = self._agree(self._space_problem(tag) if self.env.is_main else None)
        pending = None
        if problem is None:
            try:
                pending = self._copy(engine, state, data, directory, last)
            except Exception as exc:  # (the copy needs host memory)
                problem = _failure(exc)
            problem = self._agree(problem)
        if problem is not None:
            return self._failed(directory, problem, last)
        pending.started, pending.copied_in = started, time.perf_counter() - started
        self.pending = pending
        if not self._exit_hook:
            atexit.register(self._finish_at_exit)
            self._exit_hook = True
        pending.start()
        return self.wait() if last else None

    def _copy(self, engine, state: TrainState, data: dict | None, directory: Path, last: bool):
        storages: dict = {}
        inner = engine.checkpoint_engine
        capture = background.capturing_engine(inner, storages)
        engine.checkpoint_engine = capture
        try:
            engine.save_checkpoint(
                str(self.root), tag=directory.name, client_state=self._client_state(), save_latest=False
            )
        except Exception:
            barrier()  # (DeepSpeed's closing barrier, which this rank skipped: see _write)
            raise
        finally:
            engine.checkpoint_engine = inner
        held = [background.copy_tensor(t, storages) for t in held_weights(engine)]
        params = None
        if self.env.is_main and engine.zero_optimization_stage() < 3:
            params = [(n, background.copy_tensor(p, storages)) for n, p in engine.module.named_parameters()]
        main_files = {}
        if self.env.is_main:
            write_special_tokens(self.tokenizer, directory, self.special_tokens)  # (small: now)
            main_files = {
                "train_state": self._train_state(state, data),
                "run_config": self.run_config,
                "tokenizer": self.tokenizer,
                "tokenizer_name": stored_name(self.tokenizer),
                "keep": self.keep,
                "mirror": self.mirror,  # (uploads it once complete)
            }
        return background.BackgroundSave(
            directory=directory,
            rank=self.env.rank,
            world_size=self.env.world_size,
            step=state.step,
            last=last,
            writer=inner,
            captured=capture.captured,
            rng_state=rng.capture(),
            held=held,
            params=params,
            storages=storages,
            main_files=main_files,
            pause=(self.faults.save_pause(state.step) if self.faults else 0.0),
        )

    def wait(self) -> str | None:
        """Every rank, at the same point (collectives): wait for the save in flight, if any, until
        its marker is written; its tag, or None when there was none or it failed (counted as a
        failed save: `checkpoint.save_retries`)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        waited = time.perf_counter()
        pending.written.wait()
        problem = self._agree(pending.problem)  # any rank's files not written
        if self.env.is_main:
            if problem is not None:
                pending.abort.set()
            pending.thread.join()
            problem = problem or pending.outcome
        problem = self._agree(problem if self.env.is_main else None)  # rank 0's marker
        if problem is not None:
            return self._failed(pending.directory, problem, pending.last)
        waited = time.perf_counter() - waited
        if self.env.is_main and waited >= 0.1 and not pending.last:
            print(f"checkpoint: waited {waited:.1f} s for {pending.tag} to be written", flush=True)
        self.failures, self.last_tag = 0, pending.tag
        return pending.tag

    def _finish_at_exit(self) -> None:
        """At the process's exit (no collectives then): let a save in flight finish — this
        rank's files, and on rank 0 the marker, unless another rank's record does not come
        within twice the time rank 0's own files took, plus 5 s (that rank is gone: the job failed)."""
        pending = self.pending
        if pending is None or pending.thread is None:
            return
        pending.written.wait()
        if self.env.is_main and pending.thread.is_alive():
            pending.thread.join(timeout=5 + 2 * pending.wrote_in)
            if pending.thread.is_alive():
                pending.abort.set()
                pending.thread.join(timeout=5)
        problem = pending.problem or (pending.outcome if self.env.is_main else None)
        if problem is not None and self.env.is_main:
            print(
                f"warning: checkpoint {pending.tag} was not completed as the process exited: {problem}",
                file=sys.stderr,
                flush=True,
            )

    # ------------------------------------------------------------------ completion

    def _complete(self, directory: Path, tag: str, step: int) -> None:
        """Rank 0, once every rank has written: the manifest, `latest`, retention."""
        layout.mark_complete(directory, {"tag": tag, "step": step, "world_size": self.env.world_size})
        layout.set_latest(self.run_dir, tag)
        retention.apply_retention(self.run_dir, self.keep)
        if self.mirror is not None:
            self.mirror.submit(tag)

    def _make_room(self, tag: str) -> None:
        """Rank 0: an unfinished save of this tag is deleted; a complete checkpoint of it belongs to
        another timeline (this one never saves a tag twice) and moves to abandoned/, never deleted."""
        directory = self.root / tag
        if (directory / layout.COMPLETE).is_file():
            retention.move_aside(self.root, retention.ABANDONED_DIR, tag)
        elif directory.exists():
            shutil.rmtree(directory)

    def _space_problem(self, tag: str) -> str | None:
        """Rank 0: not enough free space for a checkpoint as large as the last one, or no directory
        for it (made here, so that a failure inside DeepSpeed's save can only come from its writes,
        between its barriers)."""
        needed = layout.checkpoint_bytes(self.root / self.last_tag) if self.last_tag else 0
        try:
            (self.root / tag).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return _failure(exc)
        free = shutil.disk_usage(self.root).free
        if needed and free < needed * 1.05:
            return f"it needs about {_size(needed)} (the size of {self.last_tag}), not tried"
        return None

    def _agree(self, problem: str | None) -> str | None:
        """Every rank: a problem if any rank had one (this rank's message, or another rank's)."""
        failed = all_reduce_sum(torch.tensor([float(problem is not None)]))
        if failed.item() == 0:
            return None
        return problem or "another rank's write failed"

    def _failed(self, directory: Path, problem: str, last: bool) -> None:
        """Every rank: nothing that looks complete stays; one line; stop once the retries are spent."""
        if self.env.is_main:
            shutil.rmtree(directory, ignore_errors=True)
        barrier()
        self.failures += 1
        free = _size(shutil.disk_usage(self.root if self.root.exists() else self.run_dir).free)
        line = f"checkpoint {directory.name} could not be saved in {self.root} ({free} free): {problem}"
        if last:
            raise CheckpointSaveError(
                f"{line}; it was the run's last save: free space or fix permissions, "
                "then run the same command again to resume"
            )
        if self.failures > self.save_retries:
            raise CheckpointSaveError(
                f"{line}; {self.failures} failed save(s) in a row (checkpoint.save_retries={self.save_retries}): "
                "free space or fix permissions, then run the same command again to resume"
            )
        if self.env.is_main:
            print(f"warning: {line}; trying again at the next save", file=sys.stderr, flush=True)
        return None

    def restore(self, engine, resume: Resume) -> TrainState:
        """Every rank: load the checkpoint a run resumes from (weights, optimizer, RNG); returns
        where the run is. At another world size it is read in DeepSpeed's universal format, whose
        RNG states (one per old rank) do not map onto the new ranks and are not restored."""
        self.wait()
        if resume.universal:
            self._make_universal(resume.tag)
        load_dir = self.root / "universal" if resume.universal else self.root
        self._load_weights(engine, load_dir, resume.tag)
        if resume.universal:
            universal.load_momentum(engine.optimizer, load_dir / resume.tag)
            universal.load_buffers(engine.module, load_dir / resume.tag)
        else:
            rng.restore(json.loads((self.root / resume.tag / rng.rng_file(self.env.rank)).read_text()))
        self.last_tag = resume.tag
        return resume.state

    def load(self, engine, tag: str, log=None) -> tuple[dict, bool | None] | None:
        """Every rank: load checkpoint `tag` (weights and optimizer) for a rollback, or the next
        older intact one if its files do not verify; returns its train_state.json and whether what
        was loaded matches the digests saved with it (None: not comparable, e.g. another world
        size), or None when no intact checkpoint is left. A save in flight is waited for first."""
        self.wait()
        step = -1
        if self.env.is_main:
            found = integrity.newest_intact(self.run_dir, layout.step_of(tag), log=log)
            step = -1 if found is None else layout.step_of(found)
        step = broadcast_int(step, self.env)
        if step < 0:
            return None
        tag = layout.tag_for(step)
        self._load_weights(engine, self.root, tag)
        saved = read_train_state(self.run_dir, tag)
        self.last_tag = tag
        return saved, self.matches(engine, saved)

    def _load_weights(self, engine, directory: Path, tag: str) -> None:
        """DeepSpeed's load; with experts split across ranks, each rank's experts then put back from
        its own fp32 partitions (ZeRO's `update_lp_params`, as a step does): the module file every
        rank reads is rank 0's, which holds rank 0's experts only. Each parameter group's learning-
        rate scale stays the config's (torch's load_state_dict puts the saved groups' keys in place:
        a changed optim.muon_lr, or a checkpoint saved before groups carried one)."""
        scales = [group.get(LR_SCALE) for group in engine.optimizer.param_groups]
        engine.load_checkpoint(
            str(directory), tag=tag, load_module_strict=True, load_lr_scheduler_states=False
        )
        for group, scale in zip(engine.optimizer.param_groups, scales, strict=True):
            if scale is not None:
                group[LR_SCALE] = scale
        if self.expert_parallel > 1:
            engine.optimizer.update_lp_params()

    def matches(self, engine, saved: dict) -> bool | None:
        """Every rank: do the weights it now holds (fp32 master weights included) equal those saved?"""
        digests = saved.get("weights_sha256")
        comparable = isinstance(digests, list) and len(digests) == self.env.world_size
        mismatched = 0.0 if not comparable else float(weights_digest(engine) != digests[self.env.rank])
        counts = all_reduce_sum(torch.tensor([float(comparable), mismatched]))
        if counts[0].item() < self.env.world_size:
            return None
        return counts[1].item() == 0

    def _make_universal(self, tag: str) -> None:
        """Convert a checkpoint to DeepSpeed's universal format (world-size independent) once,
        Muon's momentum included (universal.py)."""
        source, target = self.root / tag, self.root / "universal" / tag
        if self.env.is_main and layout.check_complete(target, verify_hashes=False) is not None:
            shutil.rmtree(target, ignore_errors=True)
            target.parent.mkdir(parents=True, exist_ok=True)
            universal.convert(source, target)
            layout.mark_complete(target, {"tag": tag, "universal": True})
        barrier()


_failure = background.failure


def _size(count: float) -> str:
    for unit in ("B", "KB", "MB"):
        if count < 1024:
            return f"{count:.0f} B" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GB"
