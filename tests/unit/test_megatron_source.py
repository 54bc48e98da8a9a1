"""A corpus tokenized for Megatron-LM or GPT-NeoX as a `data prepare` source (--format megatron).

The .bin/.idx pairs here come from `write_megatron`, a writer of the format written from its
specification (Megatron-LM's megatron/core/datasets/indexed_dataset.py: header, sequence lengths,
sequence pointers, document indices), not from our reader: the prepared shards must hold exactly
the written ids, each document followed by our EOS, and every broken pair is refused in one line.
"""

import json
import math
import pydoc_data.topics
import struct
from pathlib import Path

import numpy as np
import pytest

import pretrain.data.megatron as megatron
from pretrain.config import load_config
from pretrain.data.prepare import prepare
from pretrain.data.shards import DocumentIndex, read_manifest
from pretrain.tokenizer import Tokenizer
from tests.helpers import FAST, TINY, assert_one_line_error
from tests.unit.fakes import pretraining_trainer

# The format's token dtype codes (Megatron-LM's DType enum).
MEGATRON_CODES = {1: "u1", 2: "i1", 3: "<i2", 4: "<i4", 5: "<i8", 6: "<f8", 7: "<f4", 8: "<u2"}
EOS = 2  # the session tokenizer's (every tokenizer trained here has eos 2)
VOCAB = 512


def write_megatron(prefix, documents, code, dtype=None, version=1, magic=b"MMIDIDX\x00\x00"):
    """PREFIX.bin + PREFIX.idx of `documents` (each a list of sequences, each a list of ids),
    written as the format specifies: the .bin is the sequences' tokens back to back; the .idx is
    the 9-byte magic, version (uint64), dtype code (uint8), sequence count and document-index
    count (uint64 each), then int32 sequence lengths, int64 sequence byte offsets, and the int64
    document indices (0, then the sequence count after each document). Returns the prefix."""
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    dtype = np.dtype(dtype or MEGATRON_CODES[code])
    lengths, pointers, document_indices = [], [], [0]
    with open(f"{prefix}.bin", "wb") as data:
        for document in documents:
            for sequence in document:
                pointers.append(data.tell())
                data.write(np.array(sequence, dtype=dtype).tobytes())
                lengths.append(len(sequence))
            document_indices.append(len(lengths))
    with open(f"{prefix}.idx", "wb") as index:
        index.write(magic)
        index.write(struct.pack("<Q", version))
        index.write(struct.pack("<B", code))
        index.write(struct.pack("<Q", len(lengths)))
        index.write(struct.pack("<Q", len(document_indices)))
        index.write(np.array(lengths, dtype="<i4").tobytes())
        index.write(np.array(pointers, dtype="<i8").tobytes())
        index.write(np.array(document_indices, dtype="<i8").tobytes())
    return prefix


def sample_documents(seed, count=40, low=3, high=127):
    """Documents of 1 to 4 sequences of random ids in [low, high) (no EOS: ids start at 3)."""
    rng = np.random.default_rng(seed)
    return [
        [rng.integers(low, high, rng.integers(1, 30)).tolist() for _ in range(rng.integers(1, 5))]
        for _ in range(count)
    ]


def expected_splits(documents, val_fraction, eos=EOS):
    """What `prepare` writes for text: each non-blank document's ids then EOS (not a second one),
    held out evenly by position among the documents kept; with their (record, tokens) rows."""
    split = {"train": [], "validation": []}
    rows = {"train": [], "validation": []}
    kept = 0
    for record, document in enumerate(documents):
        ids = [token for sequence in document for token in sequence]
        if not ids or ids == [eos]:
            continue
        ids = ids if ids[-1] == eos else [*ids, eos]
        held = math.floor((kept + 1) * val_fraction) > math.floor(kept * val_fraction)
        kept += 1
        name = "validation" if held else "train"
        rows[name].append((sum(map(len, split[name])), record))
        split[name].append(ids)
    return {name: [t for ids in docs for t in ids] for name, docs in split.items()}, rows


def read_tokens(out, manifest, split):
    dtype = np.dtype(manifest["dtype"])
    parts = [np.fromfile(out / s["file"], dtype=dtype) for s in manifest["splits"][split]["shards"]]
    return np.concatenate(parts).tolist() if parts else []


def check_prepared(out, manifest, documents, prefix, val_fraction, origin_index=0):
    expected, rows = expected_splits(documents, val_fraction)
    for split in ("train", "validation"):
        assert read_tokens(out, manifest, split) == expected[split], split
        index = DocumentIndex(out, split, manifest)
        assert [(int(a), int(c)) for a, _, c in index.rows] == rows[split]
        assert {int(b) for b in index.rows[:, 1]} <= {origin_index}
    assert manifest["documents"]["origins"][origin_index] == f"megatron:{Path(prefix).resolve()}"


