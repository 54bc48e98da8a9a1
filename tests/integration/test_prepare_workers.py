"""`data prepare` with several tokenizer worker processes: the same bytes as one worker."""

import subprocess
import sys

import pretrain.data.prepare as prepare_module
from pretrain.data import prepare_dataset, resolve_source
from pretrain.tokenizer import Tokenizer
from tests.unit.test_prepare import DOCS, interleave, read_split, write_jsonl
from tests.unit.test_prepare import test_round_trip_and_manifest as round_trip


def test_round_trip_and_manifest_with_two_workers(tmp_path, tokenizer_dir):
    round_trip(tmp_path, tokenizer_dir, workers=2)


def test_output_is_byte_identical_for_any_worker_count(tmp_path, tokenizer_dir, monkeypatch):
    monkeypatch.setattr(prepare_module, "BATCH_DOCS", 7)  # many batches in flight, out of order
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


def test_long_documents_are_tokenized_in_pieces_and_round_trip(tmp_path, tokenizer_dir, monkeypatch):
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    text = "\n".join(topics[k] for k in sorted(topics))
    long_doc = (text * (3_000_000 // len(text) + 1))[:3_000_000]
    no_newline = "é日🤗 word" * 3000  # 27,000 characters without a newline: hard cuts
    # Document 4 of 10 is held out at F = 0.2 (and so is document 9).
    docs = ["short one", "short two\n", "\n" + no_newline + "\ntail", DOCS[0], long_doc, *DOCS[1:6]]
    source = resolve_source(str(write_jsonl(tmp_path / "long.jsonl", docs)))
    monkeypatch.setattr(prepare_module, "PIECE_CHARS", 10_000)
    longest = []
    tok = Tokenizer.load(tokenizer_dir)
    kind = type(tok)  # (SentencePiece's: Tokenizer.load picks the class for the file)
    encode_batch = kind.encode_batch
    monkeypatch.setattr(
        kind,
        "encode_batch",
        lambda self, texts, *args, **kwargs: (
            longest.append(max(map(len, texts))) or encode_batch(self, texts, *args, **kwargs)
        ),
    )
    outputs = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        manifest = prepare_dataset(
            source, tokenizer_dir, out, val_fraction=0.2, shard_tokens=50_000, workers=workers, progress=False
        )
        train, val = read_split(out, manifest, "train", tok), read_split(out, manifest, "validation", tok)
        assert interleave(train, val, 0.2) == docs  # exact, though cut into pieces
        assert (
            manifest["splits"]["train"]["documents"] == 8
            and manifest["splits"]["validation"]["documents"] == 2
        )
        assert long_doc in val  # the hold-out is per document, not per piece
        outputs.append({p.name: p.read_bytes() for p in sorted(out.iterdir())})
    assert outputs[0] == outputs[1]
    assert max(longest) <= 10_000, "one encode call never sees more than a piece"
    # A tokenizer that puts a dummy prefix before every encode call gets whole documents.
    monkeypatch.setattr(kind, "adds_dummy_prefix", property(lambda self: True))
    longest.clear()
    prepare_dataset(source, tokenizer_dir, tmp_path / "whole", val_fraction=0.2, progress=False)
    assert max(longest) == len(long_doc)


def test_a_worker_that_dies_ends_the_prepare_in_one_line_instead_of_a_hang(tmp_path, tokenizer_dir):
    """A tokenizing worker killed mid-run (out of memory, an operator): a multiprocessing.Pool
    would wait forever for its lost batch; the prepare ends with one line, and no manifest."""
    import subprocess
    import sys
    import time

    import psutil

    out = tmp_path / "out"
    source = write_jsonl(tmp_path / "docs.jsonl", DOCS * 3000)
    prepare = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pretrain",
            "data",
            "prepare",
            "--source",
            str(source),
            "--tokenizer",
            str(tokenizer_dir),
            "--out",
            str(out),
            "--workers",
            "2",
            "--no-progress",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline, workers = time.time() + 60, []
    while not workers and time.time() < deadline and prepare.poll() is None:
        children = psutil.Process(prepare.pid).children()
        workers = [c for c in children if "spawn_main" in " ".join(c.cmdline())]
        time.sleep(0.05)
    assert workers, prepare.communicate()
    workers[0].kill()
    _, stderr = prepare.communicate(timeout=60)
    lines = stderr.strip().splitlines()
    assert prepare.returncode == 2 and len(lines) == 1 and "a tokenizing worker process died" in lines[0], (
        stderr
    )
    assert not (out / "manifest.json").exists()


def test_the_tokenizing_workers_do_not_import_torch():
    """Each spawned worker imports pretrain.data.prepare to run its tasks: importing torch there
    (it once came in through the window-count helpers the prepare report uses) cost every worker
    seconds of start-up and took `data prepare`'s 2-worker speed-up from 1.75x to 1.2x on a
    6.5M-token corpus (`pretrain bench data`)."""
    probe = "import sys, pretrain.data.prepare; print(sorted(m for m in ('torch', 'omegaconf', 'deepspeed') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
