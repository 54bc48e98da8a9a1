import dataclasses
import json
import math

import pytest

from monitoring.protocol import (
    CONTINUE,
    MAX_RANKS_REPORTED,
    Action,
    Outcome,
    ProtocolError,
    Rollback,
    StepMetrics,
)


def test_metrics_round_trip_through_json_text_including_nan():
    metrics = StepMetrics(
        step=12,
        loss=float("nan"),
        grad_norm=float("inf"),
        lr=3e-4,
        step_time=0.2,
        tokens=4096,
        layer_grad_norms={"layers.0": 0.5, "layers.1": float("nan")},
    )
    text = json.dumps(metrics.to_json(), allow_nan=False)  # strict JSON: no bare NaN tokens
    back = StepMetrics.from_json(json.loads(text))
    assert back.step == 12 and math.isnan(back.loss) and math.isinf(back.grad_norm)
    assert back.layer_grad_norms["layers.0"] == 0.5 and math.isnan(back.layer_grad_norms["layers.1"])


@pytest.mark.parametrize(
    "payload",
    [
        [],
        {"step": -1, "loss": 1, "grad_norm": 1, "lr": 1, "step_time": 1, "tokens": 0},
        {"step": 1, "loss": "high", "grad_norm": 1, "lr": 1, "step_time": 1, "tokens": 0},
        {"step": 1, "loss": 1, "grad_norm": True, "lr": 1, "step_time": 1, "tokens": 0},
        {"step": 1, "loss": 1, "grad_norm": 1, "lr": 1, "step_time": 1},
        {"step": 1, "loss": 1, "grad_norm": 1, "lr": 1, "step_time": 1, "tokens": 0, "layer_grad_norms": [1]},
        {"step": 1, "loss": 1, "grad_norm": 1, "lr": 1, "step_time": 1, "tokens": 0, "gradnorm": 1},
    ],
)
def test_bad_metrics_are_refused(payload):
    with pytest.raises(ProtocolError):
        StepMetrics.from_json(payload)


RANK = {"rank": 1, "host": "node7", "step_seconds": 0.031}


def test_a_logging_steps_report_carries_each_ranks_time_and_the_stragglers_named():
    ranks = [RANK | {"factor": 3.1, "straggler": True}, {"rank": 0, "host": "node0", "step_seconds": 0.01}]
    metrics = StepMetrics(step=31, loss=3.0, grad_norm=1.0, lr=1e-3, step_time=0.1, tokens=100, ranks=ranks)
    back = StepMetrics.from_json(json.loads(json.dumps(metrics.to_json(), allow_nan=False)))
    assert back.ranks == ranks
    assert StepMetrics.from_json({k: v for k, v in metrics.to_json().items() if k != "ranks"}).ranks == []
    full = [{"rank": r, "host": "h", "step_seconds": 0.01} for r in range(MAX_RANKS_REPORTED)]
    assert len(StepMetrics.from_json(metrics.to_json() | {"ranks": full}).ranks) == MAX_RANKS_REPORTED


@pytest.mark.parametrize(
    "ranks, message",
    [
        ({"1": 0.03}, "'ranks' must be a list"),
        ([RANK] * (MAX_RANKS_REPORTED + 1), "at most 64"),
        (["node7"], "rank must be a JSON object"),
        ([RANK | {"speed": 1}], "unknown rank fields ['speed']"),
        ([RANK | {"rank": -1}], "'ranks.rank' must be an integer"),
        ([RANK | {"rank": True}], "'ranks.rank' must be an integer"),
        ([{"rank": 1, "step_seconds": 0.03}], "'ranks.host' must be a host name"),
        ([RANK | {"host": "x" * 256}], "'ranks.host' must be a host name"),
        ([{"rank": 1, "host": "node7"}], "'step_seconds' must be a number"),
        ([RANK | {"step_seconds": "nan"}], "'step_seconds' must be a number"),
        ([RANK | {"step_seconds": -0.5}], "'ranks.step_seconds' must be a finite number >= 0"),
        ([RANK | {"step_seconds": 1e309}], "'ranks.step_seconds' must be a finite number >= 0"),
        ([RANK | {"factor": -1}], "'ranks.factor' must be a finite number >= 0"),
        ([RANK | {"straggler": 1}], "'ranks.straggler' must be true or false"),
    ],
)
def test_bad_rank_times_are_refused(ranks, message):
    payload = {"step": 1, "loss": 1, "grad_norm": 1, "lr": 1, "step_time": 1, "tokens": 0, "ranks": ranks}
    with pytest.raises(ProtocolError) as refused:
        StepMetrics.from_json(payload)
    assert message in str(refused.value)


