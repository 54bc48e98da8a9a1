"""`pretrain bench stability`: the evidence for the stability ladder (docs/monitoring.md), from
real runs on this machine. Three parts (`--parts`; by default the first two, and the third when
`--calibration` names runs):

* **sweep**, the proxy experiment of Wortsman et al. 2023: the small model of
  `configs/ablation/transformer_pp.yaml` trained at each learning rate of `--lrs` on each corpus
  of `--corpora`, as it is (`baseline`) and with `model.qk_norm=true loss.z_loss=1e-4`
  (`qk_norm+z_loss`); one `pretrain train` process per run, no monitor, nothing to stop it. The
  final evaluation loss against the learning rate. Each run measures the instability precursors
  every `--precursors-every` steps; its recorded series (metrics.jsonl) is then judged by the
  service's own `Policy`, with its default bands and every finding only warned, step by step as
  the service would have: the first step the loss spikes (non-finite, or above `SPIKE_RATIO` ×
  the lowest loss so far) and how many steps before it the first `instability_precursor`
  warning of the `LEAD_WINDOW` steps before it came.
* **escalation**: the baseline at each of `--escalation-lrs` (rates that diverge; default 2) under
  `pretrain launch` (the monitoring service, rollbacks), once per arm of `ESCALATION`
  (`monitor.on_repeat` off, the default ladder, the ladder ending in a stop): how each ended, its
  rollbacks and learning-rate cuts, and its final loss against the sweep's best stable rate's.
* **calibration**: the run directories of `scripts/monitor_calibration.py` given with
  `--calibration` (its `clean` runs and its `faults` runs, with `monitor.skip_step` off and on):
  the precursors' warnings on the clean runs (false ones), the steps `monitor.skip_step` would have
  skipped on them (the trainer's own guard replayed on their series: false skips), and per
  injected fault with the skip off and on, the rollbacks, steps retrained, updates skipped and
  final loss.

Runs that finished are not repeated, so an interrupted bench continues where it stopped. Writes
OUT/stability.json and OUT/stability.png.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from monitoring.config import FINDINGS, ServiceConfig
from monitoring.policy import Policy
from monitoring.protocol import (
    PRECURSORS,
    LrLowered,
    RepeatsStopped,
    RollbackApplied,
    RollbackDecided,
    StepMetrics,
    UpdateSkipped,
    WarningRaised,
    read_events,
    strict_json,
)
from pretrain.bench.ablation import arm_config, corpus_name
from pretrain.bench.detection import has_faults, run_config
from pretrain.bench.runs import finished, run_once
from pretrain.errors import UserError
from pretrain.reporting.metrics import read_metrics
from pretrain.stability.precursors import PREFIX
from pretrain.stability.settings import SkipSettings

ARMS = {"baseline": [], "qk_norm+z_loss": ["model.qk_norm=true", "loss.z_loss=1e-4"]}
DEFAULT_LRS = (3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0)
DEFAULT_ESCALATION_LRS = (2.0,)  # the rate where the ladder made the difference (docs/monitoring.md)
PARTS = ("sweep", "escalation", "calibration")
SPIKE_RATIO = 2.0  # a loss this many times the lowest loss so far is the run's loss spike
LEAD_WINDOW = 50  # a precursor warning counts as the spike's when at most this many steps before it
# The escalation's arms: monitor.on_repeat off, the default ladder, and the ladder ending in a stop.
ESCALATION = {
    "off": "[]",
    "quarantine_lower_lr": "[quarantine,lower_lr]",
    "quarantine_lower_lr_stop": "[quarantine,lower_lr,stop]",
}
ESCALATION_COLORS = ("tab:red", "tab:green", "tab:orange")


# --------------------------------------------------------------------------- the sweep


def sweep_overrides(data_dir: Path, lr: float, settings: dict) -> list[str]:
    return [
        f"data.dir={data_dir}",
        f"optim.lr={lr}",
        f"train.steps={settings['steps']}",
        f"schedule.warmup_steps={settings['warmup']}",
        f"train.micro_batch_size={settings['micro_batch_size']}",
        f"eval.every={settings['eval_every']}",
        "logging.every=1",
        f"logging.precursors_every={settings['precursors_every']}",
    ]


def _number(value) -> float:
    return math.nan if value is None else float(value)


def _point(step: int, value) -> list:
    """A curve's point, to 5 significant digits (the curves are most of the JSON)."""
    value = _number(value)
    return [step, float(f"{value:.5g}") if math.isfinite(value) else value]


