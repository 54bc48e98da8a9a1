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

    def accuracy(self, texts: Sequence[str], labels: Sequence[int]) -> float:
        return sum(self.predict(t) == y for t, y in zip(texts, labels, strict=True)) / len(labels)

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
