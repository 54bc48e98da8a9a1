"""The on-disk format of a prepared corpus: token shards and `manifest.json`.

    DIR/manifest.json          written last: a directory without it is not a dataset
    DIR/tokenizer.model        the tokenizer the shards were made with (and tokenizer_meta.json)
    DIR/train_00000.bin ...    raw little-endian tokens (uint16 when the vocabulary fits, else
    DIR/validation_00000.bin   uint32); every document is followed by EOS
    DIR/train_documents.bin    where each document came from (format version 2): per document,
    DIR/validation_documents.bin  little-endian int64 (first token's offset in the split, origin, record)

The manifest records the format version, the source, the tokenizer's sha256 and vocabulary size,
the dtype, per split the documents, tokens and each shard's file, token count and sha256, and
(version 2) `documents`: the origins (source files, `hub:NAME` or `builtin:pydoc`) the document
index's origin numbers refer to, and per split the index's file, rows and sha256. Version 1
datasets (no document index) still train; naming the documents behind a window needs version 2.
The corpus fingerprint is a digest of the tokenizer and the shards' contents: it names the data a
stream state belongs to.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pretrain import object_store
from pretrain.data import storage
from pretrain.data.storage import Entry, ShardCache, Source
from pretrain.errors import UserError
from pretrain.object_store import is_url, join

FORMAT = "pretrain-token-shards"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # version 1: no document index
MANIFEST = "manifest.json"
SPLITS = ("train", "validation")


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def fingerprint(manifest: dict) -> str:
    content = {
        "tokenizer_sha256": manifest["tokenizer"]["sha256"],
        "dtype": manifest["dtype"],
        "splits": {
            split: [(s["tokens"], s["sha256"]) for s in manifest["splits"][split]["shards"]]
            for split in sorted(manifest["splits"])
        },
    }
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]


class ShardWriter:
    """Appends token arrays to `{split}_NNNNN.bin` files of at most `shard_tokens` tokens each,
    hashing as it goes, so memory stays flat whatever the corpus size."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, shard_tokens: int):
        self.directory, self.split, self.dtype, self.shard_tokens = directory, split, dtype, shard_tokens
        self.shards: list[dict] = []
        self.documents = 0
        self._file = None
        self._hash = None
        self._count = 0

    def write(self, tokens: np.ndarray, documents: int) -> None:
        self.documents += documents
        tokens = tokens.astype(self.dtype, copy=False)
        while len(tokens):
            if self._file is None:
                self._open()
            room = self.shard_tokens - self._count
            part, tokens = tokens[:room], tokens[room:]
            data = part.tobytes()
            self._file.write(data)
            self._hash.update(data)
            self._count += len(part)
            if self._count == self.shard_tokens:
                self._close()

    def _open(self) -> None:
        name = f"{self.split}_{len(self.shards):05d}.bin"
        self._file = open(self.directory / name, "wb")  # noqa: SIM115 (closed in _close)
        self._hash = hashlib.sha256()
        self._count = 0
        self.shards.append({"file": name})

    def _close(self) -> None:
        # On disk before the manifest that vouches for it is written.
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self.shards[-1] |= {"tokens": self._count, "sha256": self._hash.hexdigest()}
        self._file = None

    def finish(self) -> dict:
        if self._file is not None:
            self._close()
        return {
            "documents": self.documents,
            "tokens": sum(s["tokens"] for s in self.shards),
            "shards": self.shards,
        }


class DocumentIndexWriter:
    """Appends (first token's offset in the split, origin, record) per document to
    `{split}_documents.bin`, hashing as it goes; memory stays flat."""

    FLUSH_ROWS = 1 << 16

    def __init__(self, directory: Path, split: str):
        self.name = f"{split}_documents.bin"
        self._file = open(directory / self.name, "wb")  # noqa: SIM115 (closed in finish)
        self._hash = hashlib.sha256()
        self._rows: list[tuple[int, int, int]] = []
        self.count, self.tokens = 0, 0

    def add(self, tokens: int, origin: tuple[int, int] | None) -> None:
        """A text of `tokens` tokens; `origin` (origin index, record) when it starts a document."""
        if origin is not None:
            self._rows.append((self.tokens, *origin))
            if len(self._rows) >= self.FLUSH_ROWS:
                self._flush()
        self.tokens += tokens

    def _flush(self) -> None:
        data = np.asarray(self._rows, dtype="<i8").reshape(-1, 3).tobytes()
        self._file.write(data)
        self._hash.update(data)
        self.count += len(self._rows)
        self._rows = []

    def finish(self) -> dict:
        self._flush()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        return {"file": self.name, "rows": self.count, "sha256": self._hash.hexdigest()}


