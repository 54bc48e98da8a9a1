"""Fine-tuning's pieces: truncation, batches, metrics, and every bad input (refused in this process,
before anything is written)."""

import re

import pytest
import torch

from pretrain.config import load_config
from pretrain.finetune.data import Encoded, collate, fit_pair
from pretrain.finetune.tasks import classification_metrics
from pretrain.model.loss import IGNORE_INDEX
from tests.finetune_data import CLASSIFICATION, sentiment_rows, write_csv
from tests.helpers import FAST, TINY, assert_one_line_error
from tests.unit.fakes import pretraining_trainer


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, train_data):
    """A pretraining run written in this process (tests/unit/fakes.py): complete checkpoints with
    our run_config.json and tokenizer, all that the checks before any weights are read look at."""
    run_dir = tmp_path_factory.mktemp("pretrained")
    overrides = [
        f"run.dir={run_dir}",
        f"data.dir={train_data}",
        "train.steps=2",
        "checkpoint.every=2",
        "eval.every=0",
    ]
    pretraining_trainer(load_config(TINY, [*FAST, *overrides])).train()
    return run_dir


def testfit_pair_shortens_the_longer_segment_first():
    a, b = fit_pair(list(range(10)), list(range(3)), 8)
    assert (len(a), len(b)) == (5, 3)
    a, b = fit_pair(list(range(10)), list(range(10)), 8)
    assert (len(a), len(b)) == (4, 4) and a == [0, 1, 2, 3]


def test_sft_batches_mask_the_prompt_and_the_padding():
    encoded = Encoded("sft", [[1, 10, 11, 12, 20, 21, 2], [1, 13, 22, 2]], None, [4, 2], 0)
    batch = collate(encoded, [0, 1], pad_id=3, device="cpu")
    assert batch["tokens"].tolist() == [[1, 10, 11, 12, 20, 21], [1, 13, 22, 3, 3, 3]]
    m = IGNORE_INDEX
    assert batch["targets"].tolist() == [[m, m, m, 20, 21, 2], [m, 22, 2, m, m, m]]
    # The loss is the mean over completion tokens only: prompt logits do not move it.
    from pretrain.model.transformer import Transformer
    from tests.conftest import small_model_config

    model = Transformer(small_model_config(vocab_size=32))
    loss = model(batch["tokens"], batch["targets"]).loss
    logits = model(batch["tokens"]).logits
    keep = batch["targets"] != m
    manual = torch.nn.functional.cross_entropy(logits[keep], batch["targets"][keep])
    assert torch.allclose(loss, manual)


def test_classification_metrics():
    m = classification_metrics([0, 0, 1, 1, 2], [0, 1, 1, 1, 2], 3)
    assert m["accuracy"] == pytest.approx(0.8)
    # F1 per class: 0 → 2/3, 1 → 0.8, 2 → 1
    assert m["macro_f1"] == pytest.approx((2 / 3 + 0.8 + 1) / 3)
    assert m["majority_baseline"] == pytest.approx(0.6)


def test_the_bag_of_words_baseline_predicts_as_scikit_learns_naive_bayes():
    """The baseline against a reference nobody here wrote: scikit-learn's multinomial naive Bayes
    (add-one smoothing) over the same lower-cased words, on a task with signal and noise."""
    import random

    from sklearn.feature_extraction.text import CountVectorizer
    from sklearn.naive_bayes import MultinomialNB

    from pretrain.finetune.baselines import BagOfWords

    rng = random.Random(0)
    vocabulary = [f"w{i}" for i in range(200)]
    cues = [["Alpha", "beta"], ["gamma", "Delta"], ["eps", "zeta"]]

    def example(label):  # noise words, and each cue word of the label with probability 0.3
        text = rng.sample(vocabulary, 5) + [w for w in cues[label] if rng.random() < 0.3]
        return " ".join(rng.sample(text, len(text))), label

    train = [example(rng.choice([0, 0, 0, 1, 2])) for _ in range(60)]
    test = [example(rng.randrange(3)) for _ in range(200)] + [("unseen words only", 1)]
    texts, labels = zip(*train, strict=True)
    ours = BagOfWords(texts, labels, 3)
    words = CountVectorizer(token_pattern=r"(?u)\w+", lowercase=True).fit(texts)
    reference = MultinomialNB(alpha=1.0).fit(words.transform(texts), labels)
    expected = reference.predict(words.transform([t for t, _ in test])).tolist()
    assert [ours.predict(t) for t, _ in test] == expected
    accuracy = ours.accuracy([t for t, _ in test], [y for _, y in test])
    assert accuracy == pytest.approx(
        sum(p == y for p, (_, y) in zip(expected, test, strict=True)) / len(test)
    )
    assert 0.5 < accuracy < 0.95  # the cues carry signal; the noise keeps it from perfect


