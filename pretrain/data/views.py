"""A prepared corpus in an object store, as a local directory: its *view* in the cache.

    CACHE/datasets/<digest of the URL>/   manifest.json (the store's, byte for byte), the tokenizer
                                          beside the shards (checked against the manifest's
                                          sha256), source.json (the URL and the cache's bound)

Everything downstream takes the view for the dataset's directory: the tokenizer, the checks before
a run, the window stream (its order, state and fingerprint). Only `ShardSet.shard` tells the
difference: it maps the shard's verified copy in the cache (pretrain/data/storage.py) instead of a
file beside the manifest.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pretrain import atomic
from pretrain.data.shards import MANIFEST, check_manifest
from pretrain.data.storage import (
    DEFAULT_CACHE_GIB,
    SOURCE,
    VIEWS,
    Source,
    default_cache_dir,
    read_manifest_bytes,
)
from pretrain.errors import UserError
from pretrain.object_store import exists, is_url, join, read_bytes


def view_dir(url: str, cache_dir: str | Path | None) -> Path:
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    return root / VIEWS / hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]


def local_dataset(
    location: str | Path, cache_dir: str | Path | None = None, cache_gib: float | None = None
) -> Path:
    """The local directory to read a prepared dataset from: `location` itself, or, for a URL, its
    view in the cache (manifest and tokenizer fetched and checked; the shards on first use)."""
    if not is_url(location):
        return Path(location)
    url = location.rstrip("/")
    manifest_url = join(url, MANIFEST)
    raw = read_manifest_bytes(url)
    try:
        manifest = json.loads(raw)
    except ValueError:
        raise UserError(f"{manifest_url} is not valid JSON: prepare the dataset again") from None
    check_manifest(manifest, manifest_url)
    view = view_dir(url, cache_dir)
    view.mkdir(parents=True, exist_ok=True)
    budget = DEFAULT_CACHE_GIB if cache_gib is None else float(cache_gib)
    if not _same_bytes(view / MANIFEST, raw):
        _fetch_tokenizer(url, view, manifest)
        atomic.write_bytes(view / MANIFEST, raw)
    elif not _tokenizer_here(view, manifest):
        _fetch_tokenizer(url, view, manifest)
    if Source.of(view) != Source(url, budget):
        atomic.write_json(view / SOURCE, {"url": url, "cache_gib": budget})
    return view


def _same_bytes(path: Path, data: bytes) -> bool:
    try:
        return path.read_bytes() == data
    except OSError:
        return False


def _tokenizer_here(view: Path, manifest: dict) -> bool:
    path = view / manifest["tokenizer"].get("file", "tokenizer.model")
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest() == manifest["tokenizer"]["sha256"]
    except OSError:
        return False


def _fetch_tokenizer(url: str, view: Path, manifest: dict) -> None:
    """The tokenizer beside the shards (and its tokenizer_meta.json, when there is one). One that
    is missing is left to the checks before a run (a run may name its own: data.tokenizer)."""
    name = manifest["tokenizer"].get("file", "tokenizer.model")
    if not exists(join(url, name)):
        return
    data = read_bytes(join(url, name))
    digest = hashlib.sha256(data).hexdigest()
    if digest != manifest["tokenizer"]["sha256"]:
        raise UserError(
            f"{join(url, name)} is not the tokenizer the shards were made with (sha256 {digest[:12]}…, the "
            f"manifest says {manifest['tokenizer']['sha256'][:12]}…): prepare the dataset again"
        )
    atomic.write_bytes(view / name, data)
    meta = join(url, "tokenizer_meta.json")
    if exists(meta):
        atomic.write_bytes(view / "tokenizer_meta.json", read_bytes(meta))


def local_sources(data) -> list[tuple[str, Path, float]]:
    """A run's corpora (`DataConfig.sources()`: name, dir, weight), each directory the local one to
    read it from: a URL's view in `data.cache_dir`, bounded by `data.cache_gib`."""
    cache_dir, cache_gib = getattr(data, "cache_dir", None), getattr(data, "cache_gib", None)
    return [(name, local_dataset(d, cache_dir, cache_gib), weight) for name, d, weight in data.sources()]
