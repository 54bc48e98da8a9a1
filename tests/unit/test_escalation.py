"""When rollbacks repeat (monitor.on_repeat, docs/monitoring.md "When rollbacks repeat"): the
service's ladder — quarantine, a lowered learning rate, stop with a diagnosis — with the real
MonitorState in this process, across a service restart; the wire's new fields; and the trainer's
side, the loop in this process with the real service on a thread: the factor applied for its
steps, then lifted, kept in the checkpoint and across a resume."""

import json
import shutil
import threading

import pytest

from monitoring.config import SettingError
from monitoring.page import render_page
from monitoring.protocol import (
    Action,
    Outcome,
    ProtocolError,
    Rollback,
    RollbackApplied,
    StepMetrics,
    append_event,
    read_events,
    split_answer,
)
from monitoring.service import MonitorState, serve
from pretrain import checkpoint as ck
from pretrain.config import MonitorConfig, load_config
from pretrain.monitor_link import broadcast_action
from tests.helpers import FAST, TINY
from tests.helpers import metrics_by_step as records
from tests.unit.fakes import pretraining_trainer
from tests.unit.test_monitor import fake_checkpoint

LADDER = {
    "warmup": 4,
    "window": 16,
    "on_repeat": ["quarantine", "lower_lr", "stop"],
    "repeat_window": 5,
    "repeat_lr_factor": 0.5,
    "repeat_lr_steps": 7,
}
NEW_FIELDS = {"repeat", "stage", "quarantine", "lr_factor", "lr_factor_steps"}


class FakeTrainer:
    """What the service sees of a trainer: each step reported in order, a checkpoint every second
    step once judged, a spike at each of `spikes` the first time the step runs (like faults.*), and
    a rollback applied at once (newer checkpoints abandoned)."""

    def __init__(self, run_dir, spikes):
        self.run_dir, self.spikes, self.step = run_dir, set(spikes), 0
        self.answers: list[dict] = []

    def run(self, state: MonitorState, until: int) -> dict:
        """Steps until `until` or a stop; the last answer."""
        while self.step < until:
            self.step += 1
            spiked = self.step in self.spikes
            self.spikes.discard(self.step)
            report = report_of(self.step, 300.0 if spiked else 3.0)
            answer = state.handle_metrics(report)
            self.answers.append(answer)
            if answer["action"] == "stop":
                return answer
            if answer["action"] == "rollback":
                decision = answer["rollback"]
                target = ck.step_of(decision["target"])
                state.handle_outcome(
                    Outcome(decision["decision"], decision["step"], True, self.step, decision["target"]),
                    None,
                    None,
                )
                applied = RollbackApplied(  # (the trainer's record, which a restarted service reads)
                    step=target,
                    tag=decision["target"],
                    requested=decision["target"],
                    seed=decision["seed"],
                    decision=decision["decision"],
                    decided_at=decision["step"],
                    applied_at=self.step,
                    matches_checkpoint=True,
                    abandoned=[],
                )
                append_event(self.run_dir, applied)
                for tag in ck.tags_on_disk(self.run_dir):
                    if ck.step_of(tag) > target:
                        shutil.rmtree(ck.checkpoints_dir(self.run_dir) / tag)
                self.step = target
            elif self.step % 2 == 0:
                fake_checkpoint(self.run_dir, self.step)
        return self.answers[-1]

    def rollbacks(self) -> list[dict]:
        """The rollback records of the answers."""
        return [a["rollback"] for a in self.answers if a["action"] == "rollback"]


def report_of(step: int, loss: float) -> StepMetrics:
    return StepMetrics(step=step, loss=loss, grad_norm=1.0, lr=1e-3, step_time=0.1, tokens=step * 100)


def ladder_of(rollbacks: list[dict]) -> list[tuple]:
    return [(r["step"], r.get("stage"), r.get("quarantine"), r.get("lr_factor")) for r in rollbacks]