@pytest.mark.parametrize(
    ("run_config", "lr", "source"),
    [
        (
            {"optim": {"lr": 3e-3}, "schedule": {"name": "cosine"}},
            3e-4,
            "a tenth of its pretraining peak, 3.0e-03",
        ),
        (
            {"optim": {"lr": 6e-4}, "schedule": {"name": "wsd"}},
            6e-5,
            "a tenth of its pretraining peak, 6.0e-04",
        ),
        # inverse_sqrt's optim.lr multiplies d_model^-0.5 · warmup^-0.5 at its peak (d_model 64)
        (
            {"optim": {"lr": 2.0}, "schedule": {"name": "inverse_sqrt", "warmup_steps": 100}},
            0.1 * 2.0 / 8 / 10,
            None,
        ),
        ({"optim": {"lr": 5e-4}, "finetune": {"task": "sft"}}, 5e-4, "the rate it was fine-tuned at"),
        (None, 1e-4, "a Hugging Face directory does not record its pretraining rate"),
    ],
)
def test_the_default_fine_tuning_rate_follows_the_checkpoint(run_config, lr, source):
    from pretrain.config import ModelConfig
    from pretrain.evaluation.inference import task_of
    from pretrain.initial_model import InitialModel, trained_peak

    model = ModelConfig(preset="tiny", d_model=64, n_heads=4, n_kv_heads=2)
    trained = None if run_config is None else trained_peak(run_config, model.d_model)
    initial = InitialModel(
        directory=None,
        kind="hf" if run_config is None else "checkpoint",
        model_cfg=model,
        tokenizer=None,
        trained_lr=trained,
        fine_tuned=run_config is not None and task_of(run_config) != "pretrain",
    )
    got, why = initial.learning_rate()
    assert got == pytest.approx(lr)
    if source:
        assert why == source


# --------------------------------------------------------------------------- bad input


def test_bad_inputs_are_one_line_and_exit_2(tmp_path, pretrained, sentiment, cli):
    train_csv, _ = sentiment
    base = [
        "finetune",
        "--config",
        CLASSIFICATION,
        f"finetune.init={pretrained}",
        f"run.dir={tmp_path / 'run'}",
    ]

    def fails(*overrides, message):
        assert_one_line_error(cli(*base, *overrides), message)

    fails(f"data.train={train_csv}", "data.text_column=sentence", message="has no column 'sentence'")
    unseen = write_csv(
        tmp_path / "unseen.csv", [*sentiment_rows(4, 5), {"text": "x", "other": "y", "label": "neutral"}]
    )
    fails(f"data.train={train_csv}", f"data.validation={unseen}", message="never seen in training: 'neutral'")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    fails(f"data.train={empty}", message="empty")
    fails(f"data.train={tmp_path / 'missing.csv'}", message="does not exist")
    fails(
        "data.train=" + str(write_csv(tmp_path / "one.csv", sentiment_rows(1, 0))),
        message="needs at least two",
    )
    # A Hugging Face directory whose tokenizer has more pieces than the model embeds.
    from pretrain.model.hf import save_hf
    from pretrain.model.transformer import Transformer
    from tests.conftest import small_model_config

    hf_dir = tmp_path / "hf"
    save_hf(Transformer(small_model_config(vocab_size=97)), hf_dir)
    (hf_dir / "tokenizer.model").write_bytes(
        (pretrained / "checkpoints" / "step_00000002" / "tokenizer.model").read_bytes()
    )
    fails(f"finetune.init={hf_dir}", f"data.train={train_csv}", message="tokenizer/vocabulary mismatch")
    assert not (tmp_path / "run").exists()  # nothing written for any of them


