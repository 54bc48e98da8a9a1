"""Checkpoints mirrored to object storage (`checkpoint.mirror: s3://bucket/prefix`, any fsspec URL).

    MIRROR/run.json                 the run's identity, as RUN_DIR/run.json records it
    MIRROR/step_00001000/...        each complete checkpoint's files, uploaded first,
    MIRROR/step_00001000/complete.json   then its completion marker (sizes and sha256 of every
                                    file): a checkpoint without it in the mirror is incomplete
    MIRROR/latest                   the newest complete one, written last

Rank 0 uploads each checkpoint once it is complete on disk, in a thread of its own, so the loop
waits for nothing beyond the local save; one upload at a time, the newest waiting one next (an
older one still waiting is skipped: the newer one supersedes it). A failed upload is retried with
backoff, then warned about in one line, and the run goes on. After each upload the mirror keeps
what the run directory keeps: a checkpoint that retention deleted, a rollback abandoned or the run
set aside as corrupt is deleted from the mirror too. At the process's exit an upload in flight is
finished (up to `EXIT_WAIT` seconds).

A run whose run directory holds no checkpoint (a new node, a wiped disk) resumes from the mirror
(`restore_newest`, in `checkpointer.choose_resume`): the newest checkpoint there with a completion
marker is downloaded beside the others, verified against its marker (sizes and sha256) and renamed
into place; one that does not verify is skipped for the next older one. A mirror holding another
run (another identity in its run.json) is refused in one line.
"""

from __future__ import annotations

import atexit
import json
import shutil
import sys
import threading
import time
import uuid
from pathlib import Path

from pretrain import atomic, object_store
from pretrain.checkpoint import layout
from pretrain.errors import UserError

RETRIES = 4
BACKOFF = 2.0
EXIT_WAIT = 300.0  # seconds an upload in flight may hold up the process's exit


