"""What a new user meets first: configs by name from any directory, the progress line's ETA,
data prepare's progress with a total, and a demo that keeps earlier runs."""

import io
import json
from pathlib import Path

import pytest
import yaml

from pretrain.config import REPO_CONFIG_DIR, load_config, packaged_configs, resolve_config
from pretrain.errors import ConfigError
from tests.helpers import assert_one_line_error


@pytest.mark.parametrize(
    ("name", "file"),
    [
        ("demo", "train/demo.yaml"),
        ("tiny", "train/tiny.yaml"),
        ("gpt3-125m", "train/gpt3-125m.yaml"),
        ("finetune/classification", "finetune/classification.yaml"),
        ("train/tiny", "train/tiny.yaml"),
    ],
)
def test_packaged_configs_resolve_by_name_from_any_directory(tmp_path, monkeypatch, name, file):
    monkeypatch.chdir(tmp_path)
    assert resolve_config(name) == REPO_CONFIG_DIR / file


@pytest.mark.parametrize("path", ["configs/finetune/classification.yaml", "configs/train/demo.yaml"])
def test_a_config_path_as_the_docs_print_it_works_outside_the_repository(tmp_path, monkeypatch, path):
    monkeypatch.chdir(tmp_path)  # (issue 29: the README's fine-tune command failed here)
    assert resolve_config(path) == REPO_CONFIG_DIR / path.removeprefix("configs/")
    (tmp_path / "configs" / "train").mkdir(parents=True)
    (tmp_path / "configs" / "train" / "demo.yaml").write_text("train: {steps: 3}\n")
    assert resolve_config("configs/train/demo.yaml") == Path("configs/train/demo.yaml")  # a local file wins


def test_a_file_in_the_working_directory_wins_over_a_packaged_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").write_text((REPO_CONFIG_DIR / "train" / "tiny.yaml").read_text())
    assert resolve_config("tiny").resolve() == tmp_path / "tiny"
    assert load_config("tiny", ["train.steps=7"]).train.steps == 7


def test_config_show_prints_a_finetune_config_that_leaves_its_checkpoint_to_the_command_line(cli):
    shown = cli("config", "show", "finetune/classification")  # (issue 29: exit 2, "finetune.init is not set")
    assert shown.returncode == 0, shown.stderr
    assert yaml.safe_load(shown.stdout)["finetune"]["task"] == "classification"
    refused = cli("finetune", "--config", "finetune/classification")  # running it still needs one
    assert_one_line_error(refused, "finetune.init is not set")


def test_config_show_and_list_by_name(tmp_path, monkeypatch, cli):
    monkeypatch.chdir(tmp_path)
    shown = cli("config", "show", "tiny", "train.steps=9")
    assert shown.returncode == 0, shown.stderr
    assert yaml.safe_load(shown.stdout)["train"]["steps"] == 9
    listed = cli("config", "list")
    assert listed.returncode == 0, listed.stderr
    names = [line.split()[0] for line in listed.stdout.splitlines()]
    assert names == list(packaged_configs())
    assert {"demo", "tiny", "gpt3-125m", "finetune/classification"} <= set(names)
    assert all(len(line.split(maxsplit=1)) == 2 for line in listed.stdout.splitlines())  # each described


def test_an_unknown_config_name_is_one_line(tmp_path, monkeypatch, cli):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="pretrain config list"):
        resolve_config("gpt3-14b")
    assert_one_line_error(cli("config", "show", "gpt3-14b"), "no config 'gpt3-14b'", "pretrain config list")
    assert_one_line_error(cli("config", "show", "missing.yaml"), "missing.yaml does not exist")


def test_the_first_progress_line_has_an_eta_from_its_step_time(tmp_path, capsys):
    from pretrain.reporting.metrics import MetricsWriter

    writer = MetricsWriter(tmp_path, 101, enabled=True, tensorboard=False)
    values = {"train/loss": 5.0, "train/tokens_per_sec": 1000.0, "train/step_time": 2.0}
    writer.console(1, values)
    writer.close()
    line = capsys.readouterr().out.strip()
    assert line.endswith("eta 0:03:20"), line  # 100 steps left at 2 s each


def _corpus(tmp_path, documents: int):
    from pretrain.data import resolve_source

    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n\n" for i in range(documents)))
    return resolve_source(str(path))