def a_rollback(**fields) -> Rollback:
    return Rollback(**({"decision": 1, "step": 7, "target": "step_00000005", "seed": 3} | fields))


def test_actions():
    assert Action.from_json(CONTINUE.to_json()) == CONTINUE
    rollback = Action("rollback", rollback=a_rollback(lr_scale=0.5, reason="grad_norm spike"))
    assert Action.from_json(json.loads(json.dumps(rollback.to_json()))) == rollback
    with pytest.raises(ProtocolError, match="carries its 'rollback' record"):
        Action("rollback")
    with pytest.raises(ProtocolError, match="carries its 'rollback' record"):
        Action("stop", rollback=a_rollback())
    with pytest.raises(ProtocolError, match="unknown action"):
        Action.from_json({"action": "explode"})
    with pytest.raises(ProtocolError, match="unknown action fields"):
        Action.from_json({"action": "continue", "extra": 1})
    with pytest.raises(ProtocolError, match="lr_scale"):
        a_rollback(lr_scale=0)
    with pytest.raises(ProtocolError, match="incomplete"):
        Action.from_json({"action": "rollback", "rollback": {"decision": 1, "step": 2, "seed": 1}})
    for bad in (
        {"lr_scale": "x"},
        {"target": 5},
        {"seed": "s"},
        {"seed": True},
        {"quarantine": 1},
        {"lr_factor": 0.5},  # without its steps
        {"lr_factor": 2.0, "lr_factor_steps": 3},
    ):
        with pytest.raises(ProtocolError):
            Action.from_json({"action": "rollback", "rollback": a_rollback().to_json() | bad})


def test_on_the_wire_an_action_is_its_kind_its_reason_and_the_rollbacks_record():
    rollback = Action("rollback", rollback=a_rollback())
    assert rollback.to_json() == {
        "action": "rollback",
        "rollback": {
            "decision": 1,
            "step": 7,
            "target": "step_00000005",
            "seed": 3,
            "lr_scale": 1.0,
            "reason": "",
            "finding": "",
        },
    }
    assert Action.from_json({"action": "stop", "reason": "r"}) == Action("stop", reason="r")


