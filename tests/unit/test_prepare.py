import json
import logging
import math
import os
import re
import signal
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import pretrain.data.prepare as prepare_module
from pretrain.data import prepare_dataset, resolve_source
from pretrain.data.prepare import prepare
from pretrain.data.progress import count_documents
from pretrain.data.shards import DocumentIndex, ShardWriter, token_dtype
from pretrain.data.sources import Source
from pretrain.errors import UserError
from pretrain.tokenizer import Tokenizer
from tests.helpers import assert_one_line_error

DOCS = [
    "The first document.\nIt has two lines.",
    "  leading spaces, a tab\tand unicode: é 日本語 🤗",
    "def f(x):\n    return x * 2\n",
    "short",
    "Another document with numbers 12345 and punctuation!?",
    "\n\nblank lines around\n\n",
    "the seventh",
    "the eighth, which is a bit longer than the others " * 5,
] * 5


def write_jsonl(path, docs, field="text"):
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def read_split(out, manifest, split, tokenizer):
    """The documents of a split, decoded from its shards (documents end with EOS)."""
    dtype = np.dtype(manifest["dtype"])
    tokens = np.concatenate(
        [np.fromfile(out / s["file"], dtype=dtype) for s in manifest["splits"][split]["shards"]]
        or [np.array([], dtype)]
    )
    ends = np.flatnonzero(tokens == tokenizer.eos_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    assert len(ends) == 0 or ends[-1] == len(tokens) - 1, "every document ends with EOS"
    return [tokenizer.decode(tokens[a:b].tolist()) for a, b in zip(starts, ends, strict=True)]


def interleave(train, val, fraction):
    """Undo the evenly spaced hold-out: document i is validation iff floor((i+1)F) > floor(iF)."""
    train, val, out = iter(train), iter(val), []
    for i in range(len(train_list := list(train)) + len(val_list := list(val))):
        held = math.floor((i + 1) * fraction) > math.floor(i * fraction)
        out.append(val_list.pop(0) if held else train_list.pop(0))
    return out


def test_round_trip_and_manifest(tmp_path, tokenizer_dir, workers=1):
    source = resolve_source(str(write_jsonl(tmp_path / "docs.jsonl", DOCS)))
    out = tmp_path / "out"
    manifest = prepare_dataset(
        source, tokenizer_dir, out, val_fraction=0.1, shard_tokens=1024, workers=workers, progress=False
    )
    tok = Tokenizer.load(tokenizer_dir)
    train, val = read_split(out, manifest, "train", tok), read_split(out, manifest, "validation", tok)
    assert len(val) == 4 and len(train) == 36
    assert interleave(train, val, 0.1) == DOCS  # exact: identity normalization, byte fallback
    assert manifest["format_version"] == 2 and manifest["dtype"] == "<u2"
    # The document index: every document's origin, record and first token, in both splits.
    assert manifest["documents"]["origins"] == [str(tmp_path / "docs.jsonl")]
    for split, docs in (("train", train), ("validation", val)):
        index = DocumentIndex(out, split, manifest)
        assert len(index.rows) == manifest["splits"][split]["documents"] == len(docs)
        held = [i for i in range(len(DOCS)) if math.floor((i + 1) * 0.1) > math.floor(i * 0.1)]
        records = held if split == "validation" else [i for i in range(len(DOCS)) if i not in held]
        assert index.rows[:, 2].tolist() == records and set(index.rows[:, 1].tolist()) == {0}
        tokens = np.concatenate(
            [np.fromfile(out / s["file"], dtype="<u2") for s in manifest["splits"][split]["shards"]]
        )
        for k in (0, 3, len(docs) - 1):
            (doc,) = [d for d in index.overlapping(int(index.rows[k, 0]), int(index.rows[k, 0]) + 1)]
            first, last = doc["tokens"]
            assert tok.decode(tokens[first : last - 1].tolist()) == DOCS[doc["record"]]  # (EOS last)
    assert manifest["tokenizer"] == {"sha256": tok.sha256, "vocab_size": 512, "eos_id": 2}
    assert manifest["source"].startswith("files:") and manifest["val_fraction"] == 0.1
    shards = manifest["splits"]["train"]["shards"]
    assert len(shards) > 1 and all(s["tokens"] == 1024 for s in shards[:-1])
    assert sum(s["tokens"] for s in shards) == manifest["splits"]["train"]["tokens"]
    assert (out / "tokenizer.model").read_bytes() == (tokenizer_dir / "tokenizer.model").read_bytes()
    assert not list(tmp_path.glob(".out.*")), "no staging directory is left behind"


def test_txt_parquet_globs_and_directories(tmp_path, tokenizer_dir):
    texts = tmp_path / "texts"
    texts.mkdir()
    for i, doc in enumerate(DOCS[:8]):
        (texts / f"{i:02d}.txt").write_text(doc)  # one document per file, sorted by name
    table = pa.table({"content": DOCS[:8], "n": list(range(8))})
    pq.write_table(table, tmp_path / "docs.parquet")
    tok = Tokenizer.load(tokenizer_dir)
    for specs, field in (
        ([str(texts / "*.txt")], "text"),
        ([str(texts)], "text"),
        ([str(tmp_path / "docs.parquet")], "content"),
    ):
        out = tmp_path / f"out-{len(list(tmp_path.iterdir()))}"
        manifest = prepare_dataset(
            resolve_source(specs, field), tokenizer_dir, out, val_fraction=0.0, progress=False
        )
        assert read_split(out, manifest, "train", tok) == DOCS[:8], specs
        index = DocumentIndex(out, "train", manifest)
        origins = [index.origins[o] for o in index.rows[:, 1]]
        if field == "text":  # a text file is one document, record 0
            assert origins == [str(texts / f"{i:02d}.txt") for i in range(8)] and set(index.rows[:, 2]) == {0}
        else:
            assert origins == [str(tmp_path / "docs.parquet")] * 8 and index.rows[:, 2].tolist() == list(
                range(8)
            )


def test_invalid_utf8_is_replaced(tmp_path, tokenizer_dir):
    path = tmp_path / "mostly.txt"
    path.write_bytes(("valid text " * 200).encode() + b"\xff\xfe" + b" more text")
    manifest = prepare_dataset(
        resolve_source(str(path)), tokenizer_dir, tmp_path / "out", val_fraction=0, progress=False
    )
    [doc] = read_split(tmp_path / "out", manifest, "train", Tokenizer.load(tokenizer_dir))
    assert doc.endswith("valid text \ufffd\ufffd more text")


def test_bad_inputs(tmp_path, tokenizer_dir, monkeypatch):
    def prepare(spec, field="text", **kw):
        return prepare_dataset(
            resolve_source(spec, field), tokenizer_dir, tmp_path / "out", progress=False, **kw
        )

    binary = tmp_path / "image.txt"
    binary.write_bytes(bytes(range(256)) * 100)
    with pytest.raises(UserError, match=r"image.txt is not text"):
        prepare(str(binary))
    empty = write_jsonl(tmp_path / "empty.jsonl", ["", "   ", "\n"])
    with pytest.raises(UserError, match="corpus is empty"):
        prepare(str(empty))
    with pytest.raises(UserError, match=r"has no field 'body' \(fields: text, id\): pass --text-field"):
        prepare(str(write_jsonl(tmp_path / "a.jsonl", DOCS)), field="body")
    pq.write_table(pa.table({"content": ["x"]}), tmp_path / "b.parquet")
    with pytest.raises(UserError, match="b.parquet has no field 'text'"):
        prepare(str(tmp_path / "b.parquet"))
    (tmp_path / "c.jsonl").write_text("this is not json\n")
    with pytest.raises(UserError, match="c.jsonl is not JSON lines"):
        prepare(str(tmp_path / "c.jsonl"))
    (tmp_path / "d.parquet").write_text("not parquet")
    with pytest.raises(UserError, match="d.parquet is not a Parquet file"):
        prepare(str(tmp_path / "d.parquet"))
    with pytest.raises(UserError, match="no files match"):
        prepare(str(tmp_path / "*.nothing"))
    with pytest.raises(UserError, match="does not exist"):
        prepare(str(tmp_path / "missing.jsonl"))
    monkeypatch.chdir(tmp_path)  # a relative path, not a Hub dataset's name
    with pytest.raises(UserError, match="missing.jsonl.gz does not exist"):
        prepare("missing.jsonl.gz")
    (tmp_path / "CREDITS.gz").write_bytes(b"")
    with pytest.raises(UserError, match=r"CREDITS.gz: unsupported file type '.gz'; use .txt/.text/.md, "):
        prepare(str(tmp_path / "CREDITS.gz"))
    with pytest.raises(UserError, match="selects no document"):
        prepare(str(write_jsonl(tmp_path / "few.jsonl", DOCS[:3])), val_fraction=0.2)
    assert not (tmp_path / "out").exists(), "a failed prepare leaves no output"
    assert not list(tmp_path.glob(".out.*")), "and no staging directory"


def test_existing_output_directories(tmp_path, tokenizer_dir):
    source = resolve_source(str(write_jsonl(tmp_path / "docs.jsonl", DOCS)))
    out = tmp_path / "out"
    first = prepare_dataset(source, tokenizer_dir, out, val_fraction=0.1, progress=False)
    # The same recipe again is a no-op.
    assert prepare_dataset(source, tokenizer_dir, out, val_fraction=0.1, progress=False) == first
    with pytest.raises(UserError, match="already holds a different dataset.*--overwrite"):
        prepare_dataset(source, tokenizer_dir, out, val_fraction=0.2, progress=False)
    second = prepare_dataset(source, tokenizer_dir, out, val_fraction=0.2, overwrite=True, progress=False)
    assert second["val_fraction"] == 0.2 and json.loads((out / "manifest.json").read_text()) == second
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "notes.txt").write_text("mine")
    for overwrite in (False, True):
        with pytest.raises(UserError, match="stray is not a prepared dataset; refusing to replace it"):
            prepare_dataset(source, tokenizer_dir, stray, overwrite=overwrite, progress=False)
    assert (stray / "notes.txt").read_text() == "mine"


