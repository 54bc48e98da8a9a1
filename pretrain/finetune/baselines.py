"""What a classifier must beat, computed from the task's own data: a bag of words (multinomial naive
Bayes over lower-cased words, add-one smoothing) trained on the training split and scored on the
validation split, beside the majority class (`tasks.classification_metrics`). A fine-tuned decoder
that does not beat the bag of words has learned less than word counts tell."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence

import numpy as np

_WORD = re.compile(r"\w+")


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


class BagOfWords:
    """Multinomial naive Bayes: log P(label) + Σ log P(word | label) over the text's words."""

    def __init__(self, texts: Sequence[str], labels: Sequence[int], num_labels: int):
        counts = [Counter() for _ in range(num_labels)]
        for text, label in zip(texts, labels, strict=True):
            counts[label].update(words(text))
        self._fit(counts, Counter(labels), num_labels)

    def _fit(self, counts: list[Counter], examples: Counter, num_labels: int) -> None:
        self.num_labels, self.counts, self.examples = num_labels, counts, examples
        vocabulary = set().union(*counts)
        self.log_prior = [
            math.log(examples[c] / sum(examples.values())) if examples[c] else -math.inf
            for c in range(num_labels)
        ]
        totals = [sum(c.values()) + len(vocabulary) for c in counts]
        self.log_likelihood = [
            {w: math.log((n + 1) / totals[c]) for w, n in counts[c].items()} for c in range(num_labels)
        ]
        self.unseen = [-math.log(t) for t in totals]  # a word of the vocabulary this label never had
        self.vocabulary = vocabulary

    def scores(self, text: str) -> list[float]:
        """log P(label) + Σ log P(word | label), for each label."""
        known = [w for w in words(text) if w in self.vocabulary]
        return [
            self.log_prior[c] + sum(self.log_likelihood[c].get(w, self.unseen[c]) for w in known)
            for c in range(self.num_labels)
        ]

    def predict(self, text: str) -> int:
        scores = self.scores(text)
        return max(range(self.num_labels), key=scores.__getitem__)

    def log_posteriors(self, texts: Sequence[str]) -> np.ndarray:
        """log P(label | text) for each text: (len(texts), num_labels), float32."""
        if not texts:
            return np.zeros((0, self.num_labels), np.float32)
        scores = np.asarray([self.scores(t) for t in texts], dtype=np.float64)
        top = scores.max(axis=1, keepdims=True)
        normaliser = top + np.log(np.exp(scores - top).sum(axis=1, keepdims=True))
        return (scores - normaliser).astype(np.float32)

    def state(self) -> dict:
        """What `from_state` rebuilds it from (JSON): the training split's word counts per label."""
        return {
            "num_labels": self.num_labels,
            "examples": [self.examples[c] for c in range(self.num_labels)],
            "counts": [dict(sorted(c.items())) for c in self.counts],
        }

    @classmethod
    def from_state(cls, state: dict) -> BagOfWords:
        model = cls.__new__(cls)
        examples = Counter(dict(enumerate(state["examples"])))
        model._fit([Counter(c) for c in state["counts"]], examples, state["num_labels"])
        return model


def cross_fitted_log_posteriors(
    texts: Sequence[str], labels: Sequence[int], num_labels: int, folds: int = 5, seed: int = 0
) -> np.ndarray:
    """Each training example's log P(label | text) from a bag of words trained on the other folds
    (out-of-fold, as in stacking, Wolpert 1992): its own words do not vote for its label, so the
    scores are as wrong on the training split as on unseen text."""
    out = np.zeros((len(texts), num_labels), np.float32)
    order = np.random.default_rng([seed, 7]).permutation(len(texts))
    for held_out in np.array_split(order, min(folds, len(texts))):
        rest = np.setdiff1d(order, held_out)
        if len(rest) == 0:
            continue
        model = BagOfWords([texts[i] for i in rest], [labels[i] for i in rest], num_labels)
        out[held_out] = model.log_posteriors([texts[i] for i in held_out])
    return out


def calibrated_weight(log_posteriors: np.ndarray, labels: Sequence[int]) -> float:
    """The weight w of the grid 0.01 … 1 for which w × the (out-of-fold) log-posteriors have the
    lowest cross-entropy on their labels: naive Bayes is overconfident (its words counted as
    independent), so its log-posteriors are tempered before they meet the network's logits."""
    rows = np.arange(len(labels))

    def loss(w: float) -> float:
        scaled = w * log_posteriors.astype(np.float64)
        top = scaled.max(axis=1, keepdims=True)
        log_norm = top[:, 0] + np.log(np.exp(scaled - top).sum(axis=1))
        return float(np.mean(log_norm - scaled[rows, np.asarray(labels)]))

    return min(WEIGHT_GRID, key=loss)


WEIGHT_GRID = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


def bag_of_words_accuracy(
    train_texts: Sequence[str],
    train_labels: Sequence[int],
    texts: Sequence[str],
    labels: Sequence[int],
    num_labels: int,
) -> float:
    """The accuracy on (texts, labels) of the bag of words trained on the training split."""
    model = BagOfWords(train_texts, train_labels, num_labels)
    return sum(model.predict(t) == y for t, y in zip(texts, labels, strict=True)) / len(labels)