def first_spike(rows: list[dict], ratio: float = SPIKE_RATIO) -> int | None:
    """The first step whose loss is non-finite or above `ratio` × the lowest loss before it."""
    lowest = math.inf
    for row in rows:
        loss = _number(row["train/loss"])
        if not math.isfinite(loss) or loss > ratio * lowest:
            return row["step"]
        lowest = min(lowest, loss)
    return None


def judge_series(rows: list[dict]) -> list[tuple[int, list[str]]]:
    """Each step's findings as the service's `Policy` (default bands) finds them, every response
    turned into a warning so that the series is judged to its end as it was recorded."""
    config = ServiceConfig(**{f"on_{finding}": "warn" for finding in FINDINGS})
    judged = []
    policy = Policy(config)
    for row in rows:
        precursors = {name: _number(row[PREFIX + name]) for name in PRECURSORS if PREFIX + name in row}
        verdict = policy.observe(
            StepMetrics(
                step=row["step"],
                loss=_number(row["train/loss"]),
                grad_norm=_number(row["train/grad_norm"]),
                lr=float(row.get("train/lr") or 0.0),
                step_time=0.0,
                tokens=0,
                precursors=precursors,
            ),
            checkpoints=[],
        )
        judged.append((row["step"], [f.kind for f in verdict.findings]))
    return judged


def would_skip(rows: list[dict], config: SkipSettings | None = None) -> list[int]:
    """The steps `monitor.skip_step` (its defaults unless `config`) would have skipped on this
    recorded series: the trainer's own guard (pretrain/stability/skip_step.py) judging each step's loss and
    gradient norm, told not to act."""
    import torch

    from pretrain.stability.skip_step import SkipGuard, SkipOutcome

    config = config or SkipSettings()
    guard = SkipGuard.for_run(
        config.skip_ratio, config.skip_window, act=False, grad_norm_ratio=config.skip_grad_norm_ratio
    )
    steps = []
    for row in rows:
        guard.set_loss(torch.tensor(_number(row["train/loss"]), dtype=torch.float64))
        guard.judge(torch.tensor(_number(row["train/grad_norm"]), dtype=torch.float64))
        if SkipOutcome.of(guard.outcome().tolist()).outlier:
            steps.append(row["step"])
    return steps


def analyse_run(run_dir: Path) -> dict:
    """A sweep run's figures: its final loss (inf when it did not finish or ended non-finite), its
    loss spike and what the precursors said before it."""
    summary = finished(run_dir)
    rows = read_metrics(run_dir)
    evals = (summary or {}).get("eval") or []
    final = evals[-1]["loss"] if evals else math.inf
    final = final if final is not None and math.isfinite(final) else math.inf
    judged = judge_series(rows)
    warned = [step for step, kinds in judged if "instability_precursor" in kinds]
    measured = sum(any(PREFIX + name in row for name in PRECURSORS) for row in rows)
    spike = first_spike(rows)
    before = [step for step in warned if spike is not None and spike - LEAD_WINDOW <= step <= spike]
    losses = [_number(r["train/loss"]) for r in rows]
    return {
        "completed": summary is not None,
        "final_loss": final,
        "max_loss": max((v for v in losses if math.isfinite(v)), default=None),
        "spike_step": spike,
        "precursor_measurements": measured,
        "precursor_warnings": len(warned),
        "first_precursor_warning": warned[0] if warned else None,
        "precursor_lead_steps": spike - before[0] if before else None,
        "would_skip": would_skip(rows),
        "attn_logit_max": max(
            (_number(r[PREFIX + "attn_logit_max"]) for r in rows if PREFIX + "attn_logit_max" in r),
            default=None,
        ),
        "curve": [_point(r["step"], r["train/loss"]) for r in rows],
        "attn_logit_curve": [
            _point(r["step"], r[PREFIX + "attn_logit_max"]) for r in rows if PREFIX + "attn_logit_max" in r
        ],
    }