def test_overwrite_replaces_only_our_own_datasets(tmp_path, tokenizer_dir):
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    source = resolve_source(str(write_jsonl(inputs / "docs.jsonl", DOCS)))
    with pytest.raises(UserError, match=r"docs.jsonl lies inside --out .*inputs"):
        prepare_dataset(source, tokenizer_dir, inputs, overwrite=True, progress=False)
    with pytest.raises(UserError, match="lies inside --out"):
        prepare_dataset(source, tokenizer_dir, tmp_path, overwrite=True, progress=False)
    other = tmp_path / "other"
    other.mkdir()
    (other / "manifest.json").write_text(json.dumps({"format": "someone-elses"}))
    with pytest.raises(UserError, match="other is not a prepared dataset; refusing to replace it"):
        prepare_dataset(source, tokenizer_dir, other, overwrite=True, progress=False)
    a_file = tmp_path / "a_file"
    a_file.write_text("mine")
    with pytest.raises(UserError, match="a_file is not a prepared dataset"):
        prepare_dataset(source, tokenizer_dir, a_file, overwrite=True, progress=False)
    assert (inputs / "docs.jsonl").is_file() and (other / "manifest.json").is_file()
    assert a_file.read_text() == "mine"
    empty = tmp_path / "empty"
    empty.mkdir()
    prepare_dataset(source, tokenizer_dir, empty, val_fraction=0.1, overwrite=True, progress=False)
    assert (empty / "manifest.json").is_file()


