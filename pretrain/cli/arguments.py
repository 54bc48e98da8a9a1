"""The config a command takes, named one way everywhere: `--config CONFIG` on every command that
takes one, and on those that took it positionally (`pretrain flops CONFIG`) that form too, since
existing command lines keep working.

`add_config_argument` gives a parser both forms; `resolve_config_argument`, run on every parsed
command line (`pretrain.cli.parse`), leaves the one config in `args.config`. Both forms with the
same text is the same config; with different texts it is refused, and so is neither: one line and
status 2, like every usage error. With `--config`, a KEY=VALUE in CONFIG's place is the first
override (`pretrain flops --config tiny model.n_layers=2`: argparse fills the positionals in order).
"""

from __future__ import annotations

import argparse
import re
from functools import partial

OVERRIDES_HELP = "dotted overrides, e.g. model.n_layers=12"
_RESOLVER = "_resolve_config"  # the parser's own resolution, in the namespace until it has run
_OVERRIDE = re.compile(r"[A-Za-z_][\w.]*=")  # KEY=VALUE: an override, where --config names the config


def add_config_argument(parser: argparse.ArgumentParser, help: str, *, overrides: bool = False) -> None:
    """CONFIG (positional, optional) and `--config CONFIG`, then the KEY=VALUE overrides if the
    command takes them (after CONFIG: positionals are filled in order)."""
    parser.add_argument("config", nargs="?", metavar="CONFIG", help=f"{help}; or --config CONFIG")
    parser.add_argument("--config", dest="config_option", metavar="CONFIG", help="the same as CONFIG")
    if overrides:
        parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=OVERRIDES_HELP)
    parser.set_defaults(**{_RESOLVER: partial(_resolve, parser)})


def resolve_config_argument(args: argparse.Namespace) -> argparse.Namespace:
    """`args.config` from CONFIG or `--config` (a usage error, status 2, for both that differ or
    neither), for a command that took `add_config_argument`; others are left as they are."""
    resolve = vars(args).pop(_RESOLVER, None)
    if resolve is not None:
        resolve(args)
    return args


def _resolve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    positional, option = args.config, vars(args).pop("config_option")
    both = option is not None and positional is not None
    if both and hasattr(args, "overrides") and _OVERRIDE.match(positional):
        args.overrides, positional = [positional, *args.overrides], None
    if positional is not None and option is not None and positional != option:
        parser.error(f"two configs given, {positional} (CONFIG) and --config {option}: give one")
    if option is None and positional is None:
        parser.error("the following arguments are required: CONFIG (or --config CONFIG)")
    args.config = option if option is not None else positional
