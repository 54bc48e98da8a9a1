"""Where documents come from: local files, a Hugging Face Hub dataset, or a built-in corpus.

    local files or globs   .txt (one document per file), .jsonl/.json and .parquet (a text field),
                           read through `datasets` in streaming mode, files in sorted order
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

A directory source takes the known file types below it, in sorted order, except hidden paths
(a component starting with ".") and prepared datasets (a directory holding our manifest.json),
so a dataset written inside its own source directory never feeds back into it.
"""

from __future__ import annotations

import ast
import glob
import hashlib
import itertools
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pretrain.data.shards import is_prepared_dataset
from pretrain.errors import UserError

BUILTIN_PYDOC = "builtin:pydoc"
TEXT_SUFFIXES = (".txt", ".text", ".md")
JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
KNOWN_SUFFIXES = TEXT_SUFFIXES + JSON_SUFFIXES + PARQUET_SUFFIXES
SNIFF_BYTES = 64 * 1024
MAX_INVALID_FRACTION = 0.01
BOM = "\ufeff"


@dataclass
class Source:
    """An ordered, re-iterable stream of documents, with a stable description for manifests."""

    kind: str  # files | hub | builtin
    description: str
    files: list[Path] = field(default_factory=list)
    name: str | None = None
    text_field: str = "text"

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
            records = _file_records(self.files, self.text_field)
        for origin, index, doc in records:
            # An editor's byte-order mark says how the file is encoded; it is not text.
            yield origin, index, doc[1:] if doc.startswith(BOM) else doc

    def stat_digest(self) -> str | None:
        """A digest of each file's resolved path, size and mtime_ns (None for other kinds), so a
        recipe changes when an input file does, though its name stays the same."""
        if self.kind != "files":
            return None
        digest = hashlib.sha256()
        for path in self.files:
            stat = path.stat()
            digest.update(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
        return digest.hexdigest()


def resolve_source(specs: list[str] | str, text_field: str = "text") -> Source:
    """Turn `--source`/`--input` values into a Source, checking local files up front."""
    specs = [specs] if isinstance(specs, str) else list(specs)
    if not specs:
        raise UserError("no source given: pass --source PATH|GLOB|HUB_NAME|builtin:pydoc")
    if specs == [BUILTIN_PYDOC]:
        return Source("builtin", f"{BUILTIN_PYDOC} (Python {sysconfig.get_python_version()})")
    if BUILTIN_PYDOC in specs:
        raise UserError(f"{BUILTIN_PYDOC} cannot be mixed with other sources")
    if len(specs) == 1 and _looks_like_hub_name(specs[0]):
        return Source("hub", f"hub:{specs[0]}", name=specs[0], text_field=text_field)
    files = _expand_files(specs)
    for path in files:
        _check_file(path, text_field)
    # Resolved paths: the same files named from another directory are the same recipe.
    description = "files:" + ",".join(str(p.resolve()) for p in files)
    return Source("files", description, files=files, text_field=text_field)


def _looks_like_hub_name(spec: str) -> bool:
    path = Path(spec)
    return not (
        path.exists() or glob.has_magic(spec) or path.suffix in KNOWN_SUFFIXES or spec.startswith((".", "/"))
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
                raise UserError(f"{spec} holds no {'/'.join(KNOWN_SUFFIXES)} files")
            files.extend(matches)
        elif Path(spec).is_file():
            files.append(Path(spec))
        else:
            raise UserError(f"{spec} does not exist: check the path")
    for path in files:
        if path.suffix not in KNOWN_SUFFIXES:
            raise UserError(f"{path}: unsupported file type {path.suffix!r}; use {', '.join(KNOWN_SUFFIXES)}")
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
        found += [here / n for n in names if not n.startswith(".") and Path(n).suffix in KNOWN_SUFFIXES]
    return sorted(found)


def _check_file(path: Path, text_field: str) -> None:
    """Refuse, by name, a file that is not what its suffix says, before anything is written."""
    with open(path, "rb") as f:
        head = f.read(SNIFF_BYTES)
    if path.suffix in PARQUET_SUFFIXES:
        import pyarrow.parquet as pq

        if not head.startswith(b"PAR1"):
            raise UserError(f"{path} is not a Parquet file")
        names = pq.read_schema(path).names
        if text_field not in names:
            raise UserError(
                f"{path} has no field {text_field!r} (fields: {', '.join(names)}): pass --text-field NAME"
            )
        return
    if b"\x00" in head or _invalid_fraction(head) > MAX_INVALID_FRACTION:
        raise UserError(f"{path} is not text (binary or not UTF-8): remove it from the source")
    if path.suffix in JSON_SUFFIXES:
        first = next(
            (line for line in head.decode("utf-8", errors="replace").splitlines() if line.strip()), None
        )
        if first is None:
            return  # empty file: contributes no documents
        try:
            record = json.loads(first)
        except json.JSONDecodeError:
            if len(head) == SNIFF_BYTES and "\n" not in head.decode("utf-8", errors="replace"):
                return  # a first line longer than the sniff window: let the reader judge it
            raise UserError(f"{path} is not JSON lines (the first line does not parse)") from None
        if not isinstance(record, dict):
            raise UserError(f"{path}: each line must be a JSON object with a {text_field!r} field")
        if text_field not in record:
            raise UserError(
                f"{path} has no field {text_field!r} (fields: {', '.join(record)}): pass --text-field NAME"
            )


def _invalid_fraction(data: bytes) -> float:
    if not data:
        return 0.0
    text = data.decode("utf-8", errors="replace")
    # A multi-byte character cut by the sniff window is not an error.
    invalid = text.count("\ufffd") - data.decode("utf-8", errors="ignore").count("\ufffd")
    if text.endswith("\ufffd") and len(data) == SNIFF_BYTES:
        invalid -= 1
    return max(invalid, 0) / len(data)


def _file_records(files: list[Path], text_field: str) -> Iterator[tuple[str, int, str]]:
    """Text files (one record each) go through one streaming `load_dataset` call per run of
    consecutive ones; a JSON or Parquet file gets its own call, so each record knows its file."""
    run: list[Path] = []
    for path in [*files, None]:
        if run and (path is None or _kind(path) != "text"):
            for file, (_, text) in zip(run, _stream_files(run, text_field), strict=True):
                yield str(file.resolve()), 0, text
            run = []
        if path is not None and _kind(path) == "text":
            run.append(path)
        elif path is not None:
            for index, text in _stream_files([path], text_field):
                yield str(path.resolve()), index, text


def _kind(path: Path) -> str:
    if path.suffix in TEXT_SUFFIXES:
        return "text"
    return "json" if path.suffix in JSON_SUFFIXES else "parquet"


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
    dataset = datasets.load_dataset(kind, data_files=data_files, split="train", streaming=True, **options)
    try:
        for index, record in enumerate(dataset):
            yield index, _text_of(record, field_name, index, record_of)
    except (ValueError, TypeError, OSError) as exc:  # a record the reader cannot parse
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"could not read {where}: {first}") from None


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
