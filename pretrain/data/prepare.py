"""`pretrain data prepare`: documents → token shards + manifest.json.

The main process reads documents in source order and hands batches of them to W worker
processes, keeping at most 2·W batches in flight (so memory stays flat); results come back in
submission order and are appended to the shards, so the output is byte-identical for any W.
Everything is written into a temporary directory beside `--out`, manifest last, and renamed into
place only when complete: an interrupted or failed run leaves nothing that looks like a dataset.

Validation documents are chosen by position, evenly spaced: document i (counting non-blank
documents from 0) is held out when floor((i+1)·F) > floor(i·F), for F = --val-fraction.

A document longer than PIECE_CHARS characters is tokenized in pieces, each cut after its last
newline (or hard-cut where a piece holds none), with EOS after the last piece only, so one huge
document never becomes one huge token list. The pieces decode to the document exactly because our
tokenizers add no dummy prefix; an older tokenizer that does gets whole documents instead, and so
does a Hugging Face tokenizer.json (its pre-tokenizer may cut a text differently at a piece's edge,
and the ids must be the tokenizer's own for the whole document).

With a Hugging Face tokenizer, its file is copied beside the shards as tokenizer.json with
tokenizer_meta.json (the special tokens used, `--eos-token` ... included); the manifest's
tokenizer entry names the file, and the special tokens are part of the recipe.

The output directory is only ever replaced when it is our own dataset or empty: the same recipe
(source files with their sizes and mtimes, or objects in a store with their sizes and ETags,
tokenizer, settings) is a no-op while its shards match
the manifest, and is rebuilt when they do not; a different recipe needs --overwrite; any other
directory, or one holding a source file, is refused.

A Megatron-LM / GPT-NeoX indexed dataset (`--format megatron`) is converted, not tokenized:
pretrain/data/megatron.py yields the same results as the tokenizing step, straight from its ids.
"""

from __future__ import annotations

import itertools
import json
import math
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import uuid
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import NamedTuple

import numpy as np

from pretrain import __version__, atomic, object_store
from pretrain.data.progress import Progress, count_documents
from pretrain.data.shards import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    SPLITS,
    DocumentIndexWriter,
    ShardSet,
    ShardWriter,
    fingerprint,
    our_manifest,
    split_windows,
    token_dtype,
)
from pretrain.data.sources import Source, resolve_source
from pretrain.errors import UserError
from pretrain.object_store import is_url
from pretrain.run_dir import pid_alive
from pretrain.tokenizer import META_FILE, MODEL_FILE, Tokenizer, train_tokenizer

# `data prepare`'s report: the validation windows at these sequence lengths (`validation_report`).
REPORT_SEQ_LENS = (512, 1024, 2048, 4096)
# A validation split to compare runs on holds at least these (`comparison_warning`): a rule of thumb,
# docs/data.md; a fraction above MAX_SUGGESTED_FRACTION would take too much from training.
COMPARE_DOCUMENTS, COMPARE_WINDOWS = 30, 100
MAX_SUGGESTED_FRACTION = 0.2
DEFAULT_SHARD_TOKENS = 1 << 27  # 128M tokens: 256 MiB per uint16 shard
BATCH_CHARS = 1 << 20  # characters of text per task handed to a worker
BATCH_DOCS = 2048
PIECE_CHARS = 1 << 20  # longer documents are tokenized in pieces of at most this many characters

# --------------------------------------------------------------------------- workers

_worker_tokenizer: Tokenizer | None = None


def _init_worker(model_path: str, special_tokens: dict[str, str] | None = None) -> None:
    global _worker_tokenizer
    # Ctrl-C reaches the whole process group: the main process handles it and terminates the pool,
    # so a worker's own KeyboardInterrupt traceback would only be noise.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # a Hugging Face tokenizer: one thread per worker
    _worker_tokenizer = Tokenizer.load(model_path, special_tokens)


def tokenize_batch(
    texts: list[str], held_out: list[bool], ends: list[bool], tokenizer: Tokenizer | None = None
) -> tuple:
    """Encode a batch of documents or pieces of them; return (train tokens, validation tokens,
    #train docs, #validation docs, tokens of each text), EOS after each document's last piece,
    concatenated in order."""
    tokenizer = tokenizer or _worker_tokenizer
    dtype = token_dtype(tokenizer.vocab_size)
    eos = [tokenizer.eos_id]
    parts: dict[bool, list[list[int]]] = {False: [], True: []}
    documents = {False: 0, True: 0}
    lengths = []
    for ids, is_val, end in zip(tokenizer.encode_batch(texts), held_out, ends, strict=True):
        parts[is_val].append(ids + eos if end else ids)
        lengths.append(len(parts[is_val][-1]))
        documents[is_val] += end
    train, val = (_flatten(parts[is_val], dtype) for is_val in (False, True))
    return train, val, documents[False], documents[True], lengths


