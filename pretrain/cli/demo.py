"""`pretrain demo`: the whole path on the built-in corpus, with nothing to download.

1. train a 4096-piece tokenizer on `builtin:pydoc` (the local Python documentation),
2. prepare it into token shards (95% train, 5% validation),
3. train `configs/train/demo.yaml` through `pretrain launch` (the monitoring service, and under it the
   DeepSpeed launcher): 2 processes on CPU (every GPU when there are GPUs), ZeRO-2, bf16, with
   evaluation, checkpoints and TensorBoard logs,
4. print the validation loss before and after, and how to look at TensorBoard and sample.

Steps 1 and 2 are skipped when their outputs already exist, so a second run only trains, in a new
run directory (OUT/run-2, ...): an earlier run is never moved or removed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from monitoring.protocol import SUMMARY_FILE
from pretrain.cli.launch import launch, local_process_count
from pretrain.config import config_dir
from pretrain.data.prepare import prepare_corpus
from pretrain.errors import UserError


def new_run_dir(out: Path) -> Path:
    """OUT/run, or OUT/run-2, run-3, ... beside earlier demo runs: a demo never touches an earlier run."""
    candidate, number = out / "run", 1
    while candidate.exists() and any(candidate.iterdir()):
        number += 1
        candidate = out / f"run-{number}"
    if number > 1:
        print(
            f"      earlier demo runs are kept ({out / 'run'}, ...); this one trains in {candidate}",
            flush=True,
        )
    return candidate


def run_demo(out_dir: str = "runs/demo", steps: int | None = None) -> int:
    if steps is not None and steps < 1:
        raise UserError(f"--steps {steps} must be at least 1")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out_dir} is a file: pass a directory")
    stages = iter(["[1/3]", "[2/3]"])  # then the counts, indented under them
    _, data_dir = prepare_corpus(
        "builtin:pydoc", out, announce=lambda line: print(f"{next(stages, '     ')} {line}", flush=True)
    )
    run_dir = new_run_dir(out)
    nproc = local_process_count()
    overrides = [f"run.dir={run_dir}", f"data.dir={data_dir}"]
    if steps is not None:
        overrides += [
            f"train.steps={steps}",
            f"eval.every={max(1, steps // 2)}",
            f"checkpoint.every={max(1, steps // 2)}",
        ]
    config = config_dir() / "train" / "demo.yaml"
    print(f"[3/3] pretrain launch --config {config} {' '.join(overrides)}", flush=True)
    returncode = launch(str(config), overrides, nproc=nproc, next_steps=False)  # (its own, below)
    if returncode != 0:
        print(f"pretrain demo: training exited with status {returncode}", file=sys.stderr)
        return returncode
    evals = json.loads((run_dir / SUMMARY_FILE).read_text())["eval"]
    print()
    print(
        f"validation loss: {evals[0]['loss']:.3f} at step {evals[0]['step']} -> {evals[-1]['loss']:.3f} "
        f"at step {evals[-1]['step']}"
    )
    print(f"TensorBoard:  tensorboard --logdir {run_dir / 'tensorboard'}")
    print(f'Sample:       pretrain generate --checkpoint {run_dir} --prompt "The list type"')
    print(f"Export:       pretrain export-hf --checkpoint {run_dir} --out {out / 'hf'}")
    return 0