def test_a_field_added_to_the_decision_travels_through_every_form_of_it(monkeypatch, tmp_path):
    """A decision is declared once (`Rollback`): add a field there — here to a copy of
    monitoring/protocol.py, one line — and the HTTP answer, the broadcast to every rank, the
    `rollback` event and the checkpoint's record all carry it, with no other change."""
    import importlib.util
    import sys
    from pathlib import Path

    from monitoring import protocol
    from pretrain import monitor_link
    from pretrain.parallel.distributed import DistEnv
    from pretrain.train.rollback import Rollbacks

    source = Path(protocol.__file__).read_text()
    anchor = "    lr_factor_steps: int | None = None\n"
    assert source.count(anchor) == 1
    spec = importlib.util.spec_from_loader("protocol_with_a_field", loader=None)
    changed = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, changed)
    exec(
        compile(source.replace(anchor, anchor + "    priority: int | None = None\n"), "x", "exec"),
        changed.__dict__,
    )

    record = changed.Rollback(decision=2, step=9, target="step_00000008", seed=5, priority=3)
    answer = json.loads(json.dumps(changed.Action("rollback", rollback=record).to_json()))
    assert answer["rollback"]["priority"] == 3
    monkeypatch.setattr(monitor_link, "Action", changed.Action)  # (one process: the broadcast is its own)
    assert monitor_link.broadcast_action(changed.Action.from_json(answer), "cpu").rollback == record
    event = changed.RollbackDecided(**dataclasses.asdict(record))
    line = changed.Event.from_json(json.loads(json.dumps(changed.strict_json(event.to_json()))))
    assert line.priority == 3 and changed.Rollback.of(line) == record
    rollbacks = Rollbacks(DistEnv(0, 0, 1), tmp_path, None, None, None, None, None)
    rollbacks.take_lr(record, target=8)
    assert rollbacks.state_dict()["rollback"]["priority"] == 3  # train_state.json `hooks.monitor`
    with pytest.raises(changed.ProtocolError, match="'priority' must be a int"):
        changed.Rollback(decision=2, step=9, target="t", seed=5, priority="high")


def test_an_answer_is_an_action_and_a_judgement_each_a_type_both_sides_use():
    """The service writes an answer as Action.to_json() | Judgement.to_json(); the trainer reads it
    back with split_answer. A NaN loss survives the JSON round trip; a malformed judgement is a
    ProtocolError, never a KeyError deep in the trainer's charting."""
    from monitoring.protocol import Judgement, split_answer

    judgement = Judgement(
        step=7,
        loss=float("nan"),
        grad_norm=2.5,
        level="rollback",
        findings=[{"kind": "nonfinite", "reason": "NaN loss"}],
        bands={"loss": None, "grad_norm": {"level": 1.0, "spread": 0.1, "threshold": 1.6}},
    )
    action = Action("rollback", rollback=a_rollback())
    wire = json.loads(json.dumps(action.to_json() | judgement.to_json(), allow_nan=False))
    got_action, got = split_answer(wire)
    assert got_action == action
    assert (got.step, got.grad_norm, got.level, got.findings, got.bands) == (
        7,
        2.5,
        "rollback",
        judgement.findings,
        judgement.bands,
    )
    assert math.isnan(got.loss)
    for broken in ({k: v for k, v in wire.items() if k != "judged"}, wire | {"verdict": "rollback"}):
        with pytest.raises(ProtocolError):
            split_answer(broken)


def one_of_each_event() -> list:
    from monitoring import protocol as p

    return [
        p.StepJudged(step=1, loss=float("nan"), grad_norm=2.5, action="rollback", level="rollback"),
        p.WarningRaised(step=2, reason="grad norm surge", findings=["grad_norm_surge"]),
        p.Anomaly(step=3, note="no checkpoint yet", reason="loss spike"),
        p.RollbackDecided(
            step=4,
            decision=1,
            reason="loss spike",
            finding="loss_spike",
            value=9.0,
            threshold=None,
            target="step_00000002",
            seed=7,
            lr_scale=0.5,
        ),
        p.RollbackApplied(
            step=2,
            tag="step_00000002",
            requested="step_00000002",
            seed=7,
            decision=1,
            decided_at=4,
            applied_at=5,
            matches_checkpoint=True,
            abandoned=["step_00000004"],
            windows=[3, 9],
            documents=[{"source": "prose", "record": 4}],
        ),
        p.RollbackCancelled(step=2, decision=2, reason="no intact checkpoint", tag="step_00000002"),
        p.UpdateSkipped(
            step=5, loss=30.0, grad_norm=4.0, reasons=["loss_spike"], loss_level=3.0, grad_norm_level=None
        ),
        p.CircuitBreaker(step=6, reason="3 rollbacks in 100 steps"),
        p.Restart(step=None, reason="exit status 1", restart=1, max_restarts=3, resume_from=None),
        p.JobStopped(step=None, saved=None, why="restarts used up", resume="pretrain launch ..."),
        p.CheckpointCorrupt(step=2, tag="step_00000002", reason="sha256", moved_to="/x/corrupt"),
        p.StopRequested(step=8, saved="step_00000008", requested_by=[{"rank": 0}]),
        p.RepeatsStopped(
            step=9, reason="loss spike", diagnosis="rollbacks kept repeating: ...", tried=[{"decision": 1}]
        ),
        p.LrLowered(step=6, decision=2, factor=0.5, until=10),
        p.LrRestored(step=11, decision=2, factor=0.5),
        p.NodeLost(step=12, host="node-b", ranks=[1], reason="its launcher exited with status 255"),
        p.NodeExcluded(step=12, host="node-b", ranks=[1], reason="ssh: connection refused"),
        p.NodeReplaced(step=12, old="node-b", new="node-c"),
        p.WorldResized(step=12, previous=2, size=1, accumulation=2),
        p.Straggler(step=20, rank=1, host="node-b", factor=1.9),
        p.MachineFault(step=21, ranks=[1], hosts=["node-b"], first=[[2.5, 3e19]], replay=[[2.5, 1.25]]),
        p.ReplicaMismatch(
            step=22, ranks=[1], hosts=["node-b"], tensors=["embed.weight"], rolled_back_to="step_00000020"
        ),
    ]


