"""Shards read through the cache (pretrain/data/storage.py, views.py): the same windows, order and
state as from the local copy, at any cache size; the budget kept; a shard in use never evicted;
a corrupt download fetched again, then refused; a URL never taken for a local path.

The store here is fsspec's in-memory filesystem (`memory://`): the cache's logic, not a network.
The real S3 API (moto's server through s3fs) is the integration tier's (tests/integration/test_s3.py).
"""

from __future__ import annotations

import fcntl
import os
import uuid

import fsspec
import numpy as np
import pytest

from pretrain.data import MixtureStream, WindowStream
from pretrain.data.storage import Entry, ShardCache
from pretrain.data.views import local_dataset
from pretrain.errors import DataError, UserError
from pretrain.object_store import is_url
from tests.conftest import write_synthetic_dataset

SHARDS = [1000, 700, 1300, 900, 1100]  # tokens of uint32: the largest shard is 5,200 bytes


@pytest.fixture(autouse=True)
def closed_caches():
    """Each test's shard caches are closed after it: no prefetcher of one test retries into the next."""
    yield
    ShardCache.close_all()


@pytest.fixture
def stored(tmp_path):
    """A synthetic dataset on disk and its copy in the in-memory store: (local dir, URL)."""
    write_synthetic_dataset(tmp_path / "local", SHARDS, [400, 300])
    url = f"memory://bucket-{uuid.uuid4().hex[:8]}/data"
    fsspec.filesystem("memory").put(str(tmp_path / "local"), url.removeprefix("memory:/"), recursive=True)
    yield tmp_path / "local", url
    fsspec.filesystem("memory").rm(url.removeprefix("memory:/"), recursive=True)
    ShardCache._instances.clear()


def gib(nbytes: int) -> float:
    return nbytes / (1 << 30)


@pytest.mark.parametrize("budget", [2 * 5200 + 100, 10**6])  # two shards (evicting all along), all
def test_the_windows_and_state_are_the_local_copys_at_any_cache_size(stored, tmp_path, budget):
    local, url = stored
    cache = tmp_path / f"cache-{budget}"
    for rank in (0, 1):  # two ranks of one job: each reads its own windows through one cache
        a = MixtureStream([("data", local, 1.0)], 64, rank, 2, seed=5)
        b = MixtureStream([("data", url, 1.0)], 64, rank, 2, seed=5, cache_dir=cache, cache_gib=gib(budget))
        for _ in range(150):
            assert np.array_equal(next(a).numpy(), next(b).numpy())
        assert a.state_dict() == b.state_dict()
        # the state resumes on the local copy exactly where the cached one stopped (and back)
        c = MixtureStream([("data", local, 1.0)], 64, rank, 2, seed=0)
        c.load_state_dict(b.state_dict())
        assert np.array_equal(next(c).numpy(), next(b).numpy())
    shards = list((cache / "shards").glob("*.bin"))
    assert sum(p.stat().st_size for p in shards) <= budget
    stats = ShardCache.at(cache, gib(budget)).stats
    assert stats["evicted"] > 0 if budget < 10**6 else stats["evicted"] == 0


def test_the_validation_pass_is_the_local_copys(stored, tmp_path):
    local, url = stored
    view = local_dataset(url, tmp_path / "cache", 0.001)
    for rank in (0, 1):
        ours = [w.numpy() for w in WindowStream(view, 64, rank, 2, split="validation")]
        theirs = [w.numpy() for w in WindowStream(local, 64, rank, 2, split="validation")]
        assert len(ours) == len(theirs) > 0 and all(
            np.array_equal(a, b) for a, b in zip(ours, theirs, strict=True)
        )


def test_the_view_holds_the_manifest_and_names_the_url(stored, tmp_path):
    local, url = stored
    view = local_dataset(url, tmp_path / "cache", 0.001)
    assert (view / "manifest.json").read_bytes() == (local / "manifest.json").read_bytes()
    assert not list(view.glob("*.bin"))  # shards only on first use, in the cache
    stream = WindowStream(view, 64)
    assert stream.fingerprint == WindowStream(local, 64).fingerprint
    assert stream.shards.files[0] == f"{url}/train_00000.bin"


def test_a_cache_too_small_for_the_processes_of_a_node_is_refused(stored, tmp_path, monkeypatch):
    _, url = stored
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(
        UserError, match=r"2 process\(es\) on this node need room for 3; raise data.cache_gib"
    ):
        WindowStream(local_dataset(url, tmp_path / "cache", gib(2 * 5200)), 64)


def test_a_shard_in_use_is_never_evicted(tmp_path):
    """A file another process maps (its shared lock) stays; the least recently used free one goes."""
    fs = fsspec.filesystem("memory")
    entries = []
    for i in range(3):
        data = bytes([i]) * 1000
        fs.pipe_file(f"/inuse/{i}.bin", data)
        entries.append(Entry(f"memory://inuse/{i}.bin", 1000, __import__("hashlib").sha256(data).hexdigest()))
    cache = ShardCache(tmp_path, 2100)
    first, second = (cache.fetch(e, reading=True) for e in entries[:2])
    os.utime(second, (1, 1))  # the second is the least recently used
    held = os.open(second, os.O_RDONLY)  # ... but in use elsewhere
    fcntl.flock(held, fcntl.LOCK_SH)
    try:
        cache.fetch(entries[2], reading=True)
        assert second.exists() and not first.exists()
    finally:
        os.close(held)
    fs.rm("/inuse", recursive=True)


