"""Trust no checkpoint unread: every load verifies the files against the completion marker's
manifest (sizes and sha256) first, and a corrupt checkpoint is set aside, never loaded.

    RUN_DIR/checkpoints/corrupt/step_...   a checkpoint whose files no longer match its manifest,
                                            moved here (never deleted) for a person to look at

`newest_intact` is what every training load goes through (resume, restart, rollback) and what
chooses a replica rollback's target: from a starting tag it walks to older checkpoints until one
verifies, setting aside each corrupt one with one printed line and an event `checkpoint_corrupt`. Read-only tools (export, eval, generate,
fine-tuning's init) use `find_checkpoint`, which skips corrupt ones the same way but changes
nothing: they may read a run directory another job owns.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from monitoring.protocol import CheckpointCorrupt, append_event
from pretrain.checkpoint.layout import (
    COMPLETE,
    LATEST,
    TAG_PATTERN,
    TRAIN_STATE,
    check_complete,
    checkpoints_dir,
    read_latest,
    set_latest,
    step_of,
    tags_on_disk,
)
from pretrain.checkpoint.retention import move_aside, unpin
from pretrain.errors import UserError

CORRUPT_DIR = "corrupt"


def verify(directory: Path) -> str | None:
    """None if every file matches the manifest (sizes and sha256), else what does not."""
    return check_complete(directory, verify_hashes=True)


def move_corrupt_aside(run_dir: str | Path, tag: str, reason: str, *, log=None) -> Path:
    """Rank 0: move a corrupt checkpoint to checkpoints/corrupt/, say so in one line and as an
    event, and keep `latest` pointing at a complete checkpoint (or at none)."""
    root = checkpoints_dir(run_dir)
    moved = move_aside(root, CORRUPT_DIR, tag)
    unpin(run_dir, tag)
    if read_latest(run_dir) == tag:
        older = [t for t in tags_on_disk(run_dir) if check_complete(root / t, verify_hashes=False) is None]
        if older:
            set_latest(run_dir, older[-1])
        else:
            (root / LATEST).unlink(missing_ok=True)
    (log or _stderr)(f"checkpoint {root / tag} is corrupt ({reason}): moved to {moved}; using an older one")
    append_event(run_dir, CheckpointCorrupt(step=step_of(tag), tag=tag, reason=reason, moved_to=str(moved)))
    return moved


def newest_intact(
    run_dir: str | Path,
    at_most: int | None = None,
    *,
    log=None,
    read_only: bool = False,
    state_passes: Callable[[dict], bool] | None = None,
) -> str | None:
    """The newest complete checkpoint at or before step `at_most` whose files verify. Corrupt ones
    met on the way are set aside (rank 0 of a training job), or only reported when `read_only`.
    Incomplete ones (a save that never finished) are skipped and left for retention.
    `state_passes`: a test of its train_state.json that it must pass too (a replica rollback's: its
    replicas were found consistent as it was saved); one that fails is passed over, left as it is."""
    root = checkpoints_dir(run_dir)
    say = log or _stderr
    for tag in reversed(tags_on_disk(run_dir)):
        if at_most is not None and step_of(tag) > at_most:
            continue
        if state_passes is not None and not _state_passes(root / tag, state_passes):
            continue
        if not (root / tag / COMPLETE).is_file():
            if not read_only:
                say(f"skipping checkpoint {root / tag}: no completion marker (its save did not finish)")
            continue
        reason = verify(root / tag)
        if reason is None:
            return tag
        if read_only:
            say(f"checkpoint {root / tag} is corrupt ({reason}): skipping it")
        else:
            move_corrupt_aside(run_dir, tag, reason, log=log)
    return None


def _state_passes(directory: Path, test: Callable[[dict], bool]) -> bool:
    try:
        return bool(test(json.loads((directory / TRAIN_STATE).read_text())))
    except (OSError, ValueError):  # (no train_state.json: an incomplete save, which fails its check)
        return False


def find_checkpoint(path: str | Path, *, log=None) -> Path:
    """Read-only tools: a checkpoint directory (which must verify), or a run directory or its
    checkpoints/ (its newest complete checkpoint that verifies; corrupt ones are skipped with one
    line each, and nothing is moved: another job may own the run)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path} does not exist: pass a run directory or a checkpoint directory")
    if TAG_PATTERN.match(path.name) and path.is_dir():
        reason = verify(path)
        if reason is not None:
            raise UserError(f"{path} is not a usable checkpoint: {reason}")
        return path
    run_dir = path.parent if path.name == "checkpoints" else path
    tag = newest_intact(run_dir, log=log, read_only=True)
    if tag is None:
        raise UserError(f"{path} holds no complete, intact checkpoint")
    return checkpoints_dir(run_dir) / tag


def timed_verify(directory: Path) -> tuple[str | None, int, float]:
    """`verify`, with the bytes read and the seconds it took: what `pretrain verify` prints."""
    started = time.perf_counter()
    total = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
    return verify(directory), total, time.perf_counter() - started


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