@dataclass
class DocumentIndex:
    """Where the documents of one split came from (format version 2): for a token range, the
    documents that overlap it."""

    data_dir: Path
    split: str
    manifest: dict

    def __post_init__(self) -> None:
        entry = (self.manifest.get("documents") or {}).get("splits", {}).get(self.split)
        if entry is None:
            raise UserError(
                f"{self.data_dir} has no document index (format version {self.manifest.get('format_version')}): "
                f"prepare it again with `pretrain data prepare` to name the documents behind a window"
            )
        self.origins = self.manifest["documents"]["origins"]
        path = self.data_dir / entry["file"]
        source = Source.of(self.data_dir)
        if source is not None:  # in an object store: its verified copy in the cache
            wanted = Entry(join(source.url, entry["file"]), entry["rows"] * 24, entry["sha256"])
            path = ShardCache.at(self.data_dir.parent.parent, source.cache_gib).fetch(wanted, reading=True)
        if not path.is_file() or path.stat().st_size != entry["rows"] * 24:
            raise UserError(f"{path} is missing or truncated: prepare the dataset again")
        rows = np.memmap(path, dtype="<i8", mode="r") if entry["rows"] else np.zeros(0, dtype="<i8")
        self.rows = rows.reshape(-1, 3)
        self.split_tokens = int(self.manifest["splits"][self.split]["tokens"])

    def overlapping(self, start: int, end: int) -> list[dict]:
        """The documents with tokens in [start, end) of the split: origin, record, and the
        document's own token range [first, last) in the split."""
        starts = self.rows[:, 0]
        first = max(int(np.searchsorted(starts, start, side="right")) - 1, 0)
        last = int(np.searchsorted(starts, end, side="left"))
        out = []
        for i in range(first, last):
            doc_end = int(starts[i + 1]) if i + 1 < len(starts) else self.split_tokens
            out.append(
                {
                    "origin": self.origins[int(self.rows[i, 1])],
                    "record": int(self.rows[i, 2]),
                    "tokens": [int(starts[i]), doc_end],
                }
            )
        return out