def _flatten(lists: list[list[int]], dtype: np.dtype) -> np.ndarray:
    count = sum(map(len, lists))
    return np.fromiter(itertools.chain.from_iterable(lists), dtype=dtype, count=count)


# --------------------------------------------------------------------------- batching


class Batch(NamedTuple):
    texts: list[str]  # documents or pieces of them
    held_out: list[bool]  # per text: in the validation split
    ends: list[bool]  # per text: the last piece of its document (EOS follows)
    origins: list[tuple[int, int] | None]  # per text: (origin index, record) for a document's first piece


def _batches(
    records: Iterator[tuple[str, int, str]],
    val_fraction: float,
    stats: dict,
    piece_chars: int | None,
    origins: dict[str, int],
) -> Iterator[Batch]:
    """Batches of texts; the hold-out is decided per document. `origins` (origin → index) grows
    as new origins come up."""
    batch, chars, index = Batch([], [], [], []), 0, 0
    for origin, record, doc in records:
        if not doc.strip():
            stats["skipped_blank_documents"] += 1
            continue
        is_val = math.floor((index + 1) * val_fraction) > math.floor(index * val_fraction)
        index += 1
        where = (origins.setdefault(origin, len(origins)), record)
        for piece, last in _pieces(doc, piece_chars):
            batch.texts.append(piece)
            batch.held_out.append(is_val)
            batch.ends.append(last)
            batch.origins.append(where)
            where = None
            chars += len(piece)
            if chars >= BATCH_CHARS or len(batch.texts) >= BATCH_DOCS:
                yield batch
                batch, chars = Batch([], [], [], []), 0
    if batch.texts:
        yield batch


def _pieces(doc: str, size: int | None) -> Iterator[tuple[str, bool]]:
    """(piece, is last) for `doc` cut into pieces of at most `size` characters (None: whole), each
    ending after its last newline, or hard-cut where it holds none."""
    start = 0
    while size is not None and len(doc) - start > size:
        newline = doc.rfind("\n", start, start + size)
        end = newline + 1 if newline >= 0 else start + size
        yield doc[start:end], False
        start = end
    yield (doc[start:] if start else doc), True


def _tokenized(batches: Iterator[Batch], tokenizer: Tokenizer, workers: int) -> Iterator[tuple[tuple, Batch]]:
    """(tokenize_batch's result, the batch), in order, in-process (W=1) or with W processes and
    bounded look-ahead."""
    if workers == 1:
        for batch in batches:
            yield tokenize_batch(batch.texts, batch.held_out, batch.ends, tokenizer), batch
        return
    # spawn: never fork a process holding threads. An executor, not a multiprocessing.Pool: a worker
    # that dies (killed, out of memory) breaks it with an error, where a Pool waits forever for the
    # lost batch.
    context = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(
        workers,
        mp_context=context,
        initializer=_init_worker,
        initargs=(str(tokenizer.path), tokenizer.named_tokens),
    )
    pending: deque = deque()
    try:
        for batch in batches:
            pending.append((pool.submit(tokenize_batch, batch.texts, batch.held_out, batch.ends), batch))
            if len(pending) >= 2 * workers:
                future, done = pending.popleft()
                yield future.result(), done
        while pending:
            future, done = pending.popleft()
            yield future.result(), done
    except BrokenProcessPool:
        raise UserError(
            f"a tokenizing worker process died (of {workers}): run again, or with --workers 1 to see why"
        ) from None
    finally:
        for future, _ in pending:
            future.cancel()
        pool.shutdown(wait=True, cancel_futures=True)


# --------------------------------------------------------------------------- prepare


