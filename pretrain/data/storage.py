"""Where shards come from: a local directory, or a URL read through a bounded, verified local cache.

A prepared corpus may live in an object store: `s3://bucket/prefix` (s3fs, the `s3` extra),
`gs://` (gcsfs), `az://` (adlfs), `hf://` (huggingface_hub), any fsspec URL whose filesystem
package is installed. `local_dataset(URL, cache_dir, cache_gib)` reads its manifest and makes a
*local view* of it in the cache:

    CACHE/datasets/<digest of the URL>/   manifest.json (the bucket's, byte for byte), the
                                          tokenizer beside the shards (checked against the
                                          manifest's sha256), source.json (the URL and the budget)
    CACHE/shards/<sha256>.bin             shards and document indexes, fetched on first use, each
                                          checked against the manifest's size and sha256 before it
                                          is renamed into place: a file here is a verified one

Everything downstream takes the view for the dataset's directory (the tokenizer, the checks before
a run, the window stream's order, its state and fingerprint), so order and resume are the stream's
own, the same as from a local disk: only `ShardSet.shard` differs, which maps a cached file
(`ShardCache.map`) instead of the file beside the manifest.

The cache is bounded (`data.cache_gib`): before a fetch, the least recently used files are
deleted until the new one fits. A shard in use is never deleted: each process holds a shared
`flock` on every shard it has mapped, and a file is deleted only under an exclusive one; a process
keeps at most `max_open` maps, so that together the processes of a node leave room for one more.
The processes of a node share the cache (content-addressed, so runs reading the same corpus share
it too); a fetch takes a per-file lock, so a shard is downloaded once per node.

Prefetch: the stream tells the cache which shards it will read next (`ShardCache.hint`, in order
of need); a thread fetches them ahead, as far as the budget allows without evicting any of them.

Failures: before a run starts every problem (no package, no bucket, no credentials, access denied,
no manifest, no answer) is one line naming the URL and what to do (`UserError`, exit 2). While
training, a fetch is retried with exponential backoff; a prefetch that keeps failing asks the run
to stop at the next step boundary with a checkpoint (the path a preemption takes), and a read that
keeps failing ends the rank with one line (`StorageUnavailable`, exit 1: a restart may succeed).
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import hashlib
import json
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np

from pretrain.errors import DataError, ExitCode, UserError
from pretrain.object_store import filesystem, is_url, join, problem
from pretrain.run_dir import pid_alive

VIEWS = "datasets"
SHARDS = "shards"
SOURCE = "source.json"
RETRIES = 5  # tries of a fetch while training, with BACKOFF, 2·BACKOFF, 4·BACKOFF ... between them
BACKOFF = 1.0
DEFAULT_CACHE_GIB = 64.0


class StorageUnavailable(UserError):
    """A fetch kept failing while training (the store stopped answering): one line, and status 1,
    which the supervisor restarts (the store may answer again)."""

    exit_code = ExitCode.FAILED
    same_on_every_rank = False


def default_cache_dir() -> Path:
    """Node-local: the temporary directory ($TMPDIR, else /tmp), one per user."""
    return Path(tempfile.gettempdir()) / f"pretrain-cache-{os.getuid()}"


def read_manifest_bytes(url: str) -> bytes:
    """DIR/manifest.json of the dataset at `url`: a missing one is "not a prepared dataset"."""
    fs, path = filesystem(join(url, "manifest.json"))
    try:
        return fs.cat_file(path)
    except FileNotFoundError as exc:
        line = problem(join(url, "manifest.json"), exc)
        if line.endswith("does not exist"):
            line = (
                f"{url} is not a prepared dataset (it holds no manifest.json): run "
                f"`pretrain data prepare --out {url}`, or check the prefix"
            )
        raise UserError(line) from None
    except Exception as exc:
        raise UserError(problem(join(url, "manifest.json"), exc)) from None


# --------------------------------------------------------------------------- the view


@dataclass(frozen=True)
class Source:
    """Where a view's files come from (its source.json)."""

    url: str
    cache_gib: float

    @classmethod
    def of(cls, view: Path) -> Source | None:
        try:
            data = json.loads((view / SOURCE).read_text())
        except (OSError, ValueError):
            return None
        return cls(data["url"], float(data["cache_gib"]))