@pytest.mark.parametrize(
    ("code", "dtype"),
    [*MEGATRON_CODES.items(), (6, "<f4"), (7, "<f8")],  # GPT-NeoX: 6 float32, 7 float64
    ids=[*(MEGATRON_CODES[c] for c in MEGATRON_CODES), "neox-6-f4", "neox-7-f8"],
)
def test_every_dtype_code_gives_the_written_ids_with_eos_between_documents(
    tmp_path, tokenizer_dir, code, dtype
):
    kind = np.dtype(dtype or MEGATRON_CODES[code])
    # Ids up to the dtype's largest (uint8: 255, read as int8 it would be negative) or the vocabulary's.
    documents = sample_documents(
        code, high=min(VOCAB, np.iinfo(kind).max + 1) if kind.kind in "iu" else VOCAB
    )
    prefix = write_megatron(tmp_path / "corpus_text_document", documents, code, dtype)
    out = tmp_path / "data"
    manifest = prepare(
        megatron.resolve_megatron_source(str(prefix)), tokenizer_dir, out, val_fraction=0.2, progress=False
    ).manifest
    check_prepared(out, manifest, documents, prefix, 0.2)
    assert manifest["splits"]["train"]["documents"] + manifest["splits"]["validation"]["documents"] == 40
    assert manifest["source"] == f"megatron:{prefix.resolve()}" and manifest["dtype"] == "<u2"
    assert read_manifest(out) == manifest


def test_sequences_empty_documents_and_documents_ending_in_eos(tmp_path, tokenizer_dir):
    documents = [
        [[5, 6, 7], [8, 9]],  # two sequences (sentences): one document
        [],  # no sequences: empty, skipped
        [[10, 11, EOS]],  # written with --append-eod: no second EOS
        [[], [12]],  # an empty sequence inside a document
        [[EOS]],  # blank text with --append-eod: skipped
        [[]],  # a zero-length sequence only: skipped
        [[13], [14, 15], [16, EOS]],
        [[17, EOS, 18]],  # an EOS inside a document stays as written
    ] * 3
    prefix = write_megatron(tmp_path / "c", documents, 8)
    out = tmp_path / "data"
    manifest = prepare(
        megatron.resolve_megatron_source(f"{prefix}.idx"),
        tokenizer_dir,
        out,
        val_fraction=0.25,
        progress=False,
    ).manifest
    check_prepared(out, manifest, documents, prefix, 0.25)
    assert manifest["stats"] == {"skipped_blank_documents": 9, "documents_ending_in_eos": 6}
    assert manifest["splits"]["train"]["documents"] + manifest["splits"]["validation"]["documents"] == 15


def test_batches_and_long_documents_in_pieces_give_the_same_bytes(tmp_path, tokenizer_dir, monkeypatch):
    rng = np.random.default_rng(7)
    documents = [*sample_documents(3, count=60), [rng.integers(3, 500, 300).tolist()], *sample_documents(4)]
    documents[10] = [[*rng.integers(3, 500, 200).tolist(), EOS]]  # a long one already ending in EOS
    prefix = write_megatron(tmp_path / "c", documents, 4)
    source = megatron.resolve_megatron_source(str(prefix))
    whole = prepare(source, tokenizer_dir, tmp_path / "whole", val_fraction=0.1, progress=False).manifest
    check_prepared(tmp_path / "whole", whole, documents, prefix, 0.1)
    monkeypatch.setattr(megatron, "BATCH_TOKENS", 64)
    monkeypatch.setattr(megatron, "BATCH_DOCS", 5)
    pieces = prepare(source, tokenizer_dir, tmp_path / "pieces", val_fraction=0.1, progress=False).manifest
    check_prepared(tmp_path / "pieces", pieces, documents, prefix, 0.1)
    assert pieces["fingerprint"] == whole["fingerprint"] and pieces["documents"] == whole["documents"]


