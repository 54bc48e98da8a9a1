"""Where documents come from: local files, a Hugging Face Hub dataset, or a built-in corpus.

    local files or globs   .txt/.text/.md (one document per file), .jsonl/.json and .parquet (a
                           text field), read through `datasets` in streaming mode, files in sorted
                           order; text and JSON files also compressed (.gz, .bz2, .xz, .zst)
    URLs or URL globs      the same file types in an object store (s3://bucket/corpus.jsonl,
                           s3://bucket/part-*.parquet: any fsspec URL, pretrain/data/storage.py),
                           downloaded into a temporary directory when first read and read from
                           there as local files are; identified by each object's URL, size and
                           ETag (`RemoteFile`), so an unchanged source is known without a download
    a Hub dataset name     the same streaming code path (`load_dataset(name, streaming=True)`)
    builtin:pydoc          the local Python installation's documentation: the `pydoc_data` topics
                           and the docstrings of the standard library, read with `ast` (nothing
                           is imported or downloaded)

Invalid UTF-8 policy: a file whose first 64 KiB hold a NUL byte or more than 1% undecodable
bytes is not text and is refused by name; elsewhere, undecodable bytes become U+FFFD.
.txt files are read with universal newlines: CRLF (and a lone CR) becomes LF. A UTF-8 byte-order
mark (U+FEFF) at the very start of a document is dropped; anywhere else it is kept as text.
A record whose text field is missing, null or not a string is refused, naming the source and the
record's index; documents that are empty or whitespace-only are skipped (and counted).

A compressed file is read as it is (`datasets` decompresses by suffix, and so do the checks here,
`open_file`): the same text compressed or not gives the same documents. An empty file (no bytes once
decompressed, a JSON file of blank lines only, a Parquet file of no rows) holds no record: it is
skipped and counted (`Source.empty_files`), and a source whose files are all empty is refused.

A directory source takes the known file types below it, in sorted order, except hidden paths
(a component starting with ".") and prepared datasets (a directory holding our manifest.json),
so a dataset written inside its own source directory never feeds back into it.
"""

from __future__ import annotations

import ast
import bz2
import glob
import gzip
import hashlib
import io
import itertools
import json
import lzma
import os
import shutil
import sys
import sysconfig
import tempfile
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pretrain import object_store
from pretrain.data.shards import is_prepared_dataset
from pretrain.errors import UserError

BUILTIN_PYDOC = "builtin:pydoc"
# The files a source takes, by suffix: the one definition (refusals name it; docs/data.md's table
# lists it, and a test holds the two together).
TEXT_SUFFIXES = (".txt", ".text", ".md")  # one document per file
JSON_SUFFIXES = (".jsonl", ".json")  # a record per line, its text field
PARQUET_SUFFIXES = (".parquet",)  # a record per row (Parquet compresses inside itself)
KNOWN_SUFFIXES = TEXT_SUFFIXES + JSON_SUFFIXES + PARQUET_SUFFIXES
# Text and JSON files may also be compressed: suffix -> the format's name.
COMPRESSIONS = {".gz": "gzip", ".bz2": "bzip2", ".xz": "xz", ".zst": "zstd"}
COMPRESSIBLE_SUFFIXES = TEXT_SUFFIXES + JSON_SUFFIXES
ACCEPTED_SUFFIXES = KNOWN_SUFFIXES + tuple(s + c for s in COMPRESSIBLE_SUFFIXES for c in COMPRESSIONS)
ACCEPTED = (
    f"{'/'.join(TEXT_SUFFIXES)}, {'/'.join(JSON_SUFFIXES)} (each also {'/'.join(COMPRESSIONS)}), "
    f"{'/'.join(PARQUET_SUFFIXES)}"
)
SNIFF_BYTES = 64 * 1024
MAX_INVALID_FRACTION = 0.01
BOM = "\ufeff"


# What identifies an object's content in a store's listing, in order of preference (S3's ETag,
# GCS's checksums, then a modification time): a source file's stat, as size and mtime are locally.
CONTENT_TAGS = ("ETag", "etag", "md5Hash", "crc32c", "LastModified", "last_modified", "updated", "mtime")


@dataclass(frozen=True)
class RemoteFile:
    """A source file in an object store: its URL, size and content tag (`CONTENT_TAGS`)."""

    url: str
    size: int
    tag: str


