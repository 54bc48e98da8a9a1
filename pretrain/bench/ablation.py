"""`pretrain bench ablation`: how much compute the Llama recipe ("Transformer++": pre-RMSNorm,
RoPE, SwiGLU) saves over the original Transformer recipe (post-LayerNorm, sinusoidal positions,
ReLU) to reach the same evaluation loss.

The two arms are `configs/ablation/transformer_pp.yaml` and `configs/ablation/original.yaml`: the
same parameter count (within 0.05%), data, tokens, batch and schedule; only the architecture
switches differ. Each arm gets the same learning-rate search: one full run per learning rate in
`--lrs`, each a real `pretrain train` process. An arm's best run is the one with the lowest final
evaluation loss. The compute an arm needs to reach a loss is read off its best run's evaluation
curve (linear between evaluations) times the training FLOPs per token of `pretrain/planning/flops.py`; the
target loss is the higher of the two best final losses, the loss both arms reach.

Runs that finished are not repeated, so an interrupted sweep continues where it stopped. Writes
OUT/ablation.json (every curve and the result) and OUT/ablation.png (the curves).
"""

from __future__ import annotations

import itertools
import json
import math
import re
import sys
from pathlib import Path

from pretrain.bench.runs import finished, run_once
from pretrain.config import config_dir, load_config
from pretrain.errors import UserError
from pretrain.planning.flops import flops_per_token

ARMS = {
    "transformer_pp": "Transformer++ (pre-RMSNorm, RoPE, SwiGLU)",
    "original": "original (post-LN, sinusoidal, ReLU)",
}
DEFAULT_LRS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2)


def corpus_name(spec: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(spec.removeprefix("builtin:")).stem) or "corpus"


def arm_config(arm: str) -> Path:
    return config_dir() / "ablation" / f"{arm}.yaml"


def train_run(
    arm: str, lr: float, run_dir: Path, data_dir: Path, steps: int | None, eval_every: int | None
) -> list[dict]:
    """One `pretrain train` process (unless it already finished); returns its evaluation curve."""
    overrides = [f"data.dir={data_dir}", f"optim.lr={lr}"]
    if steps is not None:
        overrides.append(f"train.steps={steps}")
    if eval_every is not None:
        overrides.append(f"eval.every={eval_every}")
    run_once("train", arm_config(arm), run_dir, overrides, f"{arm} lr={lr:g}")
    summary = finished(run_dir)
    if summary is None:
        print(f"    {run_dir} did not complete: counted as diverged", file=sys.stderr, flush=True)
        return []
    return summary["eval"]


def final_loss(curve: list[list[float]]) -> float:
    """The last evaluation loss of a (tokens, loss) curve; inf for a run that failed or diverged."""
    loss = curve[-1][1] if curve else math.inf
    return loss if math.isfinite(loss) else math.inf


def tokens_to_reach(curve: list[tuple[int, float]], target: float) -> float | None:
    """First token count at which the curve (tokens, loss) reaches `target`, linear between points."""
    for (t0, l0), (t1, l1) in itertools.pairwise(curve):
        if l1 <= target:
            return t1 if l0 == l1 else t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
    return None


def parse_lrs(text: str) -> tuple[float, ...]:
    """`--lrs 1e-3,3e-3` as numbers."""
    try:
        return tuple(float(v) for v in text.split(","))
    except ValueError:
        raise UserError(f"--lrs {text!r}: give comma-separated numbers, such as 1e-3,3e-3") from None