def test_prepare_progress_without_a_terminal_is_a_line_per_tenth(tmp_path, monkeypatch):
    from pretrain.data import progress

    source = _corpus(tmp_path, 40)
    assert progress.count_documents(source) == 40  # blank lines are not documents
    stream = io.StringIO()
    shown = progress.Progress(progress.count_documents(source), stream=stream)
    for _ in source.records():
        shown.wrote(3, 1)
    shown.close()
    lines = stream.getvalue().splitlines()
    assert lines[0] == "tokenizing 40 documents"
    tenths = [line for line in lines if line.startswith("tokenizing: ")]
    assert [line.split()[1] for line in tenths] == [f"{p}%" for p in range(10, 100, 10)]
    assert "of 40 documents" in tenths[0] and "left)" in tenths[0]
    assert lines[-1].startswith("tokenized 40 documents into 120 tokens in ")


def test_prepare_progress_counts_documents_written_not_read_ahead(
    tmp_path, tokenizer_dir, monkeypatch, capsys
):
    """The workers read 2 batches each ahead of the writer: counted as read, the first line came
    when the whole corpus of 40 (4 per batch) was read, and said nothing until the end."""
    from pretrain.data import prepare as prepare_module

    monkeypatch.setattr(prepare_module, "BATCH_DOCS", 4)
    tokenize = prepare_module._tokenized

    def read_ahead(batches, tokenizer, workers):
        yield from tokenize(list(batches), tokenizer, workers)  # every batch read first

    monkeypatch.setattr(prepare_module, "_tokenized", read_ahead)
    source = _corpus(tmp_path, 40)
    prepare_module.prepare(source, tokenizer_dir, tmp_path / "out", val_fraction=0.1)
    tenths = [line for line in capsys.readouterr().err.splitlines() if line.startswith("tokenizing: ")]
    assert [line.split()[1] for line in tenths] == [f"{p}%" for p in range(10, 100, 10)], tenths


def test_prepare_progress_in_a_terminal_is_a_bar_with_a_total(tmp_path):
    from pretrain.data import progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    source = _corpus(tmp_path, 20)
    stream = Terminal()
    shown = progress.Progress(progress.count_documents(source), stream=stream)
    for _ in source.records():
        shown.wrote(3, 1)
    shown.close()
    last = stream.getvalue().split("\r")[-1]
    assert "100%" in last and "20/20" in last and "60 tokens" in last, last


def test_the_demo_never_reuses_an_earlier_run(tmp_path, capsys):
    from pretrain.cli.demo import new_run_dir

    assert new_run_dir(tmp_path) == tmp_path / "run"
    (tmp_path / "run").mkdir()
    assert new_run_dir(tmp_path) == tmp_path / "run"  # an empty directory holds no run
    (tmp_path / "run" / "events.jsonl").write_text("{}\n")
    assert new_run_dir(tmp_path) == tmp_path / "run-2"
    (tmp_path / "run-2").mkdir()
    (tmp_path / "run-2" / "x").write_text("")
    assert new_run_dir(tmp_path) == tmp_path / "run-3"
    assert "earlier demo runs are kept" in capsys.readouterr().out


def test_the_console_keeps_warnings_and_drops_chatter(monkeypatch, capsys):
    import logging

    from pretrain.reporting import console

    monkeypatch.setenv(console.VERBOSE_ENV, "0")  # restored (unset) after the test
    chatter = console._DeepSpeedChatter()

    def shown(level, message):
        return chatter.filter(logging.LogRecord("DeepSpeed", level, __file__, 1, message, None, None))

    assert not shown(logging.INFO, "cmd = /usr/bin/python -u -m deepspeed.launcher.launch ...")
    assert not shown(logging.WARNING, "Setting accelerator to CPU. If you have GPU ...")
    assert not shown(
        logging.WARNING, "Unable to find hostfile, will proceed with training with local resources only."
    )
    assert shown(logging.WARNING, "Attempting to resume from a checkpoint with a different world size")
    assert shown(logging.ERROR, "anything")
    assert console.deepspeed_log_level() == "critical"  # (the supervisor names a failed rank)
    with console.without_printed_chatter():
        print("deepspeed_shm_comm_op built successfully")
        print("a line of ours")
    assert capsys.readouterr().out == "a line of ours\n"
    monkeypatch.setenv(console.VERBOSE_ENV, "1")  # --verbose: everything, as the libraries print it
    assert console.deepspeed_log_level() == "info"
    with console.without_printed_chatter():
        print("deepspeed_shm_comm_op built successfully")
    assert "built successfully" in capsys.readouterr().out


def test_verbose_anywhere_on_the_command_line(monkeypatch, cli):
    from pretrain.reporting import console

    monkeypatch.setenv(console.VERBOSE_ENV, "0")  # restored (unset) after the test
    assert cli("config", "show", "tiny", "--verbose").returncode == 0
    assert console.verbose()


def test_a_directory_named_like_a_config_does_not_hide_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo").mkdir()  # what `pretrain demo --out .` leaves beside a user
    assert resolve_config("demo") == REPO_CONFIG_DIR / "train" / "demo.yaml"