def test_repeated_rollbacks_climb_the_ladder_in_order_then_stop_with_a_diagnosis(tmp_path):
    state = MonitorState(tmp_path, MonitorConfig(**LADDER))
    trainer = FakeTrainer(tmp_path, [10, 12, 14, 16])
    last = trainer.run(state, 40)
    assert ladder_of(trainer.rollbacks()) == [
        (10, None, None, None),  # the first: a plain rollback
        (12, "quarantine", True, None),  # within 5 steps of the one before
        (14, "lower_lr", True, 0.5),  # keeps the quarantine, lowers the lr
    ]
    assert trainer.rollbacks()[2]["lr_factor_steps"] == 7 and trainer.step == 16
    reason = last["reason"]
    assert last["action"] == "stop" and last["verdict"]["level"] == "stop"
    for part in (
        "rollback 1 at step 10 (loss_spike) to step_00000008;",
        "rollback 2 at step 12 (loss_spike) to step_00000010, its windows quarantined;",
        "rollback 3 at step 14 (loss_spike) to step_00000012, its windows quarantined and learning "
        "rate x0.5 for 7 steps;",
        "at step 16: stopping after monitor.on_repeat [quarantine, lower_lr, stop]",
        "within 5 steps",
    ):
        assert part in reason, part
    log = read_events(tmp_path)
    decided = [e for e in log if e.type == "rollback"]
    assert [(e.repeat, e.stage, e.lr_factor, e.lr_factor_steps) for e in decided] == [
        (0, None, None, None),
        (1, "quarantine", None, None),
        (2, "lower_lr", 0.5, 7),
    ]
    (stopped,) = [e for e in log if e.type == "repeats_stopped"]
    assert stopped.step == 16 and stopped.diagnosis == reason
    assert [t.get("stage") for t in stopped.tried] == [None, "quarantine", "lower_lr"]
    assert not [e for e in log if e.type == "circuit_breaker"]  # one event says why it stopped
    status = state.status()
    assert status["circuit_breaker"] and status["escalation"]["stopped"] == reason
    assert status["escalation"]["repeat"] == 2 and len(status["escalation"]["chain"]) == 3
    assert [d.get("stage") for d in status["rollbacks_decided"]] == [None, "quarantine", "lower_lr"]
    page = render_page(state.status(series=True))  # the page: each rollback's stage, the diagnosis
    assert (
        "repeat 1: windows quarantined" in page
        and "repeat 2: windows quarantined, lr x0.5 for 7 steps" in page
    )
    assert '<p class="tripped">stopped: rollbacks kept repeating within 5 steps' in page


def test_a_rollback_after_a_quiet_window_starts_the_ladder_over(tmp_path):
    state = MonitorState(tmp_path, MonitorConfig(**LADDER))
    trainer = FakeTrainer(tmp_path, [10, 12, 30, 33])
    trainer.run(state, 40)
    assert ladder_of(trainer.rollbacks()) == [
        (10, None, None, None),
        (12, "quarantine", True, None),
        (30, None, None, None),  # 18 steps after the last one: quiet, starts over
        (33, "quarantine", True, None),  # the first repeat again, not the second
    ]
    assert trainer.step == 40 and state.status()["escalation"]["stopped"] is None


def test_a_restarted_service_goes_on_up_the_ladder_from_the_events(tmp_path):
    first = MonitorState(tmp_path, MonitorConfig(**LADDER))
    trainer = FakeTrainer(tmp_path, [10, 12, 14, 16])
    trainer.run(first, 13)
    assert ladder_of(trainer.rollbacks()) == [(10, None, None, None), (12, "quarantine", True, None)]
    again = MonitorState(tmp_path, MonitorConfig(**LADDER))  # a new service process: events.jsonl only
    assert again.status()["escalation"]["repeat"] == 1
    last = trainer.run(again, 40)
    third = trainer.rollbacks()[2]
    assert (third["decision"], third["stage"], third["lr_factor"]) == (3, "lower_lr", 0.5)
    assert last["action"] == "stop" and "rollback 2 at step 12" in last["reason"]


