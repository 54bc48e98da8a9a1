"""DeepSpeed's launcher (`deepspeed.launcher.runner`, what the `deepspeed` command runs) as
`pretrain launch` starts it: the same arguments and behaviour, with the console kept to what
matters (`pretrain.console`: its one-node "no hostfile" note and INFO lines only with --verbose)."""

from __future__ import annotations

from pretrain.console import quiet_libraries

if __name__ == "__main__":
    import gc

    quiet_libraries()
    from deepspeed.launcher.runner import main

    try:
        main()
    finally:
        gc.freeze()  # a quick exit (see pretrain.cli.entry)
