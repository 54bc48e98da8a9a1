"""finetune.bag_of_words: the classifier's logits add a bag of words' log-probabilities × a learned
weight (pretrain/finetune/baselines.py, pretrain/model/classifier.py, pretrain/finetune/tasks.py)."""

import json
import random

import numpy as np
import pytest
import torch

from pretrain.finetune.baselines import (
    WEIGHT_GRID,
    BagOfWords,
    calibrated_weight,
    cross_fitted_log_posteriors,
)


def cue_task(n: int, seed: int = 0) -> tuple[list[str], list[int]]:
    """Noise words and, with probability 0.3 each, the label's cue words."""
    rng = random.Random(seed)
    vocabulary = [f"w{i}" for i in range(200)]
    cues = [["Alpha", "beta"], ["gamma", "Delta"], ["eps", "zeta"]]
    texts, labels = [], []
    for _ in range(n):
        label = rng.choice([0, 0, 0, 1, 2])
        words = rng.sample(vocabulary, 5) + [w for w in cues[label] if rng.random() < 0.3]
        texts.append(" ".join(rng.sample(words, len(words))))
        labels.append(label)
    return texts, labels


def test_the_log_posteriors_are_scikit_learns_and_survive_json():
    """Against a reference nobody here wrote: MultinomialNB's predict_log_proba over the same
    lower-cased words; the state written to run_config.json rebuilds the same model."""
    from sklearn.feature_extraction.text import CountVectorizer
    from sklearn.naive_bayes import MultinomialNB

    texts, labels = cue_task(60)
    test_texts, _ = cue_task(50, seed=1)
    ours = BagOfWords(texts, labels, 3)
    words = CountVectorizer(token_pattern=r"(?u)\w+", lowercase=True).fit(texts)
    reference = MultinomialNB(alpha=1.0).fit(words.transform(texts), labels)
    expected = reference.predict_log_proba(words.transform(test_texts))
    np.testing.assert_allclose(ours.log_posteriors(test_texts), expected, rtol=1e-5, atol=1e-5)
    again = BagOfWords.from_state(json.loads(json.dumps(ours.state())))
    np.testing.assert_array_equal(again.log_posteriors(test_texts), ours.log_posteriors(test_texts))


def test_an_out_of_fold_prior_never_reads_its_own_example():
    """Each text a word of its own: a bag of words trained on the example knows its label, one
    trained on the other folds has never seen its word and answers with the labels' shares."""
    texts = [" ".join([f"unique{i}"] * 4) for i in range(40)]
    labels = [i % 2 for i in range(40)]
    in_sample = np.exp(BagOfWords(texts, labels, 2).log_posteriors(texts))
    assert (in_sample[np.arange(40), labels] > 0.9).all()  # (what stacking on it would learn)
    out_of_fold = np.exp(cross_fitted_log_posteriors(texts, labels, 2, folds=5, seed=3))
    assert np.abs(out_of_fold - 0.5).max() < 0.1  # each fold's rest: 16 of a label, 16 ± 4 of the other
    assert (out_of_fold[np.arange(40), labels] < 0.6).all()
    again = cross_fitted_log_posteriors(texts, labels, 2, folds=5, seed=3)
    np.testing.assert_array_equal(np.exp(again), out_of_fold)  # the folds follow the seed


def test_the_starting_weight_tempers_an_overconfident_prior():
    """The weight of the grid whose scaled priors fit the labels best: 1 for calibrated
    log-probabilities (right 90% of the time at 0.9), small for the same ones 20× too confident."""
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, 2000)
    right = rng.random(2000) < 0.9
    said = np.where(right, labels, 1 - labels)
    calibrated = np.log(np.where(np.arange(2)[None, :] == said[:, None], 0.9, 0.1))
    assert calibrated_weight(calibrated, labels) == 1.0
    assert calibrated_weight(20 * calibrated, labels) == 0.05
    assert set(WEIGHT_GRID) >= {0.05, 1.0}


def test_the_classifier_adds_the_weighted_prior_and_reports_the_network_alone():
    from pretrain.model.classifier import SequenceClassifier
    from pretrain.model.transformer import Transformer
    from tests.conftest import small_model_config

    torch.manual_seed(0)
    cfg = small_model_config(vocab_size=64, max_seq_len=16)
    model = SequenceClassifier(Transformer(cfg), 3, prior_weight=0.5).eval()
    tokens, lengths = torch.randint(0, 64, (2, 8)), torch.tensor([8, 5])
    prior = torch.log_softmax(torch.randn(2, 3), -1)
    out = model(tokens, lengths, prior=prior)
    torch.testing.assert_close(out.logits, out.network_logits + 0.5 * prior)
    alone = model(tokens, lengths, prior=torch.zeros(2, 3))  # a prior of zeros: the network alone
    torch.testing.assert_close(alone.logits, out.network_logits)
    with pytest.raises(ValueError, match="pass one per example"):
        model(tokens, lengths)
    # the weight trains: cross-entropy's gradient reaches it
    model.train()
    model(tokens, lengths, torch.tensor([0, 2]), prior).loss.backward()
    assert model.prior_weight.shape == (1,) and model.prior_weight.grad.abs().item() > 0
    # and comes back from the consolidated weights `pretrain predict` reads
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state["prior_weight"] = torch.tensor([0.25])
    rebuilt = SequenceClassifier.from_state_dict(cfg, 3, state).eval()
    torch.testing.assert_close(
        rebuilt(tokens, lengths, prior=prior).logits, out.network_logits + 0.25 * prior
    )
    plain = {k: v for k, v in state.items() if k != "prior_weight"}
    assert SequenceClassifier.from_state_dict(cfg, 3, plain).prior_weight is None


def test_half_the_training_examples_keep_their_prior_the_same_at_any_restart():
    from pretrain.finetune.tasks import prior_kept

    kept = [prior_kept(0, p) for p in range(2000)]
    assert 0.45 < np.mean(kept) < 0.55
    assert kept == [prior_kept(0, p) for p in range(2000)]  # a function of (seed, position)
    assert kept != [prior_kept(1, p) for p in range(2000)]
