"""DeepSpeed's launcher (`deepspeed.launcher.runner`, what the `deepspeed` command runs) as
`pretrain launch` starts it: the same arguments and behaviour, with the console kept to what
matters (`pretrain.reporting.console`: its one-node "no hostfile" note and INFO lines only with --verbose),
and, over ssh (pdsh), a stop that lets the ranks save:

- SIGTERM/SIGINT: SIGTERM to this job's launcher on every host (pkill over pdsh, matched by the
  job's rendezvous port), whose ranks then save at the next step boundary and exit; pdsh is left
  running, so their output and exit still arrive, and this process exits when they have. (DeepSpeed's
  own handler kills pdsh first: the ranks' stdout then breaks under them, and they die unsaved.)
  A host whose launcher has not started yet when the stop goes out (its ssh connection was slow:
  it would then start its ranks, which wait for the rest in the rendezvous) is asked again each
  second until its launcher is found, for up to `STOP_RETRY_SECONDS`. A second signal ends this
  process at once.
- A lifeline: it runs beside the supervisor, so when the supervisor is gone it stops the job
  that way on every host (`pretrain/lifeline.py`).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time

from pretrain.reporting.console import deepspeed_log_level, quiet_libraries

_pdsh: dict = {}  # what a stop needs, from DeepSpeed's pdsh command: hosts, rendezvous port, environment;
# and "asked", once a stop has been sent


def adapt_pdsh_runner() -> None:
    """Over ssh, DeepSpeed starts each host's launcher without the --log_level it gives a local one:
    give it the same (its INFO lines only with --verbose); and note what a stop of this job needs."""
    from deepspeed.launcher.multinode_runner import PDSHRunner

    get_cmd = PDSHRunner.get_cmd

    def with_log_level(self, environment, active_resources):
        cmd, kill_cmd, env = get_cmd(self, environment, active_resources)
        _pdsh.update(hosts=",".join(active_resources), port=self.args.master_port, env=dict(env))
        at = cmd.index("deepspeed.launcher.launch") + 1
        return [*cmd[:at], f"--log_level={deepspeed_log_level()}", *cmd[at:]], kill_cmd, env

    PDSHRunner.get_cmd = with_log_level


# A host's launcher starts within DeepSpeed's ssh connect timeout (10 s), and then some.
STOP_RETRY_SECONDS = 60.0
_FOUND = "pkill-status="  # what the remote shell echoes after pkill: 0, a launcher was signalled; 1, none was there


def launch_locally_with_our_module(runner) -> None:
    """The launcher DeepSpeed's runner starts on this host is `pretrain.cli.deepspeed_launch`:
    DeepSpeed's, looking at its ranks every 0.1 s instead of every second (that module says why)."""
    from pretrain.cli import deepspeed_launch

    def started(cmd, *args, **kwargs):
        if isinstance(cmd, list) and cmd[1:4] == ["-u", "-m", "deepspeed.launcher.launch"]:
            cmd = [*cmd[:3], deepspeed_launch.MODULE, *cmd[4:]]
        return subprocess.Popen(cmd, *args, **kwargs)

    runner.subprocess = deepspeed_launch.module_with(subprocess, Popen=started)


def stop_command(hosts: str, port: int) -> list[str]:
    """pdsh: SIGTERM to the DeepSpeed launcher of the job whose rendezvous port is `port`, on every
    host, each host then saying whether it found one (`hosts_without_launcher` reads that)."""
    # The launcher's own command line only: not pdsh's, ssh's or the remote shell's, which quote it
    # (on the supervisor's host, which is often in the hostfile, those would be hit too).
    pattern = f"^[^ ]*python[^ ]* -u -m deepspeed[.]launcher[.]launch .*--master_port={port}( |$)"
    return [
        "pdsh",
        "-S",
        "-f",
        "1024",
        "-w",
        hosts,
        "pkill",
        "-TERM",
        "-f",
        shlex.quote(pattern),
        ";",
        "echo",
        f"{_FOUND}$?",
    ]


def hosts_without_launcher(pdsh_output: str) -> list[str]:
    """The hosts where the stop found no launcher of the job (pdsh labels each line `host: `);
    not those it could not reach (no line of theirs says so)."""
    missing = []
    for line in pdsh_output.splitlines():
        host, _, said = line.partition(": ")
        if said.strip() == f"{_FOUND}1":
            missing.append(host.strip())
    return missing


def _ask_hosts_to_stop(hosts: str, port: int, env: dict) -> list[str]:
    """One stop over pdsh; the hosts where no launcher was found yet."""
    try:
        done = subprocess.run(
            stop_command(hosts, port),
            env=env,
            timeout=60,
            check=False,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return hosts_without_launcher(done.stdout)


def _ask_late_hosts_again(pending: list[str], port: int, env: dict) -> None:
    """Hosts whose launcher was not there yet: asked again each second (the job's pdsh, which this
    process waits for, ends once every host's launcher has; this thread ends with the process)."""
    deadline = time.monotonic() + STOP_RETRY_SECONDS
    while pending and time.monotonic() < deadline:
        time.sleep(1.0)
        pending = _ask_hosts_to_stop(",".join(pending), port, env)


def _stop_every_host(signum, frame) -> None:
    if not _pdsh or _pdsh.get("asked"):  # one node, or asked twice: the default
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    _pdsh["asked"] = True
    print("launcher: asking every host's ranks to save and stop", file=sys.stderr, flush=True)
    pending = _ask_hosts_to_stop(_pdsh["hosts"], _pdsh["port"], _pdsh["env"])
    if pending:
        threading.Thread(
            target=_ask_late_hosts_again,
            args=(pending, _pdsh["port"], _pdsh["env"]),
            name="stop-late-hosts",
            daemon=True,
        ).start()


class _SignalsKeptOurs:
    """`signal` as DeepSpeed's runner sees it: its SIGINT/SIGTERM handler is not installed (ours is)."""

    def __getattr__(self, name):
        return getattr(signal, name)

    @staticmethod
    def signal(signum, handler):
        return signal.getsignal(signum)


if __name__ == "__main__":
    import gc

    # A scheduler's time-limit warning reaches every process of a Slurm job step: it is for the
    # supervisor and the ranks. The launchers between them ignore it (their children inherit that
    # until the ranks' own stop handler is in place).
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    quiet_libraries()
    import deepspeed.launcher.runner as runner

    from pretrain.lifeline import watch_supervisor

    adapt_pdsh_runner()
    launch_locally_with_our_module(runner)
    for stop_signal in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop_signal, _stop_every_host)
    runner.signal = _SignalsKeptOurs()
    watch_supervisor(who="launcher", then="stopping the job on every host")
    try:
        runner.main()
    finally:
        gc.freeze()  # a quick exit (see pretrain.cli.entry)
