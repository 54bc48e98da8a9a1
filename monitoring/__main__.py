"""`python -m monitoring --run-dir DIR [--config CFG] [overrides...]` (the same as `pretrain monitor`)."""

import sys

from pretrain.cli import main

if __name__ == "__main__":
    sys.exit(main(["monitor", *sys.argv[1:]]))