def test_every_kind_of_event_is_written_once_as_a_type_and_read_back_as_it(tmp_path):
    """events.jsonl's lines are the `Event` types of monitoring.protocol: every writer appends one,
    every reader gets it back equal (a NaN loss included); optional evidence is left out of the
    line when it is None; a line of a newer version's type is kept whole, a torn last line skipped,
    and a plain dict is refused at the writer."""
    from monitoring import protocol as p

    events = one_of_each_event()
    assert {type(e) for e in events} == set(p.EVENT_TYPES.values())  # one of each kind
    for event in events:
        p.append_event(tmp_path, event, sync=False)
    with open(tmp_path / p.EVENTS_FILE, "a") as f:
        f.write(json.dumps({"type": "from_the_future", "step": 9, "time": 1.0, "x": 1}) + "\n")
        f.write('{"type": "step", "st')  # a crash mid-write
    back = p.read_events(tmp_path)
    assert len(back) == len(events) + 1 and isinstance(back[-1], p.OtherEvent)
    for ours, theirs in zip(events, back, strict=False):
        if isinstance(ours, p.StepJudged):
            assert math.isnan(theirs.loss) and theirs == p.StepJudged(**{**vars(ours), "loss": theirs.loss})
        else:
            assert theirs == ours
    assert back[-1].payload["x"] == 1 and back[-1].to_json()["type"] == "from_the_future"
    lines = [json.loads(line) for line in (tmp_path / p.EVENTS_FILE).read_text().splitlines()[:-2]]
    assert [line["type"] for line in lines] == [e.type for e in events]
    assert "documents_unavailable" not in lines[4] and lines[4]["windows"] == [3, 9]
    assert "target" not in lines[5] and lines[5]["tag"] == "step_00000002"
    assert lines[0]["loss"] == "nan" and lines[8]["step"] is None
    resized = next(line for line in lines if line["type"] == "world_resized")
    assert (resized["from"], resized["to"], resized["accumulation"]) == (2, 1, 2)  # (keys, not fields)
    with pytest.raises(TypeError):
        p.append_event(tmp_path, {"type": "step", "step": 1})


