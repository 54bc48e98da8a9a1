"""Object storage against a real S3 API: moto's server on 127.0.0.1 (tests/integration/s3_server.py),
reached through s3fs over HTTP as AWS is.

One training run is shared by its assertions: the session's corpus prepared into a bucket, trained
by 2 processes with the golden run's settings from s3://, checkpoints mirrored to the bucket, and
killed (SIGKILL, every process) mid-run, after step 11; then the rest of the run in an *empty* run
directory, with part of the cache deleted, which resumes from the mirror. Its losses and
evaluations must be the golden run's, bit for bit.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time

import numpy as np
import psutil
import pytest

from pretrain.cli import main
from pretrain.data import WindowStream, read_manifest
from pretrain.data.storage import ShardCache
from pretrain.data.views import local_dataset
from pretrain.errors import DataError, UserError
from tests.integration.golden import OVERRIDES
from tests.integration.runs import FAST, TINY, metrics, torchrun
from tests.integration.s3_server import blackhole


@pytest.fixture(autouse=True)
def closed_caches():
    """Each test's shard caches are closed after it: no prefetcher of one test retries into the next."""
    yield
    ShardCache.close_all()


def prepare_into(s3_server, train_data, tokenizer_dir, url: str, *extra: str) -> None:
    """The session's corpus, prepared into `url` with the settings the train_data fixture used (and
    `extra` arguments of `data prepare`)."""
    with s3_server.environment():
        code = main(
            [
                "data",
                "prepare",
                "--source",
                str(train_data.parent / "topics.jsonl"),
                "--tokenizer",
                str(tokenizer_dir),
                "--out",
                url,
                "--val-fraction",
                "0.1",
                "--workers",
                "1",
                "--no-progress",
                *extra,
            ]
        )
    assert code == 0


def train(run_dir, data: str, *overrides: str, env: dict) -> subprocess.CompletedProcess:
    """A 2-process job (tests.integration.runs.train's, in the S3 server's environment)."""
    args = [*torchrun(2), "--config", TINY, f"run.dir={run_dir}", f"data.dir={data}", *FAST, *overrides]
    result = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


def train_until_killed(run_dir, data: str, *overrides: str, env: dict, mirrored: str, fs) -> str:
    """`train`'s job with rank 0 hung as step 12 begins (faults.hang_step), every process of it
    SIGKILLed once the hang began and `mirrored` is in the store: a node lost mid-run. Its output."""
    args = [*torchrun(2), "--config", TINY, f"run.dir={run_dir}", f"data.dir={data}", *FAST, *overrides]
    output = run_dir.parent / f"{run_dir.name}.out"
    with open(output, "w") as out:
        job = subprocess.Popen([*args, "faults.hang_step=12"], stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 600  # (a safety net: the job is at step 12 within a minute alone)
    while not ((run_dir / "faults_fired.json").exists() and fs.exists(mirrored)):
        assert job.poll() is None and time.monotonic() < deadline, output.read_text()[-4000:]
        time.sleep(0.1)
        fs.invalidate_cache()
    launcher = psutil.Process(job.pid)
    for process in [launcher, *launcher.children(recursive=True)]:  # (the ranks: sessions of their own)
        process.kill()
    job.wait()
    return output.read_text()


def test_training_from_s3_is_the_golden_run_and_resumes_from_the_mirror(
    s3_server, golden_run, train_data, tokenizer_dir, tmp_path
):
    bucket = s3_server.bucket()
    data, mirror, cache = f"{bucket}/topics", f"{bucket}/checkpoints", tmp_path / "cache"
    prepare_into(s3_server, train_data, tokenizer_dir, data)
    fs = s3_server.fs()
    assert json.loads(fs.cat_file(f"{data}/manifest.json")) == json.loads(
        (train_data / "manifest.json").read_text()
    )
    settings = [*OVERRIDES, f"checkpoint.mirror={mirror}", f"data.cache_dir={cache}"]
    step_10 = f"{mirror}/step_00000010/complete.json"
    first = train_until_killed(
        tmp_path / "first", data, *settings, env=s3_server.env, mirrored=step_10, fs=fs
    )
    assert sorted(metrics(tmp_path / "first")) == list(range(1, 12)), first[-2000:]
    # A new node: an empty run directory, and a cache that lost the validation shard.
    manifest = json.loads((train_data / "manifest.json").read_text())
    (cache / "shards" / f"{manifest['splits']['validation']['shards'][0]['sha256']}.bin").unlink()
    second = train(tmp_path / "second", data, *settings, env=s3_server.env)
    assert "restored step_00000010 from" in second.stderr
    ours = metrics(tmp_path / "first") | metrics(tmp_path / "second")
    golden = metrics(golden_run)
    for step in range(1, 21):
        for key in ("train/loss", "train/grad_norm", "train/lr", "train/tokens"):
            assert ours[step][key] == golden[step][key], (step, key)
    summaries = [
        json.loads((d / "train_summary.json").read_text()) for d in (tmp_path / "second", golden_run)
    ]
    assert [e["loss"] for e in summaries[0]["eval"]] == [
        e["loss"] for e in summaries[1]["eval"] if e["step"] > 10
    ]
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(mirror)) == [
        "latest",
        "run.json",
        "step_00000010",
        "step_00000020",
    ]
    assert fs.cat_file(f"{mirror}/latest").decode().strip() == "step_00000020"


