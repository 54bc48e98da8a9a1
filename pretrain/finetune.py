"""Fine-tuning pretrained decoders on downstream tasks, with the pretraining engine.

    deepspeed [--num_gpus N] --module pretrain.finetune --config CFG [overrides...]
    accelerate launch --multi_gpu --num_processes N -m pretrain.finetune --config CFG [overrides...]
    pretrain finetune --config CFG [overrides...]                      (one process)

Tasks (`finetune.task`):

- `classification`: GPT-1 style. Each example is EOS text [EOS pair] EOS (EOS starts a document
  in pretraining, so it starts one here too, as `pretrain generate` does) and a linear head reads
  the final hidden state of that last EOS. Labels (strings or integers) are numbered in sorted
  order of the training split. Validation reports accuracy and macro-F1.
- `sft`: EOS prompt completion EOS; the loss covers the completion and its EOS only. Validation
  reports the mean loss per completion token.

The model starts from `finetune.init`: a checkpoint of ours (a run or checkpoint directory) or a
Hugging Face Llama directory (with its SentencePiece `tokenizer.model`). Data is read with
`datasets` from local CSV/JSONL/parquet files or a Hub dataset, and tokenized with the
checkpoint's tokenizer; examples longer than `finetune.max_length` (default: the model's
max_seq_len) are truncated and counted. Checkpoints have the pretraining layout; an sft checkpoint
is a plain language model (`pretrain generate`, `export-hf`), a classification checkpoint is read by
`pretrain predict`. The final validation metrics go to RUN_DIR/eval_results.json.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from pretrain import atomic, checkpoint
from pretrain.classifier import SequenceClassifier
from pretrain.config import (
    FinetuneConfig,
    FinetuneDataConfig,
    ModelConfig,
    finetune_config_from_dict,
    load_finetune_config,
    to_yaml,
)
from pretrain.engine import deepspeed_config, initialize, plan_batches, set_lr, zero_stage
from pretrain.errors import UserError
from pretrain.loss import IGNORE_INDEX
from pretrain.metrics import MetricsWriter
from pretrain.model import Transformer
from pretrain.schedules import lr_at
from pretrain.tokenizer import MODEL_FILE, Tokenizer

EVAL_RESULTS = "eval_results.json"
DATA_SUFFIXES = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


# --------------------------------------------------------------------------- the starting point


@dataclass
class Initial:
    """`finetune.init` before its weights are read: enough to check the data against it."""

    directory: Path
    kind: str  # "hf" | "checkpoint"
    model_cfg: ModelConfig
    tokenizer: Tokenizer

    @property
    def source(self) -> str:
        return f"{'Hugging Face model' if self.kind == 'hf' else 'checkpoint'} {self.directory}"

    def load_model(self) -> Transformer:
        if self.kind == "hf":
            from pretrain.hf import load_hf

            return load_hf(self.directory)
        from pretrain.inference import read_checkpoint, task_of

        _, run_config, state = read_checkpoint(self.directory)
        if task_of(run_config) == "classification":  # its backbone, without the old head
            state = {k.removeprefix("backbone."): v for k, v in state.items() if k.startswith("backbone.")}
        return Transformer.from_state_dict(self.model_cfg, state)


def find_initial(path: str) -> Initial:
    """`finetune.init`: a Hugging Face Llama directory (config.json), or a checkpoint of ours."""
    directory = Path(path)
    if (directory / "config.json").is_file():
        from pretrain.hf import model_config_from_llama

        if not (directory / MODEL_FILE).is_file():
            raise UserError(
                f"{directory} has no {MODEL_FILE}: fine-tuning tokenizes with the model's SentencePiece "
                "tokenizer; copy it there (`pretrain export-hf` does)"
            )
        cfg = model_config_from_llama(json.loads((directory / "config.json").read_text()), str(directory))
        initial = Initial(directory, "hf", cfg, Tokenizer.load(directory))
    else:
        found = checkpoint.find_checkpoint(directory)
        run_config = json.loads((found / checkpoint.RUN_CONFIG).read_text())
        cfg = ModelConfig(**run_config["model"])
        if (run_config.get("finetune") or {}).get("task") == "classification" and not cfg.tie_embeddings:
            raise UserError(
                f"{found} is a classification fine-tune without a language-model head: start from its init"
            )
        initial = Initial(found, "checkpoint", cfg, Tokenizer.load(found))
    if initial.tokenizer.vocab_size > cfg.vocab_size:
        raise UserError(
            f"tokenizer/vocabulary mismatch: {initial.tokenizer.path} has {initial.tokenizer.vocab_size} pieces "
            f"but the model in {path} embeds {cfg.vocab_size}: use the tokenizer the model was trained with"
        )
    return initial


# --------------------------------------------------------------------------- data


def read_split(data: FinetuneDataConfig, split: str, which: str):
    """One split as a `datasets.Dataset`: a local file, or a split of `data.hub`."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    if data.hub:
        try:
            return datasets.load_dataset(data.hub, split=split)
        except Exception as exc:
            raise UserError(
                f"data.hub={data.hub} split {split!r} ({which}) could not be loaded: {exc}"
            ) from None
    path = Path(split)
    if not path.is_file():
        raise UserError(f"data.{which}={split} does not exist: pass a .csv, .jsonl or .parquet file")
    if path.stat().st_size == 0:
        raise UserError(f"data.{which}={split} is empty: it needs at least one example")
    builder = DATA_SUFFIXES.get(path.suffix.lower())
    if builder is None:
        raise UserError(
            f"data.{which}={split}: unknown file type {path.suffix!r}; use .csv, .jsonl or .parquet"
        )
    kwargs = {"delimiter": "\t"} if path.suffix.lower() == ".tsv" else {}
    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train", **kwargs)
    except Exception as exc:
        raise UserError(
            f"data.{which}={split} could not be read as {builder}: {str(exc).splitlines()[0]}"
        ) from None