@pytest.mark.parametrize(
    "payload, message",
    [
        ([], "must be a JSON object"),
        ({"decision": 1, "decided_at": 1, "applied": 1, "applied_at": 1}, "'applied' must be a bool"),
        ({"decision": -1, "decided_at": 1, "applied": True, "applied_at": 1}, "non-negative"),
        ({"decision": True, "decided_at": 1, "applied": True, "applied_at": 1}, "'decision' must be a int"),
        ({"decision": 1, "decided_at": 1, "applied": True}, "incomplete"),
        (
            {"decision": 1, "decided_at": 1, "applied": True, "applied_at": 1, "tag": 3},
            "'tag' must be a str or null",
        ),
        (
            {"decision": 1, "decided_at": 1, "applied": True, "applied_at": 1, "why": "x"},
            "unknown outcome fields",
        ),
    ],
)
def test_bad_outcomes_are_refused(payload, message):
    with pytest.raises(ProtocolError, match=message):
        Outcome.from_json(payload)
    good = {"decision": 1, "decided_at": 1, "applied": True, "applied_at": 2, "tag": "step_00000001"}
    assert Outcome.from_json(good).to_json() == good


def test_the_trainers_own_rollback_is_the_same_record_and_the_service_numbers_only_its_own(tmp_path):
    """The replica check's rollback is a `Rollback` with no decision number and no new seed: it
    reads back from its JSON (a checkpoint's `hooks.monitor`) and from its `rollback` event; a
    service started on that history goes on from its own decisions, none of them pending, and
    the outcome the trainer tells it, with no number, is a valid message."""
    from monitoring import protocol as p
    from monitoring.policy import Policy
    from pretrain.config import MonitorConfig

    ours = a_rollback(
        decision=None, seed=None, step=13, finding="replica_mismatch", reason="the replicas differ"
    )
    assert Rollback.from_json(json.loads(json.dumps(ours.to_json()))) == ours
    service = a_rollback(decision=4)
    applied = {
        "tag": "step_00000005",
        "requested": "step_00000005",
        "matches_checkpoint": True,
        "abandoned": [],
    }
    for record in (service, ours):
        p.append_event(tmp_path, p.RollbackDecided(**dataclasses.asdict(record)), sync=False)
        done = p.RollbackApplied(
            step=5,
            seed=record.seed,
            decision=record.decision,
            decided_at=record.step,
            applied_at=record.step,
            **applied,
        )
        p.append_event(tmp_path, done, sync=False)
    line = json.loads((tmp_path / p.EVENTS_FILE).read_text().splitlines()[2])
    assert (line["type"], line["decision"], line["seed"], line["finding"]) == (
        "rollback",
        None,
        None,
        "replica_mismatch",
    )
    policy = Policy(MonitorConfig(), 0)
    policy.restore(p.read_events(tmp_path))
    assert [d.decision for d in policy.decisions] == [4] and policy.pending is None
    told = Outcome(None, 13, True, 13, "step_00000005")
    assert Outcome.from_json(json.loads(json.dumps(told.to_json()))) == told


@pytest.mark.parametrize(
    "change, message",
    [
        ({"cause": "slow"}, "'cause' must be one of straggler, machine_faults"),
        ({"rank": -1}, "non-negative"),
        ({"kept": 3}, "'kept' must be a str or null"),
        ({"why": "x"}, "unknown move-off request fields"),
    ],
)
def test_a_request_to_move_a_host_off_is_one_typed_record(tmp_path, change, message):
    """RUN_DIR/monitor/replace.json, whoever asks (a straggler, machine faults) and with the
    supervisor's answer (`kept`): read back equal, refused when malformed (and then read as none)."""
    from monitoring.protocol import REPLACE_FILE, MoveOff, monitor_dir

    asked = MoveOff(host="node7", rank=1, step=30, reason="2 machine faults on node7", cause="machine_faults")
    assert "kept" not in asked.to_json()
    monitor_dir(tmp_path).mkdir()
    (monitor_dir(tmp_path) / REPLACE_FILE).write_text(json.dumps(asked.to_json()))
    assert MoveOff.read(tmp_path) == asked
    with pytest.raises(ProtocolError, match=message):
        MoveOff.from_json(asked.to_json() | change)
    (monitor_dir(tmp_path) / REPLACE_FILE).write_text(json.dumps(asked.to_json() | change))
    assert MoveOff.read(tmp_path) is None
