"""Checkpoints: one package owns their layout, writing, completion, loading, universal conversion,
RNG state, retention and pins.

    layout.py        tags, directories, the completion marker, `latest`, finding one to resume
    retention.py     keep the newest N, pins, moving an abandoned timeline aside
    integrity.py     verify on every load, set corrupt ones aside, fall back to older intact ones
    rng.py           each rank's generator states as JSON
    checkpointer.py  save and load with a DeepSpeed engine: the one interface for the state a run
                     saves (step, tokens, lr scale, the data stream, RNG)
    background.py    `checkpoint.async_save`: the state copied in the loop, written, hashed and marked
                     complete by a thread
    universal.py     resuming at another world size: DeepSpeed's universal checkpoint, with Muon's
                     momentum

The names of layout.py, retention.py and integrity.py are importable from here without torch (the monitoring
service reads checkpoints this way); the checkpointer is imported from its module.
"""

from pretrain.checkpoint.integrity import find_checkpoint, move_corrupt_aside, newest_intact, verify
from pretrain.checkpoint.layout import (
    COMPLETE,
    LATEST,
    RUN_CONFIG,
    TAG_PATTERN,
    TRAIN_STATE,
    check_complete,
    checkpoints_dir,
    mark_complete,
    newest_complete,
    read_latest,
    resolve_resume,
    set_latest,
    step_of,
    tag_for,
    tags_on_disk,
    validate_tag,
)
from pretrain.checkpoint.retention import (
    abandon_after,
    apply_retention,
    move_aside,
    pin,
    pinned,
    pins_dir,
    trim_abandoned,
    unpin,
)

__all__ = [
    "COMPLETE",
    "LATEST",
    "RUN_CONFIG",
    "TAG_PATTERN",
    "TRAIN_STATE",
    "abandon_after",
    "apply_retention",
    "check_complete",
    "checkpoints_dir",
    "find_checkpoint",
    "mark_complete",
    "move_aside",
    "move_corrupt_aside",
    "newest_complete",
    "newest_intact",
    "pin",
    "pinned",
    "pins_dir",
    "read_latest",
    "resolve_resume",
    "set_latest",
    "step_of",
    "tag_for",
    "tags_on_disk",
    "trim_abandoned",
    "unpin",
    "validate_tag",
    "verify",
]