# --------------------------------------------------------------------------- the loop, in this process


@pytest.fixture(scope="module")
def hf_init(tmp_path_factory, tokenizer_dir):
    """A Hugging Face Llama directory with our tokenizer: a starting point read without DeepSpeed."""
    from pretrain.model.hf import save_hf
    from pretrain.model.transformer import Transformer
    from tests.conftest import small_model_config

    directory = tmp_path_factory.mktemp("hf_init")
    torch.manual_seed(0)
    save_hf(Transformer(small_model_config(vocab_size=512, max_seq_len=128)), directory)
    (directory / "tokenizer.model").write_bytes((tokenizer_dir / "tokenizer.model").read_bytes())
    return directory


def finetune_config(path, run_dir, init, *overrides):
    from pretrain.config import load_finetune_config

    return load_finetune_config(
        path,
        [
            f"finetune.init={init}",
            f"run.dir={run_dir}",
            "logging.every=1",
            "train.micro_batch_size=4",
            "optim.lr=2e-3",
            *overrides,
        ],
    )


def test_classification_runs_through_the_loop_and_writes_its_results(tmp_path, hf_init, sentiment):
    import json

    from monitoring.protocol import SUMMARY_FILE
    from tests.unit.fakes import finetuning_trainer

    train_csv, val_csv = sentiment
    run = (CLASSIFICATION, tmp_path, hf_init, f"data.train={train_csv}", f"data.validation={val_csv}")
    cfg = finetune_config(*run, "train.steps=6", "eval.every=3", "checkpoint.every=3")
    summary = finetuning_trainer(cfg).train()
    assert summary["completed"] and summary["task"] == "classification" and summary["steps"] == 6
    # a tenth of the 192 training examples held out to fit the blend (finetune.bag_of_words, the default)
    assert summary["train_examples"] == 173 and summary["blend_examples"] == 19
    assert summary["validation_examples"] == 64
    assert [e["step"] for e in summary["eval"]] == [0, 3, 6]
    results = json.loads((tmp_path / "eval_results.json").read_text())
    assert results["step"] == 6 and results["examples"] == 64 and results["majority_baseline"] == 0.5
    assert results["bag_of_words_baseline"] == 1.0  # one keyword decides the label
    # the blend: from the start the answers are at least the bag of words' (the random head weighs
    # nothing), the network's own accuracy reported beside
    assert summary["eval"][0]["accuracy"] == 1.0 and summary["eval"][0]["blend_network"] == 0.0
    assert 0 <= results["network_accuracy"] <= 1 and results["blend_bag_of_words"] > 0
    assert results["accuracy"] == summary["eval"][-1]["accuracy"] and 0 <= results["macro_f1"] <= 1
    state = json.loads((tmp_path / "checkpoints" / "step_00000006" / "train_state.json").read_text())
    assert state["data"] == {"examples": 6 * 4} and state["tokens"] > 0
    run_config = json.loads((tmp_path / "checkpoints" / "step_00000006" / "run_config.json").read_text())
    assert run_config["labels"] == ["negative", "positive"] and run_config["init_source"].startswith(
        "Hugging Face"
    )
    assert set(run_config["bag_of_words"]) == {"num_labels", "examples", "counts"}
    # Run again, a complete run says so and trains nothing; killed after its last save but before
    # its summary was written, it is resumed at its last step and still reports its final evaluation.
    again = finetune_config(*run, "train.steps=6", "checkpoint.resume=auto")
    written = json.loads((tmp_path / SUMMARY_FILE).read_text())
    assert written["completed"] and finetuning_trainer(again) == written  # (the summary, no trainer)
    (tmp_path / SUMMARY_FILE).unlink()
    again = finetuning_trainer(again)
    assert again.state.step == 6 and again.task.examples == 24
    assert again.train()["eval"][-1]["step"] == 6
    assert json.loads((tmp_path / "eval_results.json").read_text())["accuracy"] == results["accuracy"]


