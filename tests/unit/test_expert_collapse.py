"""The monitor's warning when a mixture of experts' routing collapses (monitoring/experts.py): the
decision as a table of reported loads, through the policy (no process, no file); the settings;
the report's `experts` on the wire; the service's event, page and counters. The loop with a real
service over HTTP, its routing forced off one expert: tests/unit/test_moe_hook.py."""

from __future__ import annotations

import pytest
import torch

from monitoring.policy import Policy
from monitoring.protocol import ProtocolError, StepMetrics
from pretrain.config import MonitorConfig, load_config
from pretrain.errors import ConfigError

STARVED = {"load_min": 0.01, "min_expert": 3, "top_share": 0.3, "top_expert": 2}
DOMINANT = {"load_min": 0.4, "min_expert": 0, "top_share": 0.8, "top_expert": 5}
HEALTHY = {"load_min": 0.7, "min_expert": 1, "top_share": 0.3, "top_expert": 2}


def report(step: int, *layers: dict) -> StepMetrics:
    """Step `step`'s report, with `layers` as {layer, ...loads} (layer 1 unless given)."""
    experts = [{"layer": 1} | layer for layer in layers]
    return StepMetrics(
        step=step, loss=3.0, grad_norm=1.0, lr=1e-3, step_time=0.1, tokens=step, experts=experts
    )


def warnings_of(reports: list[tuple], config: MonitorConfig | None = None) -> list[tuple[int, str, str]]:
    """The (step, level, reason) of every step with an expert_collapse finding, the reports judged in
    order with a checkpoint at step 1 to go back to (a rollback would find a target)."""
    policy = Policy(config or MonitorConfig())
    out = []
    for step, *layers in reports:
        verdict = policy.observe(report(step, *layers), ["step_00000001"])
        assert verdict.action.kind == "continue"  # never a rollback, never a stop
        collapsed = [f for f in verdict.findings if f.kind == "expert_collapse"]
        out += [(step, verdict.level, f.reason) for f in collapsed]
    return out


def run_of(*parts: tuple[int, dict]) -> list[tuple]:
    """Consecutive steps from 1: `count` reports of each `loads` in turn."""
    reports = []
    for count, loads in parts:
        reports += [(len(reports) + 1 + i, loads) for i in range(count)]
    return reports


@pytest.mark.parametrize(
    "case, reports, config, expected",
    [
        ("a starved expert 20 steps: one warning", run_of((20, STARVED)), {}, [20]),
        ("19 steps: none", run_of((19, STARVED), (5, HEALTHY)), {}, []),
        ("60 steps: still one", run_of((60, STARVED)), {}, [20]),
        ("recovered, then again: a second", run_of((25, STARVED), (1, HEALTHY), (20, STARVED)), {}, [20, 46]),
        ("a dominant expert", run_of((20, DOMINANT)), {}, [20]),
        ("starved, then dominant: one episode", run_of((10, STARVED), (10, DOMINANT)), {}, [20]),
        ("ignore", run_of((40, STARVED)), {"on_expert_collapse": "ignore"}, []),
        ("expert_collapse_steps=3", run_of((3, STARVED)), {"expert_collapse_steps": 3}, [3]),
        ("a load above expert_collapse_load", run_of((20, STARVED)), {"expert_collapse_load": 0.01}, []),
        ("a share under expert_collapse_share", run_of((20, DOMINANT)), {"expert_collapse_share": 0.9}, []),
    ],
)
def test_a_collapse_warns_once_per_episode_and_never_rolls_back(case, reports, config, expected):
    found = warnings_of(reports, MonitorConfig(**config))
    assert [step for step, _, _ in found] == expected, case
    assert all(level == "warn" for _, level, _ in found), case


def test_the_warning_names_the_layer_the_experts_and_what_to_do():
    starved_then_five = [(s, STARVED) for s in range(1, 11)] + [
        (s, STARVED | {"min_expert": 5}) for s in range(11, 21)
    ]
    ((_, _, reason),) = warnings_of(starved_then_five)
    assert reason.startswith("experts of layer 1 collapsed: experts 3, 5 starved (least load 0.01x the mean)")
    assert "for 20 steps in a row" in reason
    assert all(key in reason for key in ("model.moe.balance", "bias_rate", "aux_loss_coef"))
    ((_, _, reason),) = warnings_of(run_of((20, DOMINANT)))
    assert "layer 1 collapsed: expert 5 chosen by 0.8 of the tokens" in reason
    # two layers: each its own episode and warning; a healthy layer beside them none
    found = warnings_of([(s, STARVED, {"layer": 3} | DOMINANT, {"layer": 4} | HEALTHY) for s in range(1, 21)])
    assert [reason.split(":")[0] for _, _, reason in found] == [
        "experts of layer 1 collapsed",
        "experts of layer 3 collapsed",
    ]


def test_a_step_run_again_starts_the_count_over():
    """After a rollback (or a restart) the reports go back to an earlier step: another timeline."""
    reports = run_of((15, STARVED)) + [(step, STARVED) for step in range(6, 26)]
    assert [step for step, _, _ in warnings_of(reports)] == [25]


