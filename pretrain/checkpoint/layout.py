"""Checkpoint layout: tags, the completion marker with its integrity manifest, the `latest`
pointer, and finding a checkpoint to resume or read.

    RUN_DIR/checkpoints/
        step_00001000/            DeepSpeed's files for tag step_00001000, plus ours:
            train_state.json      step, tokens, data-stream state, lr scale, world size, config hash
            run_config.json       the resolved run config (rebuilds the model for export/eval)
            tokenizer.model       the tokenizer the run trained with (SentencePiece), or
            tokenizer.json        a Hugging Face tokenizer, unchanged, with
            tokenizer_meta.json   the special tokens the run used with it
            rng_rank_00000.json   each rank's RNG states
            complete.json         written last, by rank 0 after every rank finished: an integrity
                                  manifest (every file's size and sha256)
            .saved_rank_00001.json
                                  a background save (`checkpoint.async_save`) only, while it is written:
                                  what that rank wrote, with sizes and sha256 (background.py)
        latest                    a tag; only ever names a complete checkpoint (write, rename)
        pins/step_00000500        a pinned tag: retention never deletes it (the monitor pins
                                  rollback targets)
        universal/step_...        DeepSpeed universal copies, made when resuming at another world size
        abandoned/step_...        checkpoints newer than a rollback's target: from the timeline the
                                  rollback abandoned, kept for inspection, never resumed from

A directory without `complete.json` is incomplete (its save never finished): resuming skips it.
One whose files no longer match the manifest is corrupt: see integrity.py. Tags are `step_` + 8
digits and nothing else, so no tag can point outside the run directory.
"""

from __future__ import annotations

import hashlib
import json
import re
import warnings
from pathlib import Path

from pretrain import atomic
from pretrain.errors import UserError

TAG_PATTERN = re.compile(r"^step_\d{8}$")
COMPLETE = "complete.json"
TRAIN_STATE = "train_state.json"
RUN_CONFIG = "run_config.json"
LATEST = "latest"


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def step_of(tag: str) -> int:
    return int(validate_tag(tag).removeprefix("step_"))


def validate_tag(tag: str) -> str:
    if not isinstance(tag, str) or not TAG_PATTERN.match(tag):
        raise UserError(f"{tag!r} is not a checkpoint tag: tags look like step_00001000")
    return tag


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(directory: Path) -> list[Path]:
    return sorted(
        p for p in directory.rglob("*") if p.is_file() and p.name != COMPLETE and not p.name.startswith(".")
    )


def file_entry(path: Path) -> dict:
    """A file's manifest entry: its size and sha256."""
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)}


def mark_complete(directory: Path, info: dict, hashed: dict[str, dict] | None = None) -> None:
    """Rank 0, once every rank has written: record every file's size and sha256, then the marker,
    atomically. `hashed`: entries the ranks that wrote those files already made (a background
    save), taken for a file whose size still matches; every other file is hashed here."""
    hashed = hashed or {}
    files = {}
    for p in _files(directory):
        name = str(p.relative_to(directory))
        known = hashed.get(name)
        files[name] = known if known is not None and known["bytes"] == p.stat().st_size else file_entry(p)
    atomic.write_json(directory / COMPLETE, {**info, "files": files})


def check_complete(directory: Path, verify_hashes: bool = True) -> str | None:
    """None if the checkpoint is complete and intact, else the reason it is not."""
    marker = directory / COMPLETE
    if not marker.is_file():
        return "no completion marker (the save did not finish)"
    try:
        files = json.loads(marker.read_text())["files"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return f"unreadable {COMPLETE}"
    for name, entry in files.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != entry["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, expected {entry['bytes']}"
        if verify_hashes and _sha256(path) != entry["sha256"]:
            return f"{name} does not match its sha256"
    return None


def tags_on_disk(run_dir: str | Path) -> list[str]:
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    return sorted((p.name for p in root.iterdir() if p.is_dir() and TAG_PATTERN.match(p.name)), key=step_of)


def newest_complete(run_dir: str | Path, verify_hashes: bool = True) -> str | None:
    """The newest checkpoint that is complete and intact; incomplete newer ones are skipped with a warning."""
    root = checkpoints_dir(run_dir)
    for tag in reversed(tags_on_disk(run_dir)):
        reason = check_complete(root / tag, verify_hashes)
        if reason is None:
            return tag
        warnings.warn(f"skipping checkpoint {root / tag}: {reason}", stacklevel=2)
    return None


def read_latest(run_dir: str | Path) -> str | None:
    path = checkpoints_dir(run_dir) / LATEST
    return validate_tag(path.read_text().strip()) if path.is_file() else None


def set_latest(run_dir: str | Path, tag: str) -> None:
    root = checkpoints_dir(run_dir)
    if check_complete(root / validate_tag(tag), verify_hashes=False) is not None:
        raise RuntimeError(f"refusing to point {root / LATEST} at incomplete checkpoint {tag}")
    atomic.write_text(root / LATEST, tag + "\n")


def resolve_resume(run_dir: str | Path, resume: str) -> str | None:
    """The checkpoint `checkpoint.resume` names, checked for what needs no reading of its files:
    None for "auto" and "fresh" (the newest intact one, if any, is found at start); else a tag, or
    a path to a checkpoint directory inside this run's checkpoints/, that must have a completion
    marker."""
    if resume in ("auto", "fresh"):
        return None
    root = checkpoints_dir(run_dir).resolve()
    candidate = Path(resume)
    if candidate.is_dir():
        resolved = candidate.resolve()
        if resolved.parent != root:
            raise UserError(f"checkpoint.resume={resume} is not a checkpoint of this run (under {root})")
        tag = validate_tag(resolved.name)
    else:
        tag = validate_tag(resume)
    reason = check_complete(root / tag, verify_hashes=False)
    if reason is not None:
        raise UserError(f"checkpoint {root / tag} cannot be resumed: {reason}; use checkpoint.resume=auto")
    return tag


def checkpoint_bytes(directory: Path) -> int:
    """The size of a complete checkpoint, from its manifest (0 when it has none)."""
    try:
        return sum(
            entry["bytes"] for entry in json.loads((directory / COMPLETE).read_text())["files"].values()
        )
    except (OSError, ValueError, KeyError, TypeError):
        return 0