def validation_report(manifest: dict) -> tuple[str, list[str]]:
    """A line of the validation windows at each of REPORT_SEQ_LENS, and warnings: the split has
    fewer windows at the default data.seq_len than one micro-batch at the default
    train.micro_batch_size (8 at 2048), so a run at the defaults could not evaluate, even on one
    rank (each rank evaluates whole micro-batches of its share), and is refused before it starts;
    or it is too small to compare runs on (`comparison_warning`)."""
    from pretrain.config import DataConfig, TrainConfig  # (here: the tokenizing workers import this module)

    counts = {seq_len: split_windows(manifest, "validation", seq_len) for seq_len in REPORT_SEQ_LENS}
    line = "validation windows by data.seq_len: " + ", ".join(f"{n}: {c:,}" for n, c in counts.items())
    seq_len, micro = DataConfig.seq_len, TrainConfig.micro_batch_size
    windows = split_windows(manifest, "validation", seq_len)
    warnings = [] if (compare := comparison_warning(manifest, seq_len)) is None else [compare]
    if windows >= micro:
        return line, warnings
    return line, [
        f"warning: the validation split gives {windows} window(s) at data.seq_len={seq_len}, fewer than one "
        f"evaluation micro-batch at the default train.micro_batch_size={micro} per rank: a run at those "
        f"settings is refused; prepare with a larger --val-fraction (this one: {manifest.get('val_fraction')}), "
        "or train with a shorter data.seq_len, a smaller train.micro_batch_size or eval.every=0",
        *warnings,
    ]


def comparison_warning(manifest: dict, seq_len: int) -> str | None:
    """A warning when the validation split holds fewer than COMPARE_DOCUMENTS documents or
    COMPARE_WINDOWS windows at `seq_len` (the held-out loss of two runs, compared on a few
    documents, says more about those documents than about the corpus: an optimizer comparison
    was once judged on 2), with the --val-fraction that holds out both, rounded up to two
    significant figures; above MAX_SUGGESTED_FRACTION, a separate held-out corpus instead."""
    split = manifest["splits"]["validation"]
    documents, windows = split["documents"], split_windows(manifest, "validation", seq_len)
    if documents >= COMPARE_DOCUMENTS and windows >= COMPARE_WINDOWS:
        return None
    total_documents = sum(s["documents"] for s in manifest["splits"].values())
    total_tokens = sum(s["tokens"] for s in manifest["splits"].values())
    needed = max(
        COMPARE_DOCUMENTS / max(total_documents, 1), COMPARE_WINDOWS * (seq_len + 1) / max(total_tokens, 1)
    )
    line = (
        f"warning: the validation split holds {documents:,} document(s) and {windows:,} window(s) at "
        f"data.seq_len={seq_len}, too few to compare runs on (at least {COMPARE_DOCUMENTS} documents and "
        f"{COMPARE_WINDOWS} windows: a difference in held-out loss then says more about these documents "
        "than about the corpus)"
    )
    if needed <= MAX_SUGGESTED_FRACTION:
        return f"{line}; prepare again with --val-fraction {round_up(needed):g}"
    return (
        f"{line}; this corpus ({total_documents:,} documents, {total_tokens:,} tokens) is too small to hold "
        "that out: compare runs with `pretrain eval --data DIR` on a separate held-out corpus"
    )


def round_up(value: float, figures: int = 2) -> float:
    """`value` rounded up to `figures` significant figures (0.1456 → 0.15)."""
    scale = 10 ** (figures - 1 - math.floor(math.log10(value)))
    return math.ceil(value * scale - 1e-9) / scale


def recipe(source: Source, tokenizer: Tokenizer, val_fraction: float, shard_tokens: int) -> dict:
    """What determines the output: the same recipe gives the same bytes."""
    wanted = {
        "source": source.description,
        "source_stat": source.stat_digest(),  # changes when a source file does
        "text_field": source.text_field,
        "tokenizer_sha256": tokenizer.sha256,
        "val_fraction": val_fraction,
        "shard_tokens": shard_tokens,
    }
    if tokenizer.file_name != MODEL_FILE:  # a Hugging Face tokenizer: its special tokens are a choice
        wanted["tokenizer_special_tokens"] = tokenizer.meta()["special_tokens"]
    return wanted


def skipped_report(manifest: dict, source: Source) -> str | None:
    """`data prepare`'s line on what it skipped (the manifest's `stats`): empty files, by name, and
    blank documents; None when nothing was."""
    stats = manifest.get("stats", {})
    blank = stats.get("skipped_blank_documents", 0)
    empty = source.skipped_line if source.kind == "files" else None
    parts = [empty] if empty else []
    if blank:
        parts.append(f"skipped {blank:,} blank document{'s' if blank > 1 else ''} (empty or whitespace only)")
    return "; ".join(parts) or None


class Prepared(NamedTuple):
    manifest: dict
    written: bool  # False: the output already held this dataset, and nothing was written