@dataclass
class Source:
    """An ordered, re-iterable stream of documents, with a stable description for manifests."""

    kind: str  # files | hub | builtin
    description: str
    files: list[Path] = field(default_factory=list)
    name: str | None = None
    text_field: str = "text"
    empty_files: list[Path] = field(default_factory=list)  # of `files`: no records, skipped
    remote: list[RemoteFile] = field(default_factory=list)  # files in a store, `files` once downloaded
    urls: dict[Path, str] = field(default_factory=dict)  # a downloaded file -> its URL

    @property
    def summary(self) -> str:
        """The description, short enough for a line: a directory of thousands of files is a count
        and the first few (the recipe keeps every path)."""
        if self.kind != "files" or len(self.files) <= 3:
            return self.description
        return f"{len(self.files):,} files ({_names(self.files)})"

    @property
    def skipped_line(self) -> str | None:
        """A line naming the empty files skipped, for the commands' reports (None: none)."""
        if not self.empty_files:
            return None
        count, named = len(self.empty_files), [self.urls.get(p, p) for p in self.empty_files]
        return f"skipped {count} empty file{'s' if count > 1 else ''} (no records): {_names(named)}"

    def documents(self) -> Iterator[str]:
        for _, _, doc in self.records():
            yield doc

    def records(self) -> Iterator[tuple[str, int, str]]:
        """(origin, record, text) of each document: the file's resolved path (or `hub:NAME`, or `builtin:pydoc`)
        it came from and its index there (a .txt file is one record, 0), so a document in the
        shards can be traced back to its text."""
        if self.kind == "builtin":
            records = ((BUILTIN_PYDOC, index, doc) for index, doc in enumerate(pydoc_documents()))
        elif self.kind == "hub":
            records = (
                (f"hub:{self.name}", index, doc) for index, doc in _hub_documents(self.name, self.text_field)
            )
        else:
            self.download()
            empty = set(self.empty_files)
            records = _file_records([p for p in self.files if p not in empty], self.text_field, self.urls)
        try:
            for origin, index, doc in records:
                # An editor's byte-order mark says how the file is encoded; it is not text.
                yield origin, index, doc[1:] if doc.startswith(BOM) else doc
        except UserError as exc:
            raise self.named(exc) from None

    def stat_digest(self) -> str | None:
        """A digest of each file's resolved path, size and mtime_ns (of an object in a store: its
        URL, size and content tag; None for other kinds), so a recipe changes when an input file
        does, though its name stays the same."""
        if self.kind != "files":
            return None
        digest = hashlib.sha256()
        if self.remote:  # (its downloaded copies are new files each time)
            for remote in self.remote:
                digest.update(f"{remote.url}\0{remote.size}\0{remote.tag}\n".encode())
            return digest.hexdigest()
        for path in self.files:
            stat = path.stat()
            digest.update(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
        return digest.hexdigest()

    def download(self) -> None:
        """The files in a store (`remote`), downloaded into a temporary directory (removed with
        this Source, or at exit) and checked as local files are; a no-op for local files and once
        done. Each failure is one line naming the URL."""
        if not self.remote or self.files:
            return
        root = Path(tempfile.mkdtemp(prefix="pretrain-source-"))
        weakref.finalize(self, shutil.rmtree, root, True)
        for index, remote in enumerate(self.remote):
            # Its own name (the suffix says how it is read) in a directory of its own.
            local = root / f"{index:05d}" / remote.url.rsplit("/", 1)[-1]
            local.parent.mkdir()
            fs, path = object_store.filesystem(remote.url)
            try:
                fs.get_file(path, str(local))
            except Exception as exc:  # the filesystems raise their own kinds
                raise UserError(object_store.problem(remote.url, exc)) from None
            if local.stat().st_size != remote.size:
                raise UserError(
                    f"{remote.url} changed while it was read ({local.stat().st_size:,} bytes, listed "
                    f"{remote.size:,}): run again once it is written"
                )
            self.files.append(local)
            self.urls[local] = remote.url
        try:
            self.empty_files = _empty_files(self.files, self.text_field)
        except UserError as exc:
            raise self.named(exc) from None

    def named(self, exc: UserError) -> UserError:
        """`exc` with each downloaded file's path replaced by its URL (the name a user gave)."""
        line = str(exc)
        for local, url in self.urls.items():
            line = line.replace(str(local.resolve()), url).replace(str(local), url)
        return UserError(line)


def resolve_source(specs: list[str] | str, text_field: str = "text") -> Source:
    """Turn `--source`/`--input` values into a Source, checking local files up front."""
    specs = [specs] if isinstance(specs, str) else list(specs)
    if not specs:
        raise UserError("no source given: pass --source PATH|GLOB|HUB_NAME|builtin:pydoc")
    if specs == [BUILTIN_PYDOC]:
        return Source("builtin", f"{BUILTIN_PYDOC} (Python {sysconfig.get_python_version()})")
    if BUILTIN_PYDOC in specs:
        raise UserError(f"{BUILTIN_PYDOC} cannot be mixed with other sources")
    if any(object_store.is_url(spec) for spec in specs):
        return _remote_source(specs, text_field)
    if len(specs) == 1 and _looks_like_hub_name(specs[0]):
        return Source("hub", f"hub:{specs[0]}", name=specs[0], text_field=text_field)
    files = _expand_files(specs)
    empty = _empty_files(files, text_field)
    # Resolved paths: the same files named from another directory are the same recipe.
    description = "files:" + ",".join(str(p.resolve()) for p in files)
    return Source("files", description, files=files, text_field=text_field, empty_files=empty)


def _empty_files(files: list[Path], text_field: str) -> list[Path]:
    """The files holding no records, each file checked (`_check_file`); refused when all are."""
    empty = [path for path in files if _check_file(path, text_field)]
    if empty and len(empty) == len(files):
        if len(files) == 1:
            raise UserError(f"{files[0]} is empty (no records): pass a file that holds documents")
        raise UserError(
            f"every source file is empty (no records): {_names(files)}; pass files that hold documents"
        )
    return empty


def _remote_source(specs: list[str], text_field: str) -> Source:
    """URLs or URL globs of files in an object store: listed now (names, sizes, content tags: the
    recipe), downloaded when first read (`Source.download`)."""
    if not all(object_store.is_url(spec) for spec in specs):
        raise UserError(
            f"--source mixes URLs and local paths ({', '.join(specs)}): pass URLs only (upload the local "
            "files beside the others) or local paths only"
        )
    remote = [found for spec in specs for found in _list_objects(spec)]
    for found in remote:
        if file_type(Path(found.url)) not in ACCEPTED_SUFFIXES:
            raise UserError(
                f"{found.url}: unsupported file type {file_type(Path(found.url))!r}; use {ACCEPTED}"
            )
    description = "files:" + ",".join(found.url for found in remote)
    return Source("files", description, text_field=text_field, remote=remote)


def _list_objects(spec: str) -> list[RemoteFile]:
    """The objects `spec` names (one, or a glob's matches in sorted order); one line when none."""
    fs, path = object_store.filesystem(spec)
    try:
        fs.invalidate_cache()  # (a listing this process made before may be stale: the recipe needs today's)
        if glob.has_magic(path):
            infos = [info for info in fs.glob(path, detail=True).values() if info.get("type") == "file"]
            if not infos:
                raise UserError(f"no objects match {spec!r}: check the pattern")
        else:
            infos = [fs.info(path)]
            if infos[0].get("type") != "file":
                raise UserError(
                    f"{spec} is a prefix, not an object: name its files, or a glob such as "
                    f"{spec.rstrip('/')}/*.jsonl"
                )
    except UserError:
        raise
    except Exception as exc:  # the filesystems raise their own kinds
        raise UserError(object_store.problem(spec, exc)) from None
    found = [
        RemoteFile(fs.unstrip_protocol(info["name"]), int(info["size"]), _content_tag(info)) for info in infos
    ]
    return sorted(found, key=lambda remote: remote.url)


def _content_tag(info: dict) -> str:
    """What in a store's listing of an object changes with its content (`CONTENT_TAGS`); "" when
    the store gives none of them (the size alone then identifies it)."""
    key = next((key for key in CONTENT_TAGS if info.get(key) is not None), None)
    return f"{key}={info[key]}" if key else ""


def _names(paths: Sequence[Path | str], shown: int = 3) -> str:
    more = f" and {len(paths) - shown:,} more" if len(paths) > shown else ""
    return ", ".join(str(p) for p in paths[:shown]) + more


def file_type(path: Path) -> str:
    """The suffix that says how a file is read: ".jsonl" for a.jsonl, ".jsonl.gz" for a.jsonl.gz."""
    if path.suffix in COMPRESSIONS and len(path.suffixes) > 1:
        return "".join(path.suffixes[-2:])
    return path.suffix


def content_suffix(path: Path) -> str:
    """The suffix of the file's content, compressed or not: ".jsonl" for a.jsonl and a.jsonl.gz."""
    kind = file_type(path)
    return kind[: -len(path.suffix)] if path.suffix in COMPRESSIONS else kind


def open_file(path: Path):
    """The file's content as a binary file object, decompressed as its suffix says. A .zst file
    needs the zstandard package (as `datasets` does): without it, one line saying to install it."""
    if path.suffix == ".gz":
        return gzip.open(path, "rb")
    if path.suffix == ".bz2":
        return bz2.open(path, "rb")
    if path.suffix == ".xz":
        return lzma.open(path, "rb")
    if path.suffix == ".zst":
        try:
            import zstandard
        except ImportError:
            raise UserError(
                f"{path} is zstd-compressed, which needs the zstandard package: pip install zstandard"
            ) from None
        # Buffered: whole reads of a size and lines, as the other formats' readers give.
        return io.BufferedReader(
            zstandard.ZstdDecompressor().stream_reader(
                open(path, "rb"), read_across_frames=True, closefd=True
            )
        )
    return open(path, "rb")


def decompression_errors() -> tuple[type[BaseException], ...]:
    """What reading a damaged compressed file raises (a truncated one: EOFError)."""
    errors: tuple[type[BaseException], ...] = (OSError, EOFError, lzma.LZMAError)
    zstandard = sys.modules.get("zstandard")
    return (*errors, zstandard.ZstdError) if zstandard is not None else errors


def _looks_like_hub_name(spec: str) -> bool:
    path = Path(spec)
    return not (
        path.exists()
        or glob.has_magic(spec)
        or path.suffix in KNOWN_SUFFIXES + tuple(COMPRESSIONS)
        or spec.startswith((".", "/"))
    )


def _expand_files(specs: list[str]) -> list[Path]:
    files: list[Path] = []
    for spec in specs:
        if glob.has_magic(spec):
            matches = sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file())
            if not matches:
                raise UserError(f"no files match {spec!r}: check the pattern")
            files.extend(matches)
        elif Path(spec).is_dir():
            matches = _directory_files(Path(spec))
            if not matches:
                raise UserError(f"{spec} holds no {ACCEPTED} files")
            files.extend(matches)
        elif Path(spec).is_file():
            files.append(Path(spec))
        else:
            raise UserError(f"{spec} does not exist: check the path")
    for path in files:
        if file_type(path) not in ACCEPTED_SUFFIXES:
            raise UserError(f"{path}: unsupported file type {file_type(path)!r}; use {ACCEPTED}")
    return files


