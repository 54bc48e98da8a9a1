"""The pieces of multi-node launching that need no process: pdsh's reports, the lock a job's ranks
join by their supervisor's tag, the variables carried over ssh, and who asked a job to stop."""

import pytest

from monitoring.supervisor import node_exit
from pretrain.errors import UserError
from pretrain.run_dir import RunLock
from pretrain.train.loop import describe_requesters


def test_pdsh_reports_of_failed_hosts_are_read_and_other_lines_are_not():
    assert node_exit("pdsh@vm: node-7: ssh exited with exit code 255\n") == ("node-7", 255)
    assert node_exit("pdsh@login1: gpu-003: ssh exited with exit code 2") == ("gpu-003", 2)
    assert node_exit("pdsh@vm: vm: ssh killed by signal 9") == ("vm", 137)
    assert node_exit("pdsh@vm: vm: ssh exited with exit code 0") is None
    assert node_exit("vm: pdsh@vm: x: ssh exited with exit code 3") is None  # a rank's own line, labelled
    assert node_exit("localhost: step 3/30 | loss 6.0") is None


def test_a_jobs_rank_joins_its_supervisors_lock_and_anyone_else_is_refused(tmp_path):
    supervisor = RunLock(tmp_path).acquire(owner="vm:4242:1795520000.125")
    try:
        rank0 = RunLock(tmp_path).acquire(joining="vm:4242:1795520000.125")
        assert rank0.fd is None  # joined: holds nothing, releases nothing
        with pytest.raises(UserError, match="is in use by pid"):
            RunLock(tmp_path).acquire(joining="vm:4242:1795520999.000")  # a stale tag: another supervisor
        with pytest.raises(UserError, match="is in use by pid"):
            RunLock(tmp_path).acquire()
    finally:
        supervisor.release()
    assert RunLock(tmp_path).acquire(joining="vm:4242:1795520000.125").fd is not None  # free: held


