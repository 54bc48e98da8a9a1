"""Fine-tuning with real DeepSpeed runs: classification (single texts and pairs, 2 processes under
the DeepSpeed launcher and under accelerate) and SFT, starting from the golden pretraining run,
then predictions from the fine-tuned checkpoints."""

import csv
import json
import random
import subprocess
import sys

import pytest

from pretrain.cli import main as cli_main
from pretrain.parallel.distributed import free_port
from tests.finetune_data import (
    CLASSIFICATION,
    FILLER,
    SFT,
    TINY_FT,
    sentiment_rows,
    write_csv,
    write_jsonl,
)


@pytest.fixture(scope="module")
def pretrained(golden_run):
    """The starting point of every test: the golden pretraining run (2 processes, ZeRO-2)."""
    return golden_run


def events(run_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from pretrain.reporting.metrics import tensorboard_dir

    accumulator = EventAccumulator(str(tensorboard_dir(run_dir)))
    accumulator.Reload()
    return [(e.step, e.value) for e in accumulator.Scalars(tag)]


def test_classification_under_deepspeed_beats_the_majority_baseline(tmp_path, pretrained, sentiment, capsys):
    train_csv, val_csv = sentiment
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "deepspeed.launcher.runner",
            "--num_gpus",
            "2",
            "--master_port",
            str(free_port()),
            "--module",
            "pretrain.finetune",
            "--config",
            CLASSIFICATION,
            f"finetune.init={pretrained}",
            f"data.train={train_csv}",
            f"data.validation={val_csv}",
            f"run.dir={run_dir}",
            "train.micro_batch_size=4",
            "finetune.epochs=4",
            "eval.every=12",
            *TINY_FT[1:],
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads((run_dir / "eval_results.json").read_text())
    assert results["task"] == "classification" and results["examples"] == 64
    assert results["majority_baseline"] == 0.5 and results["bag_of_words_baseline"] == 1.0
    # What the run must beat, said before it starts (rank 0 only), and the rate it chose.
    assert (
        result.stdout.count(
            "to beat on the 64 validation examples: the majority label 0.5000, a bag of words 1.0000"
        )
        == 1
    )
    assert results["accuracy"] >= 0.85 and results["macro_f1"] >= 0.85, results
    # The head starts random (the defaults), and the run ends with the verdict.
    # (and adds the bag of words: finetune.bag_of_words, on by default)
    assert result.stdout.count("the head reads the last token's final hidden state; it starts random") == 1
    blend = "answers blend the network's logits with the bag of words' log-probabilities, weighted as "
    assert result.stdout.count(blend + "fits best the 19 training examples held out from training") == 1
    assert results["over_bag_of_words"] == pytest.approx(results["accuracy"] - 1.0)
    verdict = (
        "ties the bag of words (1.0000)"
        if results["accuracy"] == 1.0
        else "short of the bag of words (1.0000)"
    )
    said = f"accuracy {results['accuracy']:.4f} (the network alone {results['network_accuracy']:.4f}): "
    assert result.stdout.count(said) == 1 and verdict in result.stdout
    summary = json.loads((run_dir / "train_summary.json").read_text())
    # 4 epochs × 173 / (4 × 2): a tenth of the 192 held out to fit the blend
    assert summary["world_size"] == 2 and summary["steps"] == 87 and summary["blend_examples"] == 19
    accuracy = events(run_dir, "eval/accuracy")
    assert accuracy[0][0] == 0 and accuracy[-1] == (87, pytest.approx(results["accuracy"]))
    assert (run_dir / "checkpoints" / "step_00000087" / "complete.json").is_file()

    out = tmp_path / "predictions.jsonl"
    with_blank = tmp_path / "with_blank.csv"  # a row without text: marked, never a confident label
    with_blank.write_text(val_csv.read_text().rstrip("\n") + "\n" + '"  ",a b,positive\n')
    assert (
        cli_main(["predict", "--checkpoint", str(run_dir), "--input", str(with_blank), "--out", str(out)])
        == 0
    )
    predictions = [json.loads(line) for line in out.read_text().splitlines()]
    assert predictions.pop() == {
        "text": "  ",
        "other": "a b",
        "label": "positive",
        "prediction": None,
        "probabilities": None,
        "skipped": "empty text",
    }
    assert len(predictions) == 64 and not any("skipped" in p for p in predictions)
    agree = sum(p["prediction"] == p["label"] for p in predictions) / 64
    assert agree == pytest.approx(results["accuracy"])  # the same weights, consolidated for the CPU
    assert f"accuracy {agree:.4f} on the 64 labelled rows" in capsys.readouterr().out  # (not the blank one)
    assert all(abs(sum(p["probabilities"].values()) - 1) < 1e-5 for p in predictions)


def test_pair_classification_under_accelerate(tmp_path, pretrained):
    rows = sentiment_rows(96, 2)
    for row in rows:  # the keyword moves to the second text: the head must read past the separator
        row["text"], row["other"] = row["other"], row["text"]
    train_csv = write_csv(tmp_path / "train.csv", rows)
    val_csv = write_csv(tmp_path / "val.csv", sentiment_rows(32, 3))
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            str(free_port()),
            "-m",
            "pretrain.finetune",
            "--config",
            CLASSIFICATION,
            f"finetune.init={pretrained}",
            f"data.train={train_csv}",
            f"data.validation={val_csv}",
            "data.text_pair_column=other",
            f"run.dir={run_dir}",
            "train.micro_batch_size=4",
            "train.steps=6",
            "finetune.linear_probe=true",
            "finetune.pooling=mean",
            "finetune.lm_loss_weight=0.5",
            *TINY_FT[1:],
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((run_dir / "train_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 6
    results = json.loads((run_dir / "eval_results.json").read_text())
    assert set(results) >= {"accuracy", "macro_f1"}
    # The head fitted on the two processes' features, gathered (each process has half).
    probe = "the head reads the mean of the final hidden states; linear probe: fitted on the frozen model's features of the 86 training examples"
    assert result.stdout.count(probe) == 1, result.stdout[-3000:]  # (10 of 96 held out for the blend)
    assert "loss: cross-entropy + 0.5 x the next-token loss on the example" in result.stdout


def test_sft_lowers_the_validation_loss_and_the_checkpoint_generates(tmp_path, pretrained):
    rng = random.Random(0)

    def rows(count):
        out = []
        for _ in range(count):
            words = rng.sample(FILLER, 3)
            out.append({"prompt": "repeat: " + " ".join(words) + " =>", "completion": " " + " ".join(words)})
        return out

    train, val = (
        write_jsonl(tmp_path / "train.jsonl", rows(96)),
        write_jsonl(tmp_path / "val.jsonl", rows(24)),
    )
    run_dir = tmp_path / "run"
    code = cli_main(
        [
            "finetune",
            "--config",
            SFT,
            f"finetune.init={pretrained}",
            f"data.train={train}",
            f"data.validation={val}",
            f"run.dir={run_dir}",
            "train.steps=30",
            *TINY_FT,
        ]
    )
    assert code == 0
    summary = json.loads((run_dir / "train_summary.json").read_text())
    losses = [e["loss"] for e in summary["eval"]]
    assert losses[-1] < losses[0] - 0.5, losses
    assert json.loads((run_dir / "eval_results.json").read_text())["loss"] == pytest.approx(losses[-1])
    generated = subprocess.run(
        [
            sys.executable,
            "-m",
            "pretrain",
            "generate",
            "--checkpoint",
            str(run_dir),
            "--prompt",
            "repeat: the list =>",
            "--max-new-tokens",
            "8",
            "--temperature",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert generated.returncode == 0 and generated.stdout.startswith("repeat: the list =>"), generated.stderr
    out = tmp_path / "completions.csv"
    assert cli_main(["predict", "--checkpoint", str(run_dir), "--input", str(val), "--out", str(out)]) == 0
    with open(out) as f:
        table = list(csv.DictReader(f))
    assert len(table) == 24 and all("completion" in row for row in table)


def test_from_a_hugging_face_directory_with_parquet_integer_labels_and_truncation(
    tmp_path, pretrained, capsys
):
    """finetune.init may be an exported Llama directory; labels may be integers; long examples
    are truncated to finetune.max_length and counted. The same command again finds the run
    complete (the lifecycle pretraining shares: pretrain/run_builder.py) and trains nothing."""
    import datasets

    export = subprocess.run(
        [
            sys.executable,
            "-m",
            "pretrain",
            "export-hf",
            "--checkpoint",
            str(pretrained),
            "--out",
            str(tmp_path / "hf"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert export.returncode == 0, export.stderr
    rows = sentiment_rows(32, 4)
    for i, row in enumerate(rows):
        row["label"] = int(row["label"] == "positive") * 7  # integers 0 and 7
        if i % 4 == 0:
            row["text"] = " ".join([row["text"]] * 6)  # about 40+ tokens: over max_length
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "train.parquet"))
    run_dir = tmp_path / "run"
    command = [
        "finetune",
        "--config",
        CLASSIFICATION,
        f"finetune.init={tmp_path / 'hf'}",
        f"data.train={tmp_path / 'train.parquet'}",
        f"data.validation={tmp_path / 'train.parquet'}",
        "finetune.max_length=24",
        f"run.dir={run_dir}",
        "train.steps=2",
        *TINY_FT,
    ]
    assert cli_main(command) == 0
    summary = json.loads((run_dir / "train_summary.json").read_text())
    assert summary["train_truncated"] == 8 and summary["validation_truncated"] == 8
    run_config = json.loads((run_dir / "checkpoints" / "step_00000002" / "run_config.json").read_text())
    assert run_config["labels"] == [0, 7] and run_config["init_source"].startswith("Hugging Face model")
    assert set(json.loads((run_dir / "eval_results.json").read_text())) >= {"accuracy", "macro_f1"}
    results = (run_dir / "eval_results.json").read_bytes()
    capsys.readouterr()
    assert cli_main(command) == 0
    again = capsys.readouterr().out
    assert f"the run in {run_dir} is already complete: step 2 of 2 is saved (step_00000002)" in again
    assert "fine-tuning (" not in again and (run_dir / "eval_results.json").read_bytes() == results
    # Killed after its last checkpoint, before its results were written: the same command trains
    # nothing and writes them (the summary says the run was not finished).
    (run_dir / "eval_results.json").unlink()
    (run_dir / "train_summary.json").unlink()
    assert cli_main(command) == 0
    assert "is already complete" not in capsys.readouterr().out
    assert (run_dir / "eval_results.json").read_bytes() == results
    assert json.loads((run_dir / "train_summary.json").read_text())["completed"]