def _directory_files(root: Path) -> list[Path]:
    """The known file types below `root`, sorted, leaving out hidden paths and prepared datasets
    (their manifest.json and tokenizer files are not a corpus)."""
    found = []
    for directory, subdirs, names in os.walk(root):
        here = Path(directory)
        if is_prepared_dataset(here):
            subdirs.clear()
            continue
        subdirs[:] = [d for d in subdirs if not d.startswith(".")]
        found += [
            here / n for n in names if not n.startswith(".") and file_type(Path(n)) in ACCEPTED_SUFFIXES
        ]
    return sorted(found)


def _check_file(path: Path, text_field: str) -> bool:
    """Refuse, by name, a file that is not what its suffix says, before anything is written; return
    whether it is empty (no records: `datasets` cannot read such a JSON or Parquet file)."""
    if path.stat().st_size == 0:
        return True
    if _kind(path) == "parquet":
        return _check_parquet(path, text_field)
    head = _head(path)
    if not head:
        return True
    if b"\x00" in head or _invalid_fraction(head) > MAX_INVALID_FRACTION:
        raise UserError(f"{path} is not text (binary or not UTF-8): remove it from the source")
    if _kind(path) == "json":
        return _check_json(path, head, text_field)
    return False


def _head(path: Path) -> bytes:
    """The first SNIFF_BYTES of the file's content (all of it, when shorter)."""
    return next(_blocks(path, SNIFF_BYTES), b"")