def test_a_cancelled_rollback_is_not_a_step_up_the_ladder(tmp_path):
    state = MonitorState(tmp_path, MonitorConfig(**LADDER))
    trainer = FakeTrainer(tmp_path, [10])
    trainer.run(state, 11)
    assert state.handle_metrics(report_of(12, 300.0))["rollback"]["decision"] == 2
    # The trainer restarted from step 10 without applying decision 2: the service cancels it.
    assert state.handle_metrics(report_of(11, 3.0))["action"] == "continue"
    fake_checkpoint(tmp_path, 12)
    answer = state.handle_metrics(report_of(13, 300.0))["rollback"]
    assert answer["decision"] == 3 and answer["stage"] == "quarantine"  # repeats 1, not the cancelled 2


def test_without_on_repeat_rollbacks_are_what_they_were(tmp_path):
    state = MonitorState(tmp_path, MonitorConfig(warmup=4, window=16, on_repeat=[]))
    trainer = FakeTrainer(tmp_path, [10, 12, 14, 16])
    trainer.run(state, 30)
    assert [r["step"] for r in trainer.rollbacks()] == [10, 12, 14, 16] and trainer.step == 30
    assert not any(NEW_FIELDS & set(r) for r in trainer.rollbacks())  # no escalation fields
    lines = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert not any(NEW_FIELDS & set(line) for line in lines if line["type"] == "rollback")
    assert state.status()["escalation"] is None


def test_by_default_repeats_are_quarantined_then_keep_lowering_the_rate_and_never_stop_the_run(tmp_path):
    """monitor.on_repeat's default, [quarantine, lower_lr] (chosen from `pretrain bench stability`:
    docs/monitoring.md): the first repeat quarantines, each later one also halves the rate; no stop
    stage (the circuit breaker is still there for rollbacks that make no progress)."""
    assert MonitorConfig().on_repeat == ["quarantine", "lower_lr"]
    state = MonitorState(tmp_path, MonitorConfig(warmup=4, window=16))
    trainer = FakeTrainer(tmp_path, [10, 12, 14, 16])
    assert trainer.run(state, 30)["action"] == "continue" and trainer.step == 30
    assert [(r["step"], r.get("stage"), r.get("lr_factor")) for r in trainer.rollbacks()] == [
        (10, None, None),
        (12, "quarantine", None),
        (14, "lower_lr", 0.5),
        (16, "lower_lr", 0.5),
    ]


def test_the_circuit_breaker_still_stops_first_and_names_what_the_chain_tried(tmp_path):
    """The same step failing again and again: the breaker (max_rollbacks=2) trips before the ladder's
    stop, and says what was tried."""
    state = MonitorState(tmp_path, MonitorConfig(**LADDER | {"max_rollbacks": 2}))
    for step in range(1, 10):
        state.handle_metrics(report_of(step, 3.0))
    fake_checkpoint(tmp_path, 8)
    answers = []
    for _ in range(3):
        answers.append(state.handle_metrics(report_of(10, 300.0)))
        if answers[-1]["action"] == "rollback":
            decision = answers[-1]["rollback"]["decision"]
            state.handle_outcome(Outcome(decision, 10, True, 10, "step_00000008"), None, None)
            state.handle_metrics(report_of(9, 3.0))
    assert [a["action"] for a in answers] == ["rollback", "rollback", "stop"]
    assert answers[-1]["reason"].startswith("circuit breaker: 2 rollbacks made no progress past step 10")
    assert "; tried: rollback 1 at step 10" in answers[-1]["reason"]
    assert (
        "rollback 2 at step 10 (loss_spike) to step_00000008, its windows quarantined"
        in answers[-1]["reason"]
    )


# ----------------------------------------------------------------------------------------- the wire