def required_columns(cfg: FinetuneConfig) -> list[str]:
    d = cfg.data
    if cfg.finetune.task == "sft":
        return [d.prompt_column, d.completion_column]
    return [d.text_column, *([d.text_pair_column] if d.text_pair_column else []), d.label_column]


def check_columns(dataset, columns: list[str], where: str) -> None:
    missing = [c for c in columns if c not in dataset.column_names]
    if missing:
        raise UserError(
            f"{where} has no column {', '.join(map(repr, missing))}; its columns are "
            f"{', '.join(dataset.column_names)}: set data.*_column to the right names"
        )
    if len(dataset) == 0:
        raise UserError(f"{where} is empty: it needs at least one example")


def label_names(values: list) -> list:
    """The label set in a stable order: numbers numerically, strings alphabetically."""
    unique = set(values)
    if any(v is None for v in unique):
        raise UserError("some labels are empty: every training example needs a label")
    return sorted(unique, key=lambda v: (isinstance(v, str), v))


@dataclass
class Encoded:
    task: str
    ids: list[list[int]]
    labels: list[int] | None  # classification: class ids (None: unlabelled rows to predict)
    prompt_lengths: list[int] | None  # sft: tokens of the start token + prompt
    truncated: int


def _fit_pair(a: list[int], b: list[int], budget: int) -> tuple[list[int], list[int]]:
    """Shorten the longer of two segments first until both fit in `budget` tokens."""
    while len(a) + len(b) > budget:
        if len(a) >= len(b):
            a = a[: max(budget - len(b), len(b))] if len(a) > len(b) else a[:-1]
        else:
            b = b[: max(budget - len(a), len(a))] if len(b) > len(a) else b[:-1]
    return a, b