def _blocks(path: Path, size: int = 1 << 20) -> Iterator[bytes]:
    """The file's content in blocks of `size` bytes (the last one shorter); a compressed file that
    does not decompress is refused by name."""
    with open_file(path) as f:
        try:
            while block := f.read(size):
                yield block
        except decompression_errors() as exc:
            if path.suffix not in COMPRESSIONS:
                raise
            raise UserError(
                f"{path} does not decompress as {COMPRESSIONS[path.suffix]} ({_first_line(exc)}): replace it "
                "with a whole copy, or remove it from the source"
            ) from None


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _check_parquet(path: Path, text_field: str) -> bool:
    import pyarrow.parquet as pq

    with open(path, "rb") as f:
        if f.read(4) != b"PAR1":
            raise UserError(f"{path} is not a Parquet file")
    names = pq.read_schema(path).names
    if text_field not in names:
        raise UserError(
            f"{path} has no field {text_field!r} (fields: {', '.join(names)}): pass --text-field NAME"
        )
    return pq.ParquetFile(path).metadata.num_rows == 0


def _check_json(path: Path, head: bytes, text_field: str) -> bool:
    first = next((line for line in head.decode("utf-8", errors="replace").splitlines() if line.strip()), None)
    if first is None:  # blank lines only, so far
        return len(head) < SNIFF_BYTES or _blank_to_the_end(path)
    try:
        record = json.loads(first)
    except json.JSONDecodeError:
        if len(head) == SNIFF_BYTES and "\n" not in head.decode("utf-8", errors="replace"):
            return False  # a first line longer than the sniff window: let the reader judge it
        raise UserError(f"{path} is not JSON lines (the first line does not parse)") from None
    if not isinstance(record, dict):
        raise UserError(f"{path}: each line must be a JSON object with a {text_field!r} field")
    if text_field not in record:
        raise UserError(
            f"{path} has no field {text_field!r} (fields: {', '.join(record)}): pass --text-field NAME"
        )
    return False