def test_the_variables_carried_over_ssh_keep_the_users_own_first(tmp_path, monkeypatch):
    from pretrain.cli.launch import deepspeed_env_file

    home, here = tmp_path / "home", tmp_path / "here"
    home.mkdir(), here.mkdir()
    (home / ".deepspeed_env").write_text("NCCL_IB_HCA=mlx5\n\n")
    (here / ".deepspeed_env").write_text("HF_HOME=/shared/hf\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(here)
    monkeypatch.setenv("PRETRAIN_VERBOSE", "1")
    path = deepspeed_env_file(tmp_path / "run", {"PRETRAIN_RUN_OWNER": "vm:1:2.000"})
    lines = path.read_text().splitlines()
    assert lines[:2] == ["NCCL_IB_HCA=mlx5", "HF_HOME=/shared/hf"]
    assert "PRETRAIN_VERBOSE=1" in lines and lines[-1] == "PRETRAIN_RUN_OWNER=vm:1:2.000"
    assert path.is_absolute() and all("=" in line for line in lines)  # DeepSpeed splits every line at '='


def test_who_asked_to_stop_is_said_per_node_and_reason():
    lost = "its supervisor (pid 7 on b) is gone"
    requesters = [{"rank": r, "node": 1, "host": "b", "why": lost} for r in (4, 5, 6, 7)]
    requesters.append({"rank": 0, "node": 0, "host": "a", "why": "SIGTERM received"})
    assert (
        describe_requesters(requesters)
        == f"node 0 (a, rank 0): SIGTERM received; node 1 (b, ranks 4-7): {lost}"
    )
    assert describe_requesters([{"rank": r, "node": 0, "host": "a", "why": "x"} for r in (0, 2)]) == (
        "node 0 (a, ranks 0,2): x"
    )


def test_the_stop_over_ssh_hits_this_jobs_launchers_only():
    """pkill -f on every host: the job's DeepSpeed launchers, not the pdsh, ssh and shell command
    lines that quote them (on the supervisor's host, often one of the hosts), nor another job's."""
    import re
    import shlex

    from pretrain.cli.deepspeed_runner import stop_command

    command = stop_command("localhost,vm", 29517)
    assert command[:6] == ["pdsh", "-S", "-f", "1024", "-w", "localhost,vm"] and command[6:9] == [
        "pkill",
        "-TERM",
        "-f",
    ]
    assert command[10:] == [";", "echo", "pkill-status=$?"]  # each host says whether it found a launcher
    (pattern,) = shlex.split(command[9])  # as the remote shell reads it
    launch = "-u -m deepspeed.launcher.launch --world_info=eyJ9 --node_rank=1 --master_addr=localhost"
    assert re.search(pattern, f"/usr/bin/python3.11 {launch} --master_port=29517 --module pretrain.train")
    assert re.search(pattern, f"python {launch} --master_port=29517")
    assert not re.search(pattern, f"/usr/bin/python3.11 {launch} --master_port=29518 --module pretrain.train")
    quoted = f"export PYTHONPATH=/r; cd /r; /usr/bin/python3.11 {launch} --master_port=29517 --module pretrain.train"
    for wrapper in (
        f"pdsh -S -f 1024 -w localhost,vm {quoted}",
        f"ssh -2 -a -x vm {quoted}",
        f"bash -c {quoted}",
    ):
        assert not re.search(pattern, wrapper), wrapper


def test_hosts_where_the_stop_found_no_launcher_are_read_from_pdshs_lines():
    """pkill's status, echoed by each host: 1 (no launcher of the job there yet) is asked again; a
    host that was signalled (0) or that could not be reached (no status line) is not."""
    from pretrain.cli.deepspeed_runner import hosts_without_launcher

    output = "localhost: pkill-status=0\nvm: pkill-status=1\nnode-7: pkill-status=1\n"
    assert hosts_without_launcher(output) == ["vm", "node-7"]
    assert hosts_without_launcher("down: ssh: connect to host 10.0.0.9 port 22: Connection refused\n") == []
    assert hosts_without_launcher("") == []


def test_the_local_launcher_is_ours_and_polls_its_ranks_often(monkeypatch):
    """DeepSpeed's runner starts `pretrain.cli.deepspeed_launch` on this host (DeepSpeed's launcher,
    looking at its ranks every 0.1 s, not every second); a pdsh command for other hosts is its own."""
    import subprocess
    import time
    import types

    from pretrain.cli import deepspeed_launch
    from pretrain.cli.deepspeed_runner import launch_locally_with_our_module

    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda cmd, *a, **k: started.append(cmd))
    runner = types.SimpleNamespace(subprocess=subprocess)
    launch_locally_with_our_module(runner)
    local = [
        "/usr/bin/python3",
        "-u",
        "-m",
        "deepspeed.launcher.launch",
        "--world_info=eyJ9",
        "--module",
        "x",
    ]
    over_pdsh = [
        "pdsh",
        "-S",
        "-f",
        "1024",
        "-w",
        "a,b",
        "python -u -m deepspeed.launcher.launch --world_info=eyJ9",
    ]
    runner.subprocess.Popen(local, env={})
    runner.subprocess.Popen(over_pdsh, env={})
    assert started == [[*local[:3], "pretrain.cli.deepspeed_launch", *local[4:]], over_pdsh]
    assert runner.subprocess.DEVNULL == subprocess.DEVNULL  # the rest of subprocess, as it was

    clock = deepspeed_launch._polling_clock()
    slept = []  # (what it asks to sleep, not how long it took: a loaded machine wakes it late)
    monkeypatch.setattr(time, "sleep", slept.append)
    clock.sleep(1)
    assert slept == [deepspeed_launch.POLL_SECONDS] and clock.strftime(
        "%Y", clock.localtime()
    ) == time.strftime("%Y")
    assert deepspeed_launch.MODULE == deepspeed_launch.__name__


def test_each_start_of_the_job_is_its_command_from_a_typed_start(tmp_path):
    """The launcher's command for each start is built from the supervisor's `JobStart` alone: the
    first as the user asked, later ones resuming from the newest checkpoint; over ssh, that start's
    hosts (RUN_DIR/monitor/hostfile) and the accumulation that keeps the global batch."""
    from monitoring.hosts import Choice
    from monitoring.supervisor import JobStart
    from pretrain.cli.launch import ATTEMPT_HOSTFILE, JobCommand, JobShape

    shape = JobShape(hosts={"a": 1, "b": 1, "c": 1}, spares=None, per_node=1)
    command = JobCommand(
        module_args=["--config", "c.yaml", "monitor.enabled=true"],
        shape=shape,
        grad_accum=1,
        run_dir=tmp_path,
        hostfile="hosts",
        master_addr="a",
        master_port=29500,
        no_ssh=False,
        node_rank=0,
    )
    first, again = command(JobStart(0)), command(JobStart(1))
    assert first[-1] == "monitor.enabled=true" and "--hostfile" in first and "hosts" in first
    assert again == [*first, "checkpoint.resume=auto"]
    shrunk = command(JobStart(2, Choice(["b"], grad_accum=2)))
    assert shrunk[-2:] == ["checkpoint.resume=auto", "train.grad_accum=2"]
    assert shrunk[shrunk.index("--master_addr") + 1] == "b" and "--force_multi" in shrunk
    assert (tmp_path / ATTEMPT_HOSTFILE).read_text() == "b slots=1\n"
