"""Which checkpoints stay on disk: the newest `checkpoint.keep`, every pinned one (the monitor pins
the checkpoint a rollback would go back to), and none from a timeline a rollback abandoned."""

from __future__ import annotations

import shutil
from pathlib import Path

from pretrain.checkpoint.layout import (
    TAG_PATTERN,
    check_complete,
    checkpoints_dir,
    read_latest,
    set_latest,
    step_of,
    tag_for,
    tags_on_disk,
    validate_tag,
)

ABANDONED_DIR = "abandoned"
ABANDONED_KEPT = 4  # abandoned checkpoints kept for inspection (the newest, by when they were abandoned)


def pins_dir(run_dir: str | Path) -> Path:
    return checkpoints_dir(run_dir) / "pins"


def pin(run_dir: str | Path, tag: str) -> None:
    directory = pins_dir(run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / validate_tag(tag)).touch()


def unpin(run_dir: str | Path, tag: str) -> None:
    (pins_dir(run_dir) / validate_tag(tag)).unlink(missing_ok=True)


def pinned(run_dir: str | Path) -> set[str]:
    directory = pins_dir(run_dir)
    return {p.name for p in directory.iterdir() if TAG_PATTERN.match(p.name)} if directory.is_dir() else set()


def apply_retention(run_dir: str | Path, keep: int) -> list[str]:
    """Keep the newest `keep` complete checkpoints and every pinned one; delete older complete
    ones, and incomplete ones older than the newest complete (they can never complete)."""
    root = checkpoints_dir(run_dir)
    tags = tags_on_disk(run_dir)
    complete = [t for t in tags if check_complete(root / t, verify_hashes=False) is None]
    if not complete:
        return []
    keep_set = set(complete[-keep:]) | pinned(run_dir) | {read_latest(run_dir)}
    newest = step_of(complete[-1])
    deleted = []
    for tag in tags:
        if tag in keep_set or step_of(tag) > newest:
            continue
        shutil.rmtree(root / tag, ignore_errors=True)
        shutil.rmtree(root / "universal" / tag, ignore_errors=True)
        deleted.append(tag)
    return deleted


def move_aside(root: Path, subdir: str, tag: str) -> Path:
    """Rename checkpoints/TAG to checkpoints/SUBDIR/TAG (TAG.1, TAG.2... if taken); never deletes."""
    target = root / subdir / tag
    suffix = 1
    while target.exists():
        target, suffix = root / subdir / f"{tag}.{suffix}", suffix + 1
    target.parent.mkdir(parents=True, exist_ok=True)
    (root / tag).rename(target)
    return target


def abandon_after(run_dir: str | Path, step: int) -> list[str]:
    """Move checkpoints newer than `step` to checkpoints/abandoned/ (after a rollback to `step`, or
    a resume from an older checkpoint, they belong to a timeline that no longer exists: resume=auto
    must not pick them, and this timeline must not overwrite them), and point `latest` back at
    `step`."""
    root = checkpoints_dir(run_dir)
    moved = []
    for tag in tags_on_disk(run_dir):
        if step_of(tag) <= step:
            continue
        move_aside(root, ABANDONED_DIR, tag)
        unpin(run_dir, tag)
        moved.append(tag)
    if moved and check_complete(root / tag_for(step), verify_hashes=False) is None:
        set_latest(run_dir, tag_for(step))
    return moved


def trim_abandoned(run_dir: str | Path, keep: int = ABANDONED_KEPT) -> list[str]:
    """After a rollback: keep only the `keep` most recently abandoned checkpoints, so a long run's
    rollbacks do not fill the disk with timelines the monitor judged anomalous."""
    directory = checkpoints_dir(run_dir) / ABANDONED_DIR
    if not directory.is_dir():
        return []
    abandoned = sorted(directory.iterdir(), key=lambda p: p.stat().st_mtime)
    dropped = abandoned[: max(len(abandoned) - keep, 0)]
    for old in dropped:
        shutil.rmtree(old, ignore_errors=True)
    return [p.name for p in dropped]
