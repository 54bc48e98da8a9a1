"""Fine-tuning data: splits read with `datasets`, labels, examples encoded with the model's
tokenizer, right-padded micro-batches, and the order examples are served in."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pretrain.config import FinetuneConfig, FinetuneDataConfig
from pretrain.errors import UserError
from pretrain.finetune.baselines import BagOfWords
from pretrain.finetune.blend import held_out
from pretrain.model.loss import IGNORE_INDEX
from pretrain.tokenizer import Tokenizer

DATA_SUFFIXES = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


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
    # examples to blend (finetune.bag_of_words): the bag of words' log P(label | text), (N, labels)
    prior: np.ndarray | None = None


def fit_pair(a: list[int], b: list[int], budget: int) -> tuple[list[int], list[int]]:
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
            a, b = fit_pair(first, seconds[i], max_length - 3)
            truncated += len(a) + len(b) < len(first) + len(seconds[i])
            ids.append([start, *a, eos, *b, eos])
    index = {label: i for i, label in enumerate(labels)}
    targets = [index[v] for v in dataset[d.label_column]] if d.label_column in dataset.column_names else None
    return Encoded("classification", ids, targets, None, truncated)


def encode_sft(dataset, cfg: FinetuneConfig, tokenizer: Tokenizer, max_length: int) -> Encoded:
    d = cfg.data
    prompts = tokenizer.encode_documents([str(t or "") for t in dataset[d.prompt_column]])
    completions = tokenizer.encode_batch([str(t or "") for t in dataset[d.completion_column]])
    ids, prompt_lengths, truncated = [], [], 0
    for prompt, completion in zip(prompts, completions, strict=True):
        completion = [*completion, tokenizer.eos_id]
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
        if encoded.prior is not None:
            batch["prior"] = torch.from_numpy(encoded.prior[indices]).to(device)
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


GROUPED_BATCHES = 64  # micro-batches per length-sorted chunk of an epoch (`ExampleOrder`)


class ExampleOrder:
    """The order examples are served in: one shuffled epoch after another, so the examples at a
    position of the stream are the same at any restart and any world size.

    With `lengths` (finetune.group_by_length), each epoch's shuffled order is cut into chunks of
    GROUPED_BATCHES micro-batches, each sorted by length and cut into micro-batches, and those are
    shuffled (Hugging Face's group_by_length): a micro-batch, padded to its longest example,
    holds examples of like length (of a shuffled one, a third of the tokens were real on the docs'
    tasks). The cuts fall where micro-batches start in the stream (their positions are multiples
    of the micro-batch size, on every rank), so the order depends on it too."""

    def __init__(self, n: int, seed: int, lengths: list[int] | None = None, micro_batch_size: int = 1):
        self.n, self.seed, self.micro = n, seed, micro_batch_size
        self.lengths = None if lengths is None else np.asarray(lengths)
        self._epochs: dict[int, np.ndarray] = {}

    def indices(self, position: int, count: int) -> list[int]:
        """`count` examples from `position` of the stream."""
        out = []
        for p in range(position, position + count):
            epoch, offset = divmod(p, self.n)
            out.append(int(self.epoch(epoch)[offset]))
        return out

    def epoch(self, epoch: int) -> np.ndarray:
        if epoch not in self._epochs:
            self._epochs = {epoch: self._order(epoch)}  # (the stream reads epochs in order)
        return self._epochs[epoch]

    def _order(self, epoch: int) -> np.ndarray:
        order = np.random.default_rng([self.seed, epoch]).permutation(self.n)
        if self.lengths is None:
            return order
        chunk = GROUPED_BATCHES * self.micro
        by_length = np.concatenate(
            [
                c[np.argsort(self.lengths[c], kind="stable")]
                for c in np.split(order, range(chunk, self.n, chunk))
            ]
        )
        # micro-batches as the stream cuts them: the epoch starts `lead` examples before a cut
        lead = (-epoch * self.n) % self.micro
        cuts = list(range(lead, self.n, self.micro))
        pieces = np.split(by_length, [c for c in cuts if 0 < c < self.n])
        first, middle = (pieces[:1], pieces[1:]) if lead else ([], pieces)
        last = middle[-1:] if middle and len(middle[-1]) < self.micro else []
        middle = middle[: len(middle) - len(last)]
        shuffled = np.random.default_rng([self.seed, epoch, 1]).permutation(len(middle))
        return np.concatenate([*first, *(middle[i] for i in shuffled), *last])


@dataclass
class Examples:
    """A run's encoded splits and label set (None for sft); for classification with a validation
    split, the bag-of-words baseline's accuracy on it (`pretrain/finetune/baselines.py`) and, with
    finetune.bag_of_words, the bag of words and the held-out examples the blend is fitted on
    (`pretrain/finetune/blend.py`)."""

    train: Encoded  # what the network trains on (with a blend: all but the held-out tenth)
    validation: Encoded | None
    labels: list | None
    bag_of_words: float | None = None
    prior_model: BagOfWords | None = None  # the bag of words of the whole training split
    blend: Encoded | None = None  # the held-out tenth, each with the prior of the rest's bag of words

    def train_truncated(self) -> int:
        """Examples of the training split (held-out ones too) cut to the example length."""
        return self.train.truncated + (self.blend.truncated if self.blend else 0)


def raw_texts(dataset, data: FinetuneDataConfig) -> list[str]:
    """Each example's text as read (a pair's two texts joined), for baselines that count words."""
    columns = [data.text_column, *([data.text_pair_column] if data.text_pair_column else [])]
    return [" ".join(str(row[c] or "") for c in columns) for row in dataset.select_columns(columns)]


def load_examples(cfg: FinetuneConfig, tokenizer: Tokenizer, max_length: int) -> Examples:
    """Read, check and encode both splits: every problem with the data is found here, before any
    process group starts."""
    columns = required_columns(cfg)
    train_set = read_split(cfg.data, cfg.data.train, "train")
    check_columns(train_set, columns, f"the training split ({cfg.data.train})")
    val_set = None
    if cfg.data.validation:
        val_set = read_split(cfg.data, cfg.data.validation, "validation")
        check_columns(val_set, columns, f"the validation split ({cfg.data.validation})")
    if cfg.finetune.task == "sft":
        encode = lambda ds: encode_sft(ds, cfg, tokenizer, max_length)  # noqa: E731
        return Examples(encode(train_set), encode(val_set) if val_set is not None else None, None)
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
    if val_set is None:
        return Examples(encode(train_set), None, labels)
    index = {label: i for i, label in enumerate(labels)}
    train_texts, val_texts = raw_texts(train_set, cfg.data), raw_texts(val_set, cfg.data)
    train_labels = [index[v] for v in train_set[cfg.data.label_column]]
    validation = encode(val_set)
    whole = BagOfWords(train_texts, train_labels, len(labels))
    bag_of_words = whole.accuracy(val_texts, validation.labels)
    if not cfg.finetune.bag_of_words or len(train_set) < 2:
        return Examples(encode(train_set), validation, labels, bag_of_words)
    # the blend: the network trains on nine tenths; the tenth held out is scored by the bag of
    # words of those nine tenths (words it never counted), the validation split by the whole's
    trains, blends = held_out(len(train_set), cfg.run.seed)
    blend = encode(train_set.select(blends))
    blend.prior = BagOfWords(
        [train_texts[i] for i in trains], [train_labels[i] for i in trains], len(labels)
    ).log_posteriors([train_texts[i] for i in blends])
    validation.prior = whole.log_posteriors(val_texts)
    return Examples(encode(train_set.select(trains)), validation, labels, bag_of_words, whole, blend)
