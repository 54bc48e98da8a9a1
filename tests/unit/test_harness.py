"""`PretrainLM`, the lm-evaluation-harness's view of a checkpoint, checked against the model's own
forward pass (a random-weights model and the session tokenizer: no harness run, which starts
subprocesses); and the argument checks of `pretrain eval`. The harness runs end to end in
tests/integration/test_harness.py."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pretrain.errors import UserError
from pretrain.evaluation.inference import Trained, generate
from pretrain.tokenizer import Tokenizer
from tests.conftest import random_weights_model
from tests.helpers import assert_one_line_error

WINDOW = 48  # data.seq_len of the pretend run: below the model's max_seq_len of 64
TEXT = "Assignment statements are used to (re)bind names to values and to modify attributes."


@pytest.fixture(scope="module")
def trained(tokenizer_dir) -> Trained:
    model = random_weights_model(qkv_scale=3.0, vocab_size=512).eval()
    return Trained(model, Tokenizer.load(tokenizer_dir), {"data": {"seq_len": WINDOW}}, Path("no-checkpoint"))


def harness_lm(trained, batch_size=3, **data):
    pytest.importorskip("lm_eval")  # the `eval` extra (in `dev`)
    from pretrain.evaluation.harness import PretrainLM

    if data:
        trained = Trained(
            trained.model, trained.tokenizer, {"data": {"seq_len": WINDOW, **data}}, trained.directory
        )
    return PretrainLM(trained, batch_size)


def requests(kind: str, *arguments: tuple):
    from lm_eval.api.instance import Instance

    return [Instance(kind, {}, args, index) for index, args in enumerate(arguments)]


@torch.no_grad()
def log_probs(model, ids: list[int], first_target: int, **forward) -> torch.Tensor:
    """log P(ids[i] | ids[:i]) for i >= first_target, from one plain forward over `ids`."""
    logits = model(torch.tensor([ids[:-1]]), **forward).logits[0].float()
    targets = torch.tensor(ids[1:])
    return F.log_softmax(logits, -1).gather(-1, targets[:, None])[first_target - 1 :, 0]


def test_loglikelihood_is_the_continuations_log_probability_after_a_document_start(trained):
    tok = trained.tokenizer
    pairs = [
        ("Question: what binds names?\nAnswer:", " assignment"),
        ("", "Assignment statements"),
        (TEXT[:40] + " ", "and more"),
        ("x = 1", ""),
    ]
    answers = harness_lm(trained).loglikelihood(requests("loglikelihood", *pairs))
    one_by_one = harness_lm(trained, batch_size=1).loglikelihood(requests("loglikelihood", *pairs))
    for (context, continuation), (logprob, greedy), alone in zip(pairs, answers, one_by_one, strict=True):
        assert logprob == pytest.approx(alone[0], abs=1e-4)  # padding and batch order leak nothing
        if not continuation:
            assert (logprob, greedy) == (0.0, True)
            continue
        split = len(context.rstrip())  # trailing spaces are scored with the continuation
        ids = tok.encode_document(context[:split])
        ids += tok.encode(context + continuation)[len(ids) - 1 :]
        expected = log_probs(trained.model, ids, len(tok.encode_document(context[:split])))
        assert logprob == pytest.approx(expected.sum().item(), abs=1e-4)
        assert logprob < 0 and isinstance(greedy, bool)


def test_contexts_longer_than_the_window_are_cut_from_the_left(trained):
    tok = trained.tokenizer
    context, continuation = TEXT * 3, " It rebinds."
    ids = tok.encode_document(context + continuation)
    assert len(ids) > WINDOW + 20
    ((logprob, _),) = harness_lm(trained).loglikelihood(requests("loglikelihood", (context, continuation)))
    count = len(tok.encode(continuation))
    kept = ids[-(WINDOW + 1) :]  # the window, plus the last target
    assert logprob == pytest.approx(log_probs(trained.model, kept, len(kept) - count).sum().item(), abs=1e-4)


def test_rolling_loglikelihood_scores_every_token_once_in_windows_of_the_training_length(trained):
    """A text of 2 windows and 5 tokens: [EOS t0..] predicts t0..t47, [t47..] predicts t48..t95,
    and the last window keeps a full context but predicts only the last 5 tokens."""
    tok = trained.tokenizer
    ids = tok.encode(TEXT * 4)[: 2 * WINDOW + 5]
    text = tok.decode(ids)
    assert tok.encode(text) == ids
    lm = harness_lm(trained)
    (total,) = lm.loglikelihood_rolling(requests("loglikelihood_rolling", (text,)))
    first = log_probs(trained.model, [tok.eos_id, *ids[:WINDOW]], 1).sum()
    second = log_probs(trained.model, ids[WINDOW - 1 : 2 * WINDOW], 1).sum()
    last = log_probs(trained.model, ids[-(WINDOW + 1) :], WINDOW + 1 - 5).sum()
    assert total == pytest.approx((first + second + last).item(), abs=1e-3)
    (short,) = lm.loglikelihood_rolling(requests("loglikelihood_rolling", (TEXT,)))
    assert short == pytest.approx(
        log_probs(trained.model, tok.encode_document(TEXT), 1).sum().item(), abs=1e-4
    )


def test_document_masked_runs_are_scored_with_the_training_document_ids(trained):
    """With document masking the EOS ends the document before: the text's first token is predicted
    from the EOS alone, and the rest see only the text, from position 0."""
    tok = trained.tokenizer
    ((masked, _),) = harness_lm(trained, document_masking=True).loglikelihood(
        requests("loglikelihood", ("", TEXT))
    )
    ids = tok.encode(TEXT)
    first = log_probs(trained.model, [tok.eos_id, ids[0]], 1).sum()
    assert masked == pytest.approx((first + log_probs(trained.model, ids, 1).sum()).item(), abs=1e-4)
    ((plain, _),) = harness_lm(trained).loglikelihood(requests("loglikelihood", ("", TEXT)))
    assert abs(masked - plain) > 1e-3  # the masking really changes what is scored


def test_generate_until_is_greedy_decoding_cut_at_the_first_stop_string(trained):
    tok = trained.tokenizer
    context = "The assignment statement"
    greedy = tok.decode(
        generate(trained.model, tok.encode_document(context), 12, temperature=0, stop_id=tok.eos_id)
    )
    assert len(greedy) >= 6, greedy
    stop = greedy[3:5]
    lm = harness_lm(trained)
    free, stopped = lm.generate_until(
        requests(
            "generate_until",
            (context, {"max_gen_toks": 12}),
            (context, {"until": [stop], "max_gen_toks": 12}),
        )
    )
    assert free == greedy
    assert stopped == greedy.split(stop)[0] and len(stopped) < len(greedy)


def test_results_never_go_inside_the_checkpoint(tmp_path):
    pytest.importorskip("lm_eval")
    from pretrain.evaluation.harness import RESULTS_FILE, results_path

    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000020"
    checkpoint.mkdir(parents=True)
    with pytest.raises(UserError, match="inside the checkpoint"):
        results_path(checkpoint / "results.json", checkpoint)
    with pytest.raises(UserError, match="inside the checkpoint"):
        results_path(checkpoint, checkpoint)
    assert results_path(tmp_path, checkpoint) == tmp_path / RESULTS_FILE
    assert results_path(tmp_path / "new" / "r.json", checkpoint) == tmp_path / "new" / "r.json"
    assert results_path(f"{tmp_path}/new/", checkpoint) == tmp_path / "new" / RESULTS_FILE


def test_a_task_list_naming_no_task_is_refused():
    pytest.importorskip("lm_eval")
    from pretrain.evaluation.harness import parse_tasks

    assert parse_tasks(" arc_easy, piqa ,") == ["arc_easy", "piqa"]
    with pytest.raises(UserError, match="names no task"):
        parse_tasks(" , ")


def test_eval_takes_exactly_one_of_data_and_tasks(cli, tmp_path):
    neither = cli("eval", "--checkpoint", tmp_path)
    assert_one_line_error(neither, "exactly one of --data", "--tasks")
    both = cli("eval", "--checkpoint", tmp_path, "--data", tmp_path, "--tasks", "arc_easy")
    assert_one_line_error(both, "exactly one of --data", "--tasks")
    assert_one_line_error(
        cli("eval", "--checkpoint", tmp_path, "--data", tmp_path, "--limit", "5"),
        "--limit cannot be used with --data",
    )
    assert_one_line_error(
        cli("eval", "--checkpoint", tmp_path, "--tasks", "arc_easy", "--max-batches", "2"),
        "--max-batches cannot be used with --tasks",
    )


def test_tasks_without_the_harness_installed_is_one_line_saying_how_to_install(cli, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # what `import lm_eval` meets when it is not installed
    monkeypatch.delitem(sys.modules, "pretrain.evaluation.harness", raising=False)
    result = cli("eval", "--checkpoint", tmp_path, "--tasks", "hellaswag")
    assert_one_line_error(result, "lm-evaluation-harness", 'install with pip install -e ".[eval]"')
