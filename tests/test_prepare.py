import json
import math
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pretrain.data import prepare_dataset, resolve_source
from pretrain.data.shards import token_dtype
from pretrain.errors import UserError
from pretrain.tokenizer import Tokenizer

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


@pytest.mark.parametrize("workers", [1, 2])
def test_round_trip_and_manifest(tmp_path, tokenizer_dir, workers):
    source = resolve_source(str(write_jsonl(tmp_path / "docs.jsonl", DOCS)))
    out = tmp_path / "out"
    manifest = prepare_dataset(
        source, tokenizer_dir, out, val_fraction=0.1, shard_tokens=1024, workers=workers, progress=False
    )
    tok = Tokenizer.load(tokenizer_dir)
    train, val = read_split(out, manifest, "train", tok), read_split(out, manifest, "validation", tok)
    assert len(val) == 4 and len(train) == 36
    assert interleave(train, val, 0.1) == DOCS  # exact: identity normalization, byte fallback
    assert manifest["format_version"] == 1 and manifest["dtype"] == "<u2"
    assert manifest["tokenizer"] == {"sha256": tok.sha256, "vocab_size": 512, "eos_id": 2}
    assert manifest["source"].startswith("files:") and manifest["val_fraction"] == 0.1
    shards = manifest["splits"]["train"]["shards"]
    assert len(shards) > 1 and all(s["tokens"] == 1024 for s in shards[:-1])
    assert sum(s["tokens"] for s in shards) == manifest["splits"]["train"]["tokens"]
    assert (out / "tokenizer.model").read_bytes() == (tokenizer_dir / "tokenizer.model").read_bytes()
    assert not list(tmp_path.glob(".out.*")), "no staging directory is left behind"


def test_output_is_byte_identical_for_any_worker_count(tmp_path, tokenizer_dir):
    source = resolve_source(str(write_jsonl(tmp_path / "docs.jsonl", DOCS * 20)))
    outputs = []
    for workers in (1, 2, 3):
        out = tmp_path / f"w{workers}"
        prepare_dataset(
            source, tokenizer_dir, out, val_fraction=0.05, shard_tokens=4096, workers=workers, progress=False
        )
        outputs.append({p.name: p.read_bytes() for p in sorted(out.iterdir())})
    assert outputs[0] == outputs[1] == outputs[2]
    assert len(outputs[0]) > 4


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


def test_invalid_utf8_is_replaced(tmp_path, tokenizer_dir):
    path = tmp_path / "mostly.txt"
    path.write_bytes(("valid text " * 200).encode() + b"\xff\xfe" + b" more text")
    manifest = prepare_dataset(
        resolve_source(str(path)), tokenizer_dir, tmp_path / "out", val_fraction=0, progress=False
    )
    [doc] = read_split(tmp_path / "out", manifest, "train", Tokenizer.load(tokenizer_dir))
    assert doc.endswith("valid text \ufffd\ufffd more text")


def test_bad_inputs(tmp_path, tokenizer_dir):
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
    with pytest.raises(UserError, match="exists and is not empty"):
        prepare_dataset(source, tokenizer_dir, stray, progress=False)
    assert (stray / "notes.txt").read_text() == "mine"


def test_dtype_choice():
    assert token_dtype(512) == np.dtype("<u2") and token_dtype(65536) == np.dtype("<u2")
    assert token_dtype(65537) == np.dtype("<u4")


def run_cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "pretrain", *args], capture_output=True, text=True, timeout=300, env=env
    )


def test_cli_tokenizer_and_prepare(tmp_path):
    docs = write_jsonl(tmp_path / "docs.jsonl", DOCS * 10)
    result = run_cli(
        "tokenizer", "train", "--input", str(docs), "--vocab-size", "400", "--out", str(tmp_path / "tok")
    )
    assert result.returncode == 0, result.stderr
    again = run_cli(
        "tokenizer", "train", "--input", str(docs), "--vocab-size", "400", "--out", str(tmp_path / "tok")
    )
    assert again.returncode == 2 and "--overwrite" in again.stderr
    result = run_cli(
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
    )
    assert result.returncode == 0, result.stderr
    assert "train: 360 documents" in result.stdout and "validation: 40 documents" in result.stdout


def test_cli_errors_are_one_line(tmp_path, tokenizer_dir):
    import os

    env = os.environ | {"HF_HUB_OFFLINE": "1"}
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
        result = run_cli(*args, env=env)
        assert result.returncode == 2, result
        assert result.stderr.strip().count("\n") == 0 and fragment in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
