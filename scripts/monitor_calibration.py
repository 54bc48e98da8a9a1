"""Calibrate and check the monitor on real runs: three corpora of different kinds, clean runs of
`configs/train/demo.yaml` and `configs/train/tiny.yaml`, and runs with injected faults.

    python scripts/monitor_calibration.py corpora --prose PATH.txt [--out runs/calibration]
    python scripts/monitor_calibration.py clean   [--out ...] [--steps 300] [overrides...]
    python scripts/monitor_calibration.py faults  [--out ...] [--steps 120]
    python scripts/monitor_calibration.py overhead [--out ...] [--pairs 3] [--steps 150]
    pretrain bench detection runs/calibration/runs/*     (the table, from what these runs recorded)

Corpora (each capped at --max-mb of text, built only from files already on this machine):
    prose   the text file given with --prose (e.g. tinyshakespeare), one document per 40 lines
    code    the Python standard library's .py files, one document per file
    docs    package documentation: the long descriptions (README) in site-packages' METADATA files
            and the .md/.rst files shipped with packages, one document per file

Every run goes through `pretrain launch` (the monitoring service with its default settings and,
under it, 2 DeepSpeed processes), so its events.jsonl holds what the monitor decided on every step.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIGS = {"demo": ("configs/train/demo.yaml", 4096), "tiny": ("configs/train/tiny.yaml", 2048)}
KINDS = ("prose", "code", "docs")


def _write_jsonl(path: Path, documents, max_bytes: int) -> int:
    total = 0
    with open(path, "w") as f:
        for text in documents:
            if not text.strip():
                continue
            f.write(json.dumps({"text": text}) + "\n")
            total += len(text.encode())
            if total >= max_bytes:
                break
    return total


def _prose(path: Path):
    lines = path.read_text(errors="replace").splitlines(keepends=True)
    for i in range(0, len(lines), 40):
        yield "".join(lines[i : i + 40])


def _code():
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts or "tests" in path.parts:
            continue
        yield path.read_text(errors="replace")


def _docs():
    purelib = Path(sysconfig.get_paths()["purelib"])
    for path in sorted(purelib.glob("*.dist-info/METADATA")):
        body = path.read_text(errors="replace").partition("\n\n")[2]  # the long description
        if len(body) > 500:
            yield body
    for pattern in ("**/*.md", "**/*.rst"):
        for path in sorted(purelib.glob(pattern)):
            if "LICENSE" not in path.name.upper():
                yield path.read_text(errors="replace")


def corpora(args) -> None:
    from pretrain.data import prepare_corpus

    out = Path(args.out)
    sources = {"prose": _prose(Path(args.prose)), "code": _code(), "docs": _docs()}
    for kind in KINDS:
        text = out / "text" / f"{kind}.jsonl"
        text.parent.mkdir(parents=True, exist_ok=True)
        if not text.exists():
            size = _write_jsonl(text, sources[kind], int(args.max_mb * 2**20))
            print(f"{kind}: {size / 2**20:.1f} MiB of text -> {text}", flush=True)
        for _, vocab in CONFIGS.values():
            prepare_corpus(str(text), out / "corpora" / f"{kind}-{vocab}", vocab_size=vocab)


def _launch(out: Path, name: str, config: str, kind: str, overrides: list[str]) -> int:
    path, vocab = CONFIGS[config]
    run_dir = out / "runs" / name
    command = [
        sys.executable,
        "-m",
        "pretrain",
        "launch",
        "--config",
        str(REPO / path),
        f"run.dir={run_dir}",
        f"data.dir={out / 'corpora' / f'{kind}-{vocab}' / 'data'}",
        f"model.vocab_size={vocab}",
        "checkpoint.resume=fresh",
        *overrides,
    ]
    print(" ".join(command), flush=True)
    with open(out / "runs" / f"{name}.log", "w") as log:
        return subprocess.call(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)


def clean(args) -> None:
    out = Path(args.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    for config in args.configs.split(","):
        for kind in KINDS:
            name = f"clean-{config}-{kind}"
            code = _launch(out, name, config, kind, [f"train.steps={args.steps}", *args.overrides])
            print(f"{name}: exit {code}", flush=True)


def faults(args) -> None:
    """Injected faults on the demo config over the code corpus: loss spikes and gradient-only
    spikes of each factor at three steps each, and NaN steps."""
    out = Path(args.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    steps = [60, 90, 120][: max(1, (args.steps - 30) // 30)]
    at = "[" + ",".join(map(str, steps)) + "]"
    cases = [(f"loss-x{f:g}", [f"faults.spike_steps={at}", f"faults.spike_factor={f}"]) for f in args.factors]
    cases += [
        (f"grad-x{f:g}", [f"faults.grad_spike_steps={at}", f"faults.grad_spike_factor={f}"])
        for f in args.factors
    ]
    cases.append(("nan", [f"faults.nan_steps={at}"]))
    for label, overrides in cases:
        name = f"fault-{args.config}-{args.kind}-{label}"
        code = _launch(
            out, name, args.config, args.kind, [f"train.steps={args.steps}", *overrides, *args.overrides]
        )
        print(f"{name}: exit {code}", flush=True)


def _step_times(run_dir: Path, skip: int = 10) -> list[float]:
    """Each whole step's wall time, monitor work included: the time between the TensorBoard
    records of consecutive steps (`logging.every=1`). `train/step_time` would not do: it ends at
    the step's all-reduce, before the step reports to the monitor and acts on its answers."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from pretrain.reporting.metrics import tensorboard_dir

    board = EventAccumulator(str(tensorboard_dir(run_dir)), size_guidance={"scalars": 0})
    board.Reload()
    events = board.Scalars("train/loss")
    pairs = itertools.pairwise(events)
    return [b.wall_time - a.wall_time for a, b in pairs if b.step == a.step + 1 and a.step >= skip]


