"""The loop's tasks for fine-tuning: batches from the encoded examples, held-out evaluation, and
the run's results (RUN_DIR/eval_results.json).

Examples are served one shuffled epoch after another, the same order at any restart. The data
position is the number of examples all ranks have consumed, E: the next micro-batch of rank r
holds the examples at positions E + r · micro ... of that order, and every micro-batch moves E on
by world · micro. A checkpoint records E, so a run resumes at the same example at any world size.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from pretrain import atomic
from pretrain.finetune.blend import fit_blend
from pretrain.finetune.data import Encoded, ExampleOrder, collate
from pretrain.model.loss import IGNORE_INDEX
from pretrain.parallel.distributed import DistEnv, all_reduce_sum

EVAL_RESULTS = "eval_results.json"


class FinetuneTask:
    """Micro-batches of encoded examples in the run's shuffled order (see the module docstring)."""

    def __init__(
        self,
        *,
        train: Encoded,
        validation: Encoded | None,
        micro_batch_size: int,
        pad_id: int,
        seed: int,
        env: DistEnv,
        device,
        run_dir: str | Path,
        group_by_length: bool = False,
    ):
        self.train, self.validation = train, validation
        self.micro_batch_size, self.pad_id, self.seed = micro_batch_size, pad_id, seed
        lengths = [len(ids) for ids in train.ids] if group_by_length else None
        self.order = ExampleOrder(len(train.ids), seed, lengths, micro_batch_size)
        self.env, self.device, self.run_dir = env, device, Path(run_dir)
        self.examples = 0  # consumed by all ranks so far
        self.last: list[int] = []
        self.evaluates = validation is not None

    def next_batch(self) -> dict[str, torch.Tensor]:
        start = self.examples + self.env.rank * self.micro_batch_size
        self.last = self.order.indices(start, self.micro_batch_size)
        self.examples += self.env.world_size * self.micro_batch_size
        return collate(self.train, self.last, self.pad_id, self.device)

    def last_batch_ids(self) -> list:
        return list(self.last)

    def state_dict(self) -> dict:
        return {"examples": self.examples}

    def load_state_dict(self, state: dict) -> None:
        self.examples = state["examples"]

    def _my_examples(self, examples: Encoded) -> list[int]:
        """This rank's share of the examples (rank, rank + world, ...), shortest first: a
        micro-batch is padded to its longest example, so examples of like length batched together
        leave little padding (on short texts with a few long ones, a third of the tokens of a
        shuffled batch were real)."""
        mine = range(self.env.rank, len(examples.ids), self.env.world_size)
        return sorted(mine, key=lambda i: len(examples.ids[i]))

    def finish(self, summary: dict) -> str | None:
        if not summary["completed"]:
            return None
        final = (
            summary["eval"][-1] if summary["eval"] and summary["eval"][-1]["step"] == summary["step"] else {}
        )
        results = {k: v for k, v in final.items() if k != "step"}
        atomic.write_json(
            self.run_dir / EVAL_RESULTS, {"task": summary["task"], "step": summary["step"], **results}
        )
        return f"done: {summary['step']} steps; validation {json.dumps(results) if results else 'not run (no data.validation)'}"


