"""DeepSpeed's per-node launcher (`deepspeed.launcher.launch`, which starts one node's ranks and
waits for them) as `pretrain launch` starts it on this machine: the same module, arguments and
behaviour, but it looks at its ranks every `POLL_SECONDS` instead of every second. Unchanged, it
notices a rank that exited (done, failed or killed) up to a second late, and sleeps a second more
after the last one has gone: each start, restart and end of a job waited for that.

Used for the launches DeepSpeed's runner starts on this host (`pretrain/cli/deepspeed_runner.py`);
over ssh each host runs DeepSpeed's own module (the stop of a job finds it there by name).
"""

from __future__ import annotations

import time
import types

POLL_SECONDS = 0.1
MODULE = "pretrain.cli.deepspeed_launch"


def module_with(module: types.ModuleType, **replaced) -> types.ModuleType:
    """A copy of `module` for one importer's global name, with `replaced` attributes in place of its
    own: the module itself, and every other importer, are left as they are."""
    copy = types.ModuleType(module.__name__)
    copy.__dict__.update(vars(module), **replaced)
    return copy


def _polling_clock() -> types.ModuleType:
    """`time` as the launcher uses it (its wait loop's `time.sleep(1)`), with shorter sleeps."""
    return module_with(time, sleep=lambda seconds: time.sleep(min(seconds, POLL_SECONDS)))


if __name__ == "__main__":
    import deepspeed.launcher.launch as launch

    launch.time = _polling_clock()
    launch.main()