def test_sft_learns_to_complete_and_counts_only_completion_tokens(tmp_path, hf_init):
    import json
    import random

    from tests.finetune_data import FILLER, SFT, write_jsonl
    from tests.unit.fakes import finetuning_trainer

    rng = random.Random(0)
    rows = [
        {"prompt": "repeat: " + " ".join(w) + " =>", "completion": " " + " ".join(w)}
        for w in (rng.sample(FILLER, 3) for _ in range(48))
    ]
    train = write_jsonl(tmp_path / "train.jsonl", rows[:40])
    val = write_jsonl(tmp_path / "val.jsonl", rows[40:])
    cfg = finetune_config(
        SFT,
        tmp_path / "run",
        hf_init,
        f"data.train={train}",
        f"data.validation={val}",
        "train.steps=12",
        "schedule.warmup_steps=2",
    )
    summary = finetuning_trainer(cfg).train()
    losses = [e["loss"] for e in summary["eval"]]
    assert [e["step"] for e in summary["eval"]] == [0, 12] and losses[-1] < losses[0] - 0.5, losses
    assert json.loads((tmp_path / "run" / "eval_results.json").read_text())["loss"] == losses[-1]


@pytest.mark.parametrize("group_by_length", [False, True])
def test_the_example_order_resumes_at_the_same_example_at_another_world_size(tmp_path, group_by_length):
    """Two ranks serve 3 micro-batches each; one process resumed from their state serves exactly
    what a single process running from the start serves next (in length-grouped order too)."""
    from pretrain.finetune.tasks import SFT
    from pretrain.parallel.distributed import DistEnv

    encoded = Encoded("sft", [[1, *[10 + i] * (1 + i % 4), 2] for i in range(10)], None, [2] * 10, 0)

    def task(rank, world):
        return SFT(
            train=encoded,
            validation=None,
            micro_batch_size=2,
            pad_id=3,
            seed=5,
            env=DistEnv(rank, rank, world),
            device="cpu",
            run_dir=tmp_path,
            group_by_length=group_by_length,
        )

    ranks = [task(0, 2), task(1, 2)]
    seen = []
    for _ in range(3):
        for rank in ranks:
            rank.next_batch()
            seen += rank.last_batch_ids()
    state = ranks[0].state_dict()
    assert state == ranks[1].state_dict() == {"examples": 12}
    alone = task(0, 1)
    for _ in range(6):
        alone.next_batch()
    resumed = task(0, 1)
    resumed.load_state_dict(state)
    for _ in range(4):
        alone.next_batch()
        resumed.next_batch()
        assert resumed.last_batch_ids() == alone.last_batch_ids()
    single = task(0, 1)
    assert [i for _ in range(6) for i in (single.next_batch(), single.last_batch_ids())[1]] == seen
    assert sorted(seen[:10]) == list(range(10))  # the first epoch: every example once


