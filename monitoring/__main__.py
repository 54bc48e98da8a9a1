"""`python -m monitoring --run-dir DIR [--config CFG] [overrides...]`: the service alone (as `pretrain monitor`)."""

import sys

from monitoring.service import add_arguments, serve_from_args
from pretrain.errors import CommandParser, run_main


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(
        prog="python -m monitoring", description="The monitoring service for one run directory."
    )
    add_arguments(parser)
    parser.add_argument("--debug", action="store_true", help="show tracebacks for bad input")
    args = parser.parse_args(argv)
    return run_main(lambda: serve_from_args(args), debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
