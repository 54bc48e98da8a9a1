"""Errors meant for people, and the one table of exit statuses.

A `UserError` is bad input (a missing file, a bad config, an unknown preset). Every command and
module entry runs through `run_main`, which prints its message as one line on stderr (from local
rank 0 only, when several ranks run the same command) and exits with status 2; `--debug` shows the
traceback instead. A rank that loses another rank of its job (`RankFailed`) says so in one line too.
Everything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from enum import IntEnum

SPEAKER_GRACE_S = 5.0  # how long a silent rank waits for local rank 0 to print the error


class ExitCode(IntEnum):
    """What a job's exit status means to a person and to the supervisor (`pretrain launch`), which
    restarts a job after any status but DONE, BAD_INPUT, STOPPED_BY_MONITOR and CHECKPOINT_FAILED."""

    DONE = 0
    FAILED = 1
    BAD_INPUT = 2  # a restart would fail the same way
    STOPPED_BY_MONITOR = 3  # a check refused to go on (the circuit breaker, the replica check): not a crash
    CHECKPOINT_FAILED = (
        4  # checkpoints could not be saved (no space, no permission): a restart would not help
    )
    REPLACE_NODE = 5  # saved and stopped to move off a host (a straggler, machine faults)
    INTERRUPTED = 130  # Ctrl-C


class UserError(Exception):
    """Bad input: the message names the problem and says what to do."""

    exit_code = ExitCode.BAD_INPUT


class ConfigError(UserError):
    """A run or model config that cannot be used as written."""


class DataError(UserError):
    """Bad data found by one rank while training (a corrupt shard): every rank says what it found."""

    same_on_every_rank = False


class RankFailed(Exception):
    """This rank cannot go on because another rank left the job (killed, crashed, or stopped on bad
    input): one line on every rank, naming what is known, and the supervisor's usual restart."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


def run_main(handler: Callable[[], int], *, debug: bool = False, prog: str = "pretrain") -> int:
    """Run a command; bad input becomes one line on stderr and status 2, Ctrl-C status 130."""
    try:
        return int(handler())
    except UserError as exc:
        if debug:
            raise
        rank = int(os.environ.get("RANK", "0"))
        if not getattr(exc, "same_on_every_rank", True):
            say(f"{prog}: error on rank {rank}: {exc}")
        elif int(os.environ.get("LOCAL_RANK", "0")) == 0:  # every rank found it: once per node
            say(f"{prog}: error: {exc}")
        else:
            # A launcher kills every rank once one exits with an error: a silent rank that exited
            # first could take the one meant to speak down with it. It waits for the speaker instead.
            time.sleep(SPEAKER_GRACE_S)
        return exc.exit_code
    except RankFailed as exc:
        if debug:
            raise
        say(f"{prog}: rank {os.environ.get('RANK', '0')}: {exc}")
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return ExitCode.INTERRUPTED
    except BrokenPipeError:  # `pretrain ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (no error at exit's flush)
        return 0


def say(line: str) -> None:
    """One line on stderr in one write: the ranks of a job share it, and print()'s separate write
    of the newline lets two ranks' lines run into one."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


class CommandParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and status 2) like every other bad input."""

    def error(self, message: str):
        self.exit(ExitCode.BAD_INPUT, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")
