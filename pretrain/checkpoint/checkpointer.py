"""Save and load checkpoints with a DeepSpeed engine: the one interface for the state a run saves.

A checkpoint is DeepSpeed's files (weights, optimizer, ZeRO shards) plus ours: `train_state.json`
(a `TrainState`, the task's data state, the world size, the config hash, digests of the weights
each rank holds, fp32 master weights included), `run_config.json`, the tokenizer, and each rank's
RNG state. Every rank writes its part; rank 0 then marks the checkpoint complete, moves `latest`
and applies retention. Resuming at another world size goes through DeepSpeed's universal
checkpoint format, converted once.

Every load verifies first (rank 0 hashes every file against the manifest; the verdict is
broadcast): a corrupt checkpoint is set aside and the next older intact one is used
(`integrity.newest_intact`). A save that fails on any rank (no space, no permission) leaves no
directory behind, says so in one line with the free space, and the run tries again at the next
save, up to `checkpoint.save_retries` failures in a row; then it stops with status 4.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from pretrain import atomic
from pretrain.checkpoint import integrity, layout, retention, rng
from pretrain.distributed import DistEnv, all_gather_objects, all_reduce_sum, barrier, broadcast_int
from pretrain.errors import ExitCode, UserError
from pretrain.tokenizer import MODEL_FILE


class CheckpointSaveError(UserError):
    """Saves kept failing (no space, no permission): the job stops, and is not restarted."""

    exit_code = ExitCode.CHECKPOINT_FAILED


@dataclass
class TrainState:
    """Where a run is: what train_state.json holds besides the data stream's own state."""

    step: int = 0
    tokens: int = 0
    lr_scale: float = 1.0
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
        saved = self.saved
        return TrainState(
            saved["step"], saved.get("tokens", 0), saved.get("lr_scale", 1.0), saved.get("hooks", {})
        )

    @property
    def data(self) -> dict | None:
        return self.saved.get("data")

    def deepspeed_config(self, ds_config: dict) -> dict:
        if not self.universal:
            return ds_config
        return ds_config | {"checkpoint": {**ds_config.get("checkpoint", {}), "load_universal": True}}


def choose_resume(run_dir: str | Path, resume: str, env: DistEnv, log=None) -> Resume | None:
    """Every rank, once the process group is up: the checkpoint to resume from, or None for a fresh
    start. Rank 0 picks it — the one `checkpoint.resume` names (a tag or directory; "auto": the
    newest) if its files verify, else the next older intact one — moves newer checkpoints, which
    belong to another timeline, to checkpoints/abandoned/, and broadcasts its step."""
    step = -1
    if env.is_main:
        wanted = layout.resolve_resume(run_dir, resume)
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
    return Resume(tag, saved, saved["world_size"] != env.world_size)


def read_train_state(run_dir: str | Path, tag: str) -> dict:
    return json.loads((layout.checkpoints_dir(run_dir) / tag / layout.TRAIN_STATE).read_text())


