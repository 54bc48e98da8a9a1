"""`pretrain bench stability`'s reading of runs (pretrain/bench/stability.py): where a run's loss
spiked, when the precursors warned (judged as the service judges them), and the calibration's
clean and fault runs. The runs themselves are real `pretrain train` / `pretrain launch` processes
(pretrain/bench/runs.py, the ablation's integration test); here their records are read.

tests/unit/data/diverging_run.jsonl: the first 132 steps of a real diverging run recorded by the
bench (the baseline of configs/ablation/transformer_pp.yaml at a peak learning rate of 1, warm-up
100 steps, micro-batch 4, the precursors measured at every step, on builtin:pydoc)."""

import json
import math
import statistics
from pathlib import Path

from monitoring.protocol import (
    RollbackApplied,
    RollbackDecided,
    StepJudged,
    UpdateSkipped,
    WarningRaised,
    append_event,
)
from pretrain.bench.stability import (
    analyse_run,
    calibration,
    first_spike,
    judge_series,
    would_skip,
)
from pretrain.reporting.metrics import read_metrics
from tests.helpers import assert_one_line_error

DIVERGING = Path(__file__).parent / "data" / "diverging_run.jsonl"


def _rows(losses):
    return [{"step": i + 1, "train/loss": loss, "train/grad_norm": 1.0} for i, loss in enumerate(losses)]


def test_the_spike_is_the_first_loss_above_twice_the_lowest_before_it_or_not_finite():
    assert first_spike(_rows([8.0, 7.0, 13.9, 6.0, 12.1])) == 5  # 12.1 > 2 × 6.0; 13.9 < 2 × 7.0
    assert first_spike(_rows([8.0, 7.0, math.nan, 30.0])) == 3
    assert first_spike(_rows([8.0, None])) == 2  # (a loss metrics.jsonl could not hold)
    assert first_spike(_rows([8.0, 7.0, 6.5])) is None


def test_a_precursor_warning_is_a_value_above_the_band_of_its_own_earlier_measurements():
    """The first precursor warning on the recorded run, against the band docs/monitoring.md states
    (median + 6 × 1.4826 · MAD of the last 64 measurements, judged after 8), computed here."""
    rows = [json.loads(line) for line in DIVERGING.open()]
    judged = judge_series(rows)
    warned = [step for step, kinds in judged if "instability_precursor" in kinds]
    assert warned, "the recorded run's precursors warned"
    first = warned[0]
    names = ("attn_logit_max", "logit_lse_max", "logit_abs_max", "update_ratio_max")

    def above_band(step: int, name: str) -> bool:
        history = [r[f"stability/{name}"] for r in rows if r["step"] < step][-64:]
        if len(history) < 8:
            return False
        level = statistics.median(history)
        spread = max(1.4826 * statistics.median(abs(x - level) for x in history), 0.02 * abs(level))
        return rows[step - 1][f"stability/{name}"] > level + 6 * spread

    # (every earlier value entered the bands: nothing before `first` warned)
    assert any(above_band(first, name) for name in names)
    assert not any(above_band(step, name) for step in range(1, first) for name in names)


def test_a_diverging_run_reads_as_its_spike_and_the_warnings_lead(tmp_path):
    run_dir = tmp_path / "lr1"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(DIVERGING.read_text())
    result = analyse_run(run_dir)
    rows = read_metrics(run_dir)
    losses = [r["train/loss"] for r in rows]
    spike = result["spike_step"]
    assert losses[spike - 1] > 2 * min(losses[: spike - 1])  # a spike ...
    assert all(losses[i] <= 2 * min(losses[:i]) for i in range(1, spike - 1))  # ... the first
    warned = [step for step, kinds in judge_series(rows) if "instability_precursor" in kinds]
    assert result["first_precursor_warning"] == warned[0] < spike - 50  # an early warning, not the spike's
    near = [step for step in warned if spike - 50 <= step <= spike]
    assert result["precursor_lead_steps"] == spike - near[0] > 0  # the first of the 50 steps before it
    assert result["completed"] is False and result["final_loss"] == math.inf  # it never finished
    assert result["precursor_measurements"] == len(rows)  # measured at every step
    assert result["attn_logit_max"] == max(r["stability/attn_logit_max"] for r in rows)


