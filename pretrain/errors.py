"""Errors meant for people.

A `UserError` is bad input (a missing file, a bad config, an unknown preset). The CLI prints its
message as one line on stderr and exits with status 2; `--debug` shows the traceback instead.
Everything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """Bad input: the message names the problem and says what to do."""

    exit_code = 2


class ConfigError(UserError):
    """A run or model config that cannot be used as written."""
