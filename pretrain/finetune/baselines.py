"""What a classifier must beat, computed from the task's own data: a bag of words (multinomial naive
Bayes over lower-cased words, add-one smoothing) trained on the training split and scored on the
validation split, beside the majority class (`tasks.classification_metrics`). A fine-tuned decoder
that does not beat the bag of words has learned less than word counts tell."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence

_WORD = re.compile(r"\w+")


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


class BagOfWords:
    """Multinomial naive Bayes: log P(label) + Σ log P(word | label) over the text's words."""

    def __init__(self, texts: Sequence[str], labels: Sequence[int], num_labels: int):
        self.num_labels = num_labels
        counts = [Counter() for _ in range(num_labels)]
        examples = Counter(labels)
        for text, label in zip(texts, labels, strict=True):
            counts[label].update(words(text))
        vocabulary = set().union(*counts)
        self.log_prior = [
            math.log(examples[c] / len(labels)) if examples[c] else -math.inf for c in range(num_labels)
        ]
        totals = [sum(c.values()) + len(vocabulary) for c in counts]
        self.log_likelihood = [
            {w: math.log((n + 1) / totals[c]) for w, n in counts[c].items()} for c in range(num_labels)
        ]
        self.unseen = [-math.log(t) for t in totals]  # a word of the vocabulary this label never had
        self.vocabulary = vocabulary

    def predict(self, text: str) -> int:
        known = [w for w in words(text) if w in self.vocabulary]
        scores = [
            self.log_prior[c] + sum(self.log_likelihood[c].get(w, self.unseen[c]) for w in known)
            for c in range(self.num_labels)
        ]
        return max(range(self.num_labels), key=scores.__getitem__)


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
