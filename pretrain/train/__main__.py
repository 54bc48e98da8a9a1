"""`python -m pretrain.train ...` is `pretrain train ...` (what launchers run on every rank)."""

import sys

from pretrain.cli import entry

if __name__ == "__main__":
    sys.argv.insert(1, "train")
    sys.exit(entry())