class Classification(FinetuneTask):
    def __init__(
        self,
        *,
        num_labels: int,
        bag_of_words: float | None = None,
        blend: Encoded | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.num_labels = num_labels
        self.bag_of_words = bag_of_words  # the baseline's accuracy on the validation split
        self.blend = blend  # held-out training examples with their priors (finetune.bag_of_words)

    @torch.no_grad()
    def evaluate(self, engine) -> dict:
        """Accuracy and macro-F1: every rank scores its share, the logits are summed. With a blend,
        (t, a) are fitted first on the held-out examples and kept in the model's `blend` buffer,
        and `network_accuracy` says what the network alone answers."""
        engine.eval()
        try:
            logits = self._network_logits(engine, self.validation)
            results = {}
            answers = logits
            if self.blend is not None:
                scale, weight = fit_blend(
                    self._network_logits(engine, self.blend),
                    torch.from_numpy(self.blend.prior),
                    torch.tensor(self.blend.labels),
                )
                engine.module.blend.copy_(torch.tensor([scale, weight]))
                scale, weight = engine.module.blend.float().tolist()  # (as saved: bf16 under the engine)
                answers = scale * logits + weight * torch.from_numpy(self.validation.prior)
                results = {"blend_network": scale, "blend_bag_of_words": weight}
        finally:
            engine.train()
        labels = self.validation.labels
        metrics = classification_metrics(answers.argmax(-1).tolist(), labels, self.num_labels)
        if self.blend is not None:
            metrics["network_accuracy"] = float(np.mean(logits.argmax(-1).numpy() == np.asarray(labels)))
        metrics |= results
        if self.bag_of_words is not None:
            metrics["bag_of_words_baseline"] = self.bag_of_words
            metrics["over_bag_of_words"] = metrics["accuracy"] - self.bag_of_words
        return metrics

    def _network_logits(self, engine, examples: Encoded) -> torch.Tensor:
        """The head's logits (N, labels) of every example, on the host: each rank scores a share
        (`_my_examples`), the others' rows are zeros, and the sum over ranks is the whole."""
        logits = torch.zeros(len(examples.ids), self.num_labels, dtype=torch.float32, device=self.device)
        mine = self._my_examples(examples)
        for start in range(0, len(mine), self.micro_batch_size):
            chunk = mine[start : start + self.micro_batch_size]
            batch = collate(examples, chunk, self.pad_id, self.device)
            logits[torch.tensor(chunk, device=self.device)] = engine(
                batch["tokens"], batch["lengths"]
            ).network_logits
        all_reduce_sum(logits)
        return logits.cpu()

    def finish(self, summary: dict) -> str | None:
        """The closing line, then by how much the bag of words was beaten, or not."""
        line = super().finish(summary)
        final = summary["eval"][-1] if line is not None and summary["eval"] else {}
        return line if "over_bag_of_words" not in final else f"{line}\n{beaten_or_not(final)}"


def beaten_or_not(results: dict) -> str:
    """ "accuracy 0.9494: beats the bag of words (0.9304) by 1.9 points", or falls short by; with
    the network's own accuracy where the answers blend it with the bag of words."""
    margin, bag = 100 * results["over_bag_of_words"], results["bag_of_words_baseline"]
    accuracy = f"accuracy {results['accuracy']:.4f}"
    if "network_accuracy" in results:
        accuracy += f" (the network alone {results['network_accuracy']:.4f})"
    if round(margin, 1) > 0:
        return f"{accuracy}: beats the bag of words ({bag:.4f}) by {margin:.1f} points"
    if round(margin, 1) == 0:
        return f"{accuracy}: ties the bag of words ({bag:.4f})"
    return (
        f"{accuracy}: falls {-margin:.1f} points short of the bag of words ({bag:.4f}); "
        "docs/finetuning.md lists what may help"
    )


class SFT(FinetuneTask):
    @torch.no_grad()
    def evaluate(self, engine) -> dict:
        """The mean loss per completion token over the validation split (and its perplexity)."""
        engine.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss sum, target tokens
        try:
            mine = self._my_examples(self.validation)
            for start in range(0, len(mine), self.micro_batch_size):
                batch = collate(
                    self.validation, mine[start : start + self.micro_batch_size], self.pad_id, self.device
                )
                tokens = int((batch["targets"] != IGNORE_INDEX).sum())
                loss = engine(batch["tokens"], batch["targets"]).loss
                totals += torch.tensor(
                    [loss.item() * tokens, tokens], dtype=torch.float64, device=self.device
                )
        finally:
            engine.train()
        all_reduce_sum(totals)
        loss = (totals[0] / totals[1]).item()
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "examples": len(self.validation.ids)}


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
    return {
        "accuracy": float(np.mean(predictions == labels)),
        "macro_f1": float(np.mean(f1s)),
        "majority_baseline": majority_share(labels, num_labels),
        "examples": len(labels),
    }


def majority_share(labels, num_labels: int) -> float:
    """The accuracy of always answering the most common label (of these labels)."""
    return float(np.bincount(np.asarray(labels), minlength=num_labels).max() / len(labels))