def prepare_dataset(*args, **kwargs) -> dict:
    """Tokenize a source into a directory (the arguments of `prepare`); return the manifest."""
    return prepare(*args, **kwargs).manifest


def prepare(
    source: Source,
    tokenizer_path: str | Path,
    out_dir: str | Path,
    val_fraction: float = 0.01,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    workers: int = 1,
    overwrite: bool = False,
    progress: bool = True,
    special_tokens: dict[str, str | None] | None = None,
) -> Prepared:
    """`prepare_dataset`, also telling whether anything was written. `special_tokens` names a Hugging
    Face tokenizer's ({"eos": "<|endoftext|>", "bos": ..., "pad": ...}: `--eos-token` ...)."""
    if not 0.0 <= val_fraction < 1.0:
        raise UserError(f"--val-fraction {val_fraction} must be in [0, 1)")
    if shard_tokens < 1024:
        raise UserError(f"--shard-tokens {shard_tokens} is too small: use at least 1024")
    if workers < 1:
        raise UserError(f"--workers {workers} must be at least 1")
    tokenizer = Tokenizer.load(tokenizer_path, special_tokens)
    wanted = recipe(source, tokenizer, val_fraction, shard_tokens)
    if is_url(out_dir):  # an object store: written here first, then uploaded, manifest last
        return _prepare_into_store(
            source, tokenizer, str(out_dir).rstrip("/"), wanted, workers, progress, overwrite
        )
    out_dir = Path(out_dir)
    _check_source_outside(source, out_dir)
    existing = our_manifest(out_dir)
    if existing is not None and not overwrite:
        if not _same_recipe(existing, wanted):
            raise UserError(
                f"{out_dir} already holds a different dataset: choose another --out, or pass --overwrite"
            )
        if _shards_match(out_dir, existing):
            print(
                f"{out_dir} already holds this dataset; nothing to do (--overwrite to rebuild)",
                file=sys.stderr,
            )
            return Prepared(existing, written=False)
        # Our own dataset, same recipe, damaged shards: rebuilding it loses nothing.
        print(f"{out_dir} holds this dataset but its shards do not match; rebuilding it", file=sys.stderr)
    if existing is None and out_dir.exists() and not _is_empty_dir(out_dir):
        raise UserError(f"{out_dir} is not a prepared dataset; refusing to replace it: choose another --out")

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_staging(out_dir)
    staging = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        manifest = _write_dataset(source, tokenizer, staging, wanted, workers, progress)
        _replace_dir(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return Prepared(manifest, written=True)


def _prepare_into_store(
    source: Source,
    tokenizer: Tokenizer,
    url: str,
    wanted: dict,
    workers: int,
    progress: bool,
    overwrite: bool,
) -> Prepared:
    """`prepare` into a URL: the same recipe there is a no-op, another one needs --overwrite; the
    dataset is written into a local staging directory, then its files are uploaded and the manifest
    last, so a dataset half uploaded never looks complete (an older manifest is deleted first)."""
    fs, root = object_store.filesystem(url)
    try:
        existing = json.loads(fs.cat_file(f"{root}/{MANIFEST}")) if fs.exists(f"{root}/{MANIFEST}") else None
    except Exception as exc:
        raise UserError(object_store.problem(url, exc)) from None
    if isinstance(existing, dict) and existing.get("format") == FORMAT and not overwrite:
        if not _same_recipe(existing, wanted):
            raise UserError(
                f"{url} already holds a different dataset: choose another --out, or pass --overwrite"
            )
        if _stored_shards_match(fs, root, existing):
            print(
                f"{url} already holds this dataset; nothing to do (--overwrite to rebuild)", file=sys.stderr
            )
            return Prepared(existing, written=False)
        print(f"{url} holds this dataset but its shards do not match; rebuilding it", file=sys.stderr)
    elif existing is not None and not overwrite:
        raise UserError(
            f"{url} holds another program's manifest.json; refusing to replace it: choose another --out"
        )
    check_writable(fs, root, url)  # before the corpus is read: hours, for a large one
    staging = Path(tempfile.mkdtemp(prefix="pretrain-prepare-"))
    try:
        manifest = _write_dataset(source, tokenizer, staging, wanted, workers, progress)
        try:
            if existing is not None:
                fs.rm_file(f"{root}/{MANIFEST}")  # (what follows is not yet a dataset)
            for path in sorted(staging.iterdir()):
                if path.name != MANIFEST:
                    fs.put_file(str(path), f"{root}/{path.name}")
            fs.put_file(str(staging / MANIFEST), f"{root}/{MANIFEST}")
        except UserError:
            raise
        except Exception as exc:
            raise UserError(f"{object_store.problem(url, exc)} (uploading the dataset)") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return Prepared(manifest, written=True)


def check_writable(fs, root: str, url: str) -> None:
    """Write and delete an empty object under `url`: a bucket that does not exist, missing
    credentials or no permission to write are one line before any work, not after the corpus has
    been tokenized, when the upload begins."""
    probe = f"{root}/.pretrain-write-check-{uuid.uuid4().hex[:8]}"
    try:
        fs.pipe_file(probe, b"")
        fs.rm_file(probe)
    except Exception as exc:
        raise UserError(
            f"{object_store.problem(url, exc, access='write')} (--out, checked before tokenizing)"
        ) from None


def _stored_shards_match(fs, root: str, manifest: dict) -> bool:
    """Whether every shard is in the store with the size its manifest records (no hashing)."""
    itemsize = np.dtype(manifest["dtype"]).itemsize
    try:
        for split in manifest["splits"].values():
            for shard in split["shards"]:
                if fs.size(f"{root}/{shard['file']}") != shard["tokens"] * itemsize:
                    return False
    except (OSError, KeyError, TypeError):
        return False
    return True


def _check_source_outside(source: Source, out_dir: Path) -> None:
    """Replacing `out_dir` must never delete an input."""
    out = out_dir.resolve()
    for path in source.files:
        if path.resolve().is_relative_to(out):
            raise UserError(
                f"source file {path} lies inside --out {out_dir}: choose an --out outside the source"
            )


def _same_recipe(manifest: dict, wanted: dict) -> bool:
    if manifest.get("format_version") != FORMAT_VERSION:
        return False
    return all(manifest.get(key) == value for key, value in wanted.items())


def _shards_match(out_dir: Path, manifest: dict) -> bool:
    """Whether every shard is there with the size its manifest records (cheap: no hashing)."""
    try:
        for split in SPLITS:
            ShardSet(out_dir, split, manifest)
    except (UserError, KeyError, TypeError):  # a shard missing or resized, or a manifest field
        return False
    return True


def _is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def _remove_stale_staging(out_dir: Path) -> None:
    """Remove what runs for the same output that died mid-way (killed, out of memory) left behind."""
    prefix = f".{out_dir.name}.partial-"
    for path in out_dir.parent.iterdir():
        pid = path.name[len(prefix) :].split("-")[0] if path.name.startswith(prefix) else ""
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _write_dataset(
    source: Source, tokenizer: Tokenizer, staging: Path, wanted: dict, workers: int, progress: bool
) -> dict:
    dtype = token_dtype(tokenizer.vocab_size)
    writers = {
        "train": ShardWriter(staging, "train", dtype, wanted["shard_tokens"]),
        "validation": ShardWriter(staging, "validation", dtype, wanted["shard_tokens"]),
    }
    index = {split: DocumentIndexWriter(staging, split) for split in SPLITS}
    stats = {"skipped_blank_documents": 0}
    if source.kind == "files":  # files with no records, skipped (pretrain/data/sources.py)
        source.download()  # (files in an object store: here, checked; only once the recipe is new)
        stats["skipped_empty_files"] = len(source.empty_files)
    origins: dict[str, int] = {}
    tokenized, shown = _token_batches(source, tokenizer, wanted, stats, origins, workers, progress)
    try:
        for (train, val, n_train, n_val, lengths), batch in tokenized:
            for length, is_val, origin in zip(lengths, batch.held_out, batch.origins, strict=True):
                index["validation" if is_val else "train"].add(length, origin)
            writers["train"].write(train, n_train)
            writers["validation"].write(val, n_val)
            shown.wrote(len(train) + len(val), n_train + n_val)
    finally:
        shown.close()
    splits = {name: writer.finish() for name, writer in writers.items()}
    documents = {
        "origins": list(origins),
        "splits": {split: writer.finish() for split, writer in index.items()},
    }
    if splits["train"]["tokens"] == 0:
        raise UserError(f"the corpus is empty: {source.description} has no non-blank documents")
    if wanted["val_fraction"] > 0 and splits["validation"]["documents"] == 0:
        raise UserError(
            f"--val-fraction {wanted['val_fraction']} selects no document out of {splits['train']['documents']}: "
            "raise it, or add documents"
        )
    shutil.copyfile(tokenizer.path, staging / tokenizer.file_name)
    atomic.write_json(staging / META_FILE, tokenizer.meta())
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        **wanted,
        "tokenizer": {
            "sha256": tokenizer.sha256,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
            # (a SentencePiece model: tokenizer.model, unnamed, as in every older dataset)
            **({"file": tokenizer.file_name} if tokenizer.file_name != MODEL_FILE else {}),
        },
        "dtype": dtype.str,
        "splits": splits,
        "documents": documents,
        "stats": stats,
        "created_by": f"pretrain {__version__}",
    }
    manifest["fingerprint"] = fingerprint(manifest)
    atomic.write_json(staging / MANIFEST, manifest)
    return manifest


