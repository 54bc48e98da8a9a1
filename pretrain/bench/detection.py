"""`pretrain bench detection RUN_DIR...`: the monitor's false alarms and detections, from real runs.

For every run directory given (runs made with `pretrain launch`, e.g. by
scripts/monitor_calibration.py), two kinds of figures:

* **What the monitor did**, from RUN_DIR/events.jsonl: steps judged, warnings and rollbacks
  decided. For a clean run (no `faults.*` in run.json) these are false alarms, reported per
  1,000 steps. For a run with injected faults: whether each injected step (RUN_DIR/faults_fired.json)
  was rolled back, warned about, or not flagged.
* **Replay** of the same policy, with the monitor settings the run had (`--defaults`: the
  default settings), on each clean run's
  recorded series (RUN_DIR/metrics.jsonl, the values the monitor judged): at every
  `--every`-th step after the warm-up, the step's loss and gradient norm are replaced by an
  injected fault (a loss spike of factor f multiplies both, as `faults.spike_factor` does; a
  gradient-only spike multiplies the gradient norm alone, as `faults.grad_spike_factor` does;
  NaN), the detector judges it with the window it had there, and the response is counted.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

from monitoring.config import SettingError
from monitoring.policy import Policy
from monitoring.protocol import (
    RollbackApplied,
    RollbackDecided,
    StepJudged,
    StepMetrics,
    WarningRaised,
    read_events,
)
from pretrain.config import MonitorConfig
from pretrain.errors import UserError
from pretrain.reporting.metrics import read_metrics

FACTORS = (1.5, 2.0, 3.0, 5.0, 50.0)


def run_config(run_dir: Path) -> dict:
    path = run_dir / "run.json"
    if not path.is_file():
        raise UserError(f"{run_dir} has no run.json: give run directories of `pretrain launch` runs")
    return json.loads(path.read_text())["config"]


def _monitor_config(flat: dict) -> MonitorConfig:
    known = MonitorConfig.__dataclass_fields__
    try:
        return MonitorConfig(
            **{
                k.removeprefix("monitor."): v
                for k, v in flat.items()
                if k.startswith("monitor.") and k.removeprefix("monitor.") in known
            }
        )
    except SettingError as exc:
        raise UserError(f"a run's run.json: {exc}") from None


def has_faults(flat: dict) -> bool:
    return any(flat.get(f"faults.{key}") for key in ("spike_steps", "grad_spike_steps", "nan_steps"))


def _series(run_dir: Path) -> list[tuple[float, float]]:
    rows = read_metrics(run_dir)
    return [
        (float(r["train/loss"]), float(r["train/grad_norm"] if r["train/grad_norm"] is not None else "nan"))
        for r in rows
    ]


def _judge(policy: Policy, step: int, loss: float, grad_norm: float) -> str:
    """The service's own policy's verdict on one step: "rollback" (or "stop"), "warn" or "none"."""
    metrics = StepMetrics(step=step, loss=loss, grad_norm=grad_norm, lr=0.0, step_time=0.0, tokens=0)
    level = policy.observe(metrics, checkpoints=[]).level
    return level if level in ("rollback", "stop", "warn") else "none"


def replay(series: list[tuple[float, float]], config: MonitorConfig, every: int) -> dict:
    """Responses to faults injected into a recorded clean series, and to the series itself, as
    the service's `Policy` gives them (judged with no checkpoint to go back to: a rollback is
    decided, with nothing to go back to, and the series goes on)."""
    policy = Policy(config)
    counts: dict[str, dict[str, int]] = {}
    clean = {"warn": 0, "rollback": 0, "stop": 0}
    injections = [(f"loss x{f:g}", f, f) for f in FACTORS] + [(f"grad x{f:g}", 1.0, f) for f in FACTORS]
    injections.append(("nan", math.nan, math.nan))
    for i, (loss, grad_norm) in enumerate(series):
        step = i + 1
        if i >= config.warmup and i % every == 0:
            for name, loss_factor, grad_factor in injections:
                response = _judge(copy.deepcopy(policy), step, loss * loss_factor, grad_norm * grad_factor)
                bucket = counts.setdefault(name, {"trials": 0, "rollback": 0, "warn": 0, "none": 0})
                bucket["trials"] += 1
                bucket["rollback" if response in ("rollback", "stop") else response] += 1
        response = _judge(policy, step, loss, grad_norm)
        if response in clean:
            clean[response] += 1
    return {"steps": len(series), "clean": clean, "injected": counts}


def _observed(run_dir: Path) -> dict:
    events = read_events(run_dir)
    steps = sum(isinstance(e, StepJudged) for e in events)
    warned = {e.step for e in events if isinstance(e, WarningRaised)}
    decided = {e.step for e in events if isinstance(e, RollbackDecided)}
    out = {
        "steps_judged": steps,
        "warnings": sum(isinstance(e, WarningRaised) for e in events),
        "rollbacks": sum(isinstance(e, RollbackDecided) for e in events),
        "rollbacks_applied": sum(isinstance(e, RollbackApplied) for e in events),
    }
    fired_path = run_dir / "faults_fired.json"
    if fired_path.is_file():
        out["faults"] = {}
        for fault in json.loads(fired_path.read_text()):
            kind, _, step = fault.partition(":")
            step = int(step)
            if kind in ("spike", "grad_spike", "nan"):
                out["faults"][fault] = (
                    "rollback" if step in decided else "warn" if step in warned else "not_flagged"
                )
    return out


def run(run_dirs: list[str], every: int = 5, as_json: bool = False, defaults: bool = False) -> dict:
    if not run_dirs:
        raise UserError("give at least one run directory")
    result = {"runs": {}, "replay": {}}
    for name in run_dirs:
        run_dir = Path(name)
        flat = run_config(run_dir)
        observed = _observed(run_dir)
        observed["clean"] = not has_faults(flat)
        if not observed["clean"]:
            observed["fault_factors"] = {
                "spike": flat.get("faults.spike_factor"),
                "grad_spike": flat.get("faults.grad_spike_factor"),
            }
        result["runs"][run_dir.name] = observed
        if observed["clean"]:
            config = MonitorConfig() if defaults else _monitor_config(flat)
            result["replay"][run_dir.name] = replay(_series(run_dir), config, every)
    result["summary"] = summarize(result)
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)
    return result


def summarize(result: dict) -> dict:
    clean = [r for r in result["runs"].values() if r["clean"]]
    steps = sum(r["steps_judged"] for r in clean)
    summary = {
        "clean_runs": len(clean),
        "clean_steps": steps,
        "warnings_per_1000_clean_steps": 1000 * sum(r["warnings"] for r in clean) / steps if steps else None,
        "rollbacks_per_1000_clean_steps": 1000 * sum(r["rollbacks"] for r in clean) / steps
        if steps
        else None,
    }
    injected: dict[str, dict[str, int]] = {}
    for rep in result["replay"].values():
        for name, counts in rep["injected"].items():
            total = injected.setdefault(name, {"trials": 0, "rollback": 0, "warn": 0, "none": 0})
            for key, value in counts.items():
                total[key] += value
    summary["replay"] = injected
    summary["replay_clean"] = {
        key: sum(rep["clean"][key] for rep in result["replay"].values())
        for key in ("warn", "rollback", "stop")
    }
    real: dict[str, dict[str, int]] = {}
    for run in result["runs"].values():
        for fault, outcome in (run.get("faults") or {}).items():
            kind = fault.partition(":")[0]
            factor = (run.get("fault_factors") or {}).get(kind)
            label = "nan" if kind == "nan" else f"{'loss' if kind == 'spike' else 'grad'} x{factor:g}"
            bucket = real.setdefault(label, {"injected": 0, "rollback": 0, "warn": 0, "not_flagged": 0})
            bucket["injected"] += 1
            bucket[outcome] += 1
    summary["real_faults"] = real
    return summary


def print_table(result: dict) -> None:
    s = result["summary"]
    print("what the monitor did (events.jsonl):")
    print(f"  {'run':<34} {'steps':>6} {'warnings':>9} {'rollbacks':>10}")
    for name, r in result["runs"].items():
        print(f"  {name:<34} {r['steps_judged']:>6} {r['warnings']:>9} {r['rollbacks']:>10}")
    if s["clean_steps"]:
        print(
            f"clean runs: {s['clean_runs']}, {s['clean_steps']} steps judged: "
            f"{s['warnings_per_1000_clean_steps']:.2f} warnings and "
            f"{s['rollbacks_per_1000_clean_steps']:.2f} rollbacks per 1,000 steps"
        )
    if s["real_faults"]:
        print("injected faults in real runs:")
        for label, b in sorted(s["real_faults"].items()):
            print(
                f"  {label:<10} {b['rollback']}/{b['injected']} rolled back, {b['warn']} warned, {b['not_flagged']} not flagged"
            )
    if s["replay"]:
        clean = s["replay_clean"]
        print(
            f"replay of the clean series with these settings: {clean['warn']} warnings, "
            f"{clean['rollback'] + clean['stop']} rollbacks in {s['clean_steps']} steps"
        )
        print("replay on the clean runs' recorded series (share of injected steps):")
        print(f"  {'fault':<10} {'trials':>7} {'rollback':>9} {'warn':>7} {'none':>7}")
        for label, b in s["replay"].items():
            n = b["trials"]
            print(
                f"  {label:<10} {n:>7} {100 * b['rollback'] / n:>8.1f}% {100 * b['warn'] / n:>6.1f}% "
                f"{100 * b['none'] / n:>6.1f}%"
            )
