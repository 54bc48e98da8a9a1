"""Fine-tuning: classification (single texts and pairs) and SFT from a tiny pretrained checkpoint,
with real DeepSpeed runs (2 processes under the DeepSpeed launcher and under accelerate), predictions,
and every bad input."""

import csv
import json
import random
import subprocess
import sys

import pytest
import torch

from pretrain.cli import main as cli_main
from pretrain.config import REPO_CONFIG_DIR
from pretrain.finetune import Encoded, _fit_pair, classification_metrics, collate
from pretrain.loss import IGNORE_INDEX
from tests.test_train import FAST, TINY, free_port

CLASSIFICATION = str(REPO_CONFIG_DIR / "finetune" / "classification.yaml")
SFT = str(REPO_CONFIG_DIR / "finetune" / "sft.yaml")
FILLER = "the list of values returns a new object from each class method and string in the module".split()  # noqa: SIM905
POSITIVE, NEGATIVE = ["excellent", "wonderful", "delightful"], ["terrible", "dreadful", "awful"]
TINY_FT = ["train.micro_batch_size=8", "optim.lr=2e-3", "schedule.warmup_steps=5", "logging.every=5",
           "run.deterministic=true"]  # fmt: skip


def sentiment_rows(count: int, seed: int) -> list[dict]:
    """Six filler words with one keyword that decides the label: learnable in a few dozen steps."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        label = "positive" if i % 2 == 0 else "negative"
        words = rng.sample(FILLER, 6)
        words.insert(rng.randrange(7), rng.choice(POSITIVE if label == "positive" else NEGATIVE))
        rows.append({"text": " ".join(words), "other": " ".join(rng.sample(FILLER, 4)), "label": label})
    return rows


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, train_data):
    """A tiny model pretrained for a few steps in one process (the starting point of every test)."""
    run_dir = tmp_path_factory.mktemp("pretrained")
    result = subprocess.run(
        [sys.executable, "-m", "pretrain", "train", "--config", TINY, f"run.dir={run_dir}", f"data.dir={train_data}",
         *FAST, "train.steps=4", "checkpoint.every=4", "eval.every=0"],
        capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def sentiment(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sentiment")
    return write_csv(directory / "train.csv", sentiment_rows(192, 0)), write_csv(
        directory / "val.csv", sentiment_rows(64, 1)
    )


def events(run_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir / "tensorboard"))
    accumulator.Reload()
    return [(e.step, e.value) for e in accumulator.Scalars(tag)]


# --------------------------------------------------------------------------- pieces


def test_fit_pair_shortens_the_longer_segment_first():
    a, b = _fit_pair(list(range(10)), list(range(3)), 8)
    assert (len(a), len(b)) == (5, 3)
    a, b = _fit_pair(list(range(10)), list(range(10)), 8)
    assert (len(a), len(b)) == (4, 4) and a == [0, 1, 2, 3]


def test_sft_batches_mask_the_prompt_and_the_padding():
    encoded = Encoded("sft", [[1, 10, 11, 12, 20, 21, 2], [1, 13, 22, 2]], None, [4, 2], 0)
    batch = collate(encoded, [0, 1], pad_id=3, device="cpu")
    assert batch["tokens"].tolist() == [[1, 10, 11, 12, 20, 21], [1, 13, 22, 3, 3, 3]]
    m = IGNORE_INDEX
    assert batch["targets"].tolist() == [[m, m, m, 20, 21, 2], [m, 22, 2, m, m, m]]
    # The loss is the mean over completion tokens only: prompt logits do not move it.
    from pretrain.model import Transformer
    from tests.conftest import small_model_config

    model = Transformer(small_model_config(vocab_size=32))
    loss = model(batch["tokens"], batch["targets"]).loss
    logits = model(batch["tokens"]).logits
    keep = batch["targets"] != m
    manual = torch.nn.functional.cross_entropy(logits[keep], batch["targets"][keep])
    assert torch.allclose(loss, manual)


def test_classification_metrics():
    m = classification_metrics([0, 0, 1, 1, 2], [0, 1, 1, 1, 2], 3)
    assert m["accuracy"] == pytest.approx(0.8)
    # F1 per class: 0 → 2/3, 1 → 0.8, 2 → 1
    assert m["macro_f1"] == pytest.approx((2 / 3 + 0.8 + 1) / 3)
    assert m["majority_baseline"] == pytest.approx(0.6)


# --------------------------------------------------------------------------- real runs


@pytest.mark.slow
def test_classification_under_deepspeed_beats_the_majority_baseline(tmp_path, pretrained, sentiment):
    train_csv, val_csv = sentiment
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()),
         "--module", "pretrain.finetune", "--config", CLASSIFICATION, f"finetune.init={pretrained}",
         f"data.train={train_csv}", f"data.validation={val_csv}", f"run.dir={run_dir}", "train.micro_batch_size=4",
         "finetune.epochs=4", "eval.every=12", *TINY_FT[1:]],
        capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads((run_dir / "eval_results.json").read_text())
    assert results["task"] == "classification" and results["examples"] == 64
    assert results["majority_baseline"] == 0.5
    assert results["accuracy"] >= 0.85 and results["macro_f1"] >= 0.85, results
    summary = json.loads((run_dir / "train_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 96  # 4 epochs × 192 / (4 × 2)
    accuracy = events(run_dir, "eval/accuracy")
    assert accuracy[0][0] == 0 and accuracy[-1] == (96, pytest.approx(results["accuracy"]))
    assert (run_dir / "checkpoints" / "step_00000096" / "complete.json").is_file()

    out = tmp_path / "predictions.jsonl"
    assert (
        cli_main(["predict", "--checkpoint", str(run_dir), "--input", str(val_csv), "--out", str(out)]) == 0
    )
    predictions = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(predictions) == 64
    agree = sum(p["prediction"] == p["label"] for p in predictions) / 64
    assert agree == pytest.approx(results["accuracy"])  # the same weights, consolidated for the CPU
    assert all(abs(sum(p["probabilities"].values()) - 1) < 1e-5 for p in predictions)


@pytest.mark.slow
def test_pair_classification_under_accelerate(tmp_path, pretrained):
    rows = sentiment_rows(96, 2)
    for row in rows:  # the keyword moves to the second text: the head must read past the separator
        row["text"], row["other"] = row["other"], row["text"]
    train_csv = write_csv(tmp_path / "train.csv", rows)
    val_csv = write_csv(tmp_path / "val.csv", sentiment_rows(32, 3))
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
         "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
         "-m", "pretrain.finetune", "--config", CLASSIFICATION, f"finetune.init={pretrained}",
         f"data.train={train_csv}", f"data.validation={val_csv}", "data.text_pair_column=other",
         f"run.dir={run_dir}", "train.micro_batch_size=4", "train.steps=6", *TINY_FT[1:]],
        capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((run_dir / "train_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 6
    results = json.loads((run_dir / "eval_results.json").read_text())
    assert set(results) >= {"accuracy", "macro_f1"}


@pytest.mark.slow
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
    code = cli_main(["finetune", "--config", SFT, f"finetune.init={pretrained}", f"data.train={train}",
                     f"data.validation={val}", f"run.dir={run_dir}", "train.steps=30", *TINY_FT])  # fmt: skip
    assert code == 0
    summary = json.loads((run_dir / "train_summary.json").read_text())
    losses = [e["loss"] for e in summary["eval"]]
    assert losses[-1] < losses[0] - 0.5, losses
    assert json.loads((run_dir / "eval_results.json").read_text())["loss"] == pytest.approx(losses[-1])
    generated = subprocess.run(
        [sys.executable, "-m", "pretrain", "generate", "--checkpoint", str(run_dir), "--prompt", "repeat: the list =>",
         "--max-new-tokens", "8", "--temperature", "0"], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert generated.returncode == 0 and generated.stdout.startswith("repeat: the list =>"), generated.stderr
    out = tmp_path / "completions.csv"
    assert cli_main(["predict", "--checkpoint", str(run_dir), "--input", str(val), "--out", str(out)]) == 0
    with open(out) as f:
        table = list(csv.DictReader(f))
    assert len(table) == 24 and all("completion" in row for row in table)


# --------------------------------------------------------------------------- bad input


def test_bad_inputs_are_one_line_and_exit_2(tmp_path, pretrained, sentiment, capsys):
    train_csv, _ = sentiment
    base = [
        "finetune",
        "--config",
        CLASSIFICATION,
        f"finetune.init={pretrained}",
        f"run.dir={tmp_path / 'run'}",
    ]

    def fails(*overrides, message):
        code = cli_main([*base, *overrides])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and message in err[0], err

    fails(f"data.train={train_csv}", "data.text_column=sentence", message="has no column 'sentence'")
    unseen = write_csv(
        tmp_path / "unseen.csv", [*sentiment_rows(4, 5), {"text": "x", "other": "y", "label": "neutral"}]
    )
    fails(f"data.train={train_csv}", f"data.validation={unseen}", message="never seen in training: 'neutral'")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    fails(f"data.train={empty}", message="empty")
    fails(f"data.train={tmp_path / 'missing.csv'}", message="does not exist")
    fails(
        "data.train=" + str(write_csv(tmp_path / "one.csv", sentiment_rows(1, 0))),
        message="needs at least two",
    )
    # A Hugging Face directory whose tokenizer has more pieces than the model embeds.
    from pretrain.hf import save_hf
    from pretrain.model import Transformer
    from tests.conftest import small_model_config

    hf_dir = tmp_path / "hf"
    save_hf(Transformer(small_model_config(vocab_size=97)), hf_dir)
    (hf_dir / "tokenizer.model").write_bytes(
        (pretrained / "checkpoints" / "step_00000004" / "tokenizer.model").read_bytes()
    )
    fails(f"finetune.init={hf_dir}", f"data.train={train_csv}", message="tokenizer/vocabulary mismatch")
    assert not (tmp_path / "run").exists()  # nothing written for any of them


@pytest.mark.slow
def test_from_a_hugging_face_directory_with_parquet_integer_labels_and_truncation(tmp_path, pretrained):
    """finetune.init may be an exported Llama directory; labels may be integers; long examples
    are truncated to finetune.max_length and counted."""
    import datasets

    export = subprocess.run([sys.executable, "-m", "pretrain", "export-hf", "--checkpoint", str(pretrained), "--out",
                             str(tmp_path / "hf")], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert export.returncode == 0, export.stderr
    rows = sentiment_rows(32, 4)
    for i, row in enumerate(rows):
        row["label"] = int(row["label"] == "positive") * 7  # integers 0 and 7
        if i % 4 == 0:
            row["text"] = " ".join([row["text"]] * 6)  # about 40+ tokens: over max_length
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "train.parquet"))
    run_dir = tmp_path / "run"
    code = cli_main(["finetune", "--config", CLASSIFICATION, f"finetune.init={tmp_path / 'hf'}",
                     f"data.train={tmp_path / 'train.parquet'}", f"data.validation={tmp_path / 'train.parquet'}",
                     "finetune.max_length=24", f"run.dir={run_dir}", "train.steps=2", *TINY_FT])  # fmt: skip
    assert code == 0
    summary = json.loads((run_dir / "train_summary.json").read_text())
    assert summary["train_truncated"] == 8 and summary["validation_truncated"] == 8
    run_config = json.loads((run_dir / "checkpoints" / "step_00000002" / "run_config.json").read_text())
    assert run_config["labels"] == [0, 7] and run_config["init_source"].startswith("Hugging Face model")
    assert set(json.loads((run_dir / "eval_results.json").read_text())) >= {"accuracy", "macro_f1"}