def _blank_to_the_end(path: Path) -> bool:
    return not any(block.strip() for block in _blocks(path))


def _invalid_fraction(data: bytes) -> float:
    if not data:
        return 0.0
    text = data.decode("utf-8", errors="replace")
    # A multi-byte character cut by the sniff window is not an error.
    invalid = text.count("\ufffd") - data.decode("utf-8", errors="ignore").count("\ufffd")
    if text.endswith("\ufffd") and len(data) == SNIFF_BYTES:
        invalid -= 1
    return max(invalid, 0) / len(data)


def _file_records(
    files: list[Path], text_field: str, urls: dict[Path, str]
) -> Iterator[tuple[str, int, str]]:
    """Text files (one record each) go through one streaming `load_dataset` call per run of
    consecutive ones; a JSON or Parquet file gets its own call, so each record knows its file (its
    resolved path, or for a file downloaded from a store, its URL in `urls`)."""
    run: list[Path] = []
    for path in [*files, None]:
        if run and (path is None or _kind(path) != "text"):
            for file, (_, text) in zip(run, _stream_files(run, text_field), strict=True):
                yield urls.get(file) or str(file.resolve()), 0, text
            run = []
        if path is not None and _kind(path) == "text":
            run.append(path)
        elif path is not None:
            for index, text in _stream_files([path], text_field):
                yield urls.get(path) or str(path.resolve()), index, text


def _kind(path: Path) -> str:
    suffix = content_suffix(path)
    if suffix in TEXT_SUFFIXES:
        return "text"
    return "json" if suffix in JSON_SUFFIXES else "parquet"


def _stream_files(files: list[Path], text_field: str) -> Iterator[tuple[int, str]]:
    import datasets

    # Its "Failed to load JSON ..." line (logged at ERROR) would come before our one-line error.
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        yield from _stream_files_quietly(files, text_field)
    finally:
        datasets.logging.set_verbosity(verbosity)