def test_recipe_follows_the_source_files(tmp_path, tokenizer_dir, monkeypatch):
    path = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    out = tmp_path / "out"
    monkeypatch.chdir(tmp_path)
    source = resolve_source("docs.jsonl")
    assert source.description == f"files:{path.resolve()}"
    first = prepare(source, tokenizer_dir, out, val_fraction=0.1, progress=False)
    assert first.written
    # The same file named from elsewhere is the same recipe.
    monkeypatch.chdir(tmp_path.parent)
    again = prepare(resolve_source(str(path)), tokenizer_dir, out, val_fraction=0.1, progress=False)
    assert again == (first.manifest, False)
    # Same name and size, new contents: the mtime gives it away.
    before = path.stat()
    path.write_text(path.read_text().replace("first", "FIRST"))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))
    assert path.stat().st_size == before.st_size
    with pytest.raises(UserError, match="already holds a different dataset"):
        prepare(resolve_source(str(path)), tokenizer_dir, out, val_fraction=0.1, progress=False)
    rebuilt = prepare(
        resolve_source(str(path)), tokenizer_dir, out, val_fraction=0.1, overwrite=True, progress=False
    )
    assert rebuilt.written and rebuilt.manifest["fingerprint"] != first.manifest["fingerprint"]


def test_damaged_shards_are_rebuilt_not_reported_as_done(tmp_path, tokenizer_dir):
    source = resolve_source(str(write_jsonl(tmp_path / "docs.jsonl", DOCS)))
    out = tmp_path / "out"
    manifest = prepare_dataset(
        source, tokenizer_dir, out, val_fraction=0.1, shard_tokens=1024, progress=False
    )
    original = {p.name: p.read_bytes() for p in out.iterdir()}
    shard = out / manifest["splits"]["train"]["shards"][-1]["file"]
    with open(shard, "r+b") as f:
        f.truncate(10)
    result = prepare(source, tokenizer_dir, out, val_fraction=0.1, shard_tokens=1024, progress=False)
    assert result.written and result.manifest == manifest
    assert {p.name: p.read_bytes() for p in out.iterdir()} == original
    (out / manifest["splits"]["validation"]["shards"][0]["file"]).unlink()
    assert prepare(source, tokenizer_dir, out, val_fraction=0.1, shard_tokens=1024, progress=False).written


