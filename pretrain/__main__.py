import sys

from pretrain.cli import main

if __name__ == "__main__":  # guarded: spawned worker processes re-import the main module
    sys.exit(main())