class Mirror:
    """Rank 0's uploader to one mirror URL, and the reads a resume makes from it."""

    def __init__(self, url: str, run_dir: str | Path, *, retries: int = RETRIES, backoff: float = BACKOFF):
        self.url, self.run_dir = url.rstrip("/"), Path(run_dir)
        self.retries, self.backoff = retries, backoff
        self._waiting: str | None = None  # the newest tag not yet uploaded
        self._lock = threading.Condition()
        self._busy = False
        self.uploaded: list[str] = []  # tags uploaded by this process, in order
        self.failed: list[str] = []  # one line per upload given up
        # Started now, not at the first upload: a background save may complete during the
        # process's exit, when no thread can be started. At exit it is waited for after that
        # save's own exit hook, which registers later and so runs first.
        threading.Thread(target=self._run, name="checkpoint-mirror", daemon=True).start()
        atexit.register(self.wait, EXIT_WAIT)

    # ------------------------------------------------------------------ upload

    def submit(self, tag: str) -> None:
        """Upload checkpoint `tag` (complete on disk) in the background."""
        with self._lock:
            self._waiting = tag
            self._lock.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Until nothing is waiting or uploading (or `timeout` seconds); whether it is all done."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._waiting is not None or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._lock.wait(left)
        return True

    def _run(self) -> None:
        while True:
            with self._lock:
                while self._waiting is None:
                    self._lock.wait()
                tag, self._waiting, self._busy = self._waiting, None, True
            try:
                self._upload_with_retries(tag)
            finally:
                with self._lock:
                    self._busy = False
                    self._lock.notify_all()

    def _upload_with_retries(self, tag: str) -> None:
        for attempt in range(self.retries):
            try:
                self.upload(tag)
                self.uploaded.append(tag)
                return
            except FileNotFoundError:
                return  # deleted locally meanwhile (retention, a rollback): nothing to mirror
            except Exception as exc:
                line = object_store.problem(self.url, exc)
                if attempt + 1 == self.retries:
                    self.failed.append(line)
                    _say(f"warning: checkpoint {tag} was not mirrored to {self.url}: {line}; the run goes on")
                    return
                time.sleep(self.backoff * 2**attempt)

    def upload(self, tag: str) -> None:
        """Checkpoint `tag`'s files, then its marker, then `latest`; then the mirror keeps what
        the run directory keeps."""
        directory = layout.checkpoints_dir(self.run_dir) / layout.validate_tag(tag)
        fs, root = object_store.filesystem(self.url)
        marker = directory / layout.COMPLETE
        files = json.loads(marker.read_text())["files"]  # (FileNotFoundError: gone meanwhile)
        run_file = self.run_dir / "run.json"
        if run_file.is_file():
            fs.pipe_file(f"{root}/run.json", json.dumps({"identity": _identity(run_file)}).encode())
        for name in sorted(files):
            fs.put_file(str(directory / name), f"{root}/{tag}/{name}")
        fs.put_file(str(marker), f"{root}/{tag}/{layout.COMPLETE}")
        fs.pipe_file(f"{root}/{layout.LATEST}", (tag + "\n").encode())
        kept = set(layout.tags_on_disk(self.run_dir))
        for other in self.tags(fs, root):
            if other not in kept:
                fs.rm(f"{root}/{other}", recursive=True)

    @staticmethod
    def tags(fs, root: str) -> list[str]:
        """The checkpoint tags in the mirror, oldest first."""
        try:
            names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)]
        except FileNotFoundError:
            return []
        return sorted((n for n in names if layout.TAG_PATTERN.match(n)), key=layout.step_of)

    # ------------------------------------------------------------------ restore

    def restore_newest(self, log=None) -> str | None:
        """Rank 0, when the run directory holds no checkpoint: the newest complete checkpoint of the
        mirror that verifies, downloaded into place; None when the mirror holds none. Bad input
        (no bucket, no credentials, another run's mirror) is one line."""
        say = log or _say
        fs, root = object_store.filesystem(self.url)
        try:
            tags = self.tags(fs, root)
            recorded = json.loads(fs.cat_file(f"{root}/run.json")) if fs.exists(f"{root}/run.json") else None
        except Exception as exc:
            raise UserError(f"checkpoint.mirror: {object_store.problem(self.url, exc)}") from None
        run_file = self.run_dir / "run.json"
        if recorded is not None and run_file.is_file() and recorded.get("identity") != _identity(run_file):
            raise UserError(
                f"checkpoint.mirror={self.url} holds another run's checkpoints (its run.json's identity differs "
                f"from {run_file}'s): point checkpoint.mirror at this run's mirror, or at an empty prefix"
            )
        for tag in reversed(tags):
            try:
                if not fs.exists(f"{root}/{tag}/{layout.COMPLETE}"):
                    say(f"skipping {self.url}/{tag}: no completion marker (its upload did not finish)")
                    continue
                reason = self._download(fs, root, tag)
            except Exception as exc:
                raise UserError(
                    f"checkpoint.mirror: {object_store.problem(f'{self.url}/{tag}', exc)}"
                ) from None
            if reason is None:
                say(f"restored {tag} from {self.url} (the run directory held no checkpoint)")
                return tag
            say(f"skipping {self.url}/{tag}: {reason}")
        return None

    def _download(self, fs, root: str, tag: str) -> str | None:
        """Download `tag` beside the run's checkpoints, verify it, rename it into place; None, or
        why it did not verify."""
        checkpoints = layout.checkpoints_dir(self.run_dir)
        checkpoints.mkdir(parents=True, exist_ok=True)
        partial = checkpoints / f".mirror-{tag}-{uuid.uuid4().hex[:8]}"
        try:
            files = json.loads(fs.cat_file(f"{root}/{tag}/{layout.COMPLETE}"))["files"]
            for name in files:
                (partial / name).parent.mkdir(parents=True, exist_ok=True)
                fs.get_file(f"{root}/{tag}/{name}", str(partial / name))
            fs.get_file(f"{root}/{tag}/{layout.COMPLETE}", str(partial / layout.COMPLETE))
            reason = layout.check_complete(partial, verify_hashes=True)
            if reason is not None:
                return reason
            target = checkpoints / tag
            if target.exists():
                shutil.rmtree(target)  # (an incomplete save of that tag: never complete)
            partial.rename(target)
            atomic.fsync_dir(checkpoints)
            layout.set_latest(self.run_dir, tag)
            return None
        finally:
            shutil.rmtree(partial, ignore_errors=True)


def _identity(run_file: Path) -> dict | None:
    try:
        return json.loads(run_file.read_text()).get("identity")
    except (OSError, ValueError, AttributeError):
        return None


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
