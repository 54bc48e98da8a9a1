import json
import os
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path

# The Hub is out of reach for tests (and for this machine): fail fast instead of retrying the network.
# Set before anything imports `datasets` or `huggingface_hub`, which read it once.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
import torch

from pretrain.config import ModelConfig

# Roughly how long each integration file's tests take here (seconds, both workers busy), for the
# order below only: a wrong figure costs time, never a result.
INTEGRATION_SECONDS = {
    "test_readme.py": 280,
    "test_pretraining.py": 190,
    "test_ownership.py": 155,
    "test_gpu_check.py": 96,
    "test_launch.py": 93,
    "test_slurm_launch.py": 92,
    "test_bench.py": 85,
    "test_finetune.py": 65,
    "test_monitoring.py": 60,
    "test_commands.py": 54,
    "test_ssh_launch.py": 50,
    "test_sequence_parallel.py": 57,
    "test_replay.py": 60,
    "test_nonfinite_engine.py": 42,
}


def pytest_configure(config):
    """Compile the project's modules once, before any test starts a process. Where
    PYTHONDONTWRITEBYTECODE is set (as on this project's CI machine) no process writes bytecode, so
    each of the suite's few hundred processes (ranks, launchers, supervisors, commands) would
    compile `pretrain/` and `monitoring/` from source again: about 0.15 s of CPU each. compileall
    writes the caches whatever that variable says, and every import reads them. (Only in the
    controller: its workers and their processes start after this.)"""
    if hasattr(config, "workerinput"):
        share_the_cores(config.workerinput["workercount"])
        return
    import compileall

    root = Path(__file__).resolve().parent.parent
    for package in ("pretrain", "monitoring"):
        compileall.compile_dir(root / package, quiet=1)


def share_the_cores(workers: int) -> None:
    """Each pytest-xdist worker, and every process it starts, computes on its share of the cores:
    torch's default gives each of them every core, so the two workers' training (in process, and
    in the single-process commands they run) would oversubscribe this 2-core machine, OpenMP's
    threads spinning while they wait for a core. A multi-process job's ranks share the worker's
    share (`pretrain.parallel.distributed.cpu_threads_per_rank` gives way to OMP_NUM_THREADS when it is
    set): one thread each, as before, for the two ranks of a job, the golden run's included.
    Measured on this machine: the unit tier alone in 31 s against 68 s (docs/performance.md)."""
    from pretrain.parallel.distributed import usable_cores

    threads = max(1, usable_cores() // max(workers, 1))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config, items):
    items[:] = in_running_order(items)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def in_running_order(items: list) -> list:
    """The integration tier first, its longest files at both ends and the shortest in the middle,
    then the unit tier. pytest-xdist's worksteal gives each worker a contiguous half and a worker
    that runs dry steals from the end of the other's queue: the long tests then start first on
    both workers, the short ones are what is left at the end, and neither worker finishes long
    after the other. Within a file, the order is the file's. (The same order on every worker, or
    xdist refuses: ties are broken by name, not by a set's order.)"""
    integration = [i for i in items if "integration" in Path(str(i.fspath)).parts]
    unit = [i for i in items if i not in set(integration)]
    files = sorted(
        {Path(str(i.fspath)).name for i in integration}, key=lambda f: (-INTEGRATION_SECONDS.get(f, 20), f)
    )
    front, back = files[0::2], files[1::2]
    place = {name: n for n, name in enumerate([*front, *reversed(back)])}
    return sorted(integration, key=lambda i: place[Path(str(i.fspath)).name]) + unit


@pytest.fixture(autouse=True)
def _stop_signals_restored():
    """A training command run in process ends by ignoring SIGTERM and SIGUSR1 (its clean exit must
    not be cut short); the worker must not keep that, or every process a later test starts (a
    monitoring service it then terminates) inherits it and cannot be stopped."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


@dataclass
class Result:
    """What `pretrain ARGS...` ended with (the `cli` fixture)."""

    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def cli(capsys):
    """`pretrain ARGS...` run in this process: its exit status and what it printed."""
    from pretrain.cli import main

    def run(*args: str) -> Result:
        capsys.readouterr()
        try:
            code = main([str(a) for a in args])
        except SystemExit as exit:  # argparse's usage errors and --help
            code = exit.code
        out, err = capsys.readouterr()
        return Result(code, out, err)

    return run


def small_model_config(**overrides) -> ModelConfig:
    """A model small enough for unit tests (sequence lengths below 512 are fine for the model itself)."""
    fields = dict(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, d_ff=48)
    fields.update(overrides)
    return ModelConfig(**fields)


def random_weights_model(qkv_scale: float = 1.0, **overrides):
    """A small model with every weight random, norms included (so no mapping error hides behind
    ones); `qkv_scale` sharpens attention far from uniform."""
    from pretrain.model.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(small_model_config(**overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif "qkv_proj" in name:
                p.mul_(qkv_scale)
    return model


def packed_document_ids(batch: int, lengths: list[int]) -> torch.Tensor:
    """(batch, sum(lengths)) document ids of documents of these lengths, each row rolled differently,
    from EOS positions as the loader finds them."""
    from pretrain.data.loader import document_ids

    window = torch.full((sum(lengths),), 5)
    window[torch.tensor(lengths).cumsum(0) - 1] = 2  # each document ends in EOS
    return document_ids(torch.stack([window.roll(17 * row) for row in range(batch)]), eos_id=2)


SMALL_MODEL = {
    "vocab_size": 512,
    "d_model": 64,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "max_seq_len": 512,
}


@pytest.fixture
def small_preset(tmp_path):
    """A model preset file of SMALL_MODEL, for the benchmarks (both tiers)."""
    path = tmp_path / "small.yaml"
    path.write_text("\n".join(f"{k}: {v}" for k, v in SMALL_MODEL.items()) + "\n")
    return path


def write_synthetic_dataset(
    directory, train_shard_tokens, val_shard_tokens=(), dtype="<u4", first_token=0
) -> dict:
    """A prepared-dataset directory whose token at position p of the concatenated split is
    first_token + p, so a window's first token names it; one shard per entry of the size lists."""
    import hashlib
    import json
    from pathlib import Path

    import numpy as np

    from pretrain.data.shards import FORMAT, FORMAT_VERSION, MANIFEST, fingerprint

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    splits = {}
    for split, sizes in (("train", train_shard_tokens), ("validation", val_shard_tokens)):
        shards, start = [], 0
        for i, size in enumerate(sizes):
            data = np.arange(first_token + start, first_token + start + size, dtype=dtype).tobytes()
            (directory / f"{split}_{i:05d}.bin").write_bytes(data)
            shards.append(
                {"file": f"{split}_{i:05d}.bin", "tokens": size, "sha256": hashlib.sha256(data).hexdigest()}
            )
            start += size
        splits[split] = {"documents": len(sizes), "tokens": start, "shards": shards}
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "source": "synthetic",
        "tokenizer": {"sha256": "none", "vocab_size": 2**31, "eos_id": 2},
        "dtype": np.dtype(dtype).str,
        "splits": splits,
    }
    manifest["fingerprint"] = fingerprint(manifest)
    (directory / MANIFEST).write_text(json.dumps(manifest))
    return manifest


