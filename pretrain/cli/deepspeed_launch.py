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


def _polling_clock() -> types.SimpleNamespace:
    """`time` as the launcher uses it (its wait loop's `time.sleep(1)`), with shorter sleeps."""
    clock = types.SimpleNamespace(
        **{name: getattr(time, name) for name in dir(time) if not name.startswith("__")}
    )
    clock.sleep = lambda seconds: time.sleep(min(seconds, POLL_SECONDS))
    return clock


if __name__ == "__main__":
    import deepspeed.launcher.launch as launch

    launch.time = _polling_clock()
    launch.main()
