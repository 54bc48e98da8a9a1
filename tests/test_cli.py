import json
import shutil
import subprocess
import sys

import pytest
import yaml

from pretrain.config import REPO_CONFIG_DIR


def run(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pretrain", *args], capture_output=True, text=True, cwd=cwd, timeout=300
    )


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert result.stdout == ""


def test_console_script_is_installed():
    exe = shutil.which("pretrain")
    assert exe, "pip install -e . should put a `pretrain` console script on PATH"
    result = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "flops" in result.stdout and "config" in result.stdout


def test_flops_json():
    result = run("flops", str(REPO_CONFIG_DIR / "model" / "gpt3-125m.yaml"), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["params"] == 134_105_856 and report["flops_per_token"] == 883_671_552
    assert {"non_embedding_params", "breakdown"} <= set(report)


def test_flops_text_with_mfu():
    result = run(
        "flops", str(REPO_CONFIG_DIR / "train" / "tiny.yaml"), "--tokens-per-sec", "1e6", "--device", "H100"
    )
    assert result.returncode == 0, result.stderr
    assert "seq_len 512" in result.stdout and "MFU at 1,000,000 tokens/s" in result.stdout


def test_config_show_resolves_overrides():
    result = run(
        "config", "show", str(REPO_CONFIG_DIR / "train" / "tiny.yaml"), "model.n_layers=3", "train.steps=9"
    )
    assert result.returncode == 0, result.stderr
    shown = yaml.safe_load(result.stdout)
    assert shown["model"]["n_layers"] == 3 and shown["train"]["steps"] == 9
    assert shown["model"]["preset"] == "tiny" and shown["model"]["d_ff"] == 512


def test_bad_inputs_exit_2_with_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  preset: tiny\n  n_heads: 4\n  n_kv_heads: 3\n")
    assert_one_line_error(run("config", "show", str(bad)), "pretrain: error:", "model.n_kv_heads=3")
    assert_one_line_error(run("flops", str(bad)), "model.n_kv_heads=3")
    assert_one_line_error(run("config", "show", "missing.yaml"), "missing.yaml does not exist")
    assert_one_line_error(
        run("config", "show", str(REPO_CONFIG_DIR / "train" / "tiny.yaml"), "model.wat=1"),
        "unknown key 'model.wat'",
    )
    unknown_preset = tmp_path / "preset.yaml"
    unknown_preset.write_text("model:\n  preset: gpt3-13b\n")
    assert_one_line_error(run("flops", str(unknown_preset)), "unknown model preset 'gpt3-13b'")
    assert_one_line_error(
        run("flops", str(REPO_CONFIG_DIR / "model" / "tiny.yaml"), "--tokens-per-sec", "5"), "--device"
    )
    tiny_preset = str(REPO_CONFIG_DIR / "model" / "tiny.yaml")
    for flags in (
        ["--peak-flops", "0", "--tokens-per-sec", "5"],
        ["--seq-len", "0"],
        ["--tokens-per-sec", "-1", "--device", "H100"],
    ):
        assert_one_line_error(run("flops", tiny_preset, *flags), "must be a positive number")
    assert_one_line_error(
        run("flops", tiny_preset, "--device", "H100", "--peak-flops", "1e15"), "not allowed with"
    )
    assert_one_line_error(run("demo", "--steps", "0", "--out", str(tmp_path / "d")), "--steps 0")
    (tmp_path / "file").write_text("x")
    assert_one_line_error(run("demo", "--out", str(tmp_path / "file")), "is a file")
    assert_one_line_error(run("no-such-command"), "invalid choice")
    assert_one_line_error(run("flops"), "required")


def test_debug_shows_the_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  preset: tiny\n  d_model: 100\n  n_heads: 3\n")
    result = run("--debug", "config", "show", str(bad))
    assert result.returncode != 0 and "Traceback" in result.stderr and "ConfigError" in result.stderr


@pytest.mark.slow
def test_demo_runs_the_whole_path(tmp_path):
    """The README's main command, shortened: tokenizer, shards, 2-process ZeRO-2 bf16 training."""
    result = run("demo", "--out", str(tmp_path / "demo"), "--steps", "8")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "demo" / "run" / "train_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["zero_stage"] == 2 and summary["completed"]
    assert [e["step"] for e in summary["eval"]] == [0, 4, 8]
    assert summary["eval"][-1]["loss"] < summary["eval"][0]["loss"] - 0.5
    assert "tensorboard --logdir" in result.stdout and "pretrain generate" in result.stdout
    assert (tmp_path / "demo" / "run" / "checkpoints" / "latest").read_text().strip() == "step_00000008"


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
