"""The run directory belongs to one job at a time and to one run.

    RUN_DIR/run.lock     an exclusive OS lock (flock) held for the job's life, and who holds it
                         (host, pid, since, owner): `pretrain launch` holds it in its supervisor,
                         whose job inherits it on that host; its ranks on every host (started over
                         ssh too) recognise it by the owner tag the supervisor gave them
                         (PRETRAIN_RUN_OWNER). `pretrain train`/`finetune` run directly hold it in
                         rank 0. The OS drops it when the holder dies, so a dead holder never
                         blocks a start.
    RUN_DIR/run.json     the run's identity (what defines it: model architecture, tokenizer, data,
                         sequence length) and the resolved config of the last start
    RUN_DIR/previous/    earlier runs moved aside by `--fresh` (checkpoint.resume=fresh), never deleted

A start whose identity differs from the recorded one is refused, naming the keys; other changes
are allowed and listed in one line.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from dataclasses import asdict
from pathlib import Path

from pretrain import atomic
from pretrain.errors import UserError

LOCK_FILE = "run.lock"
RUN_FILE = "run.json"
PREVIOUS_DIR = "previous"
FIRED_FILE = "faults_fired.json"  # the injected faults that fired (pretrain/stability/faults.py)
OWNER_ENV = "PRETRAIN_RUN_OWNER"  # set by the supervisor for its job: "host:pid:start" (pretrain/lifeline.py)

# Changing these between starts of one run is never meaningful: they are not identity, and not news.
NOT_COMPARED = ("checkpoint.resume",)


class RunLock:
    """An exclusive, non-blocking flock on RUN_DIR/run.lock."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK_FILE
        self.fd: int | None = None

    def acquire(self, *, owner: str = "", joining: str = "") -> RunLock:
        """Hold the lock, recording `owner` (a supervisor's tag) with the holder; or, when it is
        already held under the tag `joining` (this process's own supervisor), join that holder
        without holding anything (`fd` stays None). Anyone else holding it is a clear error."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder_record(fd)
            os.close(fd)
            if joining and holder.get("owner") == joining:
                return self
            raise UserError(
                f"run directory {self.path.parent} is in use by {_describe(holder)}: wait for that job to "
                f"end (or stop it), or pick another run.dir"
            ) from None
        self.fd = fd
        holder = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
            "owner": owner,
        }
        try:  # in place (a rename would swap the locked inode); on a full disk the lock still holds
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(holder).encode() + b"\n", 0)
        except OSError:
            pass
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock (unless a child inherited the descriptor)
            self.fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder_record(fd: int) -> dict:
    try:
        info = json.loads(os.pread(fd, 4096, 0))
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _describe(info: dict) -> str:
    try:
        alive = pid_alive(info["pid"]) if info["host"] == socket.gethostname() else True
        return f"pid {info['pid']} on {info['host']} since {info['since']}" + (
            "" if alive else " (that process has exited; its job is still stopping)"
        )
    except (KeyError, TypeError):
        return "another job"


def pid_alive(pid: int) -> bool:
    """Whether process `pid` of this host exists (another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def owning_run_dir(
    run_dir: str | Path, is_main: bool, identity: dict, config: dict, resume: str, *, log=print
):
    """Rank 0 of a job: hold the run directory's lock (or join the job's supervisor, which holds
    it) and claim the run for the job's life; yields the resume setting to use. Other ranks only
    yield `resume` (rank 0 decides what it means)."""
    if not is_main:
        yield resume
        return
    lock = RunLock(run_dir).acquire(joining=os.environ.get(OWNER_ENV, ""))
    try:
        yield claim(run_dir, identity, config, resume, log=log)
    finally:
        if lock is not None:
            lock.release()


def flatten(config: dict, prefix: str = "") -> dict:
    """{"optim": {"lr": 1e-3}} → {"optim.lr": 1e-3}."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            flat |= flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def model_identity(model_cfg) -> dict:
    """The architecture: every model field but the preset's name and the initialization scale."""
    return {f"model.{k}": v for k, v in asdict(model_cfg).items() if k not in ("preset", "init_std")}


# Keys added after runs were first recorded, with the value a run recorded without them had: an
# older run.json that lacks one is the same run (and the same config) when the new value is this.
ADDED_KEYS = {
    "model.qk_norm": False,
    "model.rope_scaling": None,
    "model.moe": None,
    "parallel.expert": 1,
    "checkpoint.init": None,
    "loss.z_loss": 0.0,
    "monitor.skip_step": False,
    "monitor.skip_ratio": 3.0,
    "monitor.skip_grad_norm_ratio": None,
    "monitor.skip_window": 64,
    "monitor.skip_max_consecutive": 3,
    "monitor.restart_window_hours": None,  # (max_restarts counted over the whole run)
    "monitor.straggler_factor": 1.5,
    "monitor.straggler_windows": 3,
    "monitor.on_straggler": "warn",
    "monitor.replay": False,
    "monitor.machine_faults_to_exclude": 2,
    "monitor.consistency_every": 0,
    "monitor.on_repeat": [],
    "monitor.repeat_window": 100,
    "monitor.repeat_lr_factor": 0.5,
    "monitor.repeat_lr_steps": 100,
    "logging.precursors_every": 0,
    "logging.precursor_tokens": 256,
    "data.tokenizer": None,
    "data.cache_dir": None,
    "data.cache_gib": 64.0,
    "checkpoint.mirror": None,
    "optim.name": "adamw",  # (every run recorded before it existed trained with AdamW)
    "optim.muon_lr": 0.02,
    "optim.muon_momentum": 0.95,
    "optim.muon_ns_method": "gram",
    "optim.muon_scale": "original",
    "faults.slow_rank": 0,
    "faults.slow_factor": 3.0,
    "faults.slow_from_step": None,
    "faults.flip_step": None,
    "faults.flip_rank": 0,
    "faults.flip_target": "grad",
}


# Keys renamed after runs were first recorded: an older run.json's value is the new key's.
RENAMED_KEYS = {"checkpoint.async": "checkpoint.async_save"}


def _differences(old: dict, new: dict, keys) -> list[str]:
    old = {RENAMED_KEYS.get(k, k): v for k, v in old.items()}
    keys = {RENAMED_KEYS.get(k, k) for k in keys}

    def was(k):
        if k == "model.head_dim" and k not in old and "model.d_model" in old:  # (derived: d_model / n_heads)
            return old["model.d_model"] // old["model.n_heads"]
        return old.get(k, ADDED_KEYS.get(k))

    return [f"{k} {was(k)!r} → {new.get(k)!r}" for k in sorted(keys) if was(k) != new.get(k)]


def has_checkpoints(run_dir: str | Path) -> bool:
    from pretrain.checkpoint import tags_on_disk

    return bool(tags_on_disk(run_dir))


def claim(run_dir: str | Path, identity: dict, config: dict, resume: str, *, log=print) -> str:
    """The lock holder, before any process group: check the run against the one recorded here,
    start over if asked (`resume == "fresh"`: the old run moves to previous/), and record this
    start. Returns the resume setting the job should use ("auto" after starting over)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    identity = json.loads(json.dumps(identity))  # as it reads back from run.json
    config = json.loads(json.dumps({k: v for k, v in flatten(config).items() if k not in NOT_COMPARED}))
    if resume == "fresh":
        moved = start_over(run_dir)
        if moved is not None:
            log(f"--fresh: moved the earlier run in {run_dir} to {moved}")
        resume = "auto"
    else:
        recorded = read_run_file(run_dir)
        if recorded is not None and has_checkpoints(run_dir):
            differing = _differences(
                recorded["identity"], identity, set(recorded["identity"]) | set(identity)
            )
            if differing:
                raise UserError(
                    f"{run_dir} holds another run ({'; '.join(differing)}): pick another run.dir, or pass "
                    f"--fresh (checkpoint.resume=fresh) to move the old run aside"
                )
            changed = _differences(recorded["config"], config, set(recorded["config"]) | set(config))
            if changed:
                log("changed since the last start: " + ", ".join(changed))
    try:
        atomic.write_json(
            run_dir / RUN_FILE, {"identity": identity, "config": config, "started": time.time()}
        )
    except OSError as exc:
        raise UserError(
            f"cannot write {run_dir / RUN_FILE}: {exc.strerror}: free space or fix permissions"
        ) from None
    return resume


def read_run_file(run_dir: Path) -> dict | None:
    try:
        recorded = json.loads((run_dir / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    return recorded if isinstance(recorded, dict) and {"identity", "config"} <= set(recorded) else None


def start_over(run_dir: Path) -> Path | None:
    """Move everything the earlier run wrote (all but the lock and earlier moved-aside runs) to
    previous/<time>/; nothing is deleted. None when there was nothing to move."""
    entries = (
        [p for p in run_dir.iterdir() if p.name not in (LOCK_FILE, PREVIOUS_DIR)] if run_dir.is_dir() else []
    )
    if not entries:
        return None
    target = run_dir / PREVIOUS_DIR / time.strftime("%Y%m%d-%H%M%S")
    suffix = 1
    while target.exists():
        target, suffix = target.with_name(f"{target.name.split('.')[0]}.{suffix}"), suffix + 1
    target.mkdir(parents=True)
    for entry in entries:
        entry.rename(target / entry.name)
    return target
