"""`pretrain data prepare`: documents → token shards + manifest.json.

The main process reads documents in source order and hands batches of them to W worker
processes, keeping at most 2·W batches in flight (so memory stays flat); results come back in
submission order and are appended to the shards, so the output is byte-identical for any W.
Everything is written into a temporary directory beside `--out`, manifest last, and renamed into
place only when complete: an interrupted or failed run leaves nothing that looks like a dataset.

Validation documents are chosen by position, evenly spaced: document i (counting non-blank
documents from 0) is held out when floor((i+1)·F) > floor(i·F), for F = --val-fraction.
"""

from __future__ import annotations

import itertools
import json
import math
import multiprocessing
import os
import shutil
import sys
import uuid
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from pretrain import __version__, atomic
from pretrain.data.shards import FORMAT, FORMAT_VERSION, MANIFEST, ShardWriter, fingerprint, token_dtype
from pretrain.data.sources import Source
from pretrain.errors import UserError
from pretrain.tokenizer import META_FILE, MODEL_FILE, Tokenizer

DEFAULT_SHARD_TOKENS = 1 << 27  # 128M tokens: 256 MiB per uint16 shard
BATCH_CHARS = 1 << 20  # characters of text per task handed to a worker
BATCH_DOCS = 2048

# --------------------------------------------------------------------------- workers

_worker_tokenizer: Tokenizer | None = None


