"""The service's view of the run's checkpoints: which are complete, and the pins that keep
checkpoint retention away from the ones a rollback may go back to (the policy says which:
`Policy.pins`)."""

from __future__ import annotations

from pathlib import Path

from pretrain import checkpoint


class CheckpointPins:
    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.known_complete: set[str] = set()  # a complete checkpoint stays complete: read once
        self.pinned: str | None = None  # the checkpoint a rollback now would go back to (for /status)

    def complete(self) -> list[str]:
        """The tags of the complete checkpoints on disk, oldest first (their markers, not their
        hashes: the trainer verifies a target before it loads it)."""
        tags = checkpoint.tags_on_disk(self.run_dir)
        self.known_complete &= set(tags)  # one moved away (abandoned, deleted) is read again if it returns
        root = checkpoint.checkpoints_dir(self.run_dir)
        for tag in tags:
            if (
                tag not in self.known_complete
                and checkpoint.check_complete(root / tag, verify_hashes=False) is None
            ):
                self.known_complete.add(tag)
        return [t for t in tags if t in self.known_complete]

    def keep(self, tags: set[str], target: str | None) -> None:
        """Pin exactly `tags` (also releasing pins an earlier service left); `target` is shown."""
        self.pinned = target
        current = checkpoint.pinned(self.run_dir)
        try:
            for tag in tags - current:
                checkpoint.pin(self.run_dir, tag)
            for tag in current - tags:
                checkpoint.unpin(self.run_dir, tag)
        except OSError:
            pass  # a full disk: the pins are tried again at the next step
