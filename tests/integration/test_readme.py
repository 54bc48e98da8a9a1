"""The README's commands, as printed, in the order a reader meets them: its ```bash blocks are
read from README.md (nothing is copied here), so a README change that breaks a command fails.

They run in one directory, as a new user's would, after the README's first command (`pretrain
demo`, built once by the `readme_dir` fixture); each later block is one test, and the blocks run
in the README's order within a worker. What the test adds to a command, and why:

- fewer steps, where the command takes an override (`FEWER_STEPS`); a command that states its
  own `train.steps` (the drill: its faults are placed by step) keeps them, with less work per step
  (`LESS_WORK`);
- the files a command names as its input (`corpus/*.jsonl`, `train.csv`, `val.csv`), made here
  from the built-in corpus and the test's sentiment splits;
- for a config sized for GPUs (the GPT-3 presets), a CPU shape (`CPU_SHAPE`): the same command
  path, a 2-layer model of width 128 on 512-token windows;
- commands that do not run here (`SKIPPED`): installing, this suite itself, and the multi-node
  launches, which tests/integration/test_ssh_launch.py and test_slurm_launch.py run with real sshd,
  pdsh and Slurm.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import built_once

README = Path(__file__).resolve().parents[2] / "README.md"

# For a command that fixes its own steps (the drill): smaller batches, half the layers, and no
# attention maps drawn at its evaluations (about 0.8 s each; the golden run draws them).
LESS_WORK = ["train.micro_batch_size=2", "model.n_layers=2", "eval.batches=1", "eval.attention_probe=null"]
FEWER_STEPS = {
    ("pretrain", "demo"): ["--steps", "8"],
    ("pretrain", "launch"): ["train.steps=2"],
    ("pretrain", "finetune"): ["finetune.epochs=1"],
}
CPU_SHAPE = [
    "model.n_layers=2",
    "model.d_model=128",
    "model.n_heads=4",
    "data.seq_len=512",
    "train.micro_batch_size=1",
    "eval.batches=1",
    "engine.compile=false",
]
SKIPPED = (
    (lambda words: words[0] == "pip", "installs: the suite runs in the installed environment"),
    (lambda words: words[:3] == ["python", "-m", "pytest"], "this suite itself"),
    (lambda words: "--hostfile" in words, "over ssh: tests/integration/test_ssh_launch.py"),
    (lambda words: words[0] == "sbatch", "under Slurm: tests/integration/test_slurm_launch.py"),
)


# A hang guard, not a time limit: the demo's 8 steps took 434 s on an AVX2-only CPU (bf16 products
# on a slow path), so a machine twice as slow needs more than twice that.
HANG_SECONDS = 1800


def readme_blocks() -> list[list[list[str]]]:
    """Each ```bash block of the README: its commands (continuation lines joined, comments and
    `&&` split off), as argument lists."""
    blocks = re.findall(r"^```bash\n(.*?)^```", README.read_text(), flags=re.S | re.M)
    commands = []
    for block in blocks:
        words_of_block = []
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words:
                cut = words.index("&&") if "&&" in words else len(words)
                words_of_block.append(words[:cut])
                words = words[cut + 1 :]
        commands.append(words_of_block)
    return commands


def skipped(words: list[str]) -> str | None:
    return next((why for test, why in SKIPPED if test(words)), None)


def as_run_here(words: list[str]) -> list[str]:
    """The command with fewer steps and, for a GPU-sized config, the CPU shape."""
    fixed = any(w.startswith("train.steps=") for w in words)
    extra = LESS_WORK if fixed else FEWER_STEPS.get(tuple(words[:2]), [])
    config = words[words.index("--config") + 1] if "--config" in words else ""
    if config.startswith("gpt3-"):
        extra = [*extra, *CPU_SHAPE]
    return [sys.executable, "-m", "pretrain", *words[1:], *extra] if words[0] == "pretrain" else words


def run_block(directory: Path, block: list[list[str]]) -> list[tuple[list[str], subprocess.CompletedProcess]]:
    """Every command of a block, in order, each to exit 0; each command with what it printed."""
    results = []
    for words in block:
        if skipped(words):
            continue
        result = subprocess.run(
            as_run_here(words), cwd=directory, capture_output=True, text=True, timeout=HANG_SECONDS
        )
        assert result.returncode == 0, (
            f"$ {shlex.join(words)}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
        if "--out" in words:  # what it says it writes (a file, a directory or a prefix), it wrote
            out = directory / words[words.index("--out") + 1]
            assert out.exists() or list(out.parent.glob(out.name + ".*")), shlex.join(words)
        results.append((words, result))
    return results


def check_against_references(directory: Path, words: list[str], result: subprocess.CompletedProcess) -> None:
    """What a command of the README made, checked against references nobody here wrote
    (transformers' Llama, matplotlib's reader) and the command's own promises."""
    arg = dict(itertools.pairwise(words))  # (a flag's value follows it)
    if words[:2] == ["pretrain", "export-hf"]:  # transformers loads it and computes our logits
        import torch
        import transformers

        from pretrain.evaluation.inference import load_trained

        theirs = transformers.LlamaForCausalLM.from_pretrained(directory / arg["--out"]).eval()
        ours = load_trained(directory / arg["--checkpoint"]).model
        tokens = torch.randint(
            0, theirs.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0)
        )
        with torch.no_grad():
            assert (theirs(tokens).logits - ours(tokens).logits).abs().max().item() <= 1e-4
        assert json.loads((directory / arg["--out"] / "config.json").read_text())["eos_token_id"] == 2
    if words[:2] == ["pretrain", "eval"]:
        loss, perplexity = map(
            float, re.search(r"loss ([\d.]+), perplexity ([\d.]+)", result.stdout).groups()
        )
        assert perplexity == pytest.approx(math.exp(loss), rel=1e-3), result.stdout
    if words[:2] == ["pretrain", "generate"]:
        assert result.stdout.startswith(arg["--prompt"]) and result.stderr == "", result.stderr  # no bar
    if words[:2] == ["pretrain", "attention"]:
        import matplotlib.image

        png = matplotlib.image.imread(directory / (arg["--out"] + ".png"))
        assert png.ndim == 3 and png.shape[0] > 100
        page = (directory / (arg["--out"] + ".html")).read_text()
        assert "<select" in page and "http" not in page  # the head view: self-contained


def make_inputs(directory: Path, sentiment) -> None:
    """The input files the README's commands name: a corpus of JSON lines, CSV splits."""
    from pretrain.data.sources import pydoc_documents

    documents = list(pydoc_documents())
    (directory / "corpus").mkdir()
    for part in range(2):
        lines = [json.dumps({"text": text}) + "\n" for text in documents[part::2]]
        (directory / "corpus" / f"part-{part}.jsonl").write_text("".join(lines))
    for name, path in zip(("train.csv", "val.csv"), sentiment, strict=True):
        (directory / name).write_text(Path(path).read_text())


@pytest.fixture(scope="session")
def readme_dir(tmp_path_factory, sentiment):
    """A directory where the README's first block ran (`pretrain demo`, fewer steps), with the
    inputs the later blocks name."""

    def build(directory):
        (first, *_) = readme_blocks()
        (demo,) = [words for words in first if not skipped(words)]
        assert demo[:2] == ["pretrain", "demo"], demo  # the README starts with the demo
        make_inputs(directory, sentiment)
        ((_, result),) = run_block(directory, first)
        (directory / "demo.out").write_text(result.stdout + result.stderr)

    return built_once(tmp_path_factory, "readme", build)


def test_the_readme_starts_with_the_demo_and_it_says_where_to_look_next(readme_dir):
    printed = (readme_dir / "demo.out").read_text()
    summary = json.loads((readme_dir / "runs" / "demo" / "run" / "train_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["zero_stage"] == 2 and summary["completed"]
    assert [e["step"] for e in summary["eval"]] == [0, 4, 8]
    assert summary["eval"][-1]["loss"] < summary["eval"][0]["loss"] - 0.5
    assert "tensorboard --logdir runs/demo/run/tensorboard" in printed and "pretrain generate" in printed
    assert (
        readme_dir / "runs" / "demo" / "run" / "checkpoints" / "latest"
    ).read_text().strip() == "step_00000008"


@pytest.mark.parametrize("index", range(1, len(readme_blocks())))
def test_each_later_block_of_the_readme_runs_as_printed(readme_dir, index):
    block = readme_blocks()[index]
    for words, result in run_block(readme_dir, block):
        check_against_references(readme_dir, words, result)
        output = result.stdout + result.stderr
        if any(w.startswith("faults.") for w in words):  # the drill: what it rehearses happened
            run_dir = readme_dir / next(w.split("=", 1)[1] for w in words if w.startswith("run.dir="))
            kinds = [json.loads(line)["type"] for line in (run_dir / "events.jsonl").read_text().splitlines()]
            assert "rollback_applied" in kinds and "restart" in kinds, kinds
            # The killed rank reads as one line from each side: the rank that lost it, and the
            # supervisor naming the rank, the signal and the step; no traceback, no launcher [ERROR].
            kill = next(int(w.split("=")[1]) for w in words if w.startswith("faults.kill_step="))
            rank = next(int(w.split("=")[1]) for w in words if w.startswith("faults.kill_rank="))
            assert f"faults: killing rank {rank} as step {kill} begins (faults.kill_step)" in output
            assert (
                f"pretrain: rank {1 - rank}: stopped during step {kill}: another rank left the job ("
                in output
            )
            assert re.search(
                rf"launch: restart 1/3 after rank {rank} \(\S+, pid \d+\) was killed by SIGKILL "
                rf"during step {kill} \(exit status 247\)",
                output,
            ), output[-3000:]
            assert "Traceback" not in output and "[ERROR]" not in output, output[-3000:]
