"""The training loop in this process, with a stand-in for DeepSpeed's engine (tests/unit/fakes.py):
cadence, checkpoints and exact resume, stop requests, fault injection, the data trace."""

import json
import math
import os
import shutil
import signal
import socket

import pytest
import torch

from pretrain.checkpoint import checkpoints_dir, newest_complete, read_latest
from pretrain.config import load_config
from pretrain.train.loop import layer_grad_squares
from tests.helpers import FAST, TINY
from tests.helpers import metrics_by_step as records
from tests.unit.fakes import pretraining_trainer


def config(run_dir, data_dir, *overrides):
    return load_config(
        TINY,
        [
            *FAST,
            f"run.dir={run_dir}",
            f"data.dir={data_dir}",
            "train.steps=6",
            "checkpoint.every=3",
            "eval.every=3",
            *overrides,
        ],
    )


def state_of(run_dir, step) -> dict:
    return json.loads((checkpoints_dir(run_dir) / f"step_{step:08d}" / "train_state.json").read_text())


@pytest.fixture(scope="module")
def six_steps(tmp_path_factory, train_data):
    """Six uninterrupted steps, checkpoints and evaluations at 3 and 6: what the other tests compare with."""
    run_dir = tmp_path_factory.mktemp("six_steps")
    probe = "eval.attention_probe=The quick brown fox jumps over the lazy dog."  # (FAST leaves it out)
    summary = pretraining_trainer(config(run_dir, train_data, "engine.peak_flops=1e12", probe)).train()
    return run_dir, summary


def test_the_loop_trains_evaluates_and_checkpoints_on_its_cadence(six_steps):
    run_dir, summary = six_steps
    assert summary["completed"] and summary["step"] == 6 and summary["tokens"] == 6 * 2 * 512
    assert summary["world_size"] == 1 and summary["rollbacks"] == 0
    assert [e["step"] for e in summary["eval"]] == [0, 3, 6]
    assert summary["eval"][-1]["loss"] < summary["eval"][0]["loss"] - 0.2
    assert json.loads((run_dir / "train_summary.json").read_text()) == summary
    steps = records(run_dir)
    assert sorted(steps) == [1, 2, 3, 4, 5, 6] and steps[6]["train/loss"] < steps[1]["train/loss"]
    assert steps[6]["train/tokens"] == 6 * 2 * 512 and steps[1]["train/mfu"] > 0
    assert {"train/grad_norm/embeddings", "train/grad_norm/layers.0", "train/grad_norm/head"} <= set(steps[2])
    assert "train/grad_norm/head" not in steps[3]  # logging.layer_grad_norms_every=2
    assert read_latest(run_dir) == "step_00000006"
    for step in (3, 6):
        directory = checkpoints_dir(run_dir) / f"step_{step:08d}"
        assert {
            "complete.json",
            "train_state.json",
            "run_config.json",
            "tokenizer.model",
            "rng_rank_00000.json",
        } <= {p.name for p in directory.iterdir()}
    state = state_of(run_dir, 6)
    assert state["step"] == 6 and state["data"]["consumed"] == 12 and state["world_size"] == 1
    assert "lr_scale" not in state and len(state["params_sha256"]) == 64 and len(state["config_hash"]) == 16


def test_tensorboard_holds_every_step_the_evaluations_and_the_probe(six_steps):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from pretrain.reporting.metrics import tensorboard_dir

    events = EventAccumulator(str(tensorboard_dir(six_steps[0])))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6]
    assert [e.step for e in events.Scalars("eval/perplexity")] == [0, 3, 6]
    assert [i.step for i in events.Images("attention/probe")] == [0, 3, 6]


def test_a_run_stopped_and_resumed_is_the_uninterrupted_run_bitwise(tmp_path, train_data, six_steps, capsys):
    """Weights, optimizer, data position and RNG all go through the checkpoint and come back."""
    reference, _ = six_steps
    cfg = config(tmp_path, train_data, "engine.peak_flops=1e12", "train.stop_at_step=4", "checkpoint.every=6")
    first = pretraining_trainer(cfg).train()
    assert not first["completed"] and first["step"] == 4 and read_latest(tmp_path) == "step_00000004"
    assert "reached train.stop_at_step: saved step_00000004 and exiting" in capsys.readouterr().out
    second = pretraining_trainer(
        config(tmp_path, train_data, "engine.peak_flops=1e12", "checkpoint.resume=auto")
    )
    assert second.state.step == 4
    assert second.train()["completed"]
    assert "resumed from step_00000004" in capsys.readouterr().out
    ours, theirs = records(tmp_path), records(reference)
    for step in range(1, 7):
        for key in ("train/loss", "train/grad_norm", "train/lr", "train/grad_norm/head"):
            assert ours[step].get(key) == theirs[step].get(key), (step, key)
    for key in ("data", "params_sha256", "tokens"):
        assert state_of(tmp_path, 6)[key] == state_of(reference, 6)[key], key


