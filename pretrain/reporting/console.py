"""A quiet console: our own lines only, unless `--verbose`.

DeepSpeed and torch talk at INFO level and warn about things that are not the user's to fix (the
launcher's note that a one-node run has no hostfile, the CPU fallback of its accelerator probe,
torch's deprecation of a collective DeepSpeed calls, the build note of its shared-memory op).
Whatever they say at WARNING or above that is not one of those stays on the console.

`--verbose` anywhere on a `pretrain` command line sets PRETRAIN_VERBOSE=1, which every process
of a launch inherits (the launcher, each rank), and brings all of it back.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import warnings
from collections.abc import Iterator

VERBOSE_ENV = "PRETRAIN_VERBOSE"

# DeepSpeed's own WARNING-level notes that say nothing to act on in a run we launched.
DEEPSPEED_CHATTER = (
    "Setting accelerator to CPU",  # its probe found no GPU: we know, and say where we run
    "Unable to find hostfile",  # a one-node launch has none by design
)
# print()ed by DeepSpeed when a rank opens its process group on CPU.
PRINTED_CHATTER = ("built successfully",)
# Written to file descriptor 2 by torch.profiler's C++ side (Kineto) as it starts and stops, with
# no log level that holds them back.
PROFILER_CHATTER = ("USDT:", "STAGE:")


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV) == "1"


def set_verbose(on: bool) -> None:
    if on:
        os.environ[VERBOSE_ENV] = "1"


class _DeepSpeedChatter(logging.Filter):
    """Below WARNING, or one of DEEPSPEED_CHATTER: not shown."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return False
        message = record.getMessage()
        return not any(note in message for note in DEEPSPEED_CHATTER)


def quiet_libraries() -> None:
    """Call before DeepSpeed is imported (its accelerator probe logs at import). Idempotent."""
    if verbose():
        return
    logger = logging.getLogger("DeepSpeed")  # the logger deepspeed.utils.logger is, once created
    if not any(isinstance(f, _DeepSpeedChatter) for f in logger.filters):
        logger.addFilter(_DeepSpeedChatter())
    # DeepSpeed's calls into torch.distributed that torch has deprecated (all_gather_into_tensor, ...)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.distributed")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"deepspeed")


def deepspeed_log_level() -> str:
    """For the launcher's --log_level: its INFO lines (commands, world info, device lists) and its
    own report of a failed rank (an [ERROR] line quoting the rank's whole command) only with
    --verbose; the supervisor says which rank failed, how, and at which step."""
    return "info" if verbose() else "critical"


def pin_accelerator() -> None:
    """Name DeepSpeed's accelerator (as it detects it here) in DS_ACCELERATOR for the processes
    we start: they skip the probe and its note; the choice is the one DeepSpeed makes itself."""
    if "DS_ACCELERATOR" in os.environ:
        return
    quiet_libraries()
    from deepspeed.accelerator import get_accelerator

    os.environ["DS_ACCELERATOR"] = get_accelerator()._name


@contextlib.contextmanager
def without_printed_chatter() -> Iterator[None]:
    """Hold what is print()ed inside; pass on every line but PRINTED_CHATTER's."""
    if verbose():
        yield
        return
    held = io.StringIO()
    try:
        with contextlib.redirect_stdout(held):
            yield
    finally:
        for line in held.getvalue().splitlines(keepends=True):
            if not any(note in line for note in PRINTED_CHATTER):
                sys.stdout.write(line)
        sys.stdout.flush()


@contextlib.contextmanager
def silenced_stdout() -> Iterator[None]:
    """Progress DeepSpeed prints while consolidating a checkpoint: gone, unless --verbose (then
    on stderr, so that a command's stdout holds its result only)."""
    sink = sys.stderr if verbose() else io.StringIO()
    with contextlib.redirect_stdout(sink):
        yield


@contextlib.contextmanager
def without_native_chatter(chatter: tuple[str, ...] = PROFILER_CHATTER) -> Iterator[None]:
    """Hold what reaches file descriptor 2 inside (C++ libraries write there directly, past
    `sys.stderr`); pass on every line but those starting with one of `chatter`, once the block ends."""
    if verbose():
        yield
        return
    import tempfile

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            for line in held.read().decode(errors="replace").splitlines(keepends=True):
                if not line.startswith(chatter):
                    sys.stderr.write(line)
            sys.stderr.flush()