def encode_classification(
    dataset, cfg: FinetuneConfig, tokenizer: Tokenizer, max_length: int, labels: list
) -> Encoded:
    d = cfg.data
    start = eos = tokenizer.eos_id
    texts = [str(t) if t is not None else "" for t in dataset[d.text_column]]
    firsts = tokenizer.encode_batch(texts)
    seconds = (
        tokenizer.encode_batch([str(t or "") for t in dataset[d.text_pair_column]])
        if d.text_pair_column
        else None
    )
    ids, truncated = [], 0
    for i, first in enumerate(firsts):
        if seconds is None:
            body = first[: max_length - 2]
            truncated += len(body) < len(first)
            ids.append([start, *body, eos])
        else:
            a, b = _fit_pair(first, seconds[i], max_length - 3)
            truncated += len(a) + len(b) < len(first) + len(seconds[i])
            ids.append([start, *a, eos, *b, eos])
    index = {label: i for i, label in enumerate(labels)}
    targets = [index[v] for v in dataset[d.label_column]] if d.label_column in dataset.column_names else None
    return Encoded("classification", ids, targets, None, truncated)


def encode_sft(dataset, cfg: FinetuneConfig, tokenizer: Tokenizer, max_length: int) -> Encoded:
    d = cfg.data
    prompts = tokenizer.encode_batch([str(t or "") for t in dataset[d.prompt_column]])
    completions = tokenizer.encode_batch([str(t or "") for t in dataset[d.completion_column]])
    ids, prompt_lengths, truncated = [], [], 0
    for prompt, completion in zip(prompts, completions, strict=True):
        prompt, completion = [tokenizer.eos_id, *prompt], [*completion, tokenizer.eos_id]
        if len(prompt) + len(completion) > max_length:
            truncated += 1
            completion = completion[: max(max_length - len(prompt), 1)]  # the completion's end first
            prompt = [
                prompt[0],
                *prompt[len(prompt) - (max_length - len(completion)) + 1 :],
            ]  # then the prompt's start
        ids.append(prompt + completion)
        prompt_lengths.append(len(prompt))
    return Encoded("sft", ids, None, prompt_lengths, truncated)


def padding_id(tokenizer: Tokenizer) -> int:
    """Our tokenizers reserve a pad id; one without (an imported model's) pads with EOS."""
    return tokenizer.pad_id if tokenizer.pad_id >= 0 else tokenizer.eos_id


def collate(encoded: Encoded, indices: list[int], pad_id: int, device) -> dict[str, torch.Tensor]:
    """Right-padded tensors for one micro-batch: classification (tokens, lengths, labels), or
    sft (tokens, targets) with the prompt and the padding masked out of the targets."""
    rows = [encoded.ids[i] for i in indices]
    if encoded.task == "classification":
        width = max(map(len, rows))
        tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
        for r, row in enumerate(rows):
            tokens[r, : len(row)] = torch.tensor(row)
        batch = {"tokens": tokens.to(device), "lengths": torch.tensor([len(r) for r in rows], device=device)}
        if encoded.labels is not None:
            batch["labels"] = torch.tensor([encoded.labels[i] for i in indices], device=device)
        return batch
    width = max(map(len, rows)) - 1
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    targets = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for r, (row, i) in enumerate(zip(rows, indices, strict=True)):
        row = torch.tensor(row)
        tokens[r, : len(row) - 1] = row[:-1]
        start = encoded.prompt_lengths[i] - 1  # position t predicts row[t + 1]: the first completion token
        targets[r, start : len(row) - 1] = row[start + 1 :]
    return {"tokens": tokens.to(device), "targets": targets.to(device)}