def _calibration_run(directory: Path, name: str, config: dict, events: list, final: float | None) -> None:
    run_dir = directory / name
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({"config": config}))
    rows = [
        {"step": s, "train/loss": 3.0, "train/grad_norm": 1.0}
        | ({"stability/attn_logit_max": 5.0} if s % 10 == 0 else {})
        for s in range(1, 101)
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for event in events:
        append_event(run_dir, event, sync=False)
    if final is not None:
        summary = {"completed": True, "step": 100, "eval": [{"step": 100, "loss": final}]}
        (run_dir / "train_summary.json").write_text(json.dumps(summary))


def test_the_calibrations_runs_give_false_warnings_and_the_cost_of_each_fault(tmp_path):
    off, on = tmp_path / "off", tmp_path / "on"
    judged = [StepJudged(step=s, loss=3.0, grad_norm=1.0, action="continue", level="ok") for s in (1, 2)]
    _calibration_run(
        off,
        "clean-tiny-code",
        {},
        [*judged, WarningRaised(step=50, reason="attn_logit_max 9 > 8", findings=["instability_precursor"])],
        4.0,
    )
    applied = RollbackApplied(
        step=40,
        tag="step_00000040",
        requested="step_00000040",
        seed=1,
        decision=1,
        decided_at=60,
        applied_at=60,
        matches_checkpoint=True,
        abandoned=[],
    )
    decided = RollbackDecided(
        step=60,
        decision=1,
        reason="loss spike",
        finding="loss_spike",
        value=150.0,
        threshold=6.0,
        target="step_00000040",
        seed=1,
        lr_scale=1.0,
    )
    spikes = {"faults.spike_steps": [60], "faults.spike_factor": 50.0}
    _calibration_run(off, "fault-loss-x50", spikes, [decided, applied], 4.1)
    skipped = UpdateSkipped(
        step=60, loss=150.0, grad_norm=50.0, reasons=["loss_spike"], loss_level=3.0, grad_norm_level=1.0
    )
    _calibration_run(on, "fault-loss-x50", spikes | {"monitor.skip_step": True}, [skipped], 4.2)
    _calibration_run(on, "fault-nan", {"faults.nan_steps": [60], "monitor.skip_step": True}, [], None)

    result = calibration([off, on])
    assert result["clean"] == {
        "runs": 1,
        "steps": 100,
        "rollbacks": 0,
        "warnings": 1,
        "precursor_measurements": 10,
        "precursor_warnings": 1,
        "would_skip": {"clean-tiny-code": []},
    }
    faults = {(f["fault"], f["skip_step"]): f for f in result["faults"]}
    assert faults["loss x50", False] | {"run": None} == {
        "run": None,
        "skip_step": False,
        "fault": "loss x50",
        "completed": True,
        "rollbacks": 1,
        "steps_retrained": 20,
        "updates_skipped": [],
        "final_loss": 4.1,
    }
    assert (faults["loss x50", True]["rollbacks"], faults["loss x50", True]["updates_skipped"]) == (0, [60])
    assert faults["nan", True]["completed"] is False and faults["nan", True]["final_loss"] is None


def test_bad_input_is_one_line(cli, tmp_path):
    for args, fragment in (
        (["--parts", "sweep,nope"], "--parts nope: choose among sweep,escalation,calibration"),
        (["--lrs", "1e-3,0"], "--lrs: give one or more positive learning rates"),
        (["--lrs", "fast"], "--lrs 'fast': give comma-separated numbers"),
        (["--steps", "0", "--parts", "sweep"], "--steps 0: must be a whole number >= 1"),
        (["--parts", "calibration"], "pass --calibration DIR"),
        (["--parts", "calibration", "--calibration", str(tmp_path / "none")], "no such directory"),
        (["--calibration", str(tmp_path / "none")], "no such directory"),  # (then a default part)
    ):
        assert_one_line_error(cli("bench", "stability", "--out", str(tmp_path / "out"), *args), fragment)
    assert not (tmp_path / "out").exists()  # nothing written


def test_would_skip_is_the_trainers_guard_on_the_recorded_series():
    """An outlier after the guard's 16 values is skipped, one before it is not; a NaN always is."""
    rows = [{"step": s, "train/loss": 3.0, "train/grad_norm": 1.0 + 0.01 * (s % 3)} for s in range(1, 41)]
    rows[9]["train/grad_norm"] = 5.0  # step 10: before min_count, judged only for being finite
    rows[24]["train/grad_norm"] = 3.5  # step 25: 3.5 > 3 × its median
    rows[29]["train/loss"] = 8.0  # step 30: 2.7 × its median, under the ratio
    rows[34]["train/loss"] = math.nan  # step 35
    assert would_skip(rows) == [25, 35]


def test_a_run_that_completed_or_that_the_monitor_stopped_is_not_run_again(tmp_path):
    from pretrain.bench.runs import ended, run_once

    cases = {
        "completed": {"completed": True, "step": 10},
        "stopped": {"completed": False, "step": 7, "stopped_by_monitor": "rollbacks kept repeating"},
        "interrupted": {"completed": False, "step": 5},  # (saved and stopped by a signal: resumed)
    }
    for name, summary in cases.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "train_summary.json").write_text(json.dumps(summary))
    assert ended(tmp_path / "completed")["step"] == 10 and ended(tmp_path / "stopped")["step"] == 7
    assert ended(tmp_path / "interrupted") is None and ended(tmp_path / "missing") is None
    # (no process is started for these two: the unit tier refuses subprocesses)
    assert run_once("train", "tiny", tmp_path / "completed", [], "") == 0
    assert run_once("launch", "tiny", tmp_path / "stopped", [], "") == 3
