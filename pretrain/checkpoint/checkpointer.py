"""Save and load checkpoints with a DeepSpeed engine: the one interface for the state a run saves.

A checkpoint is DeepSpeed's files (weights, optimizer, ZeRO shards) plus ours: `train_state.json`
(a `TrainState`, the task's data state, the world size, the config hash, a digest of the weights),
`run_config.json`, the tokenizer, and each rank's RNG state. Every rank writes its part; rank 0
then marks the checkpoint complete, moves `latest` and applies retention. Resuming at another
world size goes through DeepSpeed's universal checkpoint format, converted once.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from pretrain import atomic
from pretrain.checkpoint import layout, retention, rng
from pretrain.distributed import DistEnv, barrier
from pretrain.tokenizer import MODEL_FILE


@dataclass
class TrainState:
    """Where a run is: what train_state.json holds besides the data stream's own state."""

    step: int = 0
    tokens: int = 0
    lr_scale: float = 1.0


@dataclass(frozen=True)
class Resume:
    """A checkpoint to resume from, found before the engine exists (universal loading must be
    switched on in the DeepSpeed config it is built with)."""

    tag: str
    saved: dict  # its train_state.json
    universal: bool  # saved at another world size: loaded through DeepSpeed's universal format

    @property
    def state(self) -> TrainState:
        return TrainState(self.saved["step"], self.saved.get("tokens", 0), self.saved.get("lr_scale", 1.0))

    @property
    def data(self) -> dict | None:
        return self.saved.get("data")

    def deepspeed_config(self, ds_config: dict) -> dict:
        if not self.universal:
            return ds_config
        return ds_config | {"checkpoint": {**ds_config.get("checkpoint", {}), "load_universal": True}}


def find_resume(run_dir: str | Path, resume: str | None, world_size: int) -> Resume | None:
    """`checkpoint.resume` (None, "auto", a tag or a checkpoint path) as a `Resume`, or None."""
    tag = layout.resolve_resume(run_dir, resume)
    if tag is None:
        return None
    saved = read_train_state(run_dir, tag)
    return Resume(tag, saved, saved["world_size"] != world_size)


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
    ):
        self.run_dir, self.env, self.keep = Path(run_dir), env, keep
        self.run_config, self.tokenizer, self.config_hash = run_config, Path(tokenizer), config_hash
        self.root = layout.checkpoints_dir(run_dir)

    def save(self, engine, state: TrainState, data: dict | None) -> str:
        """Every rank: write checkpoint `step_<state.step>`; returns its tag once it is complete."""
        from deepspeed.checkpoint.constants import (
            UNIVERSAL_CHECKPOINT_INFO,
            UNIVERSAL_CHECKPOINT_VERSION_KEY,
            UNIVERSAL_CHECKPOINT_VERSION_VALUE,
        )

        tag = layout.tag_for(state.step)
        directory = self.root / tag
        if self.env.is_main and directory.exists():  # left by an earlier attempt that did not finish
            shutil.rmtree(directory)
        barrier()
        client_state = {
            UNIVERSAL_CHECKPOINT_INFO: {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}
        }
        engine.save_checkpoint(str(self.root), tag=tag, client_state=client_state, save_latest=False)
        train_state = asdict(state) | ({"data": data} if data is not None else {})
        train_state |= {"world_size": self.env.world_size, "config_hash": self.config_hash}
        train_state["params_sha256"] = params_digest(engine)
        atomic.write_json(directory / rng.rng_file(self.env.rank), rng.capture())
        if self.env.is_main:
            atomic.write_json(directory / layout.TRAIN_STATE, train_state)
            atomic.write_json(directory / layout.RUN_CONFIG, self.run_config)
            shutil.copyfile(self.tokenizer, directory / MODEL_FILE)
        barrier()  # every rank has finished writing
        if self.env.is_main:
            layout.mark_complete(
                directory, {"tag": tag, "step": state.step, "world_size": self.env.world_size}
            )
            layout.set_latest(self.run_dir, tag)
            retention.apply_retention(self.run_dir, self.keep)
        barrier()
        return tag

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
        return resume.state

    def load(self, engine, tag: str) -> dict:
        """Every rank: load checkpoint `tag` (weights and optimizer) for a rollback; returns its
        train_state.json."""
        engine.load_checkpoint(
            str(self.root), tag=tag, load_module_strict=True, load_lr_scheduler_states=False
        )
        return read_train_state(self.run_dir, tag)

    def _make_universal(self, tag: str) -> None:
        """Convert a checkpoint to DeepSpeed's universal format (world-size independent) once."""
        source, target = self.root / tag, self.root / "universal" / tag
        if self.env.is_main and layout.check_complete(target, verify_hashes=False) is not None:
            shutil.rmtree(target, ignore_errors=True)
            target.parent.mkdir(parents=True, exist_ok=True)
            command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(source),
                       "--output_folder", str(target), "--num_extract_workers", "1", "--num_merge_workers", "1"]  # fmt: skip
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(
                    f"converting {source} to a universal checkpoint failed:\n{result.stderr[-2000:]}"
                )
            layout.mark_complete(target, {"tag": tag, "universal": True})
        barrier()