def test_several_prefixes_a_glob_and_a_directory(tmp_path, tokenizer_dir):
    first = write_megatron(tmp_path / "shards" / "a_text_document", sample_documents(1), 8)
    second = write_megatron(tmp_path / "shards" / "b_text_document", sample_documents(2), 4)
    for spec in (
        [str(first), str(second)],
        [str(tmp_path / "shards" / "*_text_document")],
        [str(first.parent)],
    ):
        source = megatron.resolve_megatron_source(spec)
        assert [d.prefix for d in source.datasets] == [first, second]
    out = tmp_path / "data"
    manifest = prepare(source, tokenizer_dir, out, val_fraction=0.0, progress=False).manifest
    expected = (
        expected_splits(sample_documents(1), 0.0)[0]["train"]
        + expected_splits(sample_documents(2), 0.0)[0]["train"]
    )
    assert read_tokens(out, manifest, "train") == expected
    assert manifest["documents"]["origins"] == [f"megatron:{first.resolve()}", f"megatron:{second.resolve()}"]
    rows = DocumentIndex(out, "train", manifest).rows
    assert [(int(o), int(r)) for _, o, r in rows] == [(0, r) for r in range(40)] + [(1, r) for r in range(40)]


def prepare_args(prefix, tokenizer_dir, out, *extra):
    return ("data", "prepare", "--source", str(prefix), "--format", "megatron", "--tokenizer", str(tokenizer_dir),
            "--out", str(out), "--no-progress", *extra)  # fmt: skip


def test_the_cli_prepares_it_once_and_asks_for_the_format_flag(tmp_path, tokenizer_dir, cli):
    prefix = write_megatron(tmp_path / "c", sample_documents(5, count=100), 3)
    result = cli(*prepare_args(prefix, tokenizer_dir, tmp_path / "data", "--val-fraction", "0.1"))
    assert result.returncode == 0, result.stderr
    assert "train: 90 documents" in result.stdout and "validation: 10 documents" in result.stdout
    again = cli(*prepare_args(prefix, tokenizer_dir, tmp_path / "data", "--val-fraction", "0.1"))
    assert again.returncode == 0 and "already holds this dataset; nothing to do" in again.stderr
    shown = cli(
        *prepare_args(prefix, tokenizer_dir, tmp_path / "shown")[:-1]
    )  # with progress (no tty: lines)
    assert shown.returncode == 0, shown.stderr
    assert "converting 100 documents" in shown.stderr and "converted 100 documents into" in shown.stderr
    assert "tokeniz" not in shown.stderr  # nothing is tokenized
    Path(f"{prefix}.bin").touch()  # the recipe follows the files
    changed = cli(*prepare_args(prefix, tokenizer_dir, tmp_path / "data", "--val-fraction", "0.1"))
    assert_one_line_error(changed, "already holds a different dataset")
    for spec in (prefix, f"{prefix}.bin"):
        plain = cli("data", "prepare", "--source", str(spec), "--tokenizer", str(tokenizer_dir), "--out",
                    str(tmp_path / "o"))  # fmt: skip
        assert_one_line_error(plain, "is a Megatron indexed dataset", "pass --format megatron")


def damage(prefix, how):
    """Break a written pair one way; return the fragment its refusal must name."""
    bin_path, idx_path = Path(f"{prefix}.bin"), Path(f"{prefix}.idx")
    data = bytearray(idx_path.read_bytes())
    if how == "truncated .bin":
        bin_path.write_bytes(bin_path.read_bytes()[:-3])
        return "the .bin is truncated, or the two are not one pair"
    if how == "longer .bin":
        bin_path.write_bytes(bin_path.read_bytes() + b"\0\0")
        return "the .bin is longer than its index says"
    if how == "truncated .idx":
        idx_path.write_bytes(data[:-8])
        return "it is truncated"
    if how == "header only":
        idx_path.write_bytes(data[:20])
        return "shorter than the 34-byte header"
    if how == "count mismatch":  # the header counts one sequence more than the index holds
        data[18:26] = struct.pack("<Q", struct.unpack("<Q", data[18:26])[0] + 1)
        idx_path.write_bytes(data)
        return "it is truncated"
    if how == "mismatched pair":  # another corpus's .idx beside this .bin
        other = write_megatron(Path(prefix).parent / "other", sample_documents(99), 8)
        idx_path.write_bytes(Path(f"{other}.idx").read_bytes())
        return "or the two are not one pair"
    if how == "bad magic":
        data[:4] = b"JUNK"
        idx_path.write_bytes(data)
        return "is not a Megatron indexed dataset index"
    if how == "old format":
        idx_path.write_bytes(b"TNTIDX\x00\x00" + bytes(data[8:]))
        return "--dataset-impl mmap"
    if how == "bad version":
        data[9:17] = struct.pack("<Q", 2)
        idx_path.write_bytes(data)
        return "index version 2"
    if how == "bad dtype":
        data[17] = 9
        idx_path.write_bytes(data)
        return "token dtype code 9"
    if how == "pointer":
        sequences = struct.unpack("<Q", data[18:26])[0]
        at = 34 + 4 * sequences + 8 * 2  # the third sequence's pointer
        data[at : at + 8] = struct.pack("<q", struct.unpack("<q", data[at : at + 8])[0] + 2)
        idx_path.write_bytes(data)
        return "sequence 2 starts at byte"
    if how == "boundaries out of order":
        sequences = struct.unpack("<Q", data[18:26])[0]
        at = 34 + 12 * sequences + 8 * 3  # the third document's end
        data[at : at + 8] = struct.pack("<q", 0)
        idx_path.write_bytes(data)
        return "ends before it starts"
    if how == "multimodal":
        sequences = struct.unpack("<Q", data[18:26])[0]
        idx_path.write_bytes(bytes(data) + bytes(sequences))
        return "multimodal"
    if how == "missing .idx":
        idx_path.unlink()
        return "is missing beside"
    raise AssertionError(how)


