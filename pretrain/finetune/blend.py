"""finetune.bag_of_words: a classifier's answer blends the network's logits with the bag of words'
log-probabilities (`baselines.py`): t × network + a × log P(label | text), with (t, a) fitted at
each evaluation on a tenth of the training split the network never trained on (stacking by
blending: a pretrained network and word counts err on different examples, and how much to trust
each can only be told on examples neither has seen). t = 0 is the bag of words alone, a = 0 the
network alone: on the held-out tenth the blend fits at least as well as either."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

BLEND_SHARE = 0.1  # of the training split, held out to fit the blend
NETWORK_SCALES = (0.0, 0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.0)  # t
PRIOR_WEIGHTS = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0)  # a


def held_out(count: int, seed: int) -> tuple[list[int], list[int]]:
    """The training split's examples that train the network, and the tenth (at least one example,
    at most all but one) held out to fit the blend: drawn from the seed."""
    order = np.random.default_rng([seed, 5]).permutation(count)
    size = min(max(1, round(BLEND_SHARE * count)), count - 1)
    return sorted(order[size:].tolist()), sorted(order[:size].tolist())


def fit_blend(network: torch.Tensor, prior: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    """(t, a) of the grids whose t × network + a × prior has the lowest cross-entropy on `labels`
    (ties: the first, the smaller t and a). network, prior: (N, labels) logits and log-probabilities."""
    network, prior = network.double(), prior.double()
    scores = {
        (t, a): F.cross_entropy(t * network + a * prior, labels).item()
        for t in NETWORK_SCALES
        for a in PRIOR_WEIGHTS
    }
    return min(scores, key=scores.__getitem__)
