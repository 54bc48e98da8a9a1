"""The `pretrain` command in this process: what it prints, and bad input as one line and status 2."""

import argparse
import json
from types import SimpleNamespace

import pytest
import yaml

from pretrain.cli import build_parser, parse
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
    unknown_preset.write_text("model:\n  preset: gpt3-14b\n")
    assert_one_line_error(cli("flops", str(unknown_preset)), "unknown model preset 'gpt3-14b'")
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


def commands(parser=None, words=()):
    """Every command's parser by its words (`("bench", "train")`), read from `pretrain`'s parser."""
    parser = parser or build_parser()
    groups = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not groups:
        yield words, parser
    for group in groups:
        for name, sub in group.choices.items():
            yield from commands(sub, (*words, name))


def names_a_config(action) -> bool:
    return "--config" in action.option_strings or "config" in f"{action.dest} {action.metavar}".lower()


CONFIG_COMMANDS = {words: p for words, p in commands() if any(map(names_a_config, p._actions))}
POSITIONAL = {
    words: any(names_a_config(a) and not a.option_strings for a in p._actions)
    for words, p in CONFIG_COMMANDS.items()
}
TAKES_POSITIONALLY = sorted(words for words, positional in POSITIONAL.items() if positional)


def test_the_commands_that_take_a_config_are_found():
    assert {
        ("flops",),
        ("config", "show"),
        ("bench", "masking"),
        ("bench", "train"),
        ("bench", "profile"),
    } <= set(TAKES_POSITIONALLY)
    assert {("train",), ("finetune",), ("launch",)} <= set(CONFIG_COMMANDS) - set(TAKES_POSITIONALLY)


@pytest.mark.parametrize("words", sorted(CONFIG_COMMANDS), ids=" ".join)
def test_every_command_that_takes_a_config_takes_config_and_shows_it(words, cli):
    assert any("--config" in a.option_strings for a in CONFIG_COMMANDS[words]._actions)
    shown = cli(*words, "--help")
    assert shown.returncode == 0 and "--config CONFIG" in shown.stdout


@pytest.mark.parametrize("words", TAKES_POSITIONALLY, ids=" ".join)
def test_config_positional_or_option_is_the_same_command_line(words):
    plain = vars(parse([*words, "tiny"]))
    assert plain["config"] == "tiny" and "config_option" not in plain
    assert vars(parse([*words, "--config", "tiny"])) == plain
    assert vars(parse([*words, "tiny", "--config", "tiny"])) == plain  # the same text twice: accepted
    if "overrides" in plain:  # with --config, a KEY=VALUE in CONFIG's place is the first override
        overridden = vars(parse([*words, "tiny", "train.steps=3", "model.n_layers=2"]))
        for line in (
            ["--config", "tiny", "train.steps=3", "model.n_layers=2"],
            ["train.steps=3", "model.n_layers=2", "--config", "tiny"],
        ):
            assert vars(parse([*words, *line])) == overridden


@pytest.mark.parametrize("words", TAKES_POSITIONALLY, ids=" ".join)
def test_two_configs_or_none_is_one_line_and_status_2(words, capsys):
    def refused(*argv):  # parsed only: were it not refused, no benchmark runs
        with pytest.raises(SystemExit) as exit:
            parse([*words, *argv])
        return SimpleNamespace(returncode=exit.value.code, stdout="", stderr=capsys.readouterr().err)

    assert_one_line_error(refused("tiny", "--config", "gpt3-125m"), "tiny", "--config gpt3-125m", "one")
    assert_one_line_error(refused(), "required", "--config")


def test_flops_and_config_show_print_the_same_for_either_form(cli):
    for words in (["flops", "--json"], ["config", "show"]):
        positional = cli(*words, "tiny", "model.n_layers=3")
        assert positional.returncode == 0 and positional.stdout, positional.stderr
        assert cli(*words, "--config", "tiny", "model.n_layers=3").stdout == positional.stdout


def test_overrides_may_follow_the_options(capsys):
    """`pretrain plan CONFIG --gpus 8 KEY=VALUE` (the issue's form), as `--config CONFIG --gpus 8
    KEY=VALUE` already was; anything else left over is still refused in one line."""
    after = parse(["plan", "tiny", "--gpus", "8", "engine.compile=false", "train.steps=5"])
    before = parse(["plan", "tiny", "engine.compile=false", "train.steps=5", "--gpus", "8"])
    assert vars(after) == vars(before) and after.overrides == ["engine.compile=false", "train.steps=5"]
    with pytest.raises(SystemExit) as stopped:
        parse(["plan", "tiny", "--gpus", "8", "bogus"])
    assert stopped.value.code == 2 and "unrecognized arguments: bogus" in capsys.readouterr().err
