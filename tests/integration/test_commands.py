"""Commands as a user runs them, each in its own process: the console script, the demo, the data
and monitoring benchmarks, `eval` against the run's own evaluation."""

import json
import shutil
import subprocess
import sys

import pytest


def run(*args: str, cwd=None) -> subprocess.CompletedProcess:
    """(`timeout`: a safety net against a hang, as every job's in the suite; `bench ablation`, which
    trains two arms, ran past 300 s on a loaded machine.)"""
    return subprocess.run(
        [sys.executable, "-m", "pretrain", *args], capture_output=True, text=True, cwd=cwd, timeout=600
    )


def test_console_script_is_installed():
    exe = shutil.which("pretrain")
    assert exe, "pip install -e . should put a `pretrain` console script on PATH"
    result = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "flops" in result.stdout and "config" in result.stdout


def test_eval_as_run_gives_the_loss_the_runs_own_evaluation_logged(golden_run, train_data):
    """The golden run evaluates eval.batches=2 micro-batches of 2 windows on each of 2 ranks, in bf16:
    8 of the validation split's 11 windows. `eval --as-run` reads those and gives its eval/loss;
    plain `eval` reads all 11 in fp32 (another number) and says how the run's evaluation differs."""
    logged = json.loads((golden_run / "train_summary.json").read_text())["eval"][-1]
    result = run("eval", "--checkpoint", str(golden_run), "--data", str(train_data), "--as-run", "--json")
    assert result.returncode == 0, result.stderr
    ours = json.loads(result.stdout)
    assert (
        ours["step"] == logged["step"] == 20 and ours["windows"] == 2 * 2 * 2 and ours["split_windows"] == 11
    )
    assert ours["loss"] == pytest.approx(logged["loss"], abs=5e-6) and ours["logged"] == logged["loss"]
    whole = run("eval", "--checkpoint", str(golden_run), "--data", str(train_data))
    assert whole.returncode == 0, whole.stderr
    first, second = whole.stdout.strip().splitlines()
    assert "over 11 of the 11 windows of 512 tokens (5,632 tokens) of the validation split" in first
    assert second == (
        "the run's own eval/loss reads 8 of these windows (eval.batches=2 × train.micro_batch_size=2 "
        "× 2 ranks) in bf16: --as-run evaluates exactly those"
    )


def test_bench_data_prints_the_figures():
    result = run("bench", "data", "--json", "--quick")
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    for key in (
        "stream_tokens_per_sec",
        "prepare_tokens_per_sec_1_worker",
        "prepare_tokens_per_sec_2_workers",
    ):
        assert figures[key] > 0, key
    assert figures["prepare_output_identical"] is True


def test_bench_monitor_measures_the_overhead_and_acts_on_a_spike_at_once():
    result = run("bench", "monitor", "--json", "--quick")
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    assert figures["step_ms_without_monitor"] > 0 and figures["step_ms_with_monitor"] > 0
    assert 0 < figures["report_round_trip_ms_median"] < figures["step_ms_without_monitor"]
    assert figures["spike_answer"] == "rollback"
    assert figures["rollback_event_steps"] == [figures["spike_reported_at_step"]]


def test_the_wheel_carries_every_config(tmp_path):
    """A non-editable install has all of configs/ (under <prefix>/share/pretrain, where
    pretrain.config.config_dir finds it)."""
    import zipfile

    from pretrain.config import REPO_CONFIG_DIR

    root = REPO_CONFIG_DIR.parent
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "pretrain", "monitoring", "configs"):
        copy = shutil.copytree if (root / name).is_dir() else shutil.copy
        copy(root / name, source / name)
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("pretrain-*.whl")
    shipped = {
        n.split("/share/pretrain/", 1)[1]
        for n in zipfile.ZipFile(wheel).namelist()
        if "/share/pretrain/" in n
    }
    in_repo = {str(p.relative_to(root)) for p in (root / "configs").rglob("*") if p.is_file()}
    assert shipped == in_repo