def sweep(corpora: list[str], lrs: tuple[float, ...], out: Path, settings: dict) -> dict:
    from pretrain.data import prepare_corpus

    result = {}
    for spec in corpora:
        name = corpus_name(spec)
        _, data_dir = prepare_corpus(
            spec, out / "corpora" / name, announce=lambda line: print(line, file=sys.stderr, flush=True)
        )
        arms = {}
        for arm, extra in ARMS.items():
            runs = {}
            for lr in lrs:
                run_dir = out / "sweep" / name / arm / f"lr{lr:g}"
                overrides = sweep_overrides(data_dir, lr, settings) + extra
                run_once("train", arm_config("transformer_pp"), run_dir, overrides, f"{name} {arm} lr={lr:g}")
                runs[f"{lr:g}"] = analyse_run(run_dir)
            arms[arm] = runs
        result[name] = {"source": spec, "data_dir": str(data_dir), "arms": arms}
    return result


def best_stable(sweep_result: dict, corpus: str) -> tuple[float, float] | None:
    """(lr, final loss) of the baseline's lowest final loss on `corpus`."""
    runs = sweep_result[corpus]["arms"]["baseline"]
    finite = [(float(lr), r["final_loss"]) for lr, r in runs.items() if math.isfinite(r["final_loss"])]
    return min(finite, key=lambda item: item[1]) if finite else None


# --------------------------------------------------------------------------- escalation


def launched_run(run_dir: Path, code: int) -> dict:
    """How a `pretrain launch` run ended, from its exit status, summary and events."""
    events = read_events(run_dir)
    summary = finished(run_dir)
    evals = (summary or {}).get("eval") or []
    stopped = [e for e in events if isinstance(e, RepeatsStopped)]
    return {
        "exit_status": code,
        "completed": summary is not None,
        "final_loss": evals[-1]["loss"] if evals else None,
        "rollbacks": sum(isinstance(e, RollbackDecided) for e in events),
        "rollbacks_applied": sum(isinstance(e, RollbackApplied) for e in events),
        "lr_lowered": [
            {"step": e.step, "factor": e.factor, "until": e.until} for e in events if isinstance(e, LrLowered)
        ],
        "diagnosis": stopped[0].diagnosis if stopped else None,
        "stopped_by": _stop_reason(run_dir) if summary is None else None,
        "curve": [_point(r["step"], r["train/loss"]) for r in read_metrics(run_dir)],
    }