ESCALATED = Action(
    "rollback",
    rollback=Rollback(
        decision=3,
        step=14,
        target="step_00000012",
        seed=1_000_003,
        reason="loss spike",
        finding="loss_spike",
        repeat=2,
        stage="lower_lr",
        quarantine=True,
        lr_factor=0.5,
        lr_factor_steps=100,
    ),
)


def test_an_escalated_action_round_trips_and_a_plain_one_has_no_escalation_fields():
    wire = ESCALATED.to_json()
    assert NEW_FIELDS <= set(wire["rollback"])
    assert Action.from_json(json.loads(json.dumps(wire))) == ESCALATED
    answer = wire | {"judged": {"step": 14, "loss": 30.0, "grad_norm": 1.0}, "verdict": {"level": "rollback"}}
    assert split_answer(answer)[0] == ESCALATED
    plain = {
        "decision": 1,
        "step": 14,
        "target": "step_00000012",
        "seed": 7,
        "lr_scale": 1.0,
        "reason": "",
        "finding": "",
    }
    parsed = Action.from_json({"action": "rollback", "rollback": plain})
    assert (parsed.rollback.stage, parsed.rollback.quarantine, parsed.rollback.lr_factor) == (None,) * 3
    assert parsed.to_json()["rollback"] == plain  # absent fields stay absent
    assert broadcast_action(ESCALATED, "cpu") == ESCALATED  # every rank gets the measures


@pytest.mark.parametrize(
    "bad",
    [
        {"lr_factor": 0, "lr_factor_steps": 5},
        {"lr_factor": 1.5, "lr_factor_steps": 5},
        {"lr_factor": True, "lr_factor_steps": 5},
        {"lr_factor": 0.5},
        {"lr_factor": 0.5, "lr_factor_steps": 0},
        {"lr_factor": 0.5, "lr_factor_steps": 2.5},
        {"quarantine": "yes"},
        {"stage": 3},
        {"escalate": True},
    ],
)
def test_malformed_escalation_fields_are_refused(bad):
    base = {"decision": 1, "step": 14, "target": "step_00000012", "seed": 7}
    with pytest.raises(ProtocolError):
        Action.from_json({"action": "rollback", "rollback": base | bad})


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"on_repeat": ["stop", "quarantine"]}, "'stop' can only be the last stage"),
        ({"on_repeat": ["lower"]}, "monitor.on_repeat='lower' is not one of"),
        ({"on_repeat": ["quarantine"], "repeat_window": 0}, "monitor.repeat_window=0 must be > 0"),
        ({"repeat_lr_factor": 0.0}, "monitor.repeat_lr_factor=0.0 must be in (0, 1]"),
        ({"repeat_lr_factor": 2.0}, "monitor.repeat_lr_factor=2.0 must be in (0, 1]"),
        ({"repeat_lr_steps": 0}, "monitor.repeat_lr_steps=0 must be > 0"),
    ],
)
def test_the_settings_are_checked(settings, message):
    with pytest.raises(
        SettingError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
    ):
        MonitorConfig(**settings)


# -------------------------------------------------------------------------------- the trainer side


@pytest.fixture
def lowering_service(tmp_path):
    """The service on a thread of this process: a rollback repeating one within 10 steps lowers the
    learning rate to half for 4 steps."""
    settings = {"on_repeat": ["lower_lr"], "repeat_window": 10, "repeat_lr_steps": 4}
    server, state = serve(tmp_path, MonitorConfig(warmup=4, window=16, **settings))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield state
    server.shutdown()
    server.server_close()


def config(run_dir, data_dir, *overrides):
    return load_config(
        TINY,
        [
            *FAST,
            f"run.dir={run_dir}",
            f"data.dir={data_dir}",
            "monitor.enabled=true",
            "eval.every=0",
            "train.steps=14",
            "checkpoint.every=2",
            "checkpoint.keep=20",
            "faults.spike_steps=[6,8]",
            *overrides,
        ],
    )