@functools.lru_cache(maxsize=4)
def epoch_order(n: int, epoch: int, seed: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def example_indices(n: int, position: int, count: int, seed: int) -> list[int]:
    """`count` examples from `position` of the run's stream: one shuffled epoch after another, so
    a position (and a resumed run's) follows from the step alone."""
    out = []
    for p in range(position, position + count):
        epoch, offset = divmod(p, n)
        out.append(int(epoch_order(n, epoch, seed)[offset]))
    return out


# --------------------------------------------------------------------------- metrics


def classification_metrics(predictions: list[int], labels: list[int], num_labels: int) -> dict:
    """Accuracy and macro-F1 (the unweighted mean of each class's F1; a class never predicted
    nor present counts as F1 0 only if it appears in either list)."""
    predictions, labels = np.asarray(predictions), np.asarray(labels)
    f1s = []
    for c in range(num_labels):
        tp = int(np.sum((predictions == c) & (labels == c)))
        fp = int(np.sum((predictions == c) & (labels != c)))
        fn = int(np.sum((predictions != c) & (labels == c)))
        if tp + fp + fn == 0:
            continue
        f1s.append(2 * tp / (2 * tp + fp + fn))
    majority = np.bincount(labels, minlength=num_labels).max() / len(labels)
    return {
        "accuracy": float(np.mean(predictions == labels)),
        "macro_f1": float(np.mean(f1s)),
        "majority_baseline": float(majority),
        "examples": len(labels),
    }


@torch.no_grad()
def evaluate(
    engine, encoded: Encoded, cfg: FinetuneConfig, pad_id: int, num_labels: int, rank: int, world: int
) -> dict:
    """Every rank scores its share (examples rank, rank + world, ...); the totals are reduced."""
    engine.eval()
    device = engine.device
    mine = list(range(rank, len(encoded.ids), world))
    micro = cfg.train.micro_batch_size
    try:
        if encoded.task == "classification":
            predictions = torch.full((len(encoded.ids),), -1, dtype=torch.long, device=device)
            for start in range(0, len(mine), micro):
                chunk = mine[start : start + micro]
                batch = collate(encoded, chunk, pad_id, device)
                logits = engine(batch["tokens"], batch["lengths"]).logits
                predictions[torch.tensor(chunk, device=device)] = logits.argmax(-1)
            predictions += 1  # -1 → 0 where another rank scored the example; sum over ranks
            dist.all_reduce(predictions)
            return classification_metrics((predictions - 1).tolist(), encoded.labels, num_labels)
        totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, target tokens
        for start in range(0, len(mine), micro):
            batch = collate(encoded, mine[start : start + micro], pad_id, device)
            tokens = int((batch["targets"] != IGNORE_INDEX).sum())
            loss = engine(batch["tokens"], batch["targets"]).loss
            totals += torch.tensor([loss.item() * tokens, tokens], dtype=torch.float64, device=device)
        dist.all_reduce(totals)
        loss = (totals[0] / totals[1]).item()
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "examples": len(encoded.ids)}
    finally:
        engine.train()


# --------------------------------------------------------------------------- the loop