def test_records_without_a_text_string_are_refused(tmp_path, tokenizer_dir, monkeypatch):
    rows = ['{"text": "fine"}', '{"text": ""}', '{"text": null}']
    (tmp_path / "null.jsonl").write_text("\n".join(rows) + "\n")
    (tmp_path / "missing.jsonl").write_text('{"text": "fine"}\n{"id": 1}\n')
    (tmp_path / "number.jsonl").write_text('{"text": "fine"}\n{"text": "x"}\n{"text": 7}\n')
    pq.write_table(pa.table({"text": ["fine", None]}), tmp_path / "null.parquet")
    for name, fragment in (
        ("null.jsonl", "record 2 of .*null.jsonl has no string 'text' field \\(it is null or missing\\)"),
        (
            "missing.jsonl",
            "record 1 of .*missing.jsonl has no string 'text' field \\(it is null or missing\\)",
        ),
        ("number.jsonl", "record 2 of .*number.jsonl has no string 'text' field \\(it is 7\\)"),
        ("null.parquet", "record 1 of .*null.parquet has no string 'text' field"),
    ):
        with pytest.raises(UserError, match=fragment):
            prepare_dataset(
                resolve_source(str(tmp_path / name)), tokenizer_dir, tmp_path / "out", progress=False
            )
    good = write_jsonl(tmp_path / "good.jsonl", DOCS[:3])
    both = resolve_source([str(good), str(tmp_path / "null.jsonl")])
    with pytest.raises(
        UserError, match=r"record 2 of .*null.jsonl has no string"
    ):  # each file counts its own
        list(both.documents())
    # Blank strings are documents with no text: skipped and counted, not refused.
    write_jsonl(tmp_path / "blanks.jsonl", [*DOCS, "", "  \n"])
    manifest = prepare_dataset(
        resolve_source(str(tmp_path / "blanks.jsonl")),
        tokenizer_dir,
        tmp_path / "out",
        val_fraction=0.1,
        progress=False,
    )
    assert manifest["stats"]["skipped_blank_documents"] == 2
    import datasets

    records = [{"text": "a"}, {"text": "b"}, {"text": None}]
    monkeypatch.setattr(datasets, "load_dataset", lambda name, split, streaming: iter(records))
    hub = Source("hub", "hub:someone/corpus", name="someone/corpus")
    with pytest.raises(UserError, match="record 2 of Hub dataset 'someone/corpus' has no string 'text'"):
        list(hub.documents())


def test_pieces_cut_after_newlines():
    pieces = list(prepare_module._pieces("ab\ncd\nefghijkl\n", 5))
    assert pieces == [("ab\n", False), ("cd\n", False), ("efghi", False), ("jkl\n", True)]
    assert list(prepare_module._pieces("short", 5)) == [("short", True)]
    assert list(prepare_module._pieces("x" * 12, None)) == [("x" * 12, True)]


def test_directory_source_skips_prepared_datasets_and_hidden_paths(tmp_path, tokenizer_dir):
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / ".cache").mkdir()
    (corpus / "a.txt").write_text("a document")
    (corpus / "sub" / "b.jsonl").write_text('{"text": "b"}\n')
    (corpus / ".hidden.txt").write_text("hidden")
    (corpus / ".cache" / "c.txt").write_text("cached")
    prepare_dataset(
        resolve_source(str(corpus / "a.txt")),
        tokenizer_dir,
        corpus / "prepared",
        val_fraction=0,
        progress=False,
    )
    (corpus / ".prepared.partial-1-abcd").mkdir()  # a staging directory, as an interrupted run leaves it
    (corpus / ".prepared.partial-1-abcd" / "manifest.json").write_text("{}")
    files = resolve_source(str(corpus)).files
    assert [p.relative_to(corpus).as_posix() for p in files] == ["a.txt", "sub/b.jsonl"]
    with pytest.raises(UserError, match="holds no"):
        resolve_source(str(corpus / "prepared"))