def _stream_files_quietly(files: list[Path], text_field: str) -> Iterator[tuple[int, str]]:
    import datasets

    kind = _kind(files[0])
    data_files = [str(p) for p in files]
    options = (
        {"sample_by": "document", "keep_linebreaks": True, "encoding_errors": "replace"}
        if kind == "text"
        else {}
    )
    if kind == "json":
        options = {"encoding_errors": "replace"}
    field_name = "text" if kind == "text" else text_field
    where = f"{', '.join(data_files[:3])}{'...' if len(files) > 3 else ''}"
    # One reader streams all the files, so a record's index counts across them.
    record_of = f"of {where}" if len(files) == 1 else f"(counting across {where} in order)"
    try:
        dataset = datasets.load_dataset(kind, data_files=data_files, split="train", streaming=True, **options)
        for index, record in enumerate(dataset):
            yield index, _text_of(record, field_name, index, record_of)
    # A record the reader cannot parse, or a compressed file damaged past the part checked.
    except (ValueError, TypeError, *decompression_errors()) as exc:
        if isinstance(exc, decompression_errors()):
            _refuse_damaged(files)
        raise UserError(f"could not read {where}: {_first_line(exc)}") from None


def _refuse_damaged(files: list[Path]) -> None:
    """The compressed file among `files` that does not decompress, refused by name and with what
    to do, as one damaged within the part checked up front is (`_blocks`): the reader's error names
    neither. Each is read to its end, which costs a pass only once reading has already failed."""
    for path in files:
        if path.suffix in COMPRESSIONS:
            for _ in _blocks(path):
                pass


def _text_of(record: dict, field_name: str, index: int, record_of: str) -> str:
    """The record's text; a missing or non-string one is refused, not silently made empty."""
    text = record.get(field_name)
    if isinstance(text, str):
        return text
    # The readers fill a field a record lacks with None, so null and missing look the same.
    found = "null or missing" if text is None else json.dumps(text, default=repr)[:80]
    raise UserError(
        f"record {index} {record_of} has no string {field_name!r} field (it is {found}): "
        "fix or drop that record"
    )


def _hub_documents(name: str, text_field: str) -> Iterator[tuple[int, str]]:
    import datasets
    from huggingface_hub.utils import logging as hub_logging

    hub_logging.set_verbosity_error()  # its retry warnings would bury the one-line error below
    try:
        dataset = datasets.load_dataset(name, split="train", streaming=True)
        iterator = iter(dataset)
        first = next(iterator, None)
    except Exception as exc:  # the Hub's errors are many (offline, not found, gated, ...)
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"cannot open Hub dataset {name!r} ({detail}): check the name and the network, or use local files"
        ) from None
    if first is None:
        return
    if text_field not in first:
        raise UserError(
            f"Hub dataset {name!r} has no field {text_field!r} (fields: {', '.join(first)}): pass --text-field"
        )
    for index, record in enumerate(itertools.chain([first], iterator)):
        yield index, _text_of(record, text_field, index, f"of Hub dataset {name!r}")


# --------------------------------------------------------------------------- builtin:pydoc

_SKIP_DIRS = {
    "test",
    "tests",
    "idlelib",
    "lib2to3",
    "turtledemo",
    "site-packages",
    "__pycache__",
    "ensurepip",
}


def pydoc_documents() -> Iterator[str]:
    """The pydoc topics (the language reference sections `help()` shows), then one document per
    standard-library module with its module, class and function docstrings, in a fixed order."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    for key in sorted(topics):
        yield topics[key]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        relative = path.relative_to(stdlib)
        if _SKIP_DIRS & set(relative.parts):
            continue
        doc = _module_docstrings(path, ".".join(relative.with_suffix("").parts))
        if doc:
            yield doc


def _module_docstrings(path: Path, module: str) -> str | None:
    try:
        tree = ast.parse(path.read_bytes())
    except (SyntaxError, ValueError, OSError):
        return None
    parts = []
    doc = ast.get_docstring(tree)
    if doc:
        parts.append(f"{module}\n\n{doc}")
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            doc = ast.get_docstring(node)
            if doc and not node.name.startswith("_"):
                parts.append(f"{module}.{node.name}\n\n{doc}")
    return "\n\n".join(parts) if parts else None
