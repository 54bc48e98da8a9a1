"""Fine-tuning data both tiers use: a keyword-sentiment task learnable in a few dozen steps."""

import csv
import json
import random

from pretrain.config import REPO_CONFIG_DIR

CLASSIFICATION = str(REPO_CONFIG_DIR / "finetune" / "classification.yaml")
SFT = str(REPO_CONFIG_DIR / "finetune" / "sft.yaml")
FILLER = "the list of values returns a new object from each class method and string in the module".split()  # noqa: SIM905
POSITIVE, NEGATIVE = ["excellent", "wonderful", "delightful"], ["terrible", "dreadful", "awful"]
TINY_FT = [
    "train.micro_batch_size=8",
    "optim.lr=2e-3",
    "schedule.warmup_steps=5",
    "logging.every=5",
    "run.deterministic=true",
]


def sentiment_rows(count: int, seed: int) -> list[dict]:
    """Six filler words with one keyword that decides the label: learnable in a few dozen steps."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        label = "positive" if i % 2 == 0 else "negative"
        words = rng.sample(FILLER, 6)
        words.insert(rng.randrange(7), rng.choice(POSITIVE if label == "positive" else NEGATIVE))
        rows.append({"text": " ".join(words), "other": " ".join(rng.sample(FILLER, 4)), "label": label})
    return rows


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