@pytest.mark.parametrize(
    "override, message",
    [
        ("on_expert_collapse=rollback", "monitor.on_expert_collapse='rollback' must be warn or ignore"),
        ("on_expert_collapse=stop", "monitor.on_expert_collapse='stop' must be warn or ignore"),
        ("expert_collapse_load=0", r"monitor.expert_collapse_load=0.0 must be in \(0, 1\)"),
        ("expert_collapse_load=1", r"monitor.expert_collapse_load=1.0 must be in \(0, 1\)"),
        ("expert_collapse_share=0", r"monitor.expert_collapse_share=0.0 must be in \(0, 1\]"),
        ("expert_collapse_share=1.5", r"monitor.expert_collapse_share=1.5 must be in \(0, 1\]"),
        ("expert_collapse_steps=0", "monitor.expert_collapse_steps=0 must be an integer >= 1"),
    ],
)
def test_the_settings_are_checked_in_one_line_each(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny", [f"monitor.{override}"])


def test_a_share_a_perfect_balance_reaches_is_refused_with_the_monitor_on():
    cfg = load_config("tiny-moe", ["monitor.enabled=true"])
    assert (cfg.monitor.on_expert_collapse, cfg.monitor.expert_collapse_load) == ("warn", 0.05)
    assert (cfg.monitor.expert_collapse_share, cfg.monitor.expert_collapse_steps) == (0.5, 20)
    with pytest.raises(ConfigError, match=r"top_k / experts = 0.5\): set it above"):
        load_config("tiny-moe", ["monitor.enabled=true", "model.moe.top_k=4"])
    load_config(
        "tiny-moe", ["monitor.enabled=true", "model.moe.top_k=4", "monitor.expert_collapse_share=0.75"]
    )
    load_config("tiny-moe", ["monitor.enabled=false", "model.moe.top_k=4"])  # (no monitor, no warning)


def test_the_reports_experts_cross_the_wire_and_malformed_ones_are_refused():
    sent = report(7, STARVED, {"layer": 2} | DOMINANT)
    assert StepMetrics.from_json(sent.to_json()) == sent
    payload = sent.to_json()
    for bad in (
        [{"layer": 1}],
        [{"layer": 1, **STARVED, "typo": 1}],
        [{"layer": -1, **STARVED}],
        [{"layer": 1, **STARVED, "load_min": "nan"}],
        [{"layer": 1, **STARVED, "top_share": -0.5}],
        [{"layer": 1, **STARVED, "top_expert": 2.5}],
        {"layer": 1},
    ):
        with pytest.raises(ProtocolError):
            StepMetrics.from_json(payload | {"experts": bad})


def test_the_service_records_the_warning_counts_it_and_shows_it(tmp_path):
    """What POST /v1/metrics runs: the `warning` event (its reason and findings), /status's
    warnings, the page's list of them and the Prometheus counters."""
    from prometheus_client import generate_latest

    from monitoring.page import render_page
    from monitoring.protocol import read_events
    from monitoring.service import MonitorState

    service = MonitorState(tmp_path, MonitorConfig(expert_collapse_steps=5))
    answers = [service.handle_metrics(report(step, STARVED)) for step in range(1, 9)]
    assert [a["verdict"]["level"] for a in answers].count("warn") == 1
    assert all(a["action"] == "continue" for a in answers)
    (warning,) = [e for e in read_events(tmp_path) if e.type == "warning"]
    assert warning.step == 5 and warning.findings == ["expert_collapse"]
    assert warning.reason.startswith("experts of layer 1 collapsed: expert 3 starved")
    status = service.status()
    assert status["warnings"] == 1 and status["warnings_recent"][0]["reason"] == warning.reason
    assert "experts of layer 1 collapsed" in render_page(service.status(series=True))
    text = generate_latest(service.registry).decode()
    assert "pretrain_warnings_total 1.0" in text
    assert 'pretrain_anomalies_total{rule="expert_collapse",series="experts/layer_1"} 1.0' in text


def test_expert_loads_are_the_hooks_metrics_per_layer():
    """The report's per-layer loads (plain Python on the agreed vote) against the hook's device
    metrics: their smallest load and largest share over layers are `moe/load_min`, `moe/top_share`."""
    from tests.unit.test_moe_hook import hook_on, one_step

    hook, model = hook_on()
    tokens = torch.randint(0, 97, (2, 3, 10))
    hook.link = Link()
    values = one_step(hook, model, tokens)
    step, layers = hook.link.noted
    assert step == 1 and [r["layer"] for r in layers] == [1, 2]
    assert min(r["load_min"] for r in layers) == pytest.approx(values["moe/load_min"].item())
    assert max(r["top_share"] for r in layers) == pytest.approx(values["moe/top_share"].item())
    for record in layers:
        counts = model.layers[record["layer"]].mlp.load
        assert counts[record["min_expert"]] == counts.min() and counts[record["top_expert"]] == counts.max()


class Link:
    def note_experts(self, step, layers):
        self.noted = (step, layers)