def finetune(cfg: FinetuneConfig) -> dict:
    from pretrain.train import DistEnv, _as_float, _read_json, init_distributed, write_checkpoint

    env = DistEnv.from_environ()
    is_main = env.rank == 0
    run_dir = Path(cfg.run.dir)
    plan = plan_batches(cfg.train, 0, env.world_size)
    ds_config = deepspeed_config(cfg, plan)

    # Everything that can be wrong with the input is found before any process group starts.
    initial = find_initial(cfg.finetune.init)
    model_cfg = initial.model_cfg
    tokenizer, max_length = initial.tokenizer, cfg.finetune.max_length or model_cfg.max_seq_len
    if max_length > model_cfg.max_seq_len:
        raise UserError(
            f"finetune.max_length={max_length} exceeds the model's max_seq_len={model_cfg.max_seq_len}"
        )
    columns = required_columns(cfg)
    train_set = read_split(cfg.data, cfg.data.train, "train")
    check_columns(train_set, columns, f"the training split ({cfg.data.train})")
    val_set = None
    if cfg.data.validation:
        val_set = read_split(cfg.data, cfg.data.validation, "validation")
        check_columns(val_set, columns, f"the validation split ({cfg.data.validation})")
    labels = None
    if cfg.finetune.task == "classification":
        labels = label_names(train_set[cfg.data.label_column])
        if len(labels) < 2:
            raise UserError(
                f"the training split has one label ({labels[0]!r}): classification needs at least two"
            )
        if val_set is not None:
            unseen = sorted(set(val_set[cfg.data.label_column]) - set(labels), key=str)
            if unseen:
                raise UserError(
                    f"labels in the validation split never seen in training: {', '.join(map(repr, unseen[:5]))}"
                    f"{' ...' if len(unseen) > 5 else ''}: the head cannot predict them; fix the splits"
                )
        encode = lambda ds: encode_classification(ds, cfg, tokenizer, max_length, labels)  # noqa: E731
    else:
        encode = lambda ds: encode_sft(ds, cfg, tokenizer, max_length)  # noqa: E731
    train_data = encode(train_set)
    val_data = encode(val_set) if val_set is not None else None
    steps = cfg.train.steps or max(
        1, math.ceil(cfg.finetune.epochs * len(train_data.ids) / plan.global_batch_size)
    )
    resume_tag = checkpoint.resolve_resume(run_dir, cfg.checkpoint.resume)

    init_distributed(env)
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.run.seed)
    model = initial.load_model()
    if labels is not None:
        model = SequenceClassifier(model, len(labels))
    engine, optimizer = initialize(model, cfg, ds_config)
    device = engine.device
    step = 0
    if resume_tag is not None:
        engine.load_checkpoint(
            str(checkpoint.checkpoints_dir(run_dir)), tag=resume_tag, load_lr_scheduler_states=False
        )
        step = _read_json(checkpoint.checkpoints_dir(run_dir) / resume_tag / checkpoint.TRAIN_STATE)["step"]

    writer = MetricsWriter(run_dir, steps, enabled=is_main, tensorboard=cfg.logging.tensorboard)
    run_config = asdict(cfg) | {"model": asdict(model_cfg), "labels": labels, "init_source": initial.source}
    pad_id = padding_id(tokenizer)
    summary = {"task": cfg.finetune.task, "world_size": env.world_size, "zero_stage": zero_stage(ds_config),
               "train_examples": len(train_data.ids), "train_truncated": train_data.truncated,
               "validation_examples": len(val_data.ids) if val_data else 0,
               "validation_truncated": val_data.truncated if val_data else 0, "steps": steps, "eval": []}  # fmt: skip
    if is_main:
        writer.text("config", "```\n" + to_yaml(cfg) + "\n```", step)
        writer.message(
            f"fine-tuning ({cfg.finetune.task}) from {initial.source} on {env.world_size} process(es), "
            f"ZeRO-{zero_stage(ds_config)} bf16: {len(train_data.ids):,} examples "
            f"({train_data.truncated:,} truncated to {max_length} tokens)"
            + (f", {len(labels)} labels" if labels else "")
            + f", global batch {plan.global_batch_size}, steps {step + 1}..{steps}"
        )

    def save(at: int) -> None:
        state = {"step": at, "world_size": env.world_size}
        write_checkpoint(engine, run_dir, at, env, state, run_config, tokenizer.path, cfg.checkpoint.keep)

    def run_eval(at: int) -> dict | None:
        if val_data is None:
            return None
        results = evaluate(engine, val_data, cfg, pad_id, len(labels or []), env.rank, env.world_size)
        summary["eval"].append({"step": at} | results)
        writer.scalars(at, {f"eval/{k}": v for k, v in results.items() if k != "examples"})
        writer.message(
            f"eval at step {at}: " + ", ".join(f"{k} {v:.4f}" for k, v in results.items() if k != "examples")
        )
        return results

    with contextlib.ExitStack() as stack:
        stack.callback(writer.close)
        last_saved = step
        if step == 0:
            run_eval(0)  # the starting point every curve is compared with
        while step < steps:
            started = time.perf_counter()
            lr = lr_at(step + 1, cfg.optim.lr, steps, cfg.schedule, model_cfg.d_model)
            set_lr(optimizer, lr)
            loss_sum, tokens = torch.zeros((), device=device), 0
            for accum in range(plan.grad_accum):
                position = (
                    (step * plan.grad_accum + accum) * env.world_size + env.rank
                ) * plan.micro_batch_size
                indices = example_indices(len(train_data.ids), position, plan.micro_batch_size, cfg.run.seed)
                batch = collate(train_data, indices, pad_id, device)
                tokens += batch["tokens"].numel()
                loss = engine(**batch).loss
                engine.backward(loss)
                engine.step()
                loss_sum += loss.detach().float()
            dist.all_reduce(loss_sum)
            step += 1
            elapsed = time.perf_counter() - started
            metrics = {
                "train/loss": loss_sum.item() / plan.grad_accum / env.world_size,
                "train/lr": lr,
                "train/grad_norm": _as_float(engine.get_global_grad_norm()),
                "train/tokens_per_sec": tokens * env.world_size / elapsed,
                "train/step_time": elapsed,
            }
            writer.record(step, metrics)
            if step % cfg.logging.every == 0 or step == steps:
                writer.scalars(step, metrics)
                writer.console(step, metrics)
            if cfg.eval.every and step % cfg.eval.every == 0 and step != steps:
                run_eval(step)
            if step % cfg.checkpoint.every == 0 or step == steps:
                save(step)
                last_saved = step
        if last_saved != step:
            save(step)
        final = run_eval(step)

    summary["completed"] = True
    if is_main:
        atomic.write_json(run_dir / "train_summary.json", summary)
        results = {"task": cfg.finetune.task, "step": step, **(final or {})}
        atomic.write_json(run_dir / EVAL_RESULTS, results)
        writer.message(
            f"done: {step} steps; validation {json.dumps(final) if final else 'not run (no data.validation)'}"
        )
    dist.barrier()
    return summary


