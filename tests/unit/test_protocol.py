import json
import math

import pytest

from monitoring.protocol import CONTINUE, Action, ProtocolError, StepMetrics


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


def test_actions():
    assert Action.from_json(CONTINUE.to_json()) == CONTINUE
    rollback = Action("rollback", tag="step_00000020", seed=7, lr_scale=0.5, reason="grad_norm spike")
    assert Action.from_json(json.loads(json.dumps(rollback.to_json()))) == rollback
    with pytest.raises(ProtocolError, match="needs a checkpoint"):
        Action("rollback", seed=3)
    with pytest.raises(ProtocolError, match="unknown action"):
        Action.from_json({"action": "explode"})
    with pytest.raises(ProtocolError, match="unknown action fields"):
        Action.from_json({"action": "continue", "extra": 1})
    with pytest.raises(ProtocolError, match="lr_scale"):
        Action("rollback", tag="t", seed=1, lr_scale=0)
    for bad in (
        {"lr_scale": "x"},
        {"tag": 5, "seed": 1},
        {"tag": "t", "seed": "s"},
        {"tag": "t", "seed": True},
    ):
        with pytest.raises(ProtocolError, match="must be a"):
            Action.from_json({"action": "rollback", "tag": "t", "seed": 1} | bad)


def test_the_kind_of_an_action_is_the_field_action_on_the_wire():
    rollback = Action("rollback", tag="step_00000020", seed=7)
    assert rollback.kind == "rollback"
    assert rollback.to_json() == {"action": "rollback", "tag": "step_00000020", "seed": 7, "lr_scale": 1.0}
    assert Action.from_json({"action": "stop", "reason": "r"}).kind == "stop"


def test_an_answer_is_an_action_and_a_judgement_each_a_type_both_sides_use():
    """The service writes an answer as Action.to_json() | Judgement.to_json(); the trainer reads it
    back with split_answer. A NaN loss survives the JSON round trip; a malformed judgement is a
    ProtocolError, never a KeyError deep in the trainer's charting."""
    from monitoring.protocol import Judgement, split_answer

    judgement = Judgement(
        7,
        float("nan"),
        2.5,
        "rollback",
        [{"kind": "nonfinite", "reason": "NaN loss"}],
        {"loss": None, "grad_norm": {"level": 1.0, "spread": 0.1, "threshold": 1.6}},
    )
    action = Action("rollback", tag="step_00000005", seed=3, decision=1, step=7)
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
