"""The golden run: deterministic, 2 processes, ZeRO-2, 20 steps, evaluations and checkpoints at 10
and 20. A change that is not meant to change computation must reproduce its losses, gradient
norms and weights bit for bit (tests/integration/test_golden.py).

Re-record only for a change that is meant to change the numbers, and say why in the commit:

    python -m tests.integration.golden
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from tests.integration.runs import launcher, metrics, train, train_state

GOLDEN_FILE = Path(__file__).with_name("golden_zero2.json")
OVERRIDES = ["train.steps=20", "checkpoint.every=10", "eval.every=10", "engine.peak_flops=1e12"]
EXACT = ("train/loss", "train/grad_norm", "train/lr", "train/tokens", "train/skipped_steps")


def run_golden(run_dir: Path, data_dir: Path) -> None:
    train(launcher(2), run_dir, data_dir, *OVERRIDES)


def summarize(run_dir: Path, data_dir: Path) -> dict:
    """What must not change: every step's numbers, the evaluations, and the checkpoints' state."""
    steps = {}
    for step, record in sorted(metrics(run_dir).items()):
        steps[str(step)] = {k: v for k, v in record.items() if k in EXACT or k.startswith("train/grad_norm/")}
    summary = json.loads((run_dir / "train_summary.json").read_text())
    checkpoints = {}
    for step in (10, 20):
        state = train_state(run_dir, step)
        checkpoints[str(step)] = {k: state[k] for k in ("step", "tokens", "data", "params_sha256")}
    manifest = json.loads((data_dir / "manifest.json").read_text())
    return {
        "data_fingerprint": manifest["fingerprint"],
        "steps": steps,
        "eval": [{"step": e["step"], "loss": e["loss"]} for e in summary["eval"]],
        "checkpoints": checkpoints,
    }


def _record() -> None:
    """Prepare the test session's corpus the same way the fixtures do, run, and write the file."""
    import pydoc_data.topics

    from pretrain.data import prepare_dataset, resolve_source
    from pretrain.tokenizer import train_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        topics = pydoc_data.topics.topics
        train_tokenizer((topics[k] for k in sorted(topics)), tmp / "tokenizer", vocab_size=512)
        corpus = tmp / "topics.jsonl"
        corpus.write_text("".join(json.dumps({"text": topics[k]}) + "\n" for k in sorted(topics)))
        prepare_dataset(
            resolve_source(str(corpus)), tmp / "tokenizer", tmp / "data", val_fraction=0.1, progress=False
        )
        run_golden(tmp / "run", tmp / "data")
        GOLDEN_FILE.write_text(json.dumps(summarize(tmp / "run", tmp / "data"), indent=1) + "\n")
    print(f"wrote {GOLDEN_FILE}", file=sys.stderr)


if __name__ == "__main__":
    _record()