def our_manifest(data_dir: str | Path) -> dict | None:
    """The manifest of the dataset in `data_dir`, or None when it holds no manifest.json written by
    `pretrain data prepare` (missing, unreadable, not JSON, or another program's)."""
    try:
        manifest = json.loads((Path(data_dir) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("format") == FORMAT else None


def is_prepared_dataset(data_dir: str | Path) -> bool:
    return our_manifest(data_dir) is not None


def read_manifest(data_dir: str | Path) -> dict:
    """The manifest of the dataset in `data_dir` (a directory, or a URL: read from the store),
    checked for its format and version."""
    if is_url(data_dir):
        url = str(data_dir).rstrip("/")
        try:
            manifest = json.loads(storage.read_manifest_bytes(url))
        except json.JSONDecodeError:
            raise UserError(f"{join(url, MANIFEST)} is not valid JSON: prepare the dataset again") from None
        check_manifest(manifest, join(url, MANIFEST))
        return manifest
    data_dir = Path(data_dir)
    path = data_dir / MANIFEST
    if not path.is_file():
        hint = "it does not exist" if not data_dir.exists() else "it holds no manifest.json"
        raise UserError(
            f"{data_dir} is not a prepared dataset ({hint}): run `pretrain data prepare --out {data_dir}`"
        )
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError:
        raise UserError(f"{path} is not valid JSON: prepare the dataset again") from None
    check_manifest(manifest, path)
    return manifest


def check_manifest(manifest, where: str | Path) -> None:
    """A manifest of ours, of a version this code reads."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise UserError(f"{where} is not a {FORMAT} manifest")
    if manifest.get("format_version") not in READABLE_VERSIONS:
        raise UserError(
            f"{where} has format version {manifest.get('format_version')}, this code reads {FORMAT_VERSION}: "
            "prepare the dataset again"
        )


def check_tokenizer(data_dir: str | Path, manifest: dict) -> None:
    """The tokenizer beside the shards must be the one they were made with."""
    path = Path(data_dir) / manifest["tokenizer"].get("file", "tokenizer.model")
    if not path.is_file():
        raise UserError(f"{path} is missing: prepare the dataset again")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != manifest["tokenizer"]["sha256"]:
        raise UserError(
            f"{path} is not the tokenizer the shards were made with (sha256 {digest[:12]}…, the manifest says "
            f"{manifest['tokenizer']['sha256'][:12]}…): restore it, or prepare the dataset again with this tokenizer"
        )


@dataclass
class ShardSet:
    """The shards of one split, opened lazily as read-only memory maps (a shard is never read whole):
    the files beside the manifest, or, for a dataset in an object store (a view made by
    `storage.local_dataset`), the verified copies its cache fetches (`storage.ShardCache`)."""

    data_dir: Path
    split: str
    manifest: dict
    files: list = field(init=False)  # each shard's path, or its URL
    tokens: np.ndarray = field(init=False)  # tokens per shard
    dtype: np.dtype = field(init=False)
    _maps: dict[int, np.memmap] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise UserError(f"unknown split {self.split!r}: use one of {', '.join(SPLITS)}")
        entries = self.manifest["splits"].get(self.split, {}).get("shards", [])
        self.tokens = np.array([s["tokens"] for s in entries], dtype=np.int64)
        self.dtype = np.dtype(self.manifest["dtype"])
        self.source = Source.of(self.data_dir)
        if self.source is not None:  # in an object store: fetched into the cache on first use
            self.entries = [
                Entry(join(self.source.url, s["file"]), int(s["tokens"]) * self.dtype.itemsize, s["sha256"])
                for s in entries
            ]
            self.files = [entry.url for entry in self.entries]
            self.cache = ShardCache.at(self.data_dir.parent.parent, self.source.cache_gib)
            largest = max(
                (s["tokens"] for split in self.manifest["splits"].values() for s in split["shards"]),
                default=0,
            )
            self.cache.plan(int(largest) * self.dtype.itemsize)
            return
        self.files = [self.data_dir / s["file"] for s in entries]
        for path, count in zip(self.files, self.tokens, strict=True):
            if not path.is_file():
                raise UserError(f"shard {path} is missing: prepare the dataset again")
            size = path.stat().st_size
            if size != count * self.dtype.itemsize:
                raise UserError(
                    f"shard {path} holds {size} bytes, the manifest says {count} tokens of {self.dtype}: "
                    "it is truncated or corrupt; prepare the dataset again"
                )

    @classmethod
    def open(cls, data_dir: str | Path, split: str) -> ShardSet:
        return cls(Path(data_dir), split, read_manifest(data_dir))

    @property
    def remote(self) -> bool:
        return self.source is not None

    def shard(self, index: int) -> np.memmap:
        if self.source is not None:
            return self.cache.map(self.entries[index], self.dtype)
        if index not in self._maps:
            self._maps[index] = np.memmap(self.files[index], dtype=self.dtype, mode="r")
        return self._maps[index]

    def prefetch(self, indices) -> None:
        """The shards a reader will need next, in that order: fetched ahead (a local dataset: nothing to do)."""
        if self.source is not None:
            self.cache.hint([self.entries[int(i)] for i in indices])

    def __getstate__(self) -> dict:  # memory maps are reopened in the receiving process
        return {k: v for k, v in self.__dict__.items() if k != "_maps"} | {"_maps": {}}


def verify_dataset(data_dir: str | Path) -> dict:
    """Read every shard whole: its size and sha256 against the manifest, and every id below the
    vocabulary size. `data_dir` may be a URL (each object is streamed from the store, not cached).
    Returns {"shards", "tokens", "bytes", "seconds", "problems": [one line each]}."""
    import time

    started = time.perf_counter()
    manifest = read_manifest(data_dir)
    files = _Files(data_dir)
    problems = _tokenizer_problems(data_dir, manifest, files)
    entries = [s for split in manifest["splits"].values() for s in split["shards"]]
    tokens = total = 0
    for entry in entries:
        shard_problems, shard_tokens, shard_bytes = _verify_shard(files, entry, manifest)
        problems += shard_problems
        tokens, total = tokens + shard_tokens, total + shard_bytes
    problems += _document_index_problems(files, manifest)
    return {
        "shards": len(entries),
        "tokens": tokens,
        "bytes": total,
        "seconds": time.perf_counter() - started,
        "problems": problems,
    }


def _tokenizer_problems(data_dir: str | Path, manifest: dict, files: _Files) -> list[str]:
    try:
        if files.url is None:
            check_tokenizer(data_dir, manifest)
            return []
        name = join(files.url, manifest["tokenizer"].get("file", "tokenizer.model"))
        if hashlib.sha256(object_store.read_bytes(name)).hexdigest() != manifest["tokenizer"]["sha256"]:
            return [f"{name} is not the tokenizer the shards were made with"]
    except UserError as exc:
        return [str(exc)]
    return []


def _verify_shard(files: _Files, entry: dict, manifest: dict) -> tuple[list[str], int, int]:
    """One shard read whole: (its problems, its tokens (0 when missing), the bytes read)."""
    vocab, dtype = int(manifest["tokenizer"]["vocab_size"]), np.dtype(manifest["dtype"])
    name = files.name(entry["file"])
    problems, digest, largest, offset, size = [], hashlib.sha256(), -1, 0, 0
    try:
        with files.open(entry["file"]) as f:
            for block in iter(lambda f=f: f.read((1 << 24) * dtype.itemsize), b""):
                digest.update(block)
                size += len(block)
                ids = np.frombuffer(block[: len(block) // dtype.itemsize * dtype.itemsize], dtype=dtype)
                if len(ids) and int(ids.max()) >= vocab and largest < vocab:
                    problems.append(
                        f"{name} holds id {int(ids.max())} at token offset "
                        f"{offset + int(np.argmax(ids >= vocab))}, not below the vocabulary size {vocab}"
                    )
                largest = max(largest, int(ids.max()) if len(ids) else -1)
                offset += len(ids)
    except FileNotFoundError:
        return [*problems, f"{name} is missing"], 0, size
    if offset * dtype.itemsize != size or offset != entry["tokens"]:
        problems.append(f"{name} holds {size} bytes, the manifest says {entry['tokens']} tokens")
    elif digest.hexdigest() != entry["sha256"]:
        problems.append(f"{name} does not match its sha256 in the manifest")
    return problems, offset, size


def _document_index_problems(files: _Files, manifest: dict) -> list[str]:
    problems = []
    for entry in (manifest.get("documents") or {}).get("splits", {}).values():
        name = files.name(entry["file"])
        try:
            with files.open(entry["file"]) as f:
                data = f.read()
        except FileNotFoundError:
            data = None
        if data is None or len(data) != entry["rows"] * 24:
            problems.append(f"{name} is missing or does not hold the {entry['rows']} rows the manifest says")
        elif hashlib.sha256(data).hexdigest() != entry["sha256"]:
            problems.append(f"{name} does not match its sha256 in the manifest")
    return problems


class _Files:
    """The files of a dataset, beside its manifest on disk or in a store, opened for reading."""

    def __init__(self, data_dir: str | Path):
        self.url = str(data_dir).rstrip("/") if is_url(data_dir) else None
        self.dir = None if self.url else Path(data_dir)

    def name(self, file: str) -> str:
        return join(self.url, file) if self.url else str(self.dir / file)

    def open(self, file: str):
        if self.url is None:
            return open(self.dir / file, "rb")
        fs, path = object_store.filesystem(join(self.url, file))
        try:
            return fs.open(path, "rb", block_size=1 << 24)
        except FileNotFoundError:
            raise
        except Exception as exc:
            raise UserError(object_store.problem(join(self.url, file), exc)) from None


def windows_per_shard(tokens, seq_len: int) -> np.ndarray:
    """How many windows of `seq_len` + 1 tokens each shard of `tokens` tokens gives (each shard on
    its own: a window never spans two)."""
    return np.maximum((np.asarray(tokens, dtype=np.int64) - 1) // seq_len, 0)


def split_windows(manifest: dict, split: str, seq_len: int) -> int:
    """The windows a prepared split holds, from its manifest alone, so the checks before a run
    need not open a shard."""
    shards = manifest["splits"].get(split, {}).get("shards", [])
    return int(windows_per_shard([shard["tokens"] for shard in shards], seq_len).sum())