def test_a_shard_corrupted_in_the_bucket_is_fetched_again_then_refused(
    s3_server, train_data, tokenizer_dir, tmp_path, capsys
):
    bucket = s3_server.bucket()
    prepare_into(s3_server, train_data, tokenizer_dir, f"{bucket}/topics")
    fs = s3_server.fs()
    shard = f"{bucket}/topics/train_00000.bin"
    data = bytearray(fs.cat_file(shard))
    data[1000] ^= 0xFF
    fs.pipe_file(shard, bytes(data))
    with s3_server.environment():
        stream = WindowStream(local_dataset(f"{bucket}/topics", tmp_path / "cache", 1.0), 64)
        with pytest.raises(
            DataError, match=r"train_00000.bin does not match its sha256 in the manifest twice"
        ):
            next(stream)
    assert "fetching it again" in capsys.readouterr().err
    assert ShardCache.at(tmp_path / "cache", 1.0).stats["refetched"] == 1


def test_prepare_from_a_url_gives_the_local_shards_and_eval_as_run_reads_them(
    s3_server, golden_run, train_data, tokenizer_dir, tmp_path, monkeypatch, capsys
):
    """`data prepare --source s3://...` gives the shards the local file gives (the corpus
    fingerprint the golden run trained on); the same recipe again is a no-op without a download, a
    changed object a different recipe; `eval --data URL --as-run` gives the run's own eval/loss."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # (the download, eval's default cache)
    bucket = s3_server.bucket()
    fs = s3_server.fs()
    fs.put_file(str(train_data.parent / "topics.jsonl"), f"{bucket}/corpus/topics.jsonl")
    prepare = ["data", "prepare", "--source", f"{bucket}/corpus/*.jsonl", "--tokenizer", str(tokenizer_dir)]
    prepare += ["--out", f"{bucket}/topics", "--val-fraction", "0.1", "--workers", "1", "--no-progress"]
    with s3_server.environment():
        assert run(*prepare, capsys=capsys)[0] == 0
        ours, local = json.loads(fs.cat_file(f"{bucket}/topics/manifest.json")), read_manifest(train_data)
        assert ours["splits"] == local["splits"] and ours["fingerprint"] == local["fingerprint"]
        assert ours["documents"]["origins"] == [f"{bucket}/corpus/topics.jsonl"]
        code, err = run(*prepare, capsys=capsys)
        assert (
            code == 0
            and err == f"{bucket}/topics already holds this dataset; nothing to do (--overwrite to rebuild)"
        )
        edited = fs.cat_file(f"{bucket}/corpus/topics.jsonl").replace(b"a", b"b", 1)  # (the same size)
        fs.pipe_file(f"{bucket}/corpus/topics.jsonl", edited)
        code, err = run(*prepare, capsys=capsys)
        assert code == 2 and err == (
            f"pretrain: error: {bucket}/topics already holds a different dataset: choose another --out, or pass --overwrite"
        )
        logged = json.loads((golden_run / "train_summary.json").read_text())["eval"][-1]
        capsys.readouterr()
        code = main(
            ["eval", "--checkpoint", str(golden_run), "--data", f"{bucket}/topics", "--as-run", "--json"]
        )
    out, err = capsys.readouterr()
    assert code == 0, err
    result = json.loads(out)
    assert result["loss"] == pytest.approx(logged["loss"], abs=5e-6) and result["logged"] == logged["loss"]


def run(*args: str, capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = main(list(args))
    return code, capsys.readouterr().err.strip()


def test_bad_inputs_are_one_line_naming_the_url(s3_server, tmp_path, capsys):
    bucket = s3_server.bucket()
    with s3_server.environment():
        code, err = run("data", "verify", "s3://no-such-bucket/x", capsys=capsys)
        assert code == 2 and err.count("\n") == 0
        assert "s3://no-such-bucket/x" in err and "does not exist" in err
        code, err = run("data", "verify", f"{bucket}/nothing", capsys=capsys)
        assert (
            code == 2 and f"{bucket}/nothing is not a prepared dataset" in err and "data prepare --out" in err
        )
        with pytest.raises(UserError, match=r"does not exist: check its name, and AWS_ENDPOINT_URL"):
            local_dataset("s3://no-such-bucket/x", tmp_path)
    # Access denied: a 403 from the server, which checks IAM meanwhile, before anything starts.
    verify = ("data", "verify", f"{bucket}/x")
    prepare = ("data", "prepare", "--source", f"{bucket}/c.jsonl", "--tokenizer", "no", "--out", "no")
    with s3_server.denied() as user, s3_server.environment(**user):
        for args, url in ((verify, f"{bucket}/x/manifest.json"), (prepare, f"{bucket}/c.jsonl")):
            code, err = run(*args, capsys=capsys)
            assert code == 2 and err.count("\n") == 0, err
            assert f"{url}: access denied (Forbidden): give these credentials read access" in err
    with (
        s3_server.environment(AWS_ACCESS_KEY_ID=None, AWS_SECRET_ACCESS_KEY=None),
        pytest.raises(
            UserError, match=rf"{bucket}/x/manifest.json: no credentials for it .*AWS_ACCESS_KEY_ID"
        ),
    ):
        local_dataset(f"{bucket}/x", tmp_path)
    with (
        blackhole() as silent,
        s3_server.environment(
            AWS_ENDPOINT_URL=silent,
            FSSPEC_S3='{"config_kwargs": {"connect_timeout": 1, "read_timeout": 1, "retries": {"max_attempts": 1}}}',
        ),
        pytest.raises(
            UserError, match=rf"{bucket}/x/manifest.json: the store did not answer .*check the network"
        ),
    ):
        local_dataset(f"{bucket}/x", tmp_path)


def test_a_store_that_stops_answering_mid_run_is_retried_then_stops_the_run(s3_server, tmp_path, capsys):
    """While training: a fetch is retried with backoff; a prefetch that keeps failing asks the loop
    to stop at the next step boundary (SIGUSR1 with its cause, a preemption's path); a read that keeps
    failing is one line, status 1."""
    import time

    from pretrain.data.storage import Entry, StorageUnavailable
    from pretrain.parallel.distributed import STOP_CAUSE, StopRequest

    bucket = s3_server.bucket()
    s3_server.fs().pipe_file(f"{bucket}/a.bin", b"x" * 100)
    with (
        blackhole() as silent,
        s3_server.environment(
            AWS_ENDPOINT_URL=silent,
            FSSPEC_S3='{"config_kwargs": {"connect_timeout": 1, "read_timeout": 1, "retries": {"max_attempts": 1}}}',
        ),
    ):
        cache = ShardCache(tmp_path, 10**6, retries=2, backoff=0.1)
        entry = Entry(f"{bucket}/a.bin", 100, "0" * 64)
        with pytest.raises(
            StorageUnavailable, match=r"the store did not answer .*gave up after 2 tries"
        ) as raised:
            cache.fetch(entry, reading=True)
        assert raised.value.exit_code == 1
        with StopRequest() as stop:
            cache.hint([entry])
            deadline = time.monotonic() + 60  # (a safety net: two tries of 1 s and 0.1 s between)
            while not stop.requested and time.monotonic() < deadline:
                time.sleep(0.05)  # (the handler runs in this, the main, thread)
            assert stop.requested and "the data store stopped answering" in stop.why
        STOP_CAUSE.clear()
    assert "trying again in 0.1 s" in capsys.readouterr().err


def test_bench_data_measures_a_dataset_in_the_store_against_a_local_copy(
    s3_server, train_data, tokenizer_dir, tmp_path
):
    """`pretrain bench data --source URL`: the first window from an empty cache, a whole pass from
    the store, the same pass from the full cache and from a local copy. The corpus in 4 shards, each
    read once: whether a read finds its shard already fetched by the prefetcher (a hit) or waits for
    a download (a miss) is the threads' race, so only what holds whichever wins is asserted: every
    shard fetched once and verified, and each read counted once, as one or the other."""
    from pretrain.bench.data import bench_source

    bucket = s3_server.bucket()
    prepare_into(s3_server, train_data, tokenizer_dir, f"{bucket}/topics", "--shard-tokens", "65536")
    with s3_server.environment():
        manifest = json.loads(s3_server.fs().cat_file(f"{bucket}/topics/manifest.json"))
        result = bench_source(f"{bucket}/topics", tmp_path, windows=10**6, seq_len=512)
    shards = manifest["splits"]["train"]["shards"]
    shard_bytes = sum(s["tokens"] for s in shards) * np.dtype(manifest["dtype"]).itemsize
    assert len(shards) == 4 and result["windows"] == sum((s["tokens"] - 1) // 512 for s in shards)
    assert result["first_window_seconds"] > 0
    assert result["fetched_bytes"] == result["verified_bytes"] == shard_bytes  # each once, checked
    assert result["cache_hits"] + result["cache_misses"] == len(shards)  # (the pass reads every one)
    assert result["cache_hit_rate"] == result["cache_hits"] / len(shards)
    assert (
        min(
            result[k]
            for k in ("store_tokens_per_sec_cold", "store_tokens_per_sec_warm", "local_tokens_per_sec")
        )
        > 0
    )
