"""finetune.bag_of_words: a classifier's answers blend the network's logits with a bag of words'
log-probabilities, weighted as fits a held-out tenth of the training split
(pretrain/finetune/baselines.py, blend.py, data.py, tasks.py; pretrain/model/classifier.py)."""

import json
import random

import numpy as np
import pytest
import torch

from pretrain.finetune.baselines import BagOfWords
from pretrain.finetune.blend import fit_blend, held_out


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


def test_a_tenth_of_the_training_split_is_held_out_by_the_seed():
    trains, blends = held_out(632, seed=0)
    assert len(blends) == 63 and sorted(trains + blends) == list(range(632))
    assert held_out(632, seed=0) == (trains, blends) and held_out(632, seed=1)[1] != blends
    assert held_out(2, seed=0)[0] and held_out(2, seed=0)[1]  # one each, however small


def test_the_blend_trusts_what_tells_the_held_out_labels():
    """(t, a) from the grids: a network that says nothing gets t = 0 (the bag of words alone), a
    prior that says nothing gets a = 0, and where each is right on different examples both count
    and the blend is right more often than either."""
    rng = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 3, (300,), generator=rng)
    truth = torch.nn.functional.one_hot(labels, 3).float()
    noise = torch.randn(300, 3, generator=rng)
    useless = torch.log_softmax(torch.zeros(300, 3), -1)
    t, a = fit_blend(noise, torch.log_softmax(4 * truth, -1), labels)
    assert t == 0.0 and a > 0
    t, a = fit_blend(4 * truth + noise, useless, labels)
    assert a == 0.0 and t > 0
    # each right on its own half, unsure (not wrong) on the other
    first = (torch.arange(300) < 150).float()[:, None]
    network = 3 * truth * first + 0.3 * noise
    prior = torch.log_softmax(3 * truth * (1 - first) + 0.3 * torch.randn(300, 3, generator=rng), -1)
    t, a = fit_blend(network, prior, labels)
    assert t > 0 and a > 0
    right = lambda logits: (logits.argmax(-1) == labels).float().mean()  # noqa: E731
    assert right(t * network + a * prior) > max(right(network), right(prior)) + 0.2


def test_the_classifier_blends_a_prior_with_its_buffer_and_reports_the_network_alone():
    from pretrain.model.classifier import SequenceClassifier
    from pretrain.model.transformer import Transformer
    from tests.conftest import small_model_config

    torch.manual_seed(0)
    cfg = small_model_config(vocab_size=64, max_seq_len=16)
    model = SequenceClassifier(Transformer(cfg), 3, blend=True).eval()
    tokens, lengths = torch.randint(0, 64, (2, 8)), torch.tensor([8, 5])
    prior = torch.log_softmax(torch.randn(2, 3), -1)
    out = model(tokens, lengths, prior=prior)
    torch.testing.assert_close(out.logits, out.network_logits)  # (1, 0): the network alone
    model.blend.copy_(torch.tensor([0.5, 0.25]))
    out = model(tokens, lengths, prior=prior)
    torch.testing.assert_close(out.logits, 0.5 * out.network_logits + 0.25 * prior)
    torch.testing.assert_close(model(tokens, lengths).logits, out.network_logits)  # no prior: the network
    # the weights `pretrain predict` reads hold the blend
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    rebuilt = SequenceClassifier.from_state_dict(cfg, 3, state).eval()
    torch.testing.assert_close(rebuilt(tokens, lengths, prior=prior).logits, out.logits)
    plain = {k: v for k, v in state.items() if k != "blend"}
    plain_model = SequenceClassifier.from_state_dict(cfg, 3, plain)
    assert plain_model.blend is None
    with pytest.raises(ValueError, match="blends no prior"):
        plain_model(tokens, lengths, prior=prior)
