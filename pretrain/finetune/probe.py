"""`finetune.linear_probe`: before fine-tuning, the classification head is fitted on the frozen
model's pooled features of the training split, then everything trains from there (LP-FT: Kumar
et al. 2022, "Fine-Tuning can Distort Pretrained Features": the first gradients through a random
head move the pretrained features more than the task needs).

The fit is multinomial logistic regression without a bias (the head has none), by L-BFGS on all
features at once, its L2 strength the one of PROBE_L2 with the lowest cross-entropy on a held-out
fifth of the training split (every fifth example): the loss fine-tuning starts from. Chosen by
accuracy instead, weak features (a briefly pretrained model) got the weakest L2, a head of large
weights and confidently wrong logits, and fine-tuning from it started at twice a random head's loss
with gradient norms 10-20x as large, and fell behind. Every rank computes the features of its share of the examples (rank,
rank + world, ...), the shares are summed, every rank fits the same head from the same features,
and rank 0's is broadcast so that all start alike. It costs one forward pass over the training
split (examples sorted by length, so batches are barely padded) and a fit of a few seconds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pretrain.finetune.data import Encoded, collate
from pretrain.model.classifier import SequenceClassifier
from pretrain.parallel.distributed import DistEnv, all_reduce_sum, broadcast

# candidate L2 strengths (on the mean cross-entropy), up to one that keeps the head near zero
PROBE_L2 = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)
PROBE_ITERATIONS = 200  # L-BFGS iterations per fit


@dataclass(frozen=True)
class Probe:
    """A fitted head and how it was chosen."""

    weight: torch.Tensor  # (labels, d), fp32
    l2: float
    held_out_accuracy: float  # on the held-out fifth, fitted on the rest (with the chosen L2)
    seconds: float


@torch.no_grad()
def pooled_features(
    model: SequenceClassifier, examples: Encoded, pad_id: int, batch_size: int, env: DistEnv, device
) -> torch.Tensor:
    """(examples, d) fp32: what the head reads of each training example, the model frozen."""
    features = torch.zeros(len(examples.ids), model.score.in_features, device=device)
    mine = sorted(range(env.rank, len(examples.ids), env.world_size), key=lambda i: len(examples.ids[i]))
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(mine), batch_size):
            chunk = mine[start : start + batch_size]
            batch = collate(examples, chunk, pad_id, device)
            features[torch.tensor(chunk, device=device)] = model.features(
                batch["tokens"], batch["lengths"]
            ).float()
    finally:
        model.train(was_training)
    return all_reduce_sum(features)


def fit_head(features: torch.Tensor, labels: torch.Tensor, num_labels: int, l2: float) -> torch.Tensor:
    """The (labels, d) weight minimizing mean cross-entropy + l2 · ‖W‖² on (features, labels)."""
    weight = torch.zeros(num_labels, features.shape[1], device=features.device, requires_grad=True)
    optimizer = torch.optim.LBFGS([weight], max_iter=PROBE_ITERATIONS, line_search_fn="strong_wolfe")

    def loss():
        optimizer.zero_grad()
        value = F.cross_entropy(features @ weight.T, labels) + l2 * weight.square().sum()
        value.backward()
        return value

    with torch.enable_grad():
        optimizer.step(loss)
    return weight.detach()


def choose_probe(features: torch.Tensor, labels: torch.Tensor, num_labels: int) -> Probe:
    """The head, its L2 strength the one of PROBE_L2 with the lowest cross-entropy on every fifth
    example held out (the larger strength on a tie)."""
    started = time.perf_counter()
    held = torch.arange(len(labels), device=labels.device) % 5 == 0
    scored = []
    for l2 in PROBE_L2:
        logits = features[held] @ fit_head(features[~held], labels[~held], num_labels, l2).T
        accuracy = float((logits.argmax(-1) == labels[held]).float().mean())
        scored.append((float(F.cross_entropy(logits, labels[held])), -l2, accuracy))
    _, l2, accuracy = min(scored)
    weight = fit_head(features, labels, num_labels, -l2)
    return Probe(weight, -l2, accuracy, time.perf_counter() - started)


def probe_head(
    model: SequenceClassifier, examples: Encoded, pad_id: int, batch_size: int, env: DistEnv, device
) -> Probe:
    """Fit `model`'s head on its frozen features of `examples` (module docstring), on every rank."""
    started = time.perf_counter()
    features = pooled_features(model, examples, pad_id, batch_size, env, device)
    labels = torch.tensor(examples.labels, device=device)
    probe = choose_probe(features, labels, model.score.out_features)
    weight = broadcast(probe.weight.contiguous())
    with torch.no_grad():
        model.score.weight.copy_(weight.to(model.score.weight.dtype))
    return Probe(weight, probe.l2, probe.held_out_accuracy, time.perf_counter() - started)