def built_once(tmp_path_factory, name: str, build) -> Path:
    """A session fixture's directory, built once per test session. Under pytest-xdist (the
    README's `python -m pytest` runs two workers) the first worker that needs it builds it in the
    session's shared temporary directory, under a lock, and the other reuses it."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        directory = tmp_path_factory.mktemp(name)
        build(directory)
        return directory
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent  # pytest-N/, holding every worker's popen-gwK/
    directory, built = shared / name, shared / f"{name}.built"
    with FileLock(str(shared / f"{name}.lock")):
        if not built.exists():
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir()
            build(directory)
            built.touch()
    return directory


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    """A small BPE tokenizer trained once per test session on the pydoc topics."""
    import pydoc_data.topics

    from pretrain.tokenizer import train_tokenizer

    topics = pydoc_data.topics.topics
    return built_once(
        tmp_path_factory,
        "tokenizer",
        lambda directory: train_tokenizer((topics[k] for k in sorted(topics)), directory, vocab_size=512),
    )


@pytest.fixture(scope="session")
def train_data(tmp_path_factory, tokenizer_dir):
    """The pydoc topics prepared with the session tokenizer (10% held out), for training runs."""
    import pydoc_data.topics

    from pretrain.data import prepare_dataset, resolve_source

    def build(directory):
        corpus = directory / "topics.jsonl"
        topics = pydoc_data.topics.topics
        corpus.write_text("".join(json.dumps({"text": topics[k]}) + "\n" for k in sorted(topics)))
        prepare_dataset(
            resolve_source(str(corpus)), tokenizer_dir, directory / "data", val_fraction=0.1, progress=False
        )

    return built_once(tmp_path_factory, "train_data", build) / "data"


@pytest.fixture(scope="session")
def code_data(tmp_path_factory, tokenizer_dir):
    """A second corpus for mixtures, with the session tokenizer: the source code of some of the
    standard library's modules, one document per module (20% held out)."""
    import sysconfig

    from pretrain.data import prepare_dataset, resolve_source

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    modules = [
        "textwrap.py",
        "string.py",
        "shlex.py",
        "fnmatch.py",
        "colorsys.py",
        "bisect.py",
        "heapq.py",
        "keyword.py",
        "numbers.py",
        "glob.py",
    ]

    def build(directory):
        corpus = directory / "code.jsonl"
        corpus.write_text("".join(json.dumps({"text": (stdlib / m).read_text()}) + "\n" for m in modules))
        prepare_dataset(
            resolve_source(str(corpus)), tokenizer_dir, directory / "data", val_fraction=0.2, progress=False
        )

    return built_once(tmp_path_factory, "code_data", build) / "data"


@pytest.fixture(scope="session")
def sentiment(tmp_path_factory):
    """Keyword-sentiment CSV splits for fine-tuning (tests/finetune_data.py): 192 train, 64 validation."""
    from tests.finetune_data import sentiment_rows, write_csv

    directory = tmp_path_factory.mktemp("sentiment")
    return write_csv(directory / "train.csv", sentiment_rows(192, 0)), write_csv(
        directory / "val.csv", sentiment_rows(64, 1)
    )
