import sys

from pretrain.cli import entry

if __name__ == "__main__":  # guarded: spawned worker processes re-import the main module
    sys.exit(entry())
