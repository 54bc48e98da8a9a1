"""`pretrain bench optimizers`: AdamW against Muon (`optim.name: muon`, DeepSpeed's, for the
blocks' matrices; AdamW for the rest), each at its best learning rate, on one or more corpora.

The model, data, tokens, batch and schedule are `configs/ablation/transformer_pp.yaml`'s (the
demo's size: 4 layers, d_model 192, vocab 4096; 300 steps of 8 × 512 tokens, one process, bf16
ZeRO-2). Per corpus, AdamW is searched over `--adamw-lrs` (`optim.lr`) first; Muon is then
searched over `--muon-lrs` (`optim.muon_lr`), its AdamW half at AdamW's best rate. Muon trains
without clipping (`train.grad_clip=0`, as measured; the default clips the AdamW half only,
`pretrain/optim/muon.py`), AdamW with the config's (1.0). A run's best is its lowest final
evaluation loss. Each run is a real `pretrain train` process; runs that finished are not
repeated, so an interrupted sweep continues where it stopped.

What it reports per corpus: the final evaluation loss of each at equal steps; the steps Muon
needs to reach AdamW's final evaluation loss (read off its evaluation curve, linear between
evaluations) and their ratio to AdamW's steps; the time per step of each (and of Muon with the
other Newton–Schulz form), from `--timing-pairs` short runs of each at its best rate taken in
turn (AdamW, Muon, Muon, AdamW, ...), as the 20th percentile of their `train/step_time` (the
median too): on a machine shared with other work the quiet steps are the comparable ones; and
the wall-clock time to AdamW's final loss (steps × time per step). Writes OUT/optimizers.json and
OUT/optimizers.png.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

from pretrain.bench.ablation import corpus_name, final_loss, tokens_to_reach
from pretrain.bench.runs import finished, run_once
from pretrain.config import config_dir, load_config
from pretrain.errors import UserError
from pretrain.planning.flops import flops_per_token, newton_schulz_flops

CONFIG = "ablation/transformer_pp.yaml"
DEFAULT_ADAMW_LRS = (5e-4, 1e-3, 2e-3, 4e-3)
DEFAULT_MUON_LRS = (0.005, 0.01, 0.02, 0.04)
TARGET_STEP_RATIO, TARGET_TIME_RATIO = 0.75, 1.1  # issue 47's bar for Muon as the default


def config_path() -> Path:
    return config_dir() / CONFIG


def arm_overrides(name: str, lr: float, adamw_lr: float | None, muon: list[str]) -> list[str]:
    if name == "adamw":
        return ["optim.name=adamw", f"optim.lr={lr}"]
    return ["optim.name=muon", f"optim.lr={adamw_lr}", f"optim.muon_lr={lr}", "train.grad_clip=0", *muon]


def train_run(
    run_dir: Path, data_dir: Path, overrides: list[str], label: str, steps: int | None
) -> dict | None:
    """One `pretrain train` process (unless it already finished); its summary, or None."""
    extra = [f"data.dir={data_dir}", *overrides] + ([f"train.steps={steps}"] if steps else [])
    run_once("train", config_path(), run_dir, extra, label)
    summary = finished(run_dir)
    if summary is None:
        print(f"    {run_dir} did not complete: counted as diverged", file=sys.stderr, flush=True)
    return summary


def machine() -> dict:
    """Where the figures were measured: the GPU's name, or the CPU's model, and the versions."""
    import platform

    import deepspeed
    import torch

    if torch.cuda.is_available():
        device = torch.cuda.get_device_name()
    else:
        cpuinfo = Path("/proc/cpuinfo")
        names = (
            [
                line.split(":", 1)[1].strip()
                for line in cpuinfo.read_text().splitlines()
                if line.startswith("model name")
            ]
            if cpuinfo.is_file()
            else []
        )
        device = f"{names[0] if names else platform.processor()} ({len(names) or '?'} CPUs)"
    return {
        "device": device,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
    }


def step_times(run_dir: Path, skip: int = 3) -> list[float]:
    """The run's seconds per step (metrics.jsonl), its first `skip` steps left out (start-up)."""
    from pretrain.reporting.metrics import read_metrics

    return [
        r["train/step_time"] for r in read_metrics(run_dir) if r["step"] > skip and "train/step_time" in r
    ]


def steps_to_reach(curve: list[list[float]], target: float) -> float | None:
    """First step at which an evaluation curve [(step, loss)] reaches `target`."""
    return tokens_to_reach([tuple(point) for point in curve], target)