def _init_worker(model_path: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = Tokenizer.load(model_path)


def tokenize_batch(docs: list[str], held_out: list[bool], tokenizer: Tokenizer | None = None) -> tuple:
    """Encode a batch; return (train tokens, validation tokens, #train docs, #validation docs),
    each document followed by EOS, concatenated in order."""
    tokenizer = tokenizer or _worker_tokenizer
    dtype = token_dtype(tokenizer.vocab_size)
    eos = [tokenizer.eos_id]
    parts: dict[bool, list[list[int]]] = {False: [], True: []}
    for ids, is_val in zip(tokenizer.encode_batch(docs), held_out, strict=True):
        parts[is_val].append(ids + eos)
    train, val = (_flatten(parts[is_val], dtype) for is_val in (False, True))
    return train, val, len(parts[False]), len(parts[True])


def _flatten(lists: list[list[int]], dtype: np.dtype) -> np.ndarray:
    count = sum(map(len, lists))
    return np.fromiter(itertools.chain.from_iterable(lists), dtype=dtype, count=count)


# --------------------------------------------------------------------------- batching


def _batches(
    documents: Iterator[str], val_fraction: float, stats: dict
) -> Iterator[tuple[list[str], list[bool]]]:
    docs, held_out, chars, index = [], [], 0, 0
    for doc in documents:
        if not doc.strip():
            stats["skipped_blank_documents"] += 1
            continue
        docs.append(doc)
        held_out.append(math.floor((index + 1) * val_fraction) > math.floor(index * val_fraction))
        index += 1
        chars += len(doc)
        if chars >= BATCH_CHARS or len(docs) >= BATCH_DOCS:
            yield docs, held_out
            docs, held_out, chars = [], [], 0
    if docs:
        yield docs, held_out


def _tokenized(batches: Iterator[tuple], tokenizer: Tokenizer, workers: int) -> Iterator[tuple]:
    """Tokenize batches in order, in-process (W=1) or with W processes and bounded look-ahead."""
    if workers == 1:
        for docs, held_out in batches:
            yield tokenize_batch(docs, held_out, tokenizer)
        return
    context = multiprocessing.get_context("spawn")  # never fork a process holding threads
    pool = context.Pool(workers, initializer=_init_worker, initargs=(str(tokenizer.path),))
    try:
        pending: deque = deque()
        for batch in batches:
            pending.append(pool.apply_async(tokenize_batch, batch))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
        pool.close()
    finally:
        pool.terminate()
        pool.join()


# --------------------------------------------------------------------------- prepare


def recipe(source: Source, tokenizer: Tokenizer, val_fraction: float, shard_tokens: int) -> dict:
    """What determines the output: the same recipe gives the same bytes."""
    return {
        "source": source.description,
        "text_field": source.text_field,
        "tokenizer_sha256": tokenizer.sha256,
        "val_fraction": val_fraction,
        "shard_tokens": shard_tokens,
    }


def prepare_dataset(
    source: Source,
    tokenizer_path: str | Path,
    out_dir: str | Path,
    val_fraction: float = 0.01,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    workers: int = 1,
    overwrite: bool = False,
    progress: bool = True,
) -> dict:
    """Tokenize `source` into `out_dir`; return the manifest. See the module docstring."""
    if not 0.0 <= val_fraction < 1.0:
        raise UserError(f"--val-fraction {val_fraction} must be in [0, 1)")
    if shard_tokens < 1024:
        raise UserError(f"--shard-tokens {shard_tokens} is too small: use at least 1024")
    if workers < 1:
        raise UserError(f"--workers {workers} must be at least 1")
    tokenizer = Tokenizer.load(tokenizer_path)
    out_dir = Path(out_dir)
    wanted = recipe(source, tokenizer, val_fraction, shard_tokens)
    existing = _existing_recipe(out_dir)
    if existing is not None and not overwrite:
        if existing == wanted:
            print(
                f"{out_dir} already holds this dataset; nothing to do (--overwrite to rebuild)",
                file=sys.stderr,
            )
            return _read_json(out_dir / MANIFEST)
        raise UserError(
            f"{out_dir} already holds a different dataset: choose another --out, or pass --overwrite"
        )
    if out_dir.exists() and existing is None and any(out_dir.iterdir()) and not overwrite:
        raise UserError(f"{out_dir} exists and is not empty: choose another --out, or pass --overwrite")

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.parent / f".{out_dir.name}.partial-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        manifest = _write_dataset(source, tokenizer, staging, wanted, workers, progress)
        _replace_dir(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest


def _write_dataset(
    source: Source, tokenizer: Tokenizer, staging: Path, wanted: dict, workers: int, progress: bool
) -> dict:
    dtype = token_dtype(tokenizer.vocab_size)
    writers = {
        "train": ShardWriter(staging, "train", dtype, wanted["shard_tokens"]),
        "validation": ShardWriter(staging, "validation", dtype, wanted["shard_tokens"]),
    }
    stats = {"skipped_blank_documents": 0}
    from tqdm import tqdm

    documents = source.documents()
    first = next(documents, None)  # opening the source fails here, before any progress output
    documents = itertools.chain([first] if first is not None else [], documents)
    bar = tqdm(desc="tokenizing", unit="tok", unit_scale=True, disable=not progress, file=sys.stderr)
    with bar:
        batches = _batches(documents, wanted["val_fraction"], stats)
        for train, val, n_train, n_val in _tokenized(batches, tokenizer, workers):
            writers["train"].write(train, n_train)
            writers["validation"].write(val, n_val)
            bar.update(len(train) + len(val))
    splits = {name: writer.finish() for name, writer in writers.items()}
    if splits["train"]["tokens"] == 0:
        raise UserError(f"the corpus is empty: {source.description} has no non-blank documents")
    if wanted["val_fraction"] > 0 and splits["validation"]["documents"] == 0:
        raise UserError(
            f"--val-fraction {wanted['val_fraction']} selects no document out of {splits['train']['documents']}: "
            "raise it, or add documents"
        )
    shutil.copyfile(tokenizer.path, staging / MODEL_FILE)
    atomic.write_json(staging / META_FILE, tokenizer.meta())
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        **wanted,
        "tokenizer": {
            "sha256": tokenizer.sha256,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
        },
        "dtype": dtype.str,
        "splits": splits,
        "stats": stats,
        "created_by": f"pretrain {__version__}",
    }
    manifest["fingerprint"] = fingerprint(manifest)
    atomic.write_json(staging / MANIFEST, manifest)
    return manifest


def _existing_recipe(out_dir: Path) -> dict | None:
    path = out_dir / MANIFEST
    if not path.is_file():
        return None
    manifest = _read_json(path)
    keys = ("source", "text_field", "tokenizer_sha256", "val_fraction", "shard_tokens")
    if manifest.get("format_version") != FORMAT_VERSION:
        return {"format_version": manifest.get("format_version")}
    return {k: manifest.get(k) for k in keys}


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return {}


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