def test_byte_order_marks_and_crlf(tmp_path, tokenizer_dir):
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfline one\r\nline two\r\n")
    write_jsonl(tmp_path / "bom.jsonl", ["\ufeffjson text", "inner \ufeff kept"])
    assert list(resolve_source(str(tmp_path / "bom.txt")).documents()) == ["line one\nline two\n"]
    assert list(resolve_source(str(tmp_path / "bom.jsonl")).documents()) == ["json text", "inner \ufeff kept"]


def test_workers_ignore_ctrl_c(tokenizer_dir, monkeypatch):
    monkeypatch.setattr(prepare_module, "_worker_tokenizer", None)
    previous = signal.getsignal(signal.SIGINT)
    try:
        prepare_module._init_worker(str(tokenizer_dir / "tokenizer.model"))
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_stale_staging_directories_are_removed(tmp_path, tokenizer_dir):
    dead = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # no process can have this pid
    stale = tmp_path / f".out.partial-{dead}-0123abcd"
    live = tmp_path / f".out.partial-{os.getpid()}-4567abcd"
    unrelated = tmp_path / f".other.partial-{dead}-0123abcd"
    for directory in (stale, live, unrelated):
        directory.mkdir()
        (directory / "train_00000.bin").write_bytes(b"partial")
    source = resolve_source(str(write_jsonl(tmp_path / "docs.jsonl", DOCS)))
    prepare_dataset(source, tokenizer_dir, tmp_path / "out", val_fraction=0.1, progress=False)
    assert not stale.exists() and live.is_dir() and unrelated.is_dir()