def run(
    source: str = "builtin:pydoc",
    out: str | Path = "runs/ablation",
    lrs: tuple[float, ...] = DEFAULT_LRS,
    steps: int | None = None,
    eval_every: int | None = None,
    as_json: bool = False,
) -> dict:
    from pretrain.data import prepare_corpus

    if not lrs or any(lr <= 0 for lr in lrs):
        raise UserError("--lrs: give one or more positive learning rates")
    if steps is not None and steps < 1:
        raise UserError(f"--steps {steps} must be at least 1")
    out = Path(out) / corpus_name(source)
    _, data_dir = prepare_corpus(source, out, announce=lambda line: print(line, file=sys.stderr, flush=True))
    result: dict = {"source": source, "lrs": list(lrs), "arms": {}}
    for arm, label in ARMS.items():
        cfg = load_config(arm_config(arm))
        tokens_per_step = cfg.train.micro_batch_size * cfg.train.grad_accum * cfg.data.seq_len
        runs = {}
        for lr in lrs:
            curve = train_run(arm, lr, out / arm / f"lr{lr:g}", data_dir, steps, eval_every)
            runs[f"{lr:g}"] = [[e["step"] * tokens_per_step, e["loss"]] for e in curve]
        best = min(runs, key=lambda lr: final_loss(runs[lr]))
        result["arms"][arm] = {
            "label": label,
            "flops_per_token": flops_per_token(cfg.model, cfg.data.seq_len).total,
            "runs": runs,
            "best_lr": float(best),
            "best_final_loss": final_loss(runs[best]),
        }
    arms = result["arms"]
    target = max(a["best_final_loss"] for a in arms.values())
    result["target_loss"] = target
    for arm in arms.values():
        tokens = tokens_to_reach(arm["runs"][f"{arm['best_lr']:g}"], target)
        arm["tokens_to_target"] = tokens
        arm["flops_to_target"] = tokens * arm["flops_per_token"] if tokens is not None else None
    pp, orig = arms["transformer_pp"]["flops_to_target"], arms["original"]["flops_to_target"]
    result["compute_ratio"] = orig / pp if pp and orig else None
    (out / "ablation.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out / "ablation.png")
    print(json.dumps(result) if as_json else report(result))
    return result


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, sweep) = plt.subplots(1, 2, figsize=(11, 4))
    for data, color in zip(result["arms"].values(), ("tab:blue", "tab:red"), strict=True):
        best = data["runs"][f"{data['best_lr']:g}"]
        label = f"{data['label']}, lr {data['best_lr']:g}"
        curves.plot([t / 1e6 for t, _ in best], [loss for _, loss in best], color=color, label=label)
        finals = [(float(lr), c[-1][1]) for lr, c in data["runs"].items() if c and math.isfinite(c[-1][1])]
        sweep.plot(
            [lr for lr, _ in finals], [loss for _, loss in finals], "o-", color=color, label=data["label"]
        )
    curves.axhline(
        result["target_loss"], color="gray", linestyle=":", label=f"target {result['target_loss']:.3f}"
    )
    curves.set(
        xlabel="training tokens (millions)",
        ylabel="evaluation loss",
        title=f"best learning rate, {result['source']}",
    )
    curves.set_ylim(top=min(8.5, curves.get_ylim()[1]))
    curves.legend(fontsize=8)
    sweep.set(
        xscale="log",
        xlabel="peak learning rate",
        ylabel="final evaluation loss",
        title="learning-rate search",
    )
    sweep.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(result: dict) -> str:
    lines = [
        f"learning efficiency on {result['source']} (learning rates {', '.join(map(str, result['lrs']))})",
        "",
    ]
    lines.append(f"{'':<44}{'best lr':>9}{'final loss':>12}{'tokens to target':>18}{'GFLOPs to target':>18}")
    for data in result["arms"].values():
        tokens, flops = data["tokens_to_target"], data["flops_to_target"]
        lines.append(
            f"{data['label']:<44}{data['best_lr']:>9g}{data['best_final_loss']:>12.3f}"
            f"{(f'{tokens / 1e6:.2f}M' if tokens else '—'):>18}{(f'{flops / 1e9:,.0f}' if flops else '—'):>18}"
        )
    ratio = result["compute_ratio"]
    lines += [
        "",
        f"target loss {result['target_loss']:.3f} (the higher best final loss); "
        + (
            f"the original recipe needs {ratio:.2f}x the compute of Transformer++"
            if ratio
            else "not reached by both arms"
        ),
    ]
    return "\n".join(lines)
