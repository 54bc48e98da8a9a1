"""`python -m pretrain.finetune ...` is `pretrain finetune ...` (what launchers run on every rank)."""

import sys

from pretrain.cli import main

if __name__ == "__main__":
    sys.exit(main(["finetune", *sys.argv[1:]]))