def _token_batches(
    source: Source,
    tokenizer: Tokenizer,
    wanted: dict,
    stats: dict,
    origins: dict,
    workers: int,
    progress: bool,
):
    """The corpus's tokenized batches (a Megatron corpus's ids converted), and the progress shown."""
    if source.kind == "megatron":  # token ids already: converted, not tokenized (pretrain/data/megatron.py)
        from pretrain.data.megatron import converted

        shown = Progress(source.documents if progress else None, enabled=progress, converting=True)
        tokenized = converted(source, tokenizer, wanted["val_fraction"], stats, origins)
    else:
        records = source.records()
        first = next(records, None)  # opening the source fails here, before any progress output
        records = itertools.chain([first] if first is not None else [], records)
        shown = Progress(count_documents(source) if progress else None, enabled=progress)
        # Pieces decode back to the document only when encoding adds no dummy prefix to each.
        piece_chars = PIECE_CHARS if tokenizer.encodes_in_pieces else None
        batches = _batches(records, wanted["val_fraction"], stats, piece_chars, origins)
        tokenized = _tokenized(batches, tokenizer, workers)
    return tokenized, shown


def _replace_dir(staging: Path, out_dir: Path) -> None:
    """Move the finished dataset into place; an old one is moved aside first, then removed."""
    old = None
    if out_dir.exists():
        old = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(out_dir, old)
    os.replace(staging, out_dir)
    atomic.fsync_dir(out_dir.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def prepare_corpus(spec: str, out: Path, vocab_size: int = 4096, announce=print) -> tuple[Path, Path]:
    """A tokenizer trained on the source and its token shards (95% train, 5% validation) under
    `out`; both steps are skipped when their outputs exist. Returns (tokenizer_dir, data_dir)."""
    from pretrain.data.sources import resolve_source

    source = resolve_source(spec)
    tokenizer_dir, data_dir = out / "tokenizer", out / "data"
    if not (tokenizer_dir / MODEL_FILE).is_file():
        announce(f"training a {vocab_size}-piece tokenizer on {source.summary} -> {tokenizer_dir}")
        train_tokenizer(source.documents(), tokenizer_dir, vocab_size=vocab_size)
    else:
        announce(f"tokenizer: {tokenizer_dir} (exists)")
    announce(f"preparing token shards -> {data_dir}")
    manifest = prepare_dataset(source, tokenizer_dir, data_dir, val_fraction=0.05, workers=2, progress=False)
    announce(
        f"{manifest['splits']['train']['tokens']:,} training and "
        f"{manifest['splits']['validation']['tokens']:,} validation tokens"
    )
    return tokenizer_dir, data_dir


def train_tokenizer_on(
    specs: list[str],
    out_dir: str | Path,
    vocab_size: int,
    model_type: str = "bpe",
    sample_sentences: int = 2_000_000,
    text_field: str = "text",
    overwrite: bool = False,
    announce=print,
) -> Tokenizer:
    """`pretrain tokenizer train`: a tokenizer trained on sources (files, globs, a Hub dataset,
    builtin:pydoc); an existing one in `out_dir` is replaced only with `overwrite`."""
    out_dir = Path(out_dir)
    if (out_dir / MODEL_FILE).exists() and not overwrite:
        raise UserError(f"{out_dir / MODEL_FILE} exists: choose another --out, or pass --overwrite")
    source = resolve_source(specs, text_field=text_field)
    announce(f"training a {model_type} tokenizer of {vocab_size} pieces on {source.summary}")
    source.download()  # (a source in an object store: here, checked; its empty files known)
    if source.skipped_line:
        announce(source.skipped_line)
    return train_tokenizer(source.documents(), out_dir, vocab_size, model_type, sample_sentences)