def test_reader_errors_are_not_logged_before_ours(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": broken\n')
    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    logger = logging.getLogger("datasets")
    logger.addHandler(handler)
    try:
        with pytest.raises(UserError, match="could not read .*bad.jsonl"):
            list(resolve_source(str(tmp_path / "bad.jsonl")).documents())
    finally:
        logger.removeHandler(handler)
    assert not [r for r in seen if "Failed to load JSON" in r.getMessage()]


def test_written_files_have_normal_permissions_and_shards_are_synced(tmp_path, tokenizer_dir, monkeypatch):
    umask = os.umask(0o022)
    os.umask(umask)
    source = resolve_source(str(write_jsonl(tmp_path / "docs.jsonl", DOCS)))
    manifest = prepare_dataset(source, tokenizer_dir, tmp_path / "out", val_fraction=0.1, progress=False)
    for name in ("manifest.json", "tokenizer_meta.json", manifest["splits"]["train"]["shards"][0]["file"]):
        assert (tmp_path / "out" / name).stat().st_mode & 0o777 == 0o666 & ~umask, name
    synced = []
    monkeypatch.setattr(os, "fsync", synced.append)
    writer = ShardWriter(tmp_path, "train", np.dtype("<u2"), shard_tokens=10)
    writer.write(np.arange(25), documents=1)
    assert len(synced) == 2  # each full shard, on closing it
    writer.finish()
    assert len(synced) == 3


def test_dtype_choice():
    assert token_dtype(512) == np.dtype("<u2") and token_dtype(65536) == np.dtype("<u2")
    assert token_dtype(65537) == np.dtype("<u4")


def test_cli_tokenizer_and_prepare(tmp_path, cli):
    docs = write_jsonl(tmp_path / "docs.jsonl", DOCS * 10)
    result = cli(
        "tokenizer", "train", "--input", str(docs), "--vocab-size", "400", "--out", str(tmp_path / "tok")
    )
    assert result.returncode == 0, result.stderr
    again = cli(
        "tokenizer", "train", "--input", str(docs), "--vocab-size", "400", "--out", str(tmp_path / "tok")
    )
    assert again.returncode == 2 and "--overwrite" in again.stderr
    prepare_args = (
        "data",
        "prepare",
        "--source",
        str(docs),
        "--tokenizer",
        str(tmp_path / "tok"),
        "--out",
        str(tmp_path / "data"),
        "--val-fraction",
        "0.1",
        "--no-progress",
        "--workers",
        "1",
    )
    result = cli(*prepare_args)
    assert result.returncode == 0, result.stderr
    assert "train: 360 documents" in result.stdout and "validation: 40 documents" in result.stdout
    assert "wrote " in result.stdout
    again = cli(*prepare_args)
    assert again.returncode == 0, again.stderr
    assert "already holds this dataset; nothing to do" in again.stderr and "wrote" not in again.stdout


def test_cli_errors_are_one_line(tmp_path, tokenizer_dir, cli):
    cases = [
        (
            [
                "data",
                "prepare",
                "--source",
                "someone/no-such-dataset",
                "--tokenizer",
                str(tokenizer_dir),
                "--out",
                str(tmp_path / "o"),
            ],
            "cannot open Hub dataset",
        ),
        (
            [
                "data",
                "prepare",
                "--source",
                "builtin:pydoc",
                "--tokenizer",
                str(tmp_path),
                "--out",
                str(tmp_path / "o"),
            ],
            "no tokenizer",
        ),
        (
            [
                "tokenizer",
                "train",
                "--input",
                str(tmp_path / "nope.txt"),
                "--vocab-size",
                "400",
                "--out",
                str(tmp_path / "t"),
            ],
            "does not exist",
        ),
    ]
    for args, fragment in cases:
        result = cli(*args)
        assert result.returncode == 2, result
        assert result.stderr.strip().count("\n") == 0 and fragment in result.stderr, result.stderr
        assert "Traceback" not in result.stderr


def test_a_version_1_dataset_still_trains_and_naming_its_documents_asks_to_prepare_again(tmp_path):
    from pretrain.data import WindowStream
    from pretrain.data.provenance import Provenance
    from tests.conftest import write_synthetic_dataset

    manifest = write_synthetic_dataset(tmp_path / "old", (600,))
    manifest["format_version"] = 1  # before the document index
    (tmp_path / "old" / "manifest.json").write_text(json.dumps(manifest))
    stream = WindowStream(tmp_path / "old", 512)
    assert len(next(stream)) == 513
    with pytest.raises(UserError, match=r"has no document index \(format version 1\): prepare it again"):
        Provenance([("data", tmp_path / "old", 1.0)], 512).window(0)


# --------------------------------------------------------------------------- compressed and empty files


def compress(data: bytes, suffix: str) -> bytes:
    import bz2
    import gzip
    import lzma

    if suffix == ".zst":
        return pytest.importorskip("zstandard").ZstdCompressor().compress(data)
    return {".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress}[suffix](data)


def test_compressed_files_give_the_same_tokens_as_uncompressed(tmp_path, tokenizer_dir):
    plain, packed = tmp_path / "plain", tmp_path / "packed"
    plain.mkdir()
    packed.mkdir()
    files = {  # each kind of content under each compression
        "a.jsonl": (".gz", "".join(json.dumps({"text": d}) + "\n" for d in DOCS[:16])),
        "b.txt": (".bz2", "a text file\r\nwith CRLF line ends\r\n"),
        "c.md": (".xz", "# a heading\n\nmarkdown text\n"),
        "d.json": (".zst", "".join(json.dumps({"text": d}) + "\n" for d in DOCS[16:])),
        "e.text": (".gz", "\ufeffa byte-order mark, then text"),
    }
    for name, (suffix, text) in files.items():
        (plain / name).write_bytes(text.encode())
        (packed / (name + suffix)).write_bytes(compress(text.encode(), suffix))
    manifests = [
        prepare_dataset(
            resolve_source(str(d)),
            tokenizer_dir,
            tmp_path / f"out-{d.name}",
            val_fraction=0.1,
            progress=False,
        )
        for d in (plain, packed)
    ]
    assert manifests[0]["fingerprint"] == manifests[1]["fingerprint"]
    assert manifests[0]["splits"] == manifests[1]["splits"]  # the same shards, token for token
    assert manifests[1]["stats"] == {"skipped_blank_documents": 0, "skipped_empty_files": 0}
    docs = list(resolve_source(str(packed)).documents())
    assert docs == list(resolve_source(str(plain)).documents()) and len(docs) == len(DOCS) + 3
    # The progress bar's total: a line per JSON Lines record (a .json file is not counted).
    counted = resolve_source(sorted(str(p) for p in packed.iterdir() if ".json." not in p.name))
    assert count_documents(counted) == 16 + 3


def test_a_zst_source_without_zstandard_is_one_line(tmp_path, tokenizer_dir, cli, monkeypatch):
    (tmp_path / "a.jsonl.zst").write_bytes(b"(not read: the package is missing)")
    monkeypatch.setitem(sys.modules, "zstandard", None)  # `import zstandard` raises ImportError
    for args in (
        ["data", "prepare", "--source", tmp_path, "--tokenizer", tokenizer_dir, "--out", tmp_path / "o"],
        ["tokenizer", "train", "--source", tmp_path, "--vocab-size", "400", "--out", tmp_path / "t"],
    ):
        assert_one_line_error(cli(*args), "a.jsonl.zst", "pip install zstandard")
    assert not (tmp_path / "o").exists() and not (tmp_path / "t").exists()


def test_a_damaged_compressed_file_is_refused_by_name(tmp_path, tokenizer_dir):
    records = "".join(json.dumps({"text": f"record {i} " * 20}) + "\n" for i in range(3000)).encode()
    whole = compress(records, ".gz")
    (tmp_path / "cut.jsonl.gz").write_bytes(whole[:200])  # cut inside the part checked up front
    (tmp_path / "late.jsonl.gz").write_bytes(whole[: len(whole) // 2])  # cut after it
    (tmp_path / "plain.txt.xz").write_bytes(b"not xz at all")
    flipped = bytearray(whole)
    flipped[len(whole) // 2] ^= 0xFF  # a corrupt byte after the part checked: CRC or data error
    (tmp_path / "flipped.jsonl.gz").write_bytes(bytes(flipped))
    todo = "replace it with a whole copy, or remove it from the source"
    for name, fragment in (
        ("cut.jsonl.gz", r"cut.jsonl.gz does not decompress as gzip \(Compressed file ended"),
        ("plain.txt.xz", r"plain.txt.xz does not decompress as xz"),
        ("late.jsonl.gz", rf"late.jsonl.gz does not decompress as gzip \(Compressed file ended.*\): {todo}$"),
        ("flipped.jsonl.gz", rf"flipped.jsonl.gz does not decompress as gzip \(.*\): {todo}$"),
    ):
        with pytest.raises(UserError, match=fragment):
            prepare_dataset(
                resolve_source(str(tmp_path / name)), tokenizer_dir, tmp_path / "o", progress=False
            )
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.*"))


def write_empty_files(directory: Path) -> list[Path]:
    """One empty file of each kind: no bytes, an empty gzip stream, blank lines, no Parquet rows."""
    directory.mkdir(exist_ok=True)
    for name in ("empty.jsonl", "empty.json", "empty.txt", "zero.jsonl.gz"):
        (directory / name).write_bytes(b"")
    (directory / "empty.jsonl.gz").write_bytes(compress(b"", ".gz"))
    (directory / "blank.jsonl").write_text("\n  \n\n")
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), directory / "zero.parquet")
    return sorted(directory.iterdir())


def test_empty_files_are_skipped_and_counted(tmp_path, cli):
    corpus = tmp_path / "corpus"
    empty = write_empty_files(corpus)
    write_jsonl(corpus / "good.jsonl", DOCS * 10)
    source = resolve_source(str(corpus))
    assert source.empty_files == empty and list(source.documents()) == DOCS * 10
    assert count_documents(source) == len(DOCS) * 10
    result = cli("tokenizer", "train", "--source", corpus, "--vocab-size", "400", "--out", tmp_path / "tok")
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert (
        f"skipped 7 empty files (no records): {empty[0]}, {empty[1]}, {empty[2]} and 4 more" in result.stderr
    )
    args = ["--tokenizer", tmp_path / "tok", "--workers", "1", "--val-fraction", "0.1"]
    result = cli("data", "prepare", "--source", corpus, "--out", tmp_path / "data", *args)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert "train: 360 documents" in result.stdout and "skipped 7 empty files (no records)" in result.stdout
    manifest = json.loads((tmp_path / "data" / "manifest.json").read_text())
    assert manifest["stats"] == {"skipped_blank_documents": 0, "skipped_empty_files": 7}


def test_a_source_of_empty_files_only_is_refused_by_name(tmp_path, tokenizer_dir, cli):
    empty = write_empty_files(tmp_path / "corpus")
    result = cli(
        "data",
        "prepare",
        "--source",
        tmp_path / "corpus",
        "--tokenizer",
        tokenizer_dir,
        "--out",
        tmp_path / "o",
    )
    assert_one_line_error(result, "every source file is empty (no records)", str(empty[0]), "and 4 more")
    for path in empty:  # each alone, in either command
        for args in (
            ["data", "prepare", "--tokenizer", tokenizer_dir, "--out", tmp_path / "o"],
            ["tokenizer", "train", "--vocab-size", "400", "--out", tmp_path / "t"],
        ):
            assert_one_line_error(cli(*args, "--source", path), f"{path} is empty (no records)")
    assert not (tmp_path / "o").exists() and not (tmp_path / "t").exists()


def test_the_docs_list_exactly_the_accepted_suffixes():
    """docs/data.md's table of suffixes, and the refusals, say what resolve_source takes."""
    from pretrain.data.sources import ACCEPTED, ACCEPTED_SUFFIXES, COMPRESSIONS, KNOWN_SUFFIXES

    text = (Path(__file__).resolve().parents[2] / "docs" / "data.md").read_text()
    section = text[text.index("**Sources.**") : text.index("**Text policy.**")]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `.")]
    listed = [suffix for row in rows for suffix in re.findall(r"`(\.[a-z0-9.]+)`", row)]
    assert sorted(listed) == sorted(ACCEPTED_SUFFIXES) and len(set(listed)) == len(listed)
    assert all(s in ACCEPTED for s in (*KNOWN_SUFFIXES, *COMPRESSIONS))


def test_url_sources_are_listed_then_downloaded_and_read_as_local_files(tmp_path, tokenizer_dir, monkeypatch):
    """A source in an object store (fsspec's memory:// here; S3 through moto's server in
    tests/integration/test_s3.py): a glob's objects in sorted order give the local files' shards,
    named by URL in the document index and in what is said; the same recipe again downloads
    nothing; a prefix, a pattern matching nothing and URLs mixed with paths are one line each."""
    import fsspec

    fs, root = fsspec.filesystem("memory"), f"memory://unit-{os.getpid()}-{tmp_path.name}"
    local = [
        write_jsonl(tmp_path / name, docs) for name, docs in (("a.jsonl", DOCS[:3]), ("b.jsonl", DOCS[3:]))
    ]
    for path in local:
        fs.pipe_file(f"{root}/corpus/{path.name}", path.read_bytes())
    fs.pipe_file(f"{root}/corpus/c.jsonl", b"")
    source = resolve_source(f"{root}/corpus/*.jsonl")
    urls = [remote.url for remote in source.remote]
    assert [url.rsplit("/", 1)[1] for url in urls] == ["a.jsonl", "b.jsonl", "c.jsonl"] and not source.files
    ours = prepare(source, tokenizer_dir, tmp_path / "ours", val_fraction=0.1, progress=False).manifest
    theirs = prepare_dataset(
        resolve_source(str(tmp_path / "*.jsonl")), tokenizer_dir, tmp_path / "theirs", 0.1, progress=False
    )
    assert ours["splits"] == theirs["splits"] and ours["documents"]["origins"] == urls[:2]
    assert source.skipped_line == f"skipped 1 empty file (no records): {urls[2]}"
    monkeypatch.setattr(Source, "download", lambda self: pytest.fail("the same recipe downloaded its source"))
    again = prepare(
        resolve_source(f"{root}/corpus/*.jsonl"), tokenizer_dir, tmp_path / "ours", val_fraction=0.1
    )
    assert not again.written
    monkeypatch.undo()
    fs.pipe_file(f"{root}/corpus/d.jsonl", b"not json\n")
    with pytest.raises(UserError, match=r"^memory://\S+/corpus/d.jsonl is not JSON lines"):
        prepare(resolve_source(f"{root}/corpus/d.jsonl"), tokenizer_dir, tmp_path / "d", progress=False)
    for spec, line in (
        ([f"{root}/corpus"], "is a prefix, not an object: name its files, or a glob such as"),
        ([f"{root}/corpus/*.parquet"], "no objects match"),
        ([f"{root}/corpus/a.jsonl", str(local[1])], "--source mixes URLs and local paths"),
    ):
        with pytest.raises(UserError, match=re.escape(line)):
            resolve_source(spec)