def _stop_reason(run_dir: Path) -> str | None:
    """The last line of the launch's log that says why it ended."""
    log = run_dir.parent / f"{run_dir.name}.log"
    lines = (
        [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        if log.is_file()
        else []
    )
    return lines[-1][:300] if lines else None


def escalation(data_dir: Path, lr: float, out: Path, settings: dict) -> dict:
    common = [
        *sweep_overrides(data_dir, lr, settings),
        f"checkpoint.every={settings['checkpoint_every']}",
        "checkpoint.keep=4",
        "checkpoint.resume=fresh",
    ]
    result = {}
    for label, stages in ESCALATION.items():
        extra = [f"monitor.on_repeat={stages}"]
        run_dir = out / "escalation" / f"lr{lr:g}" / label
        code = run_once(
            "launch", arm_config("transformer_pp"), run_dir, common + extra, f"escalation {label} lr={lr:g}"
        )
        result[label] = launched_run(run_dir, code)
    return result


# --------------------------------------------------------------------------- the calibration's runs


def calibration(directories: list[Path]) -> dict:
    """Clean runs: precursor warnings (false ones) among the judged precursor measurements, and
    the steps `monitor.skip_step` would have skipped (false skips). Fault runs: per fault and
    skip_step setting, rollbacks, steps retrained, skips, final loss."""
    clean = {
        "runs": 0,
        "steps": 0,
        "rollbacks": 0,
        "warnings": 0,
        "precursor_measurements": 0,
        "precursor_warnings": 0,
        "would_skip": {},
    }
    faults = []
    for directory in directories:
        for run_dir in sorted(p for p in directory.glob("*") if (p / "run.json").is_file()):
            flat = run_config(run_dir)
            events = read_events(run_dir)
            summary = finished(run_dir)
            rows = read_metrics(run_dir)
            if not has_faults(flat):
                warnings = [e for e in events if isinstance(e, WarningRaised)]
                clean["runs"] += 1
                clean["steps"] += len(rows)
                clean["rollbacks"] += sum(isinstance(e, RollbackDecided) for e in events)
                clean["warnings"] += len(warnings)
                clean["precursor_measurements"] += sum(PREFIX + "attn_logit_max" in r for r in rows)
                clean["precursor_warnings"] += sum("instability_precursor" in w.findings for w in warnings)
                clean["would_skip"][run_dir.name] = would_skip(rows)
                continue
            applied = [e for e in events if isinstance(e, RollbackApplied)]
            evals = (summary or {}).get("eval") or []
            faults.append(
                {
                    "run": run_dir.name,
                    "skip_step": bool(flat.get("monitor.skip_step")),
                    "fault": _fault_label(flat),
                    "completed": summary is not None,
                    "rollbacks": len(applied),
                    "steps_retrained": sum((e.decided_at or e.step) - e.step for e in applied),
                    "updates_skipped": [e.step for e in events if isinstance(e, UpdateSkipped)],
                    "final_loss": evals[-1]["loss"] if evals else None,
                }
            )
    return {"clean": clean, "faults": faults}


def _fault_label(flat: dict) -> str:
    if flat.get("faults.nan_steps"):
        return "nan"
    if flat.get("faults.spike_steps"):
        return f"loss x{flat.get('faults.spike_factor', 50):g}"
    return f"grad x{flat.get('faults.grad_spike_factor', 50):g}"


# --------------------------------------------------------------------------- the bench


DEFAULTS = {
    "steps": 200,
    "warmup": 100,
    "micro_batch_size": 4,
    "eval_every": 50,
    "precursors_every": 2,
    "checkpoint_every": 10,
}


def run(
    corpora: tuple[str, ...] = ("builtin:pydoc",),
    out: str | Path = "runs/stability",
    lrs: tuple[float, ...] = DEFAULT_LRS,
    parts: tuple[str, ...] = PARTS,
    escalation_lrs: tuple[float, ...] = (),
    calibration_dirs: tuple[str, ...] = (),
    as_json: bool = False,
    **settings,
) -> dict:
    settings = DEFAULTS | {k: v for k, v in settings.items() if v is not None}
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise UserError(f"--parts {','.join(sorted(unknown))}: choose among {','.join(PARTS)}")
    if not lrs or any(not (math.isfinite(lr) and lr > 0) for lr in lrs):
        raise UserError("--lrs: give one or more positive learning rates")
    if any(not (math.isfinite(lr) and lr > 0) for lr in escalation_lrs):
        raise UserError("--escalation-lrs: give positive learning rates")
    for key, value in settings.items():
        if not (isinstance(value, int) and value >= 1):
            raise UserError(f"--{key.replace('_', '-')} {value}: must be a whole number >= 1")
    if "calibration" in parts and not calibration_dirs:
        raise UserError(
            "the calibration part reads runs: pass --calibration DIR (or leave it out of --parts)"
        )
    missing = [d for d in calibration_dirs if not Path(d).is_dir()]
    if missing:
        raise UserError(f"--calibration {missing[0]}: no such directory")
    out = Path(out)
    result: dict = {"settings": settings | {"lrs": list(lrs), "corpora": list(corpora)}, "arms": ARMS}
    if "sweep" in parts or "escalation" in parts:
        result["sweep"] = sweep(list(corpora), lrs, out, settings)
        result["precursor_lead"] = lead_table(result["sweep"])
    if "escalation" in parts:
        first = corpus_name(corpora[0])
        data_dir = Path(result["sweep"][first]["data_dir"])
        stable = best_stable(result["sweep"], first)
        result["escalation"] = {
            "corpus": first,
            "stable": {"lr": stable[0], "final_loss": stable[1]} if stable else None,
            "runs": {
                f"{lr:g}": escalation(data_dir, lr, out, settings)
                for lr in escalation_lrs or DEFAULT_ESCALATION_LRS
            },
        }
    if "calibration" in parts:
        result["calibration"] = calibration([Path(d) for d in calibration_dirs])
    out.mkdir(parents=True, exist_ok=True)
    (out / "stability.json").write_text(json.dumps(strict_json(result), separators=(",", ":")) + "\n")
    if "sweep" in result:
        plot(result, out / "stability.png")
    print(json.dumps(strict_json(result)) if as_json else report(result))
    return result


def lead_table(sweep_result: dict) -> list[dict]:
    """Every sweep run whose loss spiked: where, and how many steps earlier a precursor warned."""
    rows = []
    for corpus, data in sweep_result.items():
        for arm, runs in data["arms"].items():
            for lr, r in runs.items():
                if r["spike_step"] is not None:
                    rows.append(
                        {
                            "corpus": corpus,
                            "arm": arm,
                            "lr": float(lr),
                            "spike_step": r["spike_step"],
                            "first_precursor_warning": r["first_precursor_warning"],
                            "lead_steps": r["precursor_lead_steps"],
                        }
                    )
    return rows


# --------------------------------------------------------------------------- what it shows


def report(result: dict) -> str:
    lines = []
    for data in result.get("sweep", {}).values():
        lrs = list(next(iter(data["arms"].values())))
        lines.append(f"final evaluation loss on {data['source']} ({result['settings']['steps']} steps)")
        lines.append(f"  {'learning rate':<16}" + "".join(f"{lr:>10}" for lr in lrs))
        for arm, runs in data["arms"].items():
            lines.append(f"  {arm:<16}" + "".join(f"{_loss(runs[lr]['final_loss']):>10}" for lr in lrs))
        lines.append("")
    if result.get("precursor_lead"):
        lines.append(
            "loss spikes (loss non-finite or above 2x its lowest so far) and the first precursor warning"
        )
        for r in result["precursor_lead"]:
            lead = r["lead_steps"]
            said = f"{lead} steps before" if lead is not None else "no precursor warning before it"
            lines.append(
                f"  {r['corpus']} {r['arm']} lr={r['lr']:g}: spike at step {r['spike_step']}, {said}"
            )
        lines.append("")
    esc = result.get("escalation")
    if esc:
        lines.append(f"diverging learning rates under the monitor ({esc['corpus']}, the baseline)")
        for lr, runs in esc["runs"].items():
            for label in ESCALATION:
                r = runs[label]
                ended = "completed" if r["completed"] else f"stopped (exit {r['exit_status']})"
                lines.append(
                    f"  lr {lr:<6} {label:<26} {ended}, {r['rollbacks']} rollbacks, "
                    f"{len(r['lr_lowered'])} learning-rate cuts, final loss {_loss(r['final_loss'])}"
                )
        if esc.get("stable"):
            lines.append(
                f"  the best stable rate ({esc['stable']['lr']:g}): final loss {_loss(esc['stable']['final_loss'])}"
            )
        lines.append("")
    cal = result.get("calibration")
    if cal:
        c = cal["clean"]
        lines.append(
            f"clean calibration runs: {c['runs']} runs, {c['steps']} steps, {c['rollbacks']} rollbacks, {c['warnings']} warnings, "
            f"{c['precursor_warnings']} precursor warnings in {c['precursor_measurements']} measurements"
        )
        would = {name: steps for name, steps in c["would_skip"].items() if steps}
        lines.append(
            f"  skip_step (defaults) would have skipped {sum(map(len, would.values()))} of their steps"
            + (": " + "; ".join(f"{name} {steps}" for name, steps in would.items()) if would else "")
        )
        for f in cal["faults"]:
            lines.append(
                f"  {f['fault']:<10} skip_step {'on ' if f['skip_step'] else 'off'}: {f['rollbacks']} rollbacks, "
                f"{f['steps_retrained']} steps retrained, {len(f['updates_skipped'])} skipped, "
                f"final loss {_loss(f['final_loss'])}"
            )
    return "\n".join(lines).rstrip()


def _loss(value) -> str:
    return "-" if value is None else "diverged" if not math.isfinite(value) else f"{value:.3f}"


def plot(result: dict, path: Path) -> None:
    """Three panels: the sweep's loss against the learning rate, a precursor's lead before a
    spike, and the escalation's runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (sweep_ax, lead_ax, esc_ax) = plt.subplots(1, 3, figsize=(16, 4.5))
    _plot_sweep(result, sweep_ax)
    _plot_precursor_lead(result, lead_ax)
    _plot_escalation(result, esc_ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_sweep(result: dict, sweep_ax) -> None:
    styles = {"baseline": ("tab:red", "o-"), "qk_norm+z_loss": ("tab:blue", "s--")}
    ceiling = 0.0
    for data in result["sweep"].values():
        for runs in data["arms"].values():
            finite = [r["final_loss"] for r in runs.values() if math.isfinite(r["final_loss"])]
            ceiling = max([ceiling, *finite])
    for i, (corpus, data) in enumerate(result["sweep"].items()):
        for arm, runs in data["arms"].items():
            color, style = styles[arm]
            lrs = [float(lr) for lr in runs]
            losses = [
                r["final_loss"] if math.isfinite(r["final_loss"]) else ceiling * 1.05 for r in runs.values()
            ]
            sweep_ax.plot(lrs, losses, style, color=color, alpha=1 - 0.45 * i, label=f"{arm}, {corpus}")
    sweep_ax.set(
        xscale="log",
        xlabel="peak learning rate",
        ylabel="final evaluation loss",
        title="the proxy: loss against learning rate",
    )
    sweep_ax.legend(fontsize=7)


def _plot_precursor_lead(result: dict, lead_ax) -> None:
    spiked = [r for r in result.get("precursor_lead", []) if r["arm"] == "baseline"]
    if spiked:
        pick = max(spiked, key=lambda r: (r["lead_steps"] is not None, -r["lr"]))
        run = result["sweep"][pick["corpus"]]["arms"]["baseline"][f"{pick['lr']:g}"]
        steps, losses = zip(*run["curve"], strict=True)
        lead_ax.plot(
            steps, losses, color="tab:red", label=f"baseline loss, lr {pick['lr']:g}, {pick['corpus']}"
        )
        lead_ax.axvline(
            pick["spike_step"], color="black", linestyle=":", label=f"loss spike (step {pick['spike_step']})"
        )
        if run.get("attn_logit_curve"):
            logits = lead_ax.twinx()
            steps, values = zip(*run["attn_logit_curve"], strict=True)
            logits.plot(steps, values, color="tab:purple", alpha=0.6, linewidth=1)
            logits.set(yscale="log", ylabel="largest attention logit (purple)")
        if pick["lead_steps"] is not None:
            warned = pick["spike_step"] - pick["lead_steps"]
            lead_ax.axvline(warned, color="tab:orange", label=f"its first precursor warning (step {warned})")
        lead_ax.set(
            xlabel="step",
            ylabel="training loss",
            yscale="log",
            title="a precursor's warning before the spike",
        )
        lead_ax.legend(fontsize=7)


def _plot_escalation(result: dict, esc_ax) -> None:
    esc = result.get("escalation")
    if esc:
        for i, (lr, runs) in enumerate(esc["runs"].items()):
            for label, color in zip(ESCALATION, ESCALATION_COLORS, strict=True):
                curve = runs[label]["curve"]
                if curve:
                    steps, losses = zip(*curve, strict=True)
                    ended = "completed" if runs[label]["completed"] else "stopped"
                    esc_ax.plot(
                        steps,
                        losses,
                        color=color,
                        linestyle=("-", "--", ":")[i % 3],
                        label=f"lr {lr}, {label} ({ended})",
                    )
        if esc.get("stable"):
            esc_ax.axhline(
                esc["stable"]["final_loss"],
                color="gray",
                linestyle=":",
                label=f"stable lr {esc['stable']['lr']:g}: final eval loss",
            )
        esc_ax.set(
            xlabel="step", ylabel="training loss", yscale="log", title="escalation when rollbacks repeat"
        )
        esc_ax.legend(fontsize=7)