def params_digest(engine) -> str | None:
    """sha256 of the model's parameters as every rank holds them (not under ZeRO-3, which shards them)."""
    if engine.zero_optimization_stage() >= 3:
        return None
    digest = hashlib.sha256()
    for name, param in engine.module.named_parameters():
        digest.update(name.encode())
        digest.update(param.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()


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
    ZeRO-3) and its fp32 master weights. Under ZeRO-3 the shard is `ds_tensor`, not the module's
    view of the parameter, which may or may not be gathered at the time (DeepSpeed leaves its small
    persistent parameters partitioned after a skipped step until the next forward)."""
    digest = hashlib.sha256()
    for _, param in engine.module.named_parameters():
        held = getattr(param, "ds_tensor", None)
        held = param if held is None else held
        digest.update(held.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    for master in _master_weights(engine.optimizer):
        digest.update(master.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class Checkpointer:
    """Writes this run's checkpoints and reads them back into an engine."""

    def __init__(
        self,
        run_dir: str | Path,
        env: DistEnv,
        keep: int,
        run_config: dict,
        tokenizer: str | Path,
        config_hash: str,
        save_retries: int = 0,
    ):
        self.run_dir, self.env, self.keep = Path(run_dir), env, keep
        self.run_config, self.tokenizer, self.config_hash = run_config, Path(tokenizer), config_hash
        self.root = layout.checkpoints_dir(run_dir)
        self.save_retries = save_retries
        self.failures = 0  # failed saves in a row
        self.last_tag: str | None = None  # the newest checkpoint this timeline wrote or loaded

    def save(self, engine, state: TrainState, data: dict | None, last: bool = False) -> str | None:
        """Every rank: write checkpoint `step_<state.step>`; its tag once it is complete, or None
        when the save failed and the run may try again (`checkpoint.save_retries`). The `last`
        save of a run (its final step, a stop) has no next one: its failure always stops the job."""
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
        from deepspeed.checkpoint.constants import (
            UNIVERSAL_CHECKPOINT_INFO,
            UNIVERSAL_CHECKPOINT_VERSION_KEY,
            UNIVERSAL_CHECKPOINT_VERSION_VALUE,
        )

        client_state = {
            UNIVERSAL_CHECKPOINT_INFO: {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}
        }
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
        train_state = {k: v for k, v in asdict(state).items() if k != "hooks" or v}  # (none: as before)
        train_state |= {"data": data} if data is not None else {}
        train_state |= {"world_size": self.env.world_size, "config_hash": self.config_hash}
        train_state |= {"params_sha256": params_digest(engine), "weights_sha256": digests}
        try:
            atomic.write_json(directory / rng.rng_file(self.env.rank), rng.capture())
            if self.env.is_main:
                atomic.write_json(directory / layout.TRAIN_STATE, train_state)
                atomic.write_json(directory / layout.RUN_CONFIG, self.run_config)
                shutil.copyfile(self.tokenizer, directory / MODEL_FILE)
        except OSError as exc:
            return _failure(exc)
        return None

    def _complete(self, directory: Path, tag: str, step: int) -> None:
        """Rank 0, once every rank has written: the manifest, `latest`, retention."""
        layout.mark_complete(directory, {"tag": tag, "step": step, "world_size": self.env.world_size})
        layout.set_latest(self.run_dir, tag)
        retention.apply_retention(self.run_dir, self.keep)

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
        if resume.universal:
            self._make_universal(resume.tag)
        load_dir = self.root / "universal" if resume.universal else self.root
        engine.load_checkpoint(
            str(load_dir), tag=resume.tag, load_module_strict=True, load_lr_scheduler_states=False
        )
        if not resume.universal:
            rng.restore(json.loads((self.root / resume.tag / rng.rng_file(self.env.rank)).read_text()))
        self.last_tag = resume.tag
        return resume.state

    def load(self, engine, tag: str, log=None) -> tuple[dict, bool | None] | None:
        """Every rank: load checkpoint `tag` (weights and optimizer) for a rollback, or the next
        older intact one if its files do not verify; returns its train_state.json and whether what
        was loaded matches the digests saved with it (None: not comparable, e.g. another world
        size), or None when no intact checkpoint is left."""
        step = -1
        if self.env.is_main:
            found = integrity.newest_intact(self.run_dir, layout.step_of(tag), log=log)
            step = -1 if found is None else layout.step_of(found)
        step = broadcast_int(step, self.env)
        if step < 0:
            return None
        tag = layout.tag_for(step)
        engine.load_checkpoint(
            str(self.root), tag=tag, load_module_strict=True, load_lr_scheduler_states=False
        )
        saved = read_train_state(self.run_dir, tag)
        self.last_tag = tag
        return saved, self.matches(engine, saved)

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
        """Convert a checkpoint to DeepSpeed's universal format (world-size independent) once."""
        source, target = self.root / tag, self.root / "universal" / tag
        if self.env.is_main and layout.check_complete(target, verify_hashes=False) is not None:
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
            layout.mark_complete(target, {"tag": tag, "universal": True})
        barrier()


def _failure(exc: BaseException) -> str:
    """What went wrong, in one line: an OS error's own words, else the exception's first line."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def _size(count: float) -> str:
    for unit in ("B", "KB", "MB"):
        if count < 1024:
            return f"{count:.0f} B" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GB"