def describe(data_dir: str | Path) -> str:
    """How to name a dataset directory to a person: the URL of a view, else the path."""
    source = Source.of(Path(data_dir)) if not is_url(data_dir) else None
    return source.url if source is not None else str(data_dir)


# --------------------------------------------------------------------------- the cache


@dataclass(frozen=True)
class Entry:
    """A file the cache can hold: where it comes from, and what it must be."""

    url: str
    size: int
    sha256: str


class ShardCache:
    """The bounded cache of one directory, shared by every reader of a process (`ShardCache.at`)."""

    _instances: ClassVar[dict[Path, ShardCache]] = {}
    _instances_lock = threading.Lock()

    def __init__(self, root: Path, budget: int, *, retries: int = RETRIES, backoff: float = BACKOFF):
        self.root, self.budget = Path(root), int(budget)
        self.dir = self.root / SHARDS
        self.dir.mkdir(parents=True, exist_ok=True)
        self.retries, self.backoff = retries, backoff
        self.max_open = 1
        self._lock = threading.RLock()
        self._budget_thread_lock = threading.Lock()
        self._open: collections.OrderedDict[str, tuple[int, np.memmap]] = collections.OrderedDict()
        self._fetching: dict[str, threading.Lock] = collections.defaultdict(threading.Lock)
        self._hints: list[Entry] = []
        self._wake = threading.Event()
        self._closed = threading.Event()  # set by close(): the prefetcher stops, its retries too
        self._thread: threading.Thread | None = None
        self.stats = dict.fromkeys(
            ("hits", "misses", "fetched_bytes", "verified_bytes", "evicted", "refetched"), 0
        )
        self._stats_lock = threading.Lock()
        self.failed: str | None = None  # the prefetcher's last given-up fetch
        self._over_budget_said = False

    @classmethod
    def at(cls, root: Path, budget_gib: float) -> ShardCache:
        root = Path(root).resolve()
        with cls._instances_lock:
            cache = cls._instances.get(root)
            if cache is None:
                cache = cls._instances[root] = cls(root, int(budget_gib * (1 << 30)))
            else:
                cache.budget = int(budget_gib * (1 << 30))
            return cache

    def path(self, entry: Entry) -> Path:
        return self.dir / f"{entry.sha256}.bin"

    def plan(self, largest: int) -> None:
        """Size the per-process maps from the budget and the largest shard: the processes of a node
        (LOCAL_WORLD_SIZE) together hold at most all but one shard's room. Refused in one line when
        the budget cannot hold a shard for each of them and one more."""
        local = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
        fits = self.budget // max(largest, 1)
        if fits < local + 1:
            need = (local + 1) * largest / (1 << 30)
            raise UserError(
                f"data.cache_gib={self.budget / (1 << 30):.6g} holds {fits} shard(s) of {largest:,} bytes: "
                f"{local} process(es) on this node need room for {local + 1}; raise data.cache_gib to at "
                f"least {need:.3g}"
            )
        self.max_open = max(1, min(64, (fits - 1) // local))

    # ------------------------------------------------------------------ reading

    def map(self, entry: Entry, dtype: np.dtype) -> np.memmap:
        """The shard as a read-only memory map, fetched first when it is not here. It stays in use
        (never evicted, by any process) until this process maps `max_open` others."""
        with self._lock:
            held = self._open.get(entry.sha256)
            if held is not None:
                self._open.move_to_end(entry.sha256)
                return held[1]
        path = self.fetch(entry, reading=True)
        with self._lock:
            held = self._open.get(entry.sha256)
            if held is not None:
                return held[1]
            while len(self._open) >= self.max_open:
                self._close(next(iter(self._open)))
            fd = os.open(path, os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_SH)  # in use: an evicting process skips it
            if not path.exists():  # deleted between the fetch and the lock: fetch again
                os.close(fd)
                return self.map(entry, dtype)
            mapped = np.memmap(path, dtype=dtype, mode="r") if entry.size else np.zeros(0, dtype=dtype)
            self._open[entry.sha256] = (fd, mapped)
            _touch(path)  # (least recently used goes by when a file was last mapped)
            return mapped

    def _close(self, sha: str) -> None:
        fd, _ = self._open.pop(sha)
        os.close(fd)  # (the map's views stay valid: the file is gone only once nothing maps it)

    def close(self) -> None:
        """Unmap every file and stop the prefetcher (a fetch it is retrying gives up quietly)."""
        self._closed.set()
        self._wake.set()
        with self._lock:
            for sha in list(self._open):
                self._close(sha)

    @classmethod
    def close_all(cls) -> None:
        """Close every cache of this process (a test's, before the next test)."""
        with cls._instances_lock:
            caches, cls._instances = list(cls._instances.values()), {}
        for cache in caches:
            cache.close()

    def fetch(
        self, entry: Entry, *, reading: bool = False, protect: frozenset[str] = frozenset()
    ) -> Path | None:
        """The entry's verified file in the cache, downloaded if needed (retried with backoff; a
        download that does not match the manifest is fetched once more, then refused). While
        prefetching (`reading` false) it gives up quietly, returning None, when the budget has no
        room without evicting `protect`, or when a download does not match (the read fetches that
        file again and says why). A read counts as a hit when the verified file was here as it
        asked, else as a miss: it waited for a download, its own or one in flight in another
        thread or process (the prefetcher's), whichever thread took the file's lock first."""
        path = self.path(entry)
        was_here = _holds(path, entry.size)
        with self._fetching[entry.sha256], self._file_lock(entry):
            if _holds(path, entry.size):
                if reading:
                    self._count("hits" if was_here else "misses")
                _touch(path)
                return path
            part = self._reserve(entry, protect | {entry.sha256}, wait=reading)
            if part is None:
                return None
            if reading:
                self._count("misses")
            tries = 2 if reading else 1
            try:
                for attempt in range(tries):
                    reason = self._download(entry, part)
                    if reason is None:
                        os.replace(part, path)
                        return path
                    if attempt + 1 < tries:
                        self._count("refetched")
                        print(
                            f"warning: {entry.url} {reason}: fetching it again", file=sys.stderr, flush=True
                        )
            finally:
                part.unlink(missing_ok=True)
            if not reading:
                return None
            raise DataError(
                f"{entry.url} {reason} twice: the object in the store is corrupt or was replaced; run "
                f"`pretrain data verify {entry.url.rsplit('/', 1)[0]}` and prepare the dataset again"
            )

    def _count(self, key: str, amount: int = 1) -> None:
        """stats[key] += amount: the reader and the prefetcher count from two threads."""
        with self._stats_lock:
            self.stats[key] += amount

    def _download(self, entry: Entry, part: Path) -> str | None:
        """One download into `part`, checked; None, or why the bytes were refused. Counts the bytes
        downloaded (`fetched_bytes`), and those whose sha256 matched the manifest (`verified_bytes`)."""
        self._with_retries(entry.url, lambda: self._get(entry.url, part))
        size = part.stat().st_size
        self._count("fetched_bytes", size)
        if size != entry.size:
            return f"holds {size:,} bytes, the manifest says {entry.size:,}"
        if _sha256(part) != entry.sha256:
            return "does not match its sha256 in the manifest"
        self._count("verified_bytes", size)
        return None

    def _get(self, url: str, target: Path) -> None:
        fs, path = filesystem(url)
        fs.get_file(path, str(target))

    def _with_retries(self, url: str, action) -> None:
        """`action`, tried `retries` times with exponential backoff; then StorageUnavailable."""
        for attempt in range(self.retries):
            try:
                return action()
            except (UserError, KeyboardInterrupt):
                raise
            except Exception as exc:
                line = problem(url, exc)
                if attempt + 1 == self.retries:
                    raise StorageUnavailable(f"{line}; gave up after {self.retries} tries") from None
                wait = self.backoff * 2**attempt
                if self._closed.is_set():
                    raise StorageUnavailable(f"{line}; the cache is closed") from None
                print(f"warning: {line}; trying again in {wait:g} s", file=sys.stderr, flush=True)
                self._closed.wait(wait)
        return None

    @contextlib.contextmanager
    def _file_lock(self, entry: Entry):
        """One fetch of a file per node: the processes sharing the cache take turns."""
        fd = os.open(self.dir / f".{entry.sha256}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ the budget

    def _reserve(self, entry: Entry, protect: set[str] | frozenset[str], *, wait: bool) -> Path | None:
        """Room for `entry` under the budget: least recently used files, none in use and none in
        `protect`, are deleted until it fits with every other download in flight (each reserves its
        size: the name of its .part file says it); then its .part file, which holds the room. Reading
        (`wait`), a cache full of files in use is waited for a while, then exceeded with one warning;
        prefetching gives up (None)."""
        deadline = time.monotonic() + 30
        part = self.dir / f".{entry.sha256}.{entry.size}.{os.getpid()}.{threading.get_ident()}.part"
        while True:
            with self._budget_lock():
                if self._room_for(entry.size, protect) or (wait and time.monotonic() > deadline):
                    part.touch()
                    return part
            if not wait:
                return None
            with self._lock:  # this process's own maps but those protected go first
                for sha in [s for s in self._open if s not in protect]:
                    self._close(sha)
            if time.monotonic() > deadline and not self._over_budget_said:
                self._over_budget_said = True
                print(
                    f"warning: the cache {self.dir} is over data.cache_gib: every file in it is in use",
                    file=sys.stderr,
                    flush=True,
                )
            time.sleep(0.05)

    def _room_for(self, size: int, protect: set[str] | frozenset[str]) -> bool:
        """(Under the budget lock.) Evict until `size` more bytes fit; whether they do."""
        files = list(self.dir.glob("*.bin"))
        sizes = {p: _size(p) for p in files}
        total = sum(sizes.values()) + self._reserved()
        if total + size <= self.budget:
            return True
        with self._lock:
            mine = set(self._open)
        for victim in sorted(files, key=_mtime):
            if victim.stem in protect or victim.stem in mine:
                continue
            if self._evict(victim):
                total -= sizes[victim]
                if total + size <= self.budget:
                    return True
        return False

    def _reserved(self) -> int:
        """Bytes the downloads in flight will add (a dead process's .part files are removed)."""
        total = 0
        for part in self.dir.glob(".*.part"):
            fields = part.name.split(".")  # "", sha, size, pid, thread, "part"
            try:
                size, pid = int(fields[2]), int(fields[3])
            except (IndexError, ValueError):
                continue
            if pid != os.getpid() and not pid_alive(pid):
                part.unlink(missing_ok=True)
                continue
            total += size
        return total

    @contextlib.contextmanager
    def _budget_lock(self):
        """The cache's accounts, one process and thread at a time."""
        with self._budget_thread_lock:
            fd = os.open(self.dir / ".budget.lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)

    def _evict(self, path: Path) -> bool:
        """Delete `path` unless some process maps it (holds its shared lock)."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        try:
            path.unlink(missing_ok=True)
            self._count("evicted")
        finally:
            os.close(fd)
        return True

    # ------------------------------------------------------------------ prefetch

    def hint(self, entries: list[Entry]) -> None:
        """The files a reader needs next, in order: fetched ahead by a thread, as many as fit."""
        seen, ordered = set(), []
        for entry in entries:
            if entry.sha256 not in seen:
                seen.add(entry.sha256)
                ordered.append(entry)
        with self._lock:
            self._hints = ordered
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._prefetch, name="shard-prefetch", daemon=True)
                self._thread.start()
        self._wake.set()

    def _prefetch(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._closed.is_set():
                return
            with self._lock:
                hints = list(self._hints)
            protect: set[str] = set()
            for entry in hints:
                protect.add(entry.sha256)
                try:
                    if self.fetch(entry, protect=frozenset(protect)) is None:
                        break  # no room without evicting what is needed sooner
                except StorageUnavailable as exc:
                    if self._closed.is_set():
                        return
                    self.failed = str(exc)
                    request_stop(f"{exc}", exc)
                    break
                except UserError:
                    break  # (the read of that shard says it, in the loop)
                if self._wake.is_set():
                    break  # newer hints


def request_stop(line: str, exc: BaseException) -> None:
    """Ask the training loop to stop at its next step boundary and save (as a preemption does),
    when this process is one (its stop handler is installed); otherwise only say it."""
    print(
        f"warning: {line}: stopping at the next step boundary with a checkpoint", file=sys.stderr, flush=True
    )
    handler = signal.getsignal(signal.SIGUSR1)
    if callable(handler):
        from pretrain.parallel.distributed import STOP_CAUSE

        STOP_CAUSE.append(f"the data store stopped answering ({line})")
        os.kill(os.getpid(), signal.SIGUSR1)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 23), b""):
            digest.update(block)
    return digest.hexdigest()


def _touch(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.utime(path)


def _holds(path: Path, size: int) -> bool:
    """Whether the cache's file is there (then it is verified: only a checked download is renamed
    into place)."""
    return path.is_file() and _size(path) == size


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
