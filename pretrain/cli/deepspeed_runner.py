"""DeepSpeed's launcher (`deepspeed.launcher.runner`, what the `deepspeed` command runs) as
`pretrain launch` starts it: the same arguments and behaviour, with the console kept to what
matters (`pretrain.console`: its one-node "no hostfile" note and INFO lines only with --verbose),
and a lifeline: it runs beside the supervisor, so when the supervisor is gone it stops the job as
DeepSpeed stops it on SIGTERM — over ssh, its kill command on every host (`pretrain/lifeline.py`)."""

from __future__ import annotations

from pretrain.console import deepspeed_log_level, quiet_libraries


def quiet_remote_launchers() -> None:
    """Over ssh, DeepSpeed starts each host's launcher without the --log_level it gives a local
    one; give it the same (its INFO lines only with --verbose)."""
    from deepspeed.launcher.multinode_runner import PDSHRunner

    get_cmd = PDSHRunner.get_cmd

    def with_log_level(self, environment, active_resources):
        cmd, kill_cmd, env = get_cmd(self, environment, active_resources)
        at = cmd.index("deepspeed.launcher.launch") + 1
        return [*cmd[:at], f"--log_level={deepspeed_log_level()}", *cmd[at:]], kill_cmd, env

    PDSHRunner.get_cmd = with_log_level


if __name__ == "__main__":
    import gc
    import signal

    # A scheduler's time-limit warning reaches every process of a Slurm job step: it is for the
    # supervisor and the ranks. The launchers between them ignore it (their children inherit that
    # until the ranks' own stop handler is in place).
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    quiet_libraries()
    from deepspeed.launcher.runner import main

    from pretrain.lifeline import watch_supervisor

    quiet_remote_launchers()

    watch_supervisor(who="launcher", then="stopping the job on every node")
    try:
        main()
    finally:
        gc.freeze()  # a quick exit (see pretrain.cli.entry)
