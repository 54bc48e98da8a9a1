"""The monitor's page (`monitoring/page.py`), rendered from the /status of a real `MonitorState`
driven with reports, outcomes and restarts as the trainer and the supervisor send them."""

import dataclasses
import re

import pytest

from monitoring.page import render_page
from monitoring.protocol import Outcome, Restart, RollbackApplied, append_event
from monitoring.service import MonitorState
from pretrain.config import MonitorConfig
from tests.unit.test_monitor import fake_checkpoint, metrics

CONFIG = MonitorConfig(warmup=8, window=32)


def loss_at(step: int) -> float:
    return 12.0 - 0.002 * step + 0.01 * (step % 3)


def report(state: MonitorState, step: int, loss: float | None = None, grad: float = 1.0) -> dict:
    return state.handle_metrics(metrics(step, loss=loss_at(step) if loss is None else loss, grad=grad))


def drill(run_dir) -> MonitorState:
    """The drill's first launch, as the service sees it: a 30x loss spike at step 45 rolled back to
    the checkpoint of step 40 (applied after step 47), the steps from 41 trained again up to 51,
    then a killed rank and a restart."""
    fake_checkpoint(run_dir, 40)
    state = MonitorState(run_dir, CONFIG)
    for step in range(1, 45):
        report(state, step)
    answer = report(state, 45, loss=282.7)
    assert answer["action"] == "rollback" and answer["rollback"]["target"] == "step_00000040"
    decided = answer["rollback"]
    for step in (46, 47):
        assert report(state, step)["verdict"]["level"] == "superseded"
    # What the trainer does on applying it (pretrain/monitor_link.py): the event, then the outcome.
    append_event(
        run_dir,
        RollbackApplied(
            step=40,
            tag="step_00000040",
            requested=decided["target"],
            seed=decided["seed"],
            decision=decided["decision"],
            decided_at=45,
            applied_at=47,
            matches_checkpoint=True,
            abandoned=[],
        ),
    )
    state.handle_outcome(Outcome(decided["decision"], 45, True, 47, "step_00000040"), None, None)
    for step in range(41, 52):
        assert report(state, step)["action"] == "continue"
    state.record_restart(
        Restart(step=51, reason="exit status 1", restart=1, max_restarts=3, resume_from="step_00000050")
    )
    return state


def loss_chart(page: str) -> str:
    return re.search(r'<svg[^>]*aria-label="loss[^"]*".*?</svg>', page, re.S).group(0)


def test_the_loss_chart_shows_the_value_judged_at_a_rolled_back_step(tmp_path):
    status = drill(tmp_path).status(series=True)
    assert all(p["loss"] < 13 for p in status["series"])  # the timeline that went on: no spike in it
    chart = loss_chart(render_page(status))
    marked = re.findall(r'<g class="rolled-back">.*?</g>', chart, re.S)
    assert len(marked) == 1 and "282.7 (rolled back)" in marked[0] and "step 45" in marked[0]
    axis = [float(v) for v in re.findall(r'<text x="2" y="\d+">([\d.]+)</text>', chart)]
    assert max(axis) < 20  # the axis keeps the normal range (and band); the spike is drawn at its top edge


def test_a_rolled_back_nan_is_marked_at_the_top_edge(tmp_path):
    fake_checkpoint(tmp_path, 10)
    state = MonitorState(tmp_path, CONFIG)
    for step in range(1, 13):
        report(state, step, loss=float("nan") if step == 12 else None)
    state.handle_outcome(Outcome(1, 12, True, 12, "step_00000010"), None, None)
    for step in range(11, 15):
        report(state, step)
    chart = loss_chart(render_page(state.status(series=True)))
    assert re.search(
        r'<g class="rolled-back"><title>step 12: loss nan judged, rolled back</title><path d="M[\d.]+,3 ',
        chart,
    )
    assert "nan (rolled back)" in chart


def test_a_rolled_back_value_is_kept_by_a_service_started_again(tmp_path):
    drill(tmp_path)
    again = MonitorState(tmp_path, CONFIG)  # the next launch's service, from RUN_DIR/events.jsonl
    assert "282.7 (rolled back)" in loss_chart(render_page(again.status(series=True)))


def test_restarts_recorded_by_an_earlier_service_are_listed_and_counted(tmp_path):
    drill(tmp_path)
    again = MonitorState(tmp_path, CONFIG)  # `pretrain launch` run again: a new service process
    for step in range(52, 56):
        report(again, step)
    status = again.status(series=True)
    assert [r["reason"] for r in status["restarts"]] == ["exit status 1"]
    assert [d["step"] for d in status["rollbacks_decided"]] == [45] and len(status["rollbacks"]) == 1
    page = render_page(status)
    assert "<dt>restarts</dt><dd>1</dd>" in page and "<dt>rollbacks applied</dt><dd>1</dd>" in page
    assert re.search(r"<tr><td>51</td><td>restart</td><td>exit status 1</td></tr>", page)


def test_a_restart_before_any_step_of_this_service_is_listed_at_the_last_judged_step(tmp_path):
    drill(tmp_path)
    again = MonitorState(tmp_path, CONFIG)
    # The supervisor's step is that of the last report to this process: none yet.
    again.record_restart(
        Restart(
            step=None, reason="hang: no first step for 600 s", restart=1, max_restarts=3, resume_from=None
        )
    )
    for step in range(52, 262):  # then more warnings after it than the page lists
        report(again, step, grad=2.0 if step % 4 == 0 else 1.0)
    status = again.status(series=True)
    assert status["restarts"][-1]["step"] == 51 and status["warnings"] > 50
    page = render_page(status)
    assert "<td>restart</td><td>hang: no first step for 600 s</td>" in page
    assert "<td>restart</td><td>exit status 1</td>" in page


def test_status_has_the_last_steps_tokens_per_second_and_the_last_50_steps_which_the_page_shows(tmp_path):
    state = MonitorState(tmp_path, CONFIG)
    for step in range(1, 62):  # 100 tokens a step: 1 s each for the first 11, then 0.1 s, the last 0.5 s
        step_time = 1.0 if step <= 11 else 0.5 if step == 61 else 0.1
        state.handle_metrics(dataclasses.replace(metrics(step), step_time=step_time))
    status = state.status()
    assert status["tokens_per_second"] == pytest.approx(100 / 0.5)  # the last step's
    # Steps 12-61: 5,000 tokens in 49 x 0.1 + 0.5 = 5.4 s (the slow steps before them left the window)
    assert status["tokens_per_second_last_50_steps"] == pytest.approx(5000 / 5.4)
    assert "<dt>tokens/s, last 50 steps</dt><dd>926</dd>" in render_page(status)