def sweep(arm: str, lrs, out: Path, data_dir: Path, adamw_lr, muon: list[str], steps, jobs: int) -> dict:
    """One run per learning rate, `jobs` at a time (a GPU with room for several)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(lr: float) -> list[list[float]]:
        overrides = arm_overrides(arm, lr, adamw_lr, muon)
        summary = train_run(out / arm / f"lr{lr:g}", data_dir, overrides, f"{arm} lr={lr:g}", steps)
        return [[e["step"], e["loss"]] for e in summary["eval"]] if summary else []

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        runs = dict(zip((f"{lr:g}" for lr in lrs), pool.map(one, lrs), strict=True))
    best = min(runs, key=lambda lr: final_loss(runs[lr]))
    return {"runs": runs, "best_lr": float(best), "best_final_loss": final_loss(runs[best])}


def timing(out: Path, data_dir: Path, arms: dict, ns_method: str, pairs: int, steps: int) -> dict:
    """Seconds per step of each arm at its best rate (and of Muon with the other Newton–Schulz
    form), over `pairs` short runs of each, taken in turn: the median and the 20th percentile of
    every step but each run's first 3 (the machine's quiet moments, where other work shares it)."""
    adamw_lr, muon_lr = arms["adamw"]["best_lr"], arms["muon"]["best_lr"]
    other = "standard" if ns_method == "gram" else "gram"
    variants = {
        "adamw": arm_overrides("adamw", adamw_lr, None, []),
        "muon": arm_overrides("muon", muon_lr, adamw_lr, [f"optim.muon_ns_method={ns_method}"]),
        f"muon_{other}": arm_overrides("muon", muon_lr, adamw_lr, [f"optim.muon_ns_method={other}"]),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for pair in range(pairs):
        for name, overrides in variants.items():
            run_dir = out / "timing" / f"{name}_{pair}"
            train_run(run_dir, data_dir, [*overrides, "eval.every=0"], f"timing {name} #{pair + 1}", steps)
            times[name] += step_times(run_dir)
    return {
        name: {
            "seconds_per_step": statistics.quantiles(t, n=5)[0],
            "median": statistics.median(t),
            "steps_timed": len(t),
        }
        for name, t in times.items()
    }


def run(
    sources: tuple[str, ...] = ("builtin:pydoc",),
    out: str | Path = "runs/optimizers",
    adamw_lrs: tuple[float, ...] = DEFAULT_ADAMW_LRS,
    muon_lrs: tuple[float, ...] = DEFAULT_MUON_LRS,
    steps: int | None = None,
    ns_method: str = "gram",
    timing_pairs: int = 3,
    timing_steps: int = 40,
    jobs: int = 1,
    as_json: bool = False,
) -> dict:
    from pretrain.data import prepare_corpus

    for name, lrs in (("--adamw-lrs", adamw_lrs), ("--muon-lrs", muon_lrs)):
        if not lrs or any(lr <= 0 for lr in lrs):
            raise UserError(f"{name}: give one or more positive learning rates")
    if steps is not None and steps < 1:
        raise UserError(f"--steps {steps} must be at least 1")
    if jobs < 1:
        raise UserError(f"--jobs {jobs} must be at least 1")
    cfg = load_config(config_path())
    muon = [f"optim.muon_ns_method={ns_method}"]
    result: dict = {
        "machine": machine(),
        "config": CONFIG,
        "steps": steps or cfg.train.steps,
        "ns_method": ns_method,
        "flops_per_token": flops_per_token(cfg.model, cfg.data.seq_len).total,
        "newton_schulz_flops_per_step": newton_schulz_flops(cfg.model, ns_method),
        "tokens_per_step": cfg.train.micro_batch_size * cfg.train.grad_accum * cfg.data.seq_len,
        "corpora": {},
    }
    times = None
    for source in sources:
        root = Path(out) / corpus_name(source)
        _, data_dir = prepare_corpus(
            source, root, announce=lambda line: print(line, file=sys.stderr, flush=True)
        )
        adamw = sweep("adamw", adamw_lrs, root, data_dir, None, muon, steps, jobs)
        arms = {
            "adamw": adamw,
            "muon": sweep("muon", muon_lrs, root, data_dir, adamw["best_lr"], muon, steps, jobs),
        }
        if times is None:  # the same model and batch on every corpus: timed on the first
            times = timing(root, data_dir, arms, ns_method, timing_pairs, timing_steps)
            times["corpus"] = corpus_name(source)
        corpus = {"source": source, "arms": arms, "timing": times}
        corpus |= compare(arms, times)
        result["corpora"][corpus_name(source)] = corpus
    result["meets_target"] = all(c["meets_target"] for c in result["corpora"].values())
    (Path(out) / "optimizers.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, Path(out) / "optimizers.png")
    print(json.dumps(result) if as_json else report(result))
    return result


def compare(arms: dict, times: dict) -> dict:
    """Muon against AdamW's final evaluation loss: steps, their ratio, time per step, wall-clock."""
    adamw, muon = arms["adamw"], arms["muon"]
    target = adamw["best_final_loss"]
    adamw_curve, muon_curve = (a["runs"][f"{a['best_lr']:g}"] for a in (adamw, muon))
    adamw_steps = adamw_curve[-1][0] if adamw_curve else None
    muon_steps = steps_to_reach(muon_curve, target) if math.isfinite(target) else None
    step_ratio = muon_steps / adamw_steps if muon_steps and adamw_steps else None
    time_ratio = times["muon"]["seconds_per_step"] / times["adamw"]["seconds_per_step"]
    seconds = {
        "adamw": adamw_steps * times["adamw"]["seconds_per_step"] if adamw_steps else None,
        "muon": muon_steps * times["muon"]["seconds_per_step"] if muon_steps else None,
    }
    meets = step_ratio is not None and step_ratio <= TARGET_STEP_RATIO and time_ratio <= TARGET_TIME_RATIO
    return {
        "target_loss": target,
        "steps_to_target": {"adamw": adamw_steps, "muon": muon_steps},
        "step_ratio": step_ratio,
        "time_per_step_ratio": time_ratio,
        "seconds_to_target": seconds,
        "meets_target": meets,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    corpora = result["corpora"]
    fig, axes = plt.subplots(2, len(corpora), figsize=(5.5 * len(corpora), 7.5), squeeze=False)
    colors = {"adamw": "tab:blue", "muon": "tab:red"}
    for column, corpus in enumerate(corpora.values()):
        curves, search = axes[0][column], axes[1][column]
        for arm, data in corpus["arms"].items():
            best = data["runs"][f"{data['best_lr']:g}"]
            curves.plot(
                [s for s, _ in best],
                [loss for _, loss in best],
                color=colors[arm],
                label=f"{arm}, lr {data['best_lr']:g}",
            )
            finals = [
                (float(lr), c[-1][1]) for lr, c in data["runs"].items() if c and math.isfinite(c[-1][1])
            ]
            search.plot(
                [lr for lr, _ in finals], [loss for _, loss in finals], "o-", color=colors[arm], label=arm
            )
        curves.axhline(
            corpus["target_loss"],
            color="gray",
            linestyle=":",
            label=f"AdamW's final {corpus['target_loss']:.3f}",
        )
        curves.set(xlabel="step", ylabel="evaluation loss", title=corpus["source"])
        curves.set_ylim(top=min(8.5, curves.get_ylim()[1]))
        curves.legend(fontsize=8)
        search.set(
            xscale="log",
            xlabel="peak learning rate (AdamW: optim.lr; Muon: optim.muon_lr)",
            ylabel="final evaluation loss",
        )
        search.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(result: dict) -> str:
    lines = [
        f"AdamW vs Muon ({result['config']}, {result['steps']} steps, Newton–Schulz {result['ns_method']})",
        "",
    ]
    lines.append(
        f"{'corpus':<16}{'arm':<7}{'best lr':>9}{'final loss':>12}{'steps to target':>17}{'s/step':>9}{'time to target':>16}"
    )
    for name, corpus in result["corpora"].items():
        for arm, data in corpus["arms"].items():
            steps = corpus["steps_to_target"][arm]
            seconds = corpus["seconds_to_target"][arm]
            lines.append(
                f"{name:<16}{arm:<7}{data['best_lr']:>9g}{data['best_final_loss']:>12.3f}"
                f"{(f'{steps:.0f}' if steps else '—'):>17}{corpus['timing'][arm]['seconds_per_step']:>9.3f}"
                f"{(f'{seconds:.0f} s' if seconds else '—'):>16}"
            )
        ratio = corpus["step_ratio"]
        lines.append(
            f"{'':<16}Muon: {f'{ratio:.2f}×' if ratio else 'never'} AdamW's steps to its final loss "
            f"{corpus['target_loss']:.3f}, {corpus['time_per_step_ratio']:.2f}× its time per step"
        )
        for name, timed in corpus["timing"].items():
            if name not in corpus["arms"] and name != "corpus":
                ratio = timed["seconds_per_step"] / corpus["timing"]["adamw"]["seconds_per_step"]
                lines.append(f"{'':<16}{name}: {timed['seconds_per_step']:.3f} s/step, {ratio:.2f}× AdamW's")
    verdict = "meets" if result["meets_target"] else "does not meet"
    lines += [
        "",
        f"Muon {verdict} the bar (≤ {TARGET_STEP_RATIO}× the steps at ≤ {TARGET_TIME_RATIO}× the time per step) on every corpus",
    ]
    return "\n".join(lines)