@pytest.mark.parametrize(
    "how",
    [
        "truncated .bin",
        "longer .bin",
        "truncated .idx",
        "header only",
        "count mismatch",
        "mismatched pair",
        "bad magic",
        "old format",
        "bad version",
        "bad dtype",
        "pointer",
        "boundaries out of order",
        "multimodal",
        "missing .idx",
    ],
)
def test_a_broken_pair_is_refused_in_one_line_and_nothing_is_written(tmp_path, tokenizer_dir, cli, how):
    prefix = write_megatron(tmp_path / "src" / "c", sample_documents(11), 8)
    fragment = damage(prefix, how)
    result = cli(*prepare_args(prefix, tokenizer_dir, tmp_path / "data"))
    assert_one_line_error(result, fragment)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no output, no staging directory


@pytest.mark.parametrize(
    ("code", "bad_id", "fragment"),
    [
        (8, VOCAB, f"holds id {VOCAB} at token 4"),
        (4, -1, "holds id -1 at token 4"),
        (7, 4.5, "holds id 4.5 at token 4"),
        (6, float("nan"), "holds id nan at token 4"),
    ],
)
def test_ids_outside_the_vocabulary_are_refused_naming_the_document(
    tmp_path, tokenizer_dir, cli, code, bad_id, fragment
):
    documents = sample_documents(12)
    documents[17] = [[5, 6], [7, 8, bad_id]]
    prefix = write_megatron(tmp_path / "src" / "c", documents, code)
    result = cli(*prepare_args(prefix, tokenizer_dir, tmp_path / "data"))
    assert_one_line_error(result, f"document 17 {fragment}", f"vocabulary size {VOCAB}", "pass --tokenizer")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_inspect_names_the_megatron_document_behind_a_window(tmp_path, tokenizer_dir, cli):
    tokenizer = Tokenizer.load(tokenizer_dir)
    topics = pydoc_data.topics.topics
    texts = [topics[key] for key in sorted(topics)[:30]]
    # Each topic a document of one sequence per paragraph, as preprocess_data.py --split-sentences would.
    documents = [[tokenizer.encode(p) for p in text.split("\n\n") if p] for text in texts]
    prefix = write_megatron(tmp_path / "pile_text_document", documents, 8)
    data = tmp_path / "data"
    assert cli(*prepare_args(prefix, tokenizer_dir, data, "--val-fraction", "0")).returncode == 0
    run_dir = tmp_path / "run"
    overrides = [*FAST, f"run.dir={run_dir}", f"data.dir={data}", "data.seq_len=512", "train.steps=2"]
    cfg = load_config(TINY, [*overrides, "eval.every=0", "checkpoint.every=2"])
    pretraining_trainer(cfg).train()
    step = json.loads((run_dir / "data_trace" / "rank_00000.jsonl").read_text().splitlines()[-1])["step"]
    report = json.loads(
        cli("data", "inspect", "--run-dir", str(run_dir), "--step", str(step), "--json").stdout
    )
    windows = report["attempts"][0]["windows"]
    assert len(windows) == 2  # train.micro_batch_size
    for window in windows:
        # The window's ids are its documents' written ids, each followed by EOS, from its first token.
        ids = []
        for doc in window["documents"]:
            assert doc["origin"] == f"megatron:{prefix.resolve()}"
            ids += [t for sequence in documents[doc["record"]] for t in sequence] + [EOS]
        start = window["tokens"][0] - window["documents"][0]["tokens"][0]
        assert window["text"] == tokenizer.decode(ids[start : start + 513])[: len(window["text"])]
        assert len(window["text"]) > 20
    human = cli("data", "inspect", "--run-dir", str(run_dir), "--step", str(step))
    assert human.returncode == 0, human.stderr
    first = windows[0]["documents"][0]
    assert f"megatron:{prefix.resolve()}  document {first['record']}  (document tokens" in human.stdout
