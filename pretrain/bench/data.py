"""`pretrain bench data`: how fast corpora are prepared and how fast the window stream serves.

Prepare: the builtin:pydoc documents, repeated to a few million tokens and written as JSON lines,
tokenized with 1 and then 2 workers (best of `repeats` each; tokenizer training not counted).
Stream: random tokens in memory-mapped shards (read once first, so they are in the page cache),
served by one WindowStream in shuffled order; tokens/s per process at several window sizes,
through the BatchLoader, and from a two-corpus MixtureStream (one process; rank 0 of 64).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np

from pretrain.data.loader import BatchLoader
from pretrain.data.mixture import MixtureStream
from pretrain.data.prepare import prepare_dataset
from pretrain.data.shards import FORMAT, FORMAT_VERSION, MANIFEST, ShardWriter, fingerprint
from pretrain.data.sources import pydoc_documents, resolve_source
from pretrain.data.stream import WindowStream
from pretrain.tokenizer import train_tokenizer


def _write_corpus(path: Path, copies: int) -> None:
    docs = list(pydoc_documents())
    with open(path, "w") as f:
        for copy in range(copies):
            for doc in docs:
                f.write(json.dumps({"text": f"[{copy}] {doc}"}) + "\n")


def bench_prepare(work: Path, copies: int = 8, repeats: int = 2, vocab_size: int = 8192) -> dict:
    corpus = work / "corpus.jsonl"
    _write_corpus(corpus, copies)
    source = resolve_source(str(corpus))
    train_tokenizer(source.documents(), work / "tokenizer", vocab_size=vocab_size, sample_sentences=200_000)
    best: dict[int, float] = {}
    tokens = 0
    for _ in range(repeats):
        for workers in (1, 2):
            start = time.perf_counter()
            manifest = prepare_dataset(
                source,
                work / "tokenizer",
                work / f"prepared_{workers}",
                workers=workers,
                overwrite=True,
                progress=False,
            )
            elapsed = time.perf_counter() - start
            tokens = sum(split["tokens"] for split in manifest["splits"].values())
            best[workers] = max(best.get(workers, 0.0), tokens / elapsed)
    identical = all(
        (work / "prepared_1" / name).read_bytes() == (work / "prepared_2" / name).read_bytes()
        for name in [MANIFEST, *(s["file"] for s in manifest["splits"]["train"]["shards"])]
    )
    return {
        "prepare_corpus_tokens": tokens,
        "prepare_tokens_per_sec_1_worker": best[1],
        "prepare_tokens_per_sec_2_workers": best[2],
        "prepare_speedup_2_workers": best[2] / best[1],
        "prepare_output_identical": identical,
    }


def _synthetic_dataset(directory: Path, tokens: int, shards: int, vocab_size: int = 32000) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    writer = ShardWriter(directory, "train", np.dtype("<u2"), shard_tokens=tokens // shards)
    for _ in range(shards):
        writer.write(rng.integers(0, vocab_size, tokens // shards, dtype=np.uint16), documents=1)
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "source": "synthetic",
        "tokenizer": {"sha256": "synthetic", "vocab_size": vocab_size, "eos_id": 2},
        "dtype": "<u2",
        "splits": {"train": writer.finish(), "validation": {"documents": 0, "tokens": 0, "shards": []}},
    }
    manifest["fingerprint"] = fingerprint(manifest)
    (directory / MANIFEST).write_text(json.dumps(manifest))
    for shard in manifest["splits"]["train"]["shards"]:  # into the page cache
        (directory / shard["file"]).read_bytes()


def _rate(iterator, tokens_per_item: int, seconds: float) -> float:
    next(iterator)  # warm-up: first block of indices, first memory map
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        for _ in range(64):
            next(iterator)
        count += 64
    return count * tokens_per_item / elapsed


def bench_stream(work: Path, seconds: float = 2.0, tokens: int = 64 * 2**20) -> dict:
    data = work / "synthetic"
    _synthetic_dataset(data, tokens=tokens, shards=4)
    result = {}
    for seq_len in (512, 2048, 8192):
        stream = WindowStream(data, seq_len, seed=1)
        result[f"stream_tokens_per_sec_seq{seq_len}"] = _rate(stream, seq_len + 1, seconds)
    result["stream_tokens_per_sec"] = result["stream_tokens_per_sec_seq2048"]
    # A two-corpus mixture (0.7 / 0.3): one process, and rank 0 of 64 (every rank walks the round).
    _synthetic_dataset(work / "synthetic_b", tokens=tokens // 4, shards=2)
    sources = [("a", data, 0.7), ("b", work / "synthetic_b", 0.3)]
    for world_size in (1, 64):
        mixture = MixtureStream(sources, 2048, rank=0, world_size=world_size, seed=1)
        result[f"mixture_tokens_per_sec_seq2048_world{world_size}"] = _rate(mixture, 2049, seconds)
    loader = BatchLoader(WindowStream(data, 2048, seed=1), batch_size=8)
    result["loader_tokens_per_sec_seq2048_batch8"] = _rate(loader, 8 * 2049, seconds)
    loader.close()
    return result


def bench_source(url: str, work: Path, windows: int = 2000, seq_len: int = 2048) -> dict:
    """A prepared dataset in an object store (`--source URL`) against the same dataset on local
    disk: the time to the first window with an empty cache (manifest, tokenizer, the first shard
    fetched and verified), the windows per second of a whole pass of `windows` shuffled windows
    from the store (the cache filling, the prefetcher ahead) and again with the cache full, the
    cache's hits and misses, and the same windows from a local copy of the dataset. A hit is a read
    that found its shard verified in the cache, a miss one that waited for a download (its own, or
    the prefetcher's still in flight: `ShardCache.fetch`); which a shard is depends on how far
    ahead the prefetcher got, their sum (the shards the pass read) does not."""
    from pretrain.data.storage import DEFAULT_CACHE_GIB, ShardCache
    from pretrain.data.views import local_dataset
    from pretrain.object_store import filesystem

    cache = work / "cache"
    started = time.perf_counter()
    view = local_dataset(url, cache_dir=cache)
    stream = WindowStream(view, seq_len, seed=1)
    next(stream)
    first = time.perf_counter() - started
    windows = min(windows, stream.num_windows)

    def rate(data_dir) -> float:
        stream = WindowStream(data_dir, seq_len, seed=1)
        started = time.perf_counter()
        for _ in range(windows):
            next(stream)
        return windows * (seq_len + 1) / (time.perf_counter() - started)

    cold = rate(view)
    shard_cache = ShardCache.at(cache, DEFAULT_CACHE_GIB)
    stats = dict(shard_cache.stats)
    warm = rate(view)
    local = work / "local"
    fs, path = filesystem(url)
    fs.get(path.rstrip("/") + "/", str(local), recursive=True)
    rate(local)  # (read once: the page cache, as the store's copy was)
    on_disk = rate(local)
    ShardCache.close_all()
    return {
        "source": url,
        "seq_len": seq_len,
        "windows": windows,
        "first_window_seconds": first,
        "store_tokens_per_sec_cold": cold,
        "store_tokens_per_sec_warm": warm,
        "local_tokens_per_sec": on_disk,
        "cache_hits": stats["hits"],
        "cache_misses": stats["misses"],
        "cache_hit_rate": stats["hits"] / max(1, stats["hits"] + stats["misses"]),
        "fetched_bytes": stats["fetched_bytes"],
        "verified_bytes": stats["verified_bytes"],
    }


def run(as_json: bool = False, quick: bool = False, source: str | None = None) -> dict:
    """`source`: a prepared dataset's URL, measured against a local copy instead (`bench_source`)."""
    if source is not None:
        with tempfile.TemporaryDirectory(prefix="pretrain-bench-data-") as tmp:
            result = bench_source(source, Path(tmp), windows=200 if quick else 2000)
        if as_json:
            print(json.dumps(result))
            return result
        print(f"{source}, {result['windows']} shuffled windows of {result['seq_len']} tokens:")
        print(f"  first window, empty cache: {result['first_window_seconds']:.2f} s")
        for key, label in (
            ("store_tokens_per_sec_cold", "from the store, cache filling"),
            ("store_tokens_per_sec_warm", "from the store, cache full"),
            ("local_tokens_per_sec", "from a local copy"),
        ):
            print(f"  {label:<30}: {result[key] / 1e6:8.2f}M tokens/s")
        print(
            f"  cache: {result['cache_hits']} hits, {result['cache_misses']} misses in the first pass "
            f"({100 * result['cache_hit_rate']:.1f}% hits), {result['fetched_bytes'] / 2**20:.1f} MiB fetched, "
            f"{result['verified_bytes'] / 2**20:.1f} MiB of it verified"
        )
        return result
    with tempfile.TemporaryDirectory(prefix="pretrain-bench-data-") as tmp:
        work = Path(tmp)
        result = bench_stream(work, seconds=0.5, tokens=8 * 2**20) if quick else bench_stream(work)
        if quick:  # a smoke test of the same code: smaller corpus and vocabulary, one repeat
            result |= bench_prepare(work, copies=1, repeats=1, vocab_size=1024)
        else:
            result |= bench_prepare(work, copies=12, repeats=2)
    if as_json:
        print(json.dumps(result))
        return result
    print("window stream, one process, page cache (shuffled windows):")
    for seq_len in (512, 2048, 8192):
        print(f"  seq_len {seq_len:>5}: {result[f'stream_tokens_per_sec_seq{seq_len}'] / 1e6:8.1f}M tokens/s")
    print(f"  BatchLoader, 8 x 2048: {result['loader_tokens_per_sec_seq2048_batch8'] / 1e6:8.1f}M tokens/s")
    print(
        f"  mixture of 2, seq 2048: {result['mixture_tokens_per_sec_seq2048_world1'] / 1e6:7.1f}M tokens/s "
        f"(rank 0 of 64: {result['mixture_tokens_per_sec_seq2048_world64'] / 1e6:.1f}M)"
    )
    print(f"prepare ({result['prepare_corpus_tokens'] / 1e6:.1f}M tokens of Python docs as JSON lines):")
    print(f"  1 worker : {result['prepare_tokens_per_sec_1_worker'] / 1e6:6.2f}M tokens/s")
    print(
        f"  2 workers: {result['prepare_tokens_per_sec_2_workers'] / 1e6:6.2f}M tokens/s "
        f"({result['prepare_speedup_2_workers']:.2f}x; output identical: {result['prepare_output_identical']})"
    )
    return result