def test_a_corrupt_download_is_fetched_again_then_refused(stored, tmp_path, capsys):
    _, url = stored
    view = local_dataset(url, tmp_path / "cache", 0.001)
    stream = WindowStream(view, 64)
    fs = fsspec.filesystem("memory")
    path = f"{url.removeprefix('memory:/')}/train_00001.bin"
    data = bytearray(fs.cat_file(path))
    data[100] ^= 1  # one bit flipped: the same size, another sha256
    fs.pipe_file(path, bytes(data))
    with pytest.raises(DataError, match=r"train_00001.bin does not match its sha256 in the manifest twice"):
        stream.shards.shard(1)
    assert "fetching it again" in capsys.readouterr().err
    fs.pipe_file(path, bytes(data[:-8]))  # truncated
    with pytest.raises(DataError, match=r"holds 2,792 bytes, the manifest says 2,800 twice"):
        stream.shards.shard(1)
    assert not list((tmp_path / "cache" / "shards").glob("*.part"))


def test_a_prefix_without_a_manifest_is_one_line(tmp_path):
    with pytest.raises(
        UserError, match=r"memory://nothing/here is not a prepared dataset .*`pretrain data prepare --out"
    ):
        local_dataset("memory://nothing/here", tmp_path)


def test_a_url_is_never_a_relative_path(cli, tmp_path, monkeypatch):
    """`--out s3://x` once wrote a local directory `s3:/x`: now each command taking only a local
    path says so, and nothing is written."""
    assert is_url("s3://bucket/x") and is_url("gs://b") and not is_url("runs/s3:/x") and not is_url(tmp_path)
    monkeypatch.chdir(tmp_path)
    result = cli(
        "tokenizer", "train", "--source", "builtin:pydoc", "--vocab-size", "300", "--out", "s3://b/tok"
    )
    assert result.returncode == 2 and "--out s3://b/tok is a URL" in result.stderr
    assert not any(tmp_path.iterdir())


def test_closing_a_cache_stops_its_prefetcher_even_while_it_waits_to_retry(tmp_path, capsys):
    """A prefetch that keeps failing waits between tries; close() ends the wait and the thread at
    once, and a closed cache asks no run to stop."""
    import time

    cache = ShardCache(tmp_path / "cache", 1 << 20, retries=5, backoff=600.0)
    missing = Entry(url="memory://no-such-bucket/shard.bin", size=10, sha256="0" * 64)
    cache.hint([missing])
    said, deadline = "", time.monotonic() + 60
    while "trying again in 600 s" not in said:  # the prefetcher is in its 600 s wait
        assert time.monotonic() < deadline, said
        said += capsys.readouterr().err
        time.sleep(0.01)
    cache.close()
    cache._thread.join(timeout=60)  # a tenth of the wait it was in (a loaded machine wakes it late)
    assert not cache._thread.is_alive()
    assert "stopping at the next step boundary" not in said + capsys.readouterr().err


def test_a_read_counts_a_hit_only_when_the_shard_was_there_as_it_asked(tmp_path):
    """`pretrain bench data`'s hits and misses: a read that waits for the prefetcher's download
    still in flight is a miss, as one that downloads itself is; one that finds the file, a hit.
    Each file downloaded once, by whichever thread took its lock first, and verified."""
    import hashlib
    import threading
    import time

    fs = fsspec.filesystem("memory")
    entries = []
    for i in range(3):
        data = bytes([i]) * 1000
        fs.pipe_file(f"/counts/{i}.bin", data)
        entries.append(Entry(f"memory://counts/{i}.bin", 1000, hashlib.sha256(data).hexdigest()))
    cache = ShardCache(tmp_path, 10**6)
    release, get = threading.Event(), cache._get

    def held_get(url, target):  # the prefetcher's download of 1.bin waits for `release`
        if url.endswith("1.bin"):
            release.wait(60)
        get(url, target)

    class Turns:
        """1.bin's lock, which says when the read waits on it (it has looked for the file by then)."""

        lock, waiting = threading.Lock(), threading.Event()

        def __enter__(self):
            if threading.current_thread().name == "read":
                self.waiting.set()
            self.lock.acquire()

        def __exit__(self, *exc):
            self.lock.release()

    cache._get, cache._fetching[entries[1].sha256] = held_get, Turns()
    cache.fetch(entries[0])  # prefetched before the read asks: a hit
    cache.fetch(entries[0], reading=True)
    prefetch = threading.Thread(target=cache.fetch, args=(entries[1],))
    prefetch.start()
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(f"shards/.{entries[1].sha256}.*.part")):  # its download has begun
        assert time.monotonic() < deadline
        time.sleep(0.01)
    read = threading.Thread(target=cache.fetch, args=(entries[1],), kwargs={"reading": True}, name="read")
    read.start()
    assert Turns.waiting.wait(60)
    release.set()
    read.join(60)
    prefetch.join(60)
    cache.fetch(entries[2], reading=True)  # nothing in flight: its own download, a miss
    assert (cache.stats["hits"], cache.stats["misses"]) == (1, 2)
    assert cache.stats["fetched_bytes"] == cache.stats["verified_bytes"] == 3000
    fs.rm("/counts", recursive=True)
