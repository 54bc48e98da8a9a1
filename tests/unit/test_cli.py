"""The `pretrain` command in this process: what it prints, and bad input as one line and status 2."""

import json

import pytest
import yaml

from pretrain.config import REPO_CONFIG_DIR
from pretrain.errors import ConfigError
from tests.helpers import assert_one_line_error


def test_flops_json(cli):
    result = cli("flops", str(REPO_CONFIG_DIR / "model" / "gpt3-125m.yaml"), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["params"] == 134_105_856 and report["flops_per_token"] == 883_671_552
    assert {"non_embedding_params", "breakdown"} <= set(report)


def test_flops_text_with_mfu(cli):
    result = cli(
        "flops", str(REPO_CONFIG_DIR / "train" / "tiny.yaml"), "--tokens-per-sec", "1e6", "--device", "H100"
    )
    assert result.returncode == 0, result.stderr
    assert "seq_len 512" in result.stdout and "MFU at 1,000,000 tokens/s" in result.stdout


def test_config_show_resolves_overrides(cli):
    result = cli(
        "config", "show", str(REPO_CONFIG_DIR / "train" / "tiny.yaml"), "model.n_layers=3", "train.steps=9"
    )
    assert result.returncode == 0, result.stderr
    shown = yaml.safe_load(result.stdout)
    assert shown["model"]["n_layers"] == 3 and shown["train"]["steps"] == 9
    assert shown["model"]["preset"] == "tiny" and shown["model"]["d_ff"] == 512


def test_bad_inputs_exit_2_with_one_line(tmp_path, cli):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  preset: tiny\n  n_heads: 4\n  n_kv_heads: 3\n")
    assert_one_line_error(cli("config", "show", str(bad)), "pretrain: error:", "model.n_kv_heads=3")
    assert_one_line_error(cli("flops", str(bad)), "model.n_kv_heads=3")
    assert_one_line_error(cli("config", "show", "missing.yaml"), "missing.yaml does not exist")
    assert_one_line_error(
        cli("config", "show", str(REPO_CONFIG_DIR / "train" / "tiny.yaml"), "model.wat=1"),
        "unknown key 'model.wat'",
    )
    unknown_preset = tmp_path / "preset.yaml"
    unknown_preset.write_text("model:\n  preset: gpt3-13b\n")
    assert_one_line_error(cli("flops", str(unknown_preset)), "unknown model preset 'gpt3-13b'")
    assert_one_line_error(
        cli("flops", str(REPO_CONFIG_DIR / "model" / "tiny.yaml"), "--tokens-per-sec", "5"), "--device"
    )
    tiny_preset = str(REPO_CONFIG_DIR / "model" / "tiny.yaml")
    for flags in (
        ["--peak-flops", "0", "--tokens-per-sec", "5"],
        ["--seq-len", "0"],
        ["--tokens-per-sec", "-1", "--device", "H100"],
    ):
        assert_one_line_error(cli("flops", tiny_preset, *flags), "must be a positive number")
    assert_one_line_error(
        cli("flops", tiny_preset, "--device", "H100", "--peak-flops", "1e15"), "not allowed with"
    )
    assert_one_line_error(cli("demo", "--steps", "0", "--out", str(tmp_path / "d")), "--steps 0")
    (tmp_path / "file").write_text("x")
    assert_one_line_error(cli("demo", "--out", str(tmp_path / "file")), "is a file")
    assert_one_line_error(cli("no-such-command"), "invalid choice")
    assert_one_line_error(cli("flops"), "required")


def test_debug_shows_the_traceback(tmp_path, cli):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  preset: tiny\n  d_model: 100\n  n_heads: 3\n")
    with pytest.raises(ConfigError, match="not divisible"):
        cli("--debug", "config", "show", str(bad))