def test_length_grouped_batches_hold_like_lengths_and_serve_each_example_once_an_epoch():
    """finetune.group_by_length: every epoch is a permutation; the micro-batches, cut where the
    stream cuts them (positions multiple of the micro-batch, an epoch of 101 examples starting
    off a cut), are barely padded; a shuffled stream of the same lengths is mostly padding."""
    import numpy as np

    from pretrain.finetune.data import ExampleOrder

    lengths = np.random.default_rng(0).integers(3, 500, 101).tolist()

    def real_share(order: ExampleOrder, micro: int) -> float:
        stream = order.indices(0, 4 * 101 - (4 * 101) % micro)
        batches = [[lengths[i] for i in stream[s : s + micro]] for s in range(0, len(stream), micro)]
        return sum(map(sum, batches)) / sum(max(b) * len(b) for b in batches)

    for micro in (4, 8):
        grouped = ExampleOrder(101, 5, lengths, micro)
        for epoch in range(4):
            assert sorted(grouped.epoch(epoch).tolist()) == list(range(101))
        assert real_share(grouped, micro) > 0.85 > 0.7 > real_share(ExampleOrder(101, 5, None, micro), micro)
    assert (
        ExampleOrder(101, 5, lengths, 4).epoch(1).tolist()
        != ExampleOrder(101, 6, lengths, 4).epoch(1).tolist()
    )


def test_mean_pooling_reads_the_real_tokens_only():
    """The head reads the mean of the final hidden states over each example's tokens: padding,
    whatever its ids, changes nothing; `last` reads the last real token's."""
    from pretrain.model.classifier import SequenceClassifier
    from pretrain.model.transformer import Transformer
    from tests.conftest import small_model_config

    torch.manual_seed(0)
    model = SequenceClassifier(Transformer(small_model_config(vocab_size=32)), 3, pooling="mean").eval()
    alone = torch.tensor([[1, 5, 6, 7, 2]])
    padded = torch.tensor([[1, 5, 6, 7, 2, 9, 9], [1, 8, 2, 3, 3, 3, 3]])
    with torch.no_grad():
        one = model(alone, torch.tensor([5])).logits
        two = model(padded, torch.tensor([5, 3])).logits
        hidden, _ = model.backbone.hidden_states(alone)
        assert torch.allclose(one, model.score(hidden.mean(dim=1)), atol=1e-6)
        assert torch.allclose(one[0], two[0], atol=1e-5)
        model.pooling = "last"
        assert torch.allclose(model(alone, torch.tensor([5])).logits, model.score(hidden[:, -1]), atol=1e-6)


def test_the_linear_probe_is_scikit_learns_logistic_regression():
    """The head's first fit against a reference nobody here wrote: scikit-learn's multinomial
    logistic regression without intercept, C = 1 / (2 · l2 · n) for our mean loss + l2 · ‖W‖²."""
    from sklearn.linear_model import LogisticRegression

    from pretrain.finetune.probe import PROBE_L2, choose_probe, fit_head

    generator = torch.Generator().manual_seed(0)
    centers = torch.randn(3, 16, generator=generator)
    labels = torch.randint(0, 3, (240,), generator=generator)
    features = centers[labels] + 1.5 * torch.randn(240, 16, generator=generator)
    ours = fit_head(features, labels, 3, 1e-2)
    theirs = LogisticRegression(C=1 / (2 * 1e-2 * 240), fit_intercept=False, tol=1e-8, max_iter=1000)
    theirs.fit(features.double().numpy(), labels.numpy())
    expected = torch.tensor(theirs.coef_, dtype=torch.float32)
    assert torch.allclose(ours, expected, atol=1e-4), (ours - expected).abs().max()  # 2e-5 seen
    probe = choose_probe(features, labels, 3)
    assert probe.l2 in PROBE_L2 and probe.held_out_accuracy > 0.8
    # Features that say nothing of the label: the strongest L2, a head that starts near zero.
    noise = choose_probe(torch.randn(240, 16, generator=generator), labels, 3)
    assert noise.l2 == max(PROBE_L2) and noise.weight.abs().max() < 0.1


