"""`python -m pretrain.finetune ...` is `pretrain finetune ...` (what launchers run on every rank)."""

import sys

from pretrain.cli import entry

if __name__ == "__main__":
    sys.argv.insert(1, "finetune")
    sys.exit(entry())