def test_sigterm_saves_at_the_next_step_boundary_and_exits(tmp_path, train_data, capsys):
    trainer = pretraining_trainer(config(tmp_path, train_data, "train.steps=50", "eval.every=0"))
    next_batch = trainer.task.next_batch

    def batch_then_sigterm():
        if trainer.state.step == 2:  # during step 3
            os.kill(os.getpid(), signal.SIGTERM)
        return next_batch()

    trainer.task.next_batch = batch_then_sigterm
    previous = signal.getsignal(signal.SIGTERM)
    summary = trainer.train()
    assert signal.getsignal(signal.SIGTERM) == previous  # the handler is the caller's again
    assert summary["step"] == 3 and not summary["completed"] and read_latest(tmp_path) == "step_00000003"
    out = capsys.readouterr().out
    assert (
        f"stop requested by node 0 ({socket.gethostname()}, rank 0): SIGTERM received: saved step_00000003 and exiting"
        in out
    )


def test_injected_spike_and_nan_fire_once_and_a_nan_never_reaches_the_weights(tmp_path, train_data):
    cfg = config(
        tmp_path,
        train_data,
        "eval.every=0",
        "faults.spike_steps=[2]",
        "faults.nan_steps=[4]",
        "faults.spike_factor=50",
        "train.steps=4",
        "checkpoint.every=4",
    )
    trainer = pretraining_trainer(cfg)
    trainer.train()
    steps = records(tmp_path)
    assert steps[2]["train/loss"] > 20 * steps[1]["train/loss"]  # the spike multiplies the loss
    assert math.isnan(steps[4]["train/loss"]) and steps[4]["train/skipped_steps"] == 1
    assert all(torch.isfinite(p).all() for p in trainer.engine.module.parameters())
    assert json.loads((tmp_path / "faults_fired.json").read_text()) == ["nan:4", "spike:2"]
    # Run again from the start (as a restart after a crash before any checkpoint): the faults
    # already fired stay quiet.
    shutil.rmtree(tmp_path / "checkpoints")
    rerun = pretraining_trainer(
        load_config(
            TINY,
            [
                *FAST,
                f"run.dir={tmp_path}",
                f"data.dir={train_data}",
                "eval.every=0",
                "train.steps=4",
                "faults.spike_steps=[2]",
                "faults.nan_steps=[4]",
                "checkpoint.every=4",
            ],
        )
    )
    rerun.train()
    assert all(math.isfinite(r["train/loss"]) and r["train/loss"] < 10 for r in records(tmp_path).values())