def test_the_run_says_by_how_much_the_bag_of_words_was_beaten_or_not():
    from pretrain.finetune.tasks import beaten_or_not

    won = {"accuracy": 0.95, "bag_of_words_baseline": 0.9304, "over_bag_of_words": 0.95 - 0.9304}
    assert beaten_or_not(won) == "accuracy 0.9500: beats the bag of words (0.9304) by 2.0 points"
    tied = {"accuracy": 0.9304, "bag_of_words_baseline": 0.9304, "over_bag_of_words": -1e-9}
    assert beaten_or_not(tied) == "accuracy 0.9304: ties the bag of words (0.9304)"
    assert beaten_or_not(won | {"network_accuracy": 0.91}) == (
        "accuracy 0.9500 (the network alone 0.9100): beats the bag of words (0.9304) by 2.0 points"
    )
    lost = {"accuracy": 0.788, "bag_of_words_baseline": 0.935, "over_bag_of_words": 0.788 - 0.935}
    assert beaten_or_not(lost).startswith(
        "accuracy 0.7880: falls 14.7 points short of the bag of words (0.9350)"
    )


def test_an_unknown_pooling_is_refused_by_name():
    from pretrain.config.schema import FinetuneSection
    from pretrain.errors import ConfigError

    with pytest.raises(ConfigError, match="finetune.pooling='max': choose one of mean, last"):
        FinetuneSection(pooling="max")


def test_the_auxiliary_language_model_loss_is_added_as_gpt1_does():
    """finetune.lm_loss_weight λ: the training loss is cross-entropy + λ × the next-token loss over
    each example's real tokens, computed here by hand (padding, whatever its ids, left out); in
    evaluation and with λ = 0 it is the cross-entropy alone, and λ = 0 drops the language-model head."""
    import torch.nn.functional as F

    from pretrain.model.classifier import SequenceClassifier
    from pretrain.model.transformer import Transformer
    from tests.conftest import small_model_config

    torch.manual_seed(0)
    backbone = Transformer(small_model_config(vocab_size=32))
    model = SequenceClassifier(backbone, 3, lm_loss_weight=0.5)
    tokens = torch.tensor([[1, 5, 6, 7, 2, 9, 9], [1, 8, 2, 3, 3, 3, 3]])
    lengths, labels = torch.tensor([5, 3]), torch.tensor([2, 0])
    out = model(tokens, lengths, labels)
    hidden, _ = backbone.hidden_states(tokens)
    next_token = [
        F.cross_entropy(backbone.lm_head(hidden[i, : n - 1]), tokens[i, 1:n], reduction="sum")
        for i, n in enumerate(lengths.tolist())
    ]
    by_hand = F.cross_entropy(out.logits, labels) + 0.5 * sum(next_token) / (lengths - 1).sum()
    assert torch.allclose(out.loss, by_hand, atol=1e-5), (out.loss, by_hand)
    assert torch.allclose(model.eval()(tokens, lengths, labels).loss, F.cross_entropy(out.logits, labels))
    # Prediction rebuilds the classifier without the language-model head it trained.
    rebuilt = SequenceClassifier.from_state_dict(backbone.cfg, 3, model.state_dict())
    assert torch.equal(rebuilt(tokens, lengths).logits, model(tokens, lengths).logits)
    plain = SequenceClassifier(Transformer(small_model_config(vocab_size=32)), 3, lm_loss_weight=0.0)
    assert isinstance(plain.backbone.lm_head, torch.nn.Identity)
    out = plain(tokens, lengths, labels)
    assert torch.equal(out.loss, F.cross_entropy(out.logits, labels))


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"lm_loss_weight": -0.5}, "finetune.lm_loss_weight=-0.5: use a finite weight >= 0 (0: off)"),
        ({"lm_loss_weight": float("nan")}, "finetune.lm_loss_weight=nan: use a finite weight >= 0"),
        ({"lm_loss_weight": 0.5, "task": "sft"}, "is for classification; finetune.task=sft trains"),
    ],
)
def test_the_language_model_loss_weight_is_checked(settings, message):
    from pretrain.config.schema import FinetuneSection
    from pretrain.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        FinetuneSection(**settings)
