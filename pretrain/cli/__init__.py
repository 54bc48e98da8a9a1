"""The `pretrain` command (also `python -m pretrain`, `python -m pretrain.train`, `python -m
pretrain.finetune`): the one entry point of every command.

Each subcommand parses its arguments, calls one library function and prints. Bad input raises
`UserError`, which becomes one line on stderr and exit status 2 (`pretrain.errors.run_main`);
`--debug` (anywhere on the command line) shows the traceback instead. Exit statuses are
`pretrain.errors.ExitCode`: 0 done, 2 bad input, 3 stopped by the monitor.

    data.py         tokenizer train, data prepare
    training.py     train, finetune, launch, monitor, demo
    checkpoints.py  eval, generate, export-hf, predict, attention
    inspect.py      config show, flops
    bench.py        bench data / monitor / train / ablation
    launch.py       what `pretrain launch` wires together
    arguments.py    the config argument: CONFIG or --config, the same on every command
"""

from __future__ import annotations

import argparse
import sys

from pretrain.cli import bench, checkpoints, data, inspect, training
from pretrain.cli.arguments import resolve_config_argument
from pretrain.errors import CommandParser, run_main
from pretrain.reporting.console import quiet_libraries, set_verbose


def build_parser() -> CommandParser:
    parser = CommandParser(prog="pretrain", description="Llama-style pretraining with DeepSpeed ZeRO.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for bad input")
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="DeepSpeed's and torch's INFO lines and notes too (hidden by default)",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser, metavar="COMMAND")
    for group in (inspect, data, bench, training, checkpoints):
        group.register(sub)
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    """A command line's arguments as its handler gets them (the config settled: CONFIG or --config).
    Dotted overrides may also follow the options (`pretrain plan CONFIG --gpus 8 KEY=VALUE`), which
    argparse alone does not take once CONFIG has been read."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest:
        if not (hasattr(args, "overrides") and all("=" in r and not r.startswith("-") for r in rest)):
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        args.overrides = [*(args.overrides or []), *rest]
    return resolve_config_argument(args)


def _without_local_rank(argv: list[str]) -> list[str]:
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--local_rank", "--local-rank"):
            skip = True
        elif not arg.startswith(("--local_rank=", "--local-rank=")):
            kept.append(arg)
    return kept


def entry() -> int:
    """The `pretrain` command (and `python -m pretrain`, `python -m pretrain.train`): `main`, then a
    quick exit. A process that imported torch and DeepSpeed spends about half a second at exit
    collecting objects that die with it anyway, and a rank that trained up to 2 s; frozen, they are
    not visited (`gc.freeze`). Every file is written and closed by then."""
    import gc

    code = main()
    gc.freeze()
    return code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    set_verbose("--verbose" in argv)  # inherited by every process a command starts
    quiet_libraries()
    argv = [a for a in argv if a not in ("--debug", "--verbose")]
    # Launchers append --local_rank=N or --local_rank N (it is in LOCAL_RANK too, which is read).
    argv = _without_local_rank(argv)
    args = parse(argv)
    return run_main(lambda: args.handler(args), debug=debug)