def test_the_data_trace_names_every_window_of_every_step(tmp_path, train_data):
    cfg = config(tmp_path, train_data, "eval.every=0", "logging.data_trace=true", "train.grad_accum=2")
    pretraining_trainer(cfg).train()
    trace = [
        json.loads(line) for line in (tmp_path / "data_trace" / "rank_00000.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in trace] == [1, 2, 3, 4, 5, 6]
    windows = [w for r in trace for w in r["windows"]]
    assert all(len(r["windows"]) == 4 for r in trace) and len(set(windows)) == 24  # micro 2 × accum 2
    assert state_of(tmp_path, 6)["data"]["consumed"] == 24


def test_the_newest_checkpoint_is_written_again_after_an_interrupted_save(tmp_path, train_data):
    """A step directory without its completion marker (a save that died) is replaced, not trusted."""
    broken = checkpoints_dir(tmp_path) / "step_00000003"
    broken.mkdir(parents=True)
    (broken / "model.safetensors").write_bytes(b"half")
    pretraining_trainer(config(tmp_path, train_data, "eval.every=0")).train()
    assert newest_complete(tmp_path) == "step_00000006"
    assert (broken / "complete.json").is_file() and (broken / "model.safetensors").stat().st_size > 4


def test_layer_groups_of_a_classifier_are_those_of_its_backbone():
    from pretrain.model.classifier import SequenceClassifier
    from tests.conftest import random_weights_model

    model = SequenceClassifier(random_weights_model(), 3)
    tokens = torch.randint(0, 97, (2, 8))
    model(tokens, torch.tensor([8, 5]), torch.tensor([0, 2])).loss.backward()
    norms = {group: math.sqrt(square.item()) for group, square in layer_grad_squares(model).items()}
    assert set(norms) == {"embeddings", "layers.0", "layers.1", "head"}
    total = math.sqrt(sum(p.grad.pow(2).sum().item() for p in model.parameters() if p.grad is not None))
    assert math.sqrt(sum(v * v for v in norms.values())) == pytest.approx(total, rel=1e-5)


@pytest.mark.parametrize("masking", [True, False])
def test_document_masking_reaches_the_model_in_training_and_evaluation(
    tmp_path, train_data, monkeypatch, masking
):
    """`data.document_masking=true`: every forward of the loop, training and held-out evaluation
    alike, gets the batch's `document_ids`, computed from the EOS positions of its own tokens; off,
    none does (the plain causal path)."""
    from pretrain.data import read_manifest
    from pretrain.data.loader import document_ids
    from pretrain.model.transformer import Transformer

    calls = []
    forward = Transformer.forward

    def spy(self, tokens, targets=None, document_ids=None, **kwargs):
        calls.append((self.training, tokens.clone(), document_ids))
        return forward(self, tokens, targets, document_ids, **kwargs)

    monkeypatch.setattr(Transformer, "forward", spy)
    cfg = config(
        tmp_path,
        train_data,
        "train.steps=2",
        "eval.every=2",
        "checkpoint.every=2",
        f"data.document_masking={str(masking).lower()}",
    )
    pretraining_trainer(cfg).train()
    training, evaluation = [c for c in calls if c[0]], [c for c in calls if not c[0]]
    assert len(training) >= 2 and evaluation  # 2 steps' micro-batches; the baseline's and step 2's evaluation
    eos = read_manifest(train_data)["tokenizer"]["eos_id"]
    for _, tokens, ids in training + evaluation:
        if masking:
            assert ids is not None and torch.equal(ids, document_ids(tokens, eos))
        else:
            assert ids is None
    if masking:  # the corpus's windows hold several documents: the ids are not all one document
        assert any(ids.max() > ids.min() for _, _, ids in training + evaluation)


@pytest.mark.parametrize("by", ["the monitor", "the replica check"])
def test_a_step_hook_votes_in_the_steps_all_reduce_and_its_stop_ends_the_loop_unsaved(
    tmp_path, train_data, by
):
    """The hook interface as a new component uses it: its vote comes back summed over ranks (one
    rank here) at the boundary of the same step, hooks run in order, and a `Stop` before a
    checkpoint ends the run there with nothing saved after the refused state; the summary says
    who stopped it."""
    from pretrain.train.hooks import BY_THE_MONITOR, CONTINUE, StepHook, Stop

    seen = []

    class Counting(StepHook):
        def vote(self):
            return 2.5

        def after_step(self, step, metrics, batch_ids, vote):
            seen.append(("after", step, vote, metrics["train/loss"] is not None))
            return CONTINUE

        def before_checkpoint(self, step, stopping, last):
            seen.append(("checkpoint", step))
            return Stop("enough", by) if step == 4 else CONTINUE

    trainer = pretraining_trainer(
        config(tmp_path, train_data, "train.steps=6", "checkpoint.every=2", "eval.every=0")
    )
    trainer.hooks.append(Counting())
    summary = trainer.train()
    assert seen == [
        ("after", 1, 2.5, True),
        ("after", 2, 2.5, True),
        ("checkpoint", 2),
        ("after", 3, 2.5, True),
        ("after", 4, 2.5, True),
        ("checkpoint", 4),
    ]
    assert not summary["completed"] and summary["step"] == 4
    if by == BY_THE_MONITOR:
        assert summary["stopped_by_monitor"] == "enough" and "stopped_by" not in summary
    else:  # another check's stop is not the monitor's
        assert "stopped_by_monitor" not in summary
        assert (summary["stopped_by"], summary["stopped_for"]) == ("the replica check", "enough")
    assert newest_complete(tmp_path) == "step_00000002"  # step 4 was refused: never saved


def test_a_rewind_ends_the_boundary_and_the_loop_goes_on_from_its_state(tmp_path, train_data):
    """Hooks are asked in order; the first answer other than CONTINUE ends that boundary (the hooks
    after it are not asked), and a Rewind puts the loop back at its state: the step after it runs
    again."""
    from pretrain.checkpoint.checkpointer import TrainState
    from pretrain.train.hooks import CONTINUE, Rewind, StepHook

    asked = {"first": [], "second": []}

    class First(StepHook):
        def after_step(self, step, metrics, batch_ids, vote):
            asked["first"].append(step)
            if asked["first"] == [1, 2, 3]:  # once, at step 3: back to the state after step 2
                return Rewind(TrainState(step=2, tokens=int(metrics["train/tokens"]) // 3 * 2))
            return CONTINUE

    class Second(StepHook):
        def after_step(self, step, metrics, batch_ids, vote):
            asked["second"].append(step)
            return CONTINUE

    trainer = pretraining_trainer(
        config(tmp_path, train_data, "train.steps=4", "checkpoint.every=4", "eval.every=0")
    )
    trainer.hooks += [First(), Second()]
    summary = trainer.train()
    assert asked == {"first": [1, 2, 3, 3, 4], "second": [1, 2, 3, 4]}
    assert summary["completed"] and summary["step"] == 4


def test_hooks_are_called_by_their_declared_priority(tmp_path, train_data):
    """The run's hooks come in the order of their `priority` (pretrain/train/hooks.py's table: the
    faults first, the skip guard before the replica check, the replay after both), and a hook given
    last with a lower priority is still called before the others."""
    from pretrain.train.hooks import CONTINUE, StepHook
    from pretrain.train.precursor_hook import InstabilityPrecursors

    order = []

    class Early(StepHook):
        priority = 5

        def after_step(self, step, metrics, batch_ids, vote):
            order.append(type(self).__name__)
            return CONTINUE

    class Late(Early):
        priority = 1000

    trainer = pretraining_trainer(
        config(
            tmp_path, train_data, "train.steps=1", "eval.every=0", "logging.data_trace=true",
            "monitor.replay=true", "logging.precursors_every=1",
        )
    )  # fmt: skip
    names = [type(hook).__name__ for hook in trainer.hooks]
    assert names == [
        "InjectedFaults", "DataTrace", "InstabilityPrecursors", "StragglerWatch", "ReplicaCheck",
        "ReplayCheck",
    ]  # fmt: skip
    # The skip guard needs DeepSpeed's optimizer (tests/integration): its place by its priority.
    from pretrain.train.replica_hook import ReplicaCheck
    from pretrain.train.skip_hook import SkipBadUpdates

    assert InstabilityPrecursors.priority < SkipBadUpdates.priority < ReplicaCheck.priority
    trainer.hooks += [Late(), Early()]
    trainer.train()
    assert order == ["Early", "Late"]
    assert [type(hook).__name__ for hook in trainer.hooks][1:3] == ["Early", "DataTrace"]


def test_a_rewind_that_leaves_stops_at_its_checkpoint_with_its_status(tmp_path, train_data):
    """A Rewind with `leaving` (the replica check's, when the host at fault reached its limit):
    the loop stops at the state it went back to, a checkpoint already (nothing newer is saved),
    with the leaving's reason and exit status in the summary."""
    from pretrain.checkpoint import newest_complete
    from pretrain.checkpoint.checkpointer import TrainState
    from pretrain.errors import ExitCode
    from pretrain.train.hooks import CONTINUE, Rewind, SaveAndStop, StepHook

    class Leaving(StepHook):
        def after_step(self, step, metrics, batch_ids, vote):
            if step < 3:
                return CONTINUE
            leaving = SaveAndStop("moving off node7 (2 machine faults)", ExitCode.REPLACE_NODE)
            return Rewind(TrainState(step=2, tokens=int(metrics["train/tokens"]) // 3 * 2), leaving)

    trainer = pretraining_trainer(
        config(tmp_path, train_data, "train.steps=6", "checkpoint.every=2", "eval.every=0")
    )
    trainer.hooks.append(Leaving())
    summary = trainer.train()
    assert not summary["completed"] and summary["step"] == 2 and summary["exit_code"] == 5
    assert summary["stopped_for"] == "moving off node7 (2 machine faults)"
    assert newest_complete(tmp_path) == "step_00000002"


def test_the_precursors_are_measured_every_n_steps_and_read_with_the_step(tmp_path, train_data):
    """logging.precursors_every=3 with logging.every=4: steps 3 and 6 carry every precursor in
    metrics.jsonl and in TensorBoard (read back with its own reader), also at step 3, which is not
    a logging step; the summaries are the largest of their parts; the other steps carry none."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from pretrain.reporting.metrics import tensorboard_dir

    cfg = config(tmp_path, train_data, "train.steps=6", "logging.precursors_every=3", "logging.every=4")
    pretraining_trainer(cfg).train()
    records = {r["step"]: r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())}
    measured = {s: {k: v for k, v in r.items() if k.startswith("stability/")} for s, r in records.items()}
    assert [s for s, values in measured.items() if values] == [3, 6]
    values = measured[3]
    layers = [values[f"stability/attn_logit_max/layer_{i}"] for i in range(cfg.model.n_layers)]
    ratios = [v for k, v in values.items() if k.startswith("stability/update_ratio/")]
    assert values["stability/attn_logit_max"] == pytest.approx(max(layers))
    assert values["stability/update_ratio_max"] == pytest.approx(max(ratios)) and 0 < max(ratios) < 1
    assert values["stability/logit_lse_max"] >= values["stability/logit_lse_mean"] > 0
    board = EventAccumulator(str(tensorboard_dir(tmp_path)))
    board.Reload()
    assert [e.step for e in board.Scalars("stability/attn_logit_max")] == [3, 6]