def overhead(args) -> None:
    """The real loop's cost of the monitor: the same job under `pretrain launch` (service and
    supervisor, monitor.enabled=true) and under the DeepSpeed launcher alone with
    monitor.enabled=false, alternated; the ratio of their median step times (whole steps, from one
    step's record to the next: `_step_times`)."""
    import statistics

    from pretrain.parallel.distributed import free_port

    out = Path(args.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    path, vocab = CONFIGS[args.config]
    data = out / "corpora" / f"{args.kind}-{vocab}" / "data"
    common = [
        f"data.dir={data}",
        f"model.vocab_size={vocab}",
        "checkpoint.resume=fresh",
        f"train.steps={args.steps}",
        "eval.every=0",
        f"checkpoint.every={args.steps}",
        "logging.every=1",
    ]
    medians = {"with": [], "without": []}
    for pair in range(args.pairs):
        for kind in ("with", "without") if pair % 2 == 0 else ("without", "with"):
            run_dir = out / "runs" / f"overhead-{kind}-{pair}"
            if kind == "with":
                command = [sys.executable, "-m", "pretrain", "launch", "--config", str(REPO / path)]
            else:
                command = [
                    sys.executable,
                    "-m",
                    "deepspeed.launcher.runner",
                    "--num_gpus",
                    "2",
                    "--master_port",
                    str(free_port()),
                    "--module",
                    "pretrain.train",
                    "--config",
                    str(REPO / path),
                    "monitor.enabled=false",
                ]
            with open(f"{run_dir}.log", "w") as log:
                subprocess.check_call(
                    [*command, f"run.dir={run_dir}", *common], stdout=log, stderr=subprocess.STDOUT, cwd=REPO
                )
            medians[kind].append(statistics.median(_step_times(run_dir)))
            print(
                f"{kind} the monitor, pair {pair}: median step {1e3 * medians[kind][-1]:.1f} ms", flush=True
            )
    ratios = [w / wo for w, wo in zip(medians["with"], medians["without"], strict=True)]
    result = {
        "config": args.config,
        "steps": args.steps,
        "pairs": args.pairs,
        "median_step_ms_with": [1e3 * m for m in medians["with"]],
        "median_step_ms_without": [1e3 * m for m in medians["without"]],
        "ratio_with_to_without": ratios,
        "ratio_median": statistics.median(ratios),
    }
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="stage", required=True)
    c = sub.add_parser("corpora")
    c.add_argument("--prose", required=True, help="a plain-text file of prose")
    c.add_argument("--max-mb", type=float, default=8.0)
    r = sub.add_parser("clean")
    r.add_argument("--steps", type=int, default=300)
    r.add_argument("--configs", default="demo,tiny")
    f = sub.add_parser("faults")
    f.add_argument("--steps", type=int, default=150)
    f.add_argument("--config", default="tiny")
    f.add_argument("--kind", default="code")
    f.add_argument("--factors", type=float, nargs="+", default=[1.5, 2, 3, 5, 50])
    o = sub.add_parser("overhead")
    o.add_argument("--pairs", type=int, default=3)
    o.add_argument("--steps", type=int, default=150)
    o.add_argument("--config", default="tiny")
    o.add_argument("--kind", default="code")
    for p in (c, r, f, o):
        p.add_argument("--out", default="runs/calibration")
    for p in (r, f):
        p.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    {"corpora": corpora, "clean": clean, "faults": faults, "overhead": overhead}[args.stage](args)


if __name__ == "__main__":
    main()