def hooks_at(run_dir, step) -> dict:
    path = ck.checkpoints_dir(run_dir) / ck.tag_for(step) / "train_state.json"
    return json.loads(path.read_text()).get("hooks", {})


def test_the_lowered_rate_holds_for_its_steps_then_lifts_and_survives_a_resume(
    lowering_service, tmp_path, train_data, capsys
):
    """Spikes at steps 6 and 8: the first is a plain rollback (to step 4), the second repeats it and
    lowers the learning rate for the 4 steps after its target (step 6): steps 7-10. The run stops at
    step 9 and resumes: step 10 is still lowered (the checkpoint holds the factor), step 11 is not."""
    first = pretraining_trainer(config(tmp_path, train_data, "train.stop_at_step=9"))
    summary = first.train()
    assert summary["step"] == 9 and summary["rollbacks"] == 2
    decided = [e for e in read_events(tmp_path) if e.type == "rollback"]
    assert [(e.step, e.target, e.stage, e.lr_factor) for e in decided] == [
        (6, "step_00000004", None, None),
        (8, "step_00000006", "lower_lr", 0.5),
    ]
    assert hooks_at(tmp_path, 8)["monitor"]["lr"] == {"scale": 1.0, "factor": 0.5, "until": 10, "decision": 2}
    assert hooks_at(tmp_path, 8)["monitor"]["rollback"]["decision"] == 2  # the rollback's own record
    assert hooks_at(tmp_path, 6)["monitor"]["lr"]["factor"] == 1.0  # (saved before the second rollback)
    assert "learning rate x0.5 for steps 7..10" in capsys.readouterr().out
    second = pretraining_trainer(config(tmp_path, train_data, "checkpoint.resume=auto"))
    assert second.state.step == 9 and second.train()["completed"]
    lr_at, steps = second.lr_at, records(tmp_path)
    for step in range(1, 15):
        factor = 0.5 if 7 <= step <= 10 else 1.0
        assert steps[step]["train/lr"] == pytest.approx(lr_at(step) * factor, rel=1e-12), step
    assert hooks_at(tmp_path, 10)["monitor"]["lr"]["factor"] == 0.5
    assert hooks_at(tmp_path, 12)["monitor"]["lr"]["factor"] == 1.0
    log = read_events(tmp_path)
    (lowered,) = [e for e in log if e.type == "lr_lowered"]
    (restored,) = [e for e in log if e.type == "lr_restored"]
    assert (lowered.step, lowered.until, lowered.factor, lowered.decision) == (6, 10, 0.5, 2)
    assert (restored.step, restored.factor, restored.decision) == (11, 0.5, 2)
    assert "learning rate back on its schedule from step 11" in capsys.readouterr().out
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from pretrain.reporting.metrics import tensorboard_dir

    board = EventAccumulator(str(tensorboard_dir(tmp_path)), size_guidance={"scalars": 0})
    board.Reload()
    charted = {e.step: e.value for e in board.Scalars("monitor/lr_factor")}
    assert charted == {7: 0.5, 8: 0.5, 9: 0.5, 10: 0.5, 11: 1.0}


def test_the_service_asks_for_a_quarantine_the_run_did_not_switch_on(tmp_path, train_data):
    """monitor.quarantine=false in the run; the repeated rollback's stage sets its windows aside."""
    settings = {"on_repeat": ["quarantine"], "repeat_window": 10}
    server, _ = serve(tmp_path, MonitorConfig(warmup=4, window=16, **settings))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        summary = pretraining_trainer(config(tmp_path, train_data, "train.steps=10")).train()
    finally:
        server.shutdown()
        server.server_close()
    assert summary["completed"] and summary["rollbacks"] == 2
    (record,) = [json.loads(line) for line in (tmp_path / "quarantine.jsonl").read_text().splitlines()]
    assert record["step"] == 8 and record["decision"] == 2 and len(record["windows"]) == 2
    assert not [e for e in read_events(tmp_path) if e.type == "lr_lowered"]