# --------------------------------------------------------------------------- predictions


def predict(checkpoint_path: str, input_path: str, out_path: str, max_new_tokens: int = 64) -> int:
    """`pretrain predict`: classification checkpoints label each row (with the probability of
    every label); sft checkpoints complete each prompt (greedy). Writes JSON lines or CSV."""
    from pretrain.inference import generate, read_checkpoint, task_of

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
    records = []
    with torch.no_grad():
        if task == "classification":
            labels = run_config["labels"]
            model = SequenceClassifier.from_state_dict(model_cfg, len(labels), state).eval()
            unlabelled = (  # a labelled input is predicted like any other (its labels stay in the output)
                rows.remove_columns(cfg.data.label_column)
                if cfg.data.label_column in rows.column_names
                else rows
            )
            encoded = encode_classification(unlabelled, cfg, tokenizer, max_length, labels)
            pad_id = padding_id(tokenizer)
            for start in range(0, len(encoded.ids), 32):
                batch = collate(encoded, list(range(start, min(start + 32, len(encoded.ids)))), pad_id, "cpu")
                probs = model(batch["tokens"], batch["lengths"]).logits.softmax(-1)
                for p in probs.tolist():
                    best = max(range(len(labels)), key=p.__getitem__)
                    records.append(
                        {
                            "prediction": labels[best],
                            "probabilities": dict(zip(map(str, labels), p, strict=True)),
                        }
                    )
        else:
            model = Transformer.from_state_dict(model_cfg, state).eval()
            for prompt in rows[cfg.data.prompt_column]:
                ids = [tokenizer.eos_id, *tokenizer.encode(str(prompt or ""))][
                    -(max_length - max_new_tokens) :
                ]
                completion = generate(
                    model, ids, max_new_tokens, 0.0, 0, 1.0, tokenizer.eos_id, torch.Generator()
                )
                records.append({"completion": tokenizer.decode(completion)})
    table = [dict(row) | record for row, record in zip(rows, records, strict=True)]
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix.lower() == ".jsonl":
        atomic.write_text(out, "".join(json.dumps(r, default=str) + "\n" for r in table))
    else:
        import csv
        import io

        buffer = io.StringIO()
        flat = [{k: (json.dumps(v) if isinstance(v, dict) else v) for k, v in r.items()} for r in table]
        writer = csv.DictWriter(buffer, fieldnames=list(flat[0]))
        writer.writeheader()
        writer.writerows(flat)
        atomic.write_text(out, buffer.getvalue())
    return len(table)


# --------------------------------------------------------------------------- entry point


def _finetune_command(config: str, overrides: list[str]) -> int:
    finetune(load_finetune_config(config, overrides))
    return 0


def main(argv: list[str] | None = None) -> int:
    from pretrain.train import entry_point

    return entry_point("pretrain.finetune", "Fine-tune under DeepSpeed (see module docstring).",
                       "fine-tuning config (configs/finetune/*.yaml)", _finetune_command, argv)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
