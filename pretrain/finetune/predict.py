"""`pretrain predict`: classification checkpoints label each row (with the probability of every
label); sft checkpoints complete each prompt (greedy). Writes JSON lines or CSV."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import asdict
from pathlib import Path
from typing import NamedTuple

import torch

from pretrain import atomic
from pretrain.config import FinetuneConfig, FinetuneDataConfig, ModelConfig, finetune_config_from_dict
from pretrain.errors import UserError
from pretrain.finetune.baselines import BagOfWords
from pretrain.finetune.data import (
    check_columns,
    collate,
    encode_classification,
    padding_id,
    raw_texts,
    read_split,
    required_columns,
)
from pretrain.model.classifier import SequenceClassifier
from pretrain.model.transformer import Transformer
from pretrain.tokenizer import Tokenizer


class Predicted(NamedTuple):
    rows: int  # rows written
    skipped: int  # of them, rows without text: marked `"skipped": "empty text"`, no prediction
    labelled: int = 0  # classification: predicted rows whose input has a label
    accuracy: float | None = None  # over those: the prediction equals the label


def predict(checkpoint_path: str, input_path: str, out_path: str, max_new_tokens: int = 64) -> Predicted:
    """Predictions for every row of `input_path`, written to `out_path`."""
    from pretrain.evaluation.inference import read_checkpoint, task_of

    out = Path(out_path)
    if out.suffix.lower() not in (".jsonl", ".csv"):
        raise UserError(f"--out {out_path}: write .jsonl or .csv")
    directory, run_config, state = read_checkpoint(checkpoint_path)
    task = task_of(run_config)
    if task == "pretrain":
        raise UserError(f"{directory} is a pretraining checkpoint: fine-tune it first (`pretrain finetune`)")
    cfg = finetune_config_from_dict(run_config)
    model_cfg = ModelConfig(**run_config["model"])
    tokenizer = Tokenizer.load(directory)
    rows = read_split(FinetuneDataConfig(**{**asdict(cfg.data), "hub": None}), input_path, "input")
    columns = required_columns(cfg)
    needed = columns[:-1] if task == "classification" else columns[:1]  # no label / completion needed
    check_columns(rows, needed, f"--input {input_path}")
    max_length = cfg.finetune.max_length or model_cfg.max_seq_len
    # A row with no text has nothing to predict from: it is kept, marked, and given no prediction.
    empty = {i for i, row in enumerate(rows) if not any(str(row[c] or "").strip() for c in needed)}
    texts = rows.select([i for i in range(len(rows)) if i not in empty])
    with torch.no_grad():
        if task == "classification":
            model, prior_model = _classifier(run_config, model_cfg, state)
            records = _labels(model, texts, cfg, tokenizer, max_length, run_config["labels"], prior_model)
            nothing = {"prediction": None, "probabilities": None}
        else:
            model = Transformer.from_state_dict(model_cfg, state).eval()
            records = _completions(
                model, texts[cfg.data.prompt_column], tokenizer, max_length, max_new_tokens
            )
            nothing = {"completion": None}
    predicted = iter(records)
    table = [
        dict(row) | (nothing | {"skipped": "empty text"} if i in empty else next(predicted))
        for i, row in enumerate(rows)
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_text(out, _jsonl(table) if out.suffix.lower() == ".jsonl" else _csv(table))
    labelled = (
        [
            row
            for row in table
            if row.get("prediction") is not None and row.get(cfg.data.label_column) is not None
        ]
        if task == "classification"
        else []
    )
    accuracy = (
        sum(str(row["prediction"]) == str(row[cfg.data.label_column]) for row in labelled) / len(labelled)
        if labelled
        else None
    )
    return Predicted(rows=len(table), skipped=len(empty), labelled=len(labelled), accuracy=accuracy)


def _classifier(
    run_config: dict, model_cfg: ModelConfig, state: dict
) -> tuple[SequenceClassifier, BagOfWords | None]:
    """The fine-tuned classifier, and the bag of words its answers blend in (finetune.bag_of_words)."""
    # (a checkpoint written before finetune.pooling existed read the last token)
    pooling = (run_config.get("finetune") or {}).get("pooling", "last")
    model = SequenceClassifier.from_state_dict(model_cfg, len(run_config["labels"]), state, pooling=pooling)
    prior_model = BagOfWords.from_state(run_config["bag_of_words"]) if "bag_of_words" in run_config else None
    return model.eval(), prior_model


def _labels(
    model,
    rows,
    cfg: FinetuneConfig,
    tokenizer: Tokenizer,
    max_length: int,
    labels: list,
    prior_model: BagOfWords | None = None,
) -> list[dict]:
    # A labelled input is predicted like any other (its labels stay in the output).
    if cfg.data.label_column in rows.column_names:
        rows = rows.remove_columns(cfg.data.label_column)
    encoded = encode_classification(rows, cfg, tokenizer, max_length, labels)
    if prior_model is not None:  # blended with the training split's bag of words
        encoded.prior = prior_model.log_posteriors(raw_texts(rows, cfg.data))
    pad_id, records = padding_id(tokenizer), [None] * len(encoded.ids)
    by_length = sorted(range(len(encoded.ids)), key=lambda i: len(encoded.ids[i]))  # (less padding)
    for start in range(0, len(by_length), 32):
        chunk = by_length[start : start + 32]
        batch = collate(encoded, chunk, pad_id, "cpu")
        for i, p in zip(
            chunk,
            model(batch["tokens"], batch["lengths"], prior=batch.get("prior")).logits.softmax(-1).tolist(),
            strict=True,
        ):
            best = max(range(len(labels)), key=p.__getitem__)
            records[i] = {
                "prediction": labels[best],
                "probabilities": dict(zip(map(str, labels), p, strict=True)),
            }
    return records


def _completions(model, prompts, tokenizer: Tokenizer, max_length: int, max_new_tokens: int) -> list[dict]:
    from pretrain.evaluation.inference import generate

    records = []
    for prompt in prompts:
        ids = tokenizer.encode_document(str(prompt or ""))[-(max_length - max_new_tokens) :]
        completion = generate(model, ids, max_new_tokens, 0.0, 0, 1.0, tokenizer.eos_id, torch.Generator())
        records.append({"completion": tokenizer.decode(completion)})
    return records


def _jsonl(table: list[dict]) -> str:
    return "".join(json.dumps(r, default=str) + "\n" for r in table)


def _csv(table: list[dict]) -> str:
    buffer = io.StringIO()
    flat = [{k: (json.dumps(v) if isinstance(v, dict) else v) for k, v in r.items()} for r in table]
    columns = list(dict.fromkeys(key for row in flat for key in row))  # marked rows add `skipped`
    writer = csv.DictWriter(buffer, fieldnames=columns, restval="")
    writer.writeheader()
    writer.writerows(flat)
    return buffer.getvalue()
